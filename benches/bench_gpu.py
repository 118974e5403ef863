"""pinstage against its peers, in one run, on one GPU.

Run by scripts/gpu-run (``python3 benches/bench_gpu.py --out DIR``). Prints a table of absolute
figures and ratios, writes bench.json and bench.png (bandwidth vs size, both directions).
Timing: warm-up, then the median of many runs; device work is synchronized before the host clock
is read (D2H: each call until its result is on the host, once: a device synchronize only after a
call that returns earlier); data is fresh random values, and every implementation's result is
checked.
"""

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time

import numpy as np

import h2d_timing
import pinstage

GB = 1e9
RESULTS = {"d2h": {}, "h2d": {}, "small": {}, "graph": {}, "threads": {}, "memory": {}, "failed": []}
# Peers that could not run (a framework feature missing) are listed here and in the summary;
# a wrong result, for pinstage or a peer, raises at once: the bench fails loudly.


def median_time(fn, reps, warmup=2, sync=None):
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


# The D2H calls that return before their result is on the host.
ASYNC_D2H = {"torch copy_ pinned"}


def bench_d2h(torch, cp, jax, cuda_drv, sizes):
    sync = torch.cuda.synchronize
    for nbytes in sizes:
        n = nbytes // 4
        src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
        ref = src.cpu().numpy()
        reps = 30 if nbytes <= (16 << 20) else (10 if nbytes <= (256 << 20) else 5)
        row = {}
        pinned = pinstage.empty_pinned(n, np.int32)
        pageable = np.empty(n, np.int32)
        tpin = torch.empty(n, dtype=torch.int32, pin_memory=True)
        tpage = torch.empty(n, dtype=torch.int32)

        def check(name, arr):
            if not np.array_equal(np.asarray(arr), ref):
                raise AssertionError(f"{name} at {nbytes} bytes returned wrong data")

        impls = {
            "pinstage copy_d2h(dst=pinned)": lambda: pinstage.copy_d2h(src, pinned),
            "pinstage copy_d2h() pool": lambda: pinstage.copy_d2h(src),
            "pinstage copy_d2h(dst=pageable)": lambda: pinstage.copy_d2h(src, pageable),
            "torch .cpu()": lambda: src.cpu(),
            # One copy and a wait for it, as pinstage's copy_d2h (median_time syncs after each).
            "torch copy_ pinned": lambda: (tpin.copy_(src, non_blocking=True), tpin)[1],
            "torch copy_ pageable": lambda: tpage.copy_(src),
        }
        if cp is not None:
            csrc = cp.from_dlpack(src)
            cpin = cp.cuda.alloc_pinned_memory(nbytes)
            cout = np.frombuffer(cpin, np.int32, n)
            impls["cupy .get()"] = lambda: csrc.get()
            impls["cupy .get(out=pinned)"] = lambda: (csrc.get(out=cout), cout)[1]
        if jax is not None:
            jsrc = jax.numpy.asarray(ref)  # on the default (GPU) device
            fresh = []

            def jax_asarray():
                return np.asarray(fresh.pop())

            def jax_prep():
                y = jsrc + 0  # a fresh array each time: jax caches host copies
                y.block_until_ready()
                fresh.append(y)

            impls["jax np.asarray"] = (jax_prep, jax_asarray)
            try:
                pin_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
                impls["jax device_put pinned_host"] = lambda: jax.device_put(jsrc, pin_sharding).block_until_ready()
                RESULTS.setdefault("jax pinned_host", True)
            except Exception as e:  # noqa: BLE001
                print("jax pinned_host unavailable:", e)
        if cuda_drv is not None:
            drv, ptr_of = cuda_drv
            hpin = pinstage.empty_pinned(n, np.int32)
            hpage = np.empty(n, np.int32)
            dptr = src.data_ptr()
            impls["driver cuMemcpyDtoH pinned"] = lambda: (drv.cuMemcpyDtoH(hpin.ctypes.data, dptr, nbytes), hpin)[1]
            impls["driver cuMemcpyDtoH pageable"] = lambda: (drv.cuMemcpyDtoH(hpage.ctypes.data, dptr, nbytes), hpage)[1]
        poison_all = lambda: [a.fill(-7) for a in (pinned, pageable, tpin.numpy(), tpage.numpy())] + (
            [cout.fill(-7)] if cp is not None else []
        ) + ([hpin.fill(-7), hpage.fill(-7)] if cuda_drv is not None else [])
        for name, fn in impls.items():
            try:
                if isinstance(fn, tuple):
                    prep, run = fn
                    ts = []
                    for i in range(reps + 2):
                        prep()
                        sync()
                        t0 = time.perf_counter()
                        out = run()
                        ts.append(time.perf_counter() - t0)
                    t = statistics.median(ts[2:])
                else:
                    # Each call timed until its result is on the host, once: a call that returns
                    # with it (all but torch's non_blocking copy_) gets no device synchronize
                    # after it (an idle synchronize costs 4-8 us: lab/probes/d2h_legacy_stream.py),
                    # and its checked call is checked before any synchronize.
                    wait = sync if name in ASYNC_D2H else None
                    t = median_time(fn, reps, sync=wait)
                    sync()
                    poison_all()  # every destination: the checked call must write its result
                    out = fn()
                    if wait:
                        wait()
                check(name, out if not hasattr(out, "numpy") else out.numpy())
                row[name] = nbytes / t / GB
            except AssertionError:
                raise
            except Exception as e:  # noqa: BLE001
                if name.startswith("pinstage"):
                    raise
                print(f"  {name}: could not run: {e}")
                RESULTS["failed"].append(f"D2H {nbytes} {name}: {e}")
        RESULTS["d2h"][nbytes] = row
        print(f"D2H {nbytes:>11,d} B: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
        del src, pinned, pageable, tpin, tpage
        pinstage.empty_cache()
        torch.cuda.empty_cache()


def bench_h2d_large(torch, cp, sizes):
    """Each timed copy goes into a poisoned destination and is checked on the device after it
    (outside the timing): no implementation can pass by leaving the last copy's data in place."""
    for nbytes in sizes:
        n = nbytes // 4
        vals = np.random.default_rng(nbytes).integers(-(2**31), 2**31 - 1, n, dtype=np.int32)
        ref = torch.from_numpy(vals).cuda()
        dst = torch.empty(n, dtype=torch.int32, device="cuda")
        st = pinstage.PinnedStager(torch.int32, n, 2)
        reps = 10
        row = {}
        tpin = torch.from_numpy(vals).pin_memory()
        tpage = torch.from_numpy(vals)
        pin = pinstage.empty_pinned(n, np.int32)
        pin[:] = vals
        impls = {
            "pinstage copy_h2d from pageable": lambda: pinstage.copy_h2d(dst, vals),
            "pinstage copy_h2d from pinned": lambda: pinstage.copy_h2d(dst, pin),
            "pinstage stager copy_": lambda: st.copy_(dst, vals),
            "torch copy_ from pinned": lambda: dst.copy_(tpin, non_blocking=True),
            "torch copy_ from pageable": lambda: dst.copy_(tpage),
            "cupy set from pageable": None,
        }
        if cp is not None:
            cdst = cp.from_dlpack(dst)
            impls["cupy set from pageable"] = lambda: cdst.set(vals)
        else:
            del impls["cupy set from pageable"]
        for name, fn in impls.items():
            fn()
            ts = h2d_timing.timed_into(torch, fn, dst, ref, reps, what=f"H2D {name} at {nbytes} bytes")
            row[name] = nbytes / statistics.median(ts) / GB
        RESULTS["h2d"][nbytes] = row
        print(f"H2D {nbytes:>11,d} B: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
        del st, ref, pin


def bench_small(torch, cuda_drv, calls=20000, rounds=3):
    """256 of 4096 int32, padded: host microseconds per call. Every implementation is measured
    in each of `rounds` rounds (the same order each round); the table gives the median round."""
    n, total, pad = 256, 4096, -1
    rng = np.random.default_rng(1)
    value_sets = [rng.integers(1, 1 << 30, n, dtype=np.int32) for _ in range(64)]
    dst = torch.empty(total, dtype=torch.int32, device="cuda")
    sync = torch.cuda.synchronize
    loops, paceds = {}, {}

    def check(name, last):
        got = dst.cpu().numpy()
        if not (np.array_equal(got[:n], last) and (got[n:] == pad).all()):
            raise AssertionError(f"{name}: wrong result")

    clock = time.perf_counter_ns

    def spin(ns):
        t = clock()
        while clock() - t < ns:
            pass

    # What one clock() pair costs, subtracted from every paced call.
    pairs = []
    for _ in range(2000):
        t0 = clock()
        pairs.append(clock() - t0)
    clock_cost = statistics.median(pairs)

    def poison():
        dst.fill_(-777)
        sync()

    def run(name, fn, prime=None):
        """Two figures per implementation; `dst` is poisoned before each timed batch (and, for
        the mirror-hit rows, `prime` writes the values the mirror then reports), and checked
        after it. Loop (the goal's figure, as the peers were
        measured): `calls` calls back to back, wall time / calls. Paced: calls 10 us apart, so
        the GPU is idle when each call arrives, as an engine issues a step's few copies among
        other work; each call timed alone (less the clock's own cost), the median over groups
        of 8 consecutive calls of the group's mean."""
        for i in range(200):
            fn(value_sets[i % 64])
        poison()
        if prime:
            prime()
        t0 = time.perf_counter()
        for i in range(calls):
            fn(value_sets[i % 64])
        t = (time.perf_counter() - t0) / calls
        sync()
        check(name, value_sets[(calls - 1) % 64])
        loops.setdefault(name, []).append(t * 1e6)
        group, per_call = 8, []
        # About a quarter as many, ending on the same value set as the loop (the mirror-hit
        # rows always pass that one).
        paced_calls = (calls // 4) // 64 * 64 + calls % 64
        assert paced_calls % group == 0
        poison()
        if prime:
            prime()
        for g in range(paced_calls // group):
            ns = 0
            for j in range(group):
                spin(10_000)
                v = value_sets[(g * group + j) % 64]
                t0 = clock()
                fn(v)
                ns += clock() - t0 - clock_cost
            per_call.append(ns / group)
        sync()
        check(name + " (paced)", value_sets[(paced_calls - 1) % 64])
        paceds.setdefault(name, []).append(statistics.median(per_call) / 1e3)

    st = pinstage.PinnedStager(torch.int32, 256)  # the default depth (16)
    target = st.target(dst, pad_value=pad)
    hit = value_sets[(calls - 1) % 64]
    target2 = st.target(dst, pad_value=pad, skip_unchanged=True)
    m = pinstage.H2DMirror()

    def prime_target2():
        target2.invalidate()
        target2.copy_(hit)

    def prime_mirror():
        m.invalidate()
        st.copy_(dst, hit, pad, m)
    head, tail = dst[:n], dst[n:]
    side = torch.cuda.Stream()
    depth = 16  # the peers' rings are as deep as the stager's
    ring = [(torch.empty(total, dtype=torch.int32, pin_memory=True), torch.cuda.Event()) for _ in range(depth)]
    k = [0]

    def py_ring(v):
        buf, ev = ring[k[0] % depth]
        k[0] += 1
        ev.synchronize()
        b = buf.numpy()
        b[:n] = v
        b[n:] = pad
        dst.copy_(buf, non_blocking=True)
        ev.record()

    drv_ring = None
    if cuda_drv is not None:
        drv, _ = cuda_drv
        bufs = [pinstage.empty_pinned(total, np.int32) for _ in range(depth)]
        evs = [drv.cuEventCreate(2)[1] for _ in range(depth)]
        stream = torch.cuda.current_stream().cuda_stream
        dptr = dst.data_ptr()
        j = [0]

        def drv_ring(v):
            i = j[0] % depth
            j[0] += 1
            drv.cuEventSynchronize(evs[i])
            b = bufs[i]
            b[:n] = v
            b[n:] = pad
            drv.cuMemcpyHtoDAsync(dptr, b.ctypes.data, total * 4, stream)
            drv.cuEventRecord(evs[i], stream)

    for _ in range(rounds):
        run("pinstage bound target", lambda v: target.copy_(v))
        run("pinstage copy_(dst, ...)", lambda v: st.copy_(dst, v, pad))
        run("pinstage bound target, mirror hit (no copy)", lambda v: target2.copy_(hit), prime_target2)
        run("pinstage copy_(dst, ...), mirror hit (no copy)", lambda v: st.copy_(dst, hit, pad, m), prime_mirror)
        run("torch copy_ pageable + fill_", lambda v: (head.copy_(torch.from_numpy(v), non_blocking=True), tail.fill_(pad)))
        # The same on a side stream (torch's current stream inside the block; stream=None
        # follows it): the legacy default stream can cost the driver extra work per operation.
        with torch.cuda.stream(side):
            run("pinstage bound target, side stream", lambda v: target.copy_(v))
            run("pinstage copy_(dst, ...), side stream", lambda v: st.copy_(dst, v, pad))
            run("torch copy_ pageable + fill_, side stream", lambda v: (head.copy_(torch.from_numpy(v), non_blocking=True), tail.fill_(pad)))
        run("torch pin_memory() per call", lambda v: (head.copy_(torch.from_numpy(v).pin_memory(), non_blocking=True), tail.fill_(pad)))
        # The peers rewrite the whole 15 KiB of padding on every call; the stager writes it once
        # per slot and then only the values (its layout memory): that difference is part of
        # what the ratio measures.
        run("python ring of pinned torch buffers (depth 16, pad rewritten)", py_ring)
        if drv_ring is not None:
            run("cuda.bindings ring (depth 16, pad rewritten)", drv_ring)
    row = {k: statistics.median(v) for k, v in loops.items()}
    paced = {k: statistics.median(v) for k, v in paceds.items()}
    RESULTS["small"] = row
    RESULTS["small paced"] = paced
    RESULTS["small rounds"] = {"loop": loops, "paced": paceds}
    RESULTS["memory"]["stager pinned bytes"] = st.stats()["pinned_bytes"]
    RESULTS["stager stats"] = {"watermark": st.stats()}
    print("stager stats:", st.stats())
    print(f"small padded H2D (256 of 4096 int32), host us/call, loop of calls (median of {rounds} rounds): " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
    print("  paced (calls 10 us apart, GPU idle at each call): " + ", ".join(f"{k} {v:.2f}" for k, v in paced.items()))


def bench_graph(torch, seconds=2.0):
    """A ~3 ms CUDA graph replayed while copies run at full rate on another stream."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    gs = torch.cuda.Stream()
    with torch.cuda.stream(gs):
        for _ in range(3):
            c = a @ b
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=gs):
        for _ in range(20):
            c = a @ b  # noqa: F841
    reps = 60

    def time_graph():
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        with torch.cuda.stream(gs):
            for _ in range(reps):
                s.record()
                g.replay()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
        return statistics.median(times)

    base = time_graph()
    side = torch.cuda.Stream()
    dst = torch.empty(4096, dtype=torch.int32, device="cuda")
    big = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    st = pinstage.PinnedStager(torch.int32, 256)
    vals = np.arange(256, dtype=np.int32)

    def with_load(work):
        stop = threading.Event()
        count = [0]

        def loop():
            with torch.cuda.stream(side):
                while not stop.is_set():
                    work()
                    count[0] += 1

        th = threading.Thread(target=loop)
        th.start()
        time.sleep(0.05)
        t = time_graph()
        stop.set()
        th.join()
        torch.cuda.synchronize()
        return t, count[0]

    t_stager, n1 = with_load(lambda: st.copy_(dst, vals + 1, -1, stream=side.cuda_stream))
    tpin = torch.from_numpy(np.full(4096, 5, np.int32)).pin_memory()
    t_torch_copy, n2 = with_load(lambda: dst.copy_(tpin, non_blocking=True))
    t_fill_small, _ = with_load(lambda: dst.fill_(3))
    t_fill_big, _ = with_load(lambda: big.fill_(3))
    RESULTS["graph"] = {
        "graph ms": base,
        "beside pinstage copies": t_stager / base - 1,
        "beside torch copy_ from pinned 16 KiB": t_torch_copy / base - 1,
        "torch copies issued": n2,
        "beside fill_ 16 KiB": t_fill_small / base - 1,
        "beside fill_ 4 MiB": t_fill_big / base - 1,
        "pinstage copies issued": n1,
    }
    print(
        f"graph {base:.3f} ms; slowdown beside pinstage copies {100*(t_stager/base-1):+.2f}% ({n1} copies), "
        f"torch copy_ from pinned {100*(t_torch_copy/base-1):+.2f}% ({n2} copies), "
        f"fill_ 16 KiB {100*(t_fill_small/base-1):+.2f}%, fill_ 4 MiB {100*(t_fill_big/base-1):+.2f}%"
    )


def bench_threads(torch, calls=20000, rounds=5):
    """One stager shared by 1 and by 4 Python threads, every copy verified. Two settings: every
    thread on the legacy default stream (the GPU runs all copies one after another), and every
    thread on its own stream (how planner threads usually run). Each figure is the median of
    `rounds` rounds, the settings alternating within each round."""
    st = pinstage.PinnedStager(torch.int32, 256)
    dsts = [torch.empty(4096, dtype=torch.int32, device="cuda") for _ in range(4)]
    streams = [torch.cuda.Stream() for _ in range(4)]
    targets = [st.target(dsts[k], pad_value=-k - 1, skip_unchanged=True) for k in range(4)]
    runs = {}

    def timed(nthreads, work):
        ths = [threading.Thread(target=work, args=(k,)) for k in range(nthreads)]
        t0 = time.perf_counter()
        [t.start() for t in ths]
        [t.join() for t in ths]
        return time.perf_counter() - t0

    default_interval = sys.getswitchinterval()
    for _ in range(rounds):
        # (own streams, threads, GIL switch interval): the last two settings test where 4
        # threads lose against 1: the interpreter handing the GIL between them (a 50 ms switch
        # interval), or calling from 4 OS threads at all ("one after another": each thread runs
        # its whole loop alone).
        for own, nthreads, interval in (
            (False, 1, None), (False, 4, None), (True, 1, None), (True, 4, None),
            (False, 4, 0.05), (False, 4, "one after another"),
        ):
            last = {}
            owner, handovers = [None], [0]
            alone = threading.Lock()

            def work(k):
                v = np.full(256, k + 1, np.int32)
                s = streams[k] if own else torch.cuda.default_stream()
                with torch.cuda.stream(s), (alone if interval == "one after another" else contextlib.nullcontext()):
                    for i in range(calls):
                        v[0] = i
                        st.copy_(dsts[k], v, -k - 1)
                        if owner[0] != k:  # the GIL makes this check-and-set atomic
                            owner[0] = k
                            handovers[0] += 1
                last[k] = v.copy()

            for d in dsts:
                d.fill_(-777)
            torch.cuda.synchronize()
            waits0 = st.stats()["waits"]
            if isinstance(interval, float):
                sys.setswitchinterval(interval)
            try:
                dt = timed(nthreads, work)
            finally:
                sys.setswitchinterval(default_interval)
            torch.cuda.synchronize()
            for k in range(nthreads):
                got = dsts[k].cpu().numpy()
                assert np.array_equal(got[:256], last[k]) and (got[256:] == -k - 1).all()
            where = "own streams" if own else "one stream"
            if isinstance(interval, float):
                where += f", switch interval {interval * 1e3:.0f} ms"
            elif interval is not None:
                where += f", {interval}"
            key = f"{nthreads} thread{'s' if nthreads > 1 else ''}, {where}"
            runs.setdefault(key + ", calls/s", []).append(nthreads * calls / dt)
            runs.setdefault(key + ", GIL hand-overs/s", []).append(handovers[0] / dt)
            runs.setdefault(key + ", slot waits", []).append(st.stats()["waits"] - waits0)
        # Control: the same threads calling a bound target whose mirror already holds the values
        # (the Python boundary alone, no driver call). Whatever 4 threads lose here, they lose
        # to the GIL, not to the stager.
        hits = [np.full(256, k + 1, np.int32) for k in range(4)]
        for k in range(4):
            targets[k].invalidate()
            targets[k].copy_(hits[k])

        def hit_work(k):
            for _ in range(calls * 4):
                targets[k].copy_(hits[k])

        for nthreads in (1, 4):
            dt = timed(nthreads, hit_work)
            key = f"control {nthreads} thread{'s' if nthreads > 1 else ''}, mirror hits, calls/s"
            runs.setdefault(key, []).append(nthreads * calls * 4 / dt)
    out = {k: statistics.median(v) for k, v in runs.items()}
    RESULTS["threads"] = out
    RESULTS["threads rounds"] = runs
    for where in ("one stream", "own streams"):
        r1, r4 = out[f"1 thread, {where}, calls/s"], out[f"4 threads, {where}, calls/s"]
        print(
            f"one stager, {where}: 1 thread {r1:,.0f} calls/s, 4 threads {r4:,.0f} calls/s ({r4 / r1:.2f}x), "
            f"GIL hand-overs {out[f'4 threads, {where}, GIL hand-overs/s']:,.0f}/s"
        )
    r50 = out["4 threads, one stream, switch interval 50 ms, calls/s"]
    print(
        f"  4 threads, one stream, GIL switch interval 50 ms: {r50:,.0f} calls/s ({r50 / out['1 thread, one stream, calls/s']:.2f}x), "
        f"GIL hand-overs {out['4 threads, one stream, switch interval 50 ms, GIL hand-overs/s']:,.0f}/s"
    )
    seq = out["4 threads, one stream, one after another, calls/s"]
    print(f"  4 threads, one stream, one after another: {seq:,.0f} calls/s ({seq / out['1 thread, one stream, calls/s']:.2f}x)")
    c1, c4 = out["control 1 thread, mirror hits, calls/s"], out["control 4 threads, mirror hits, calls/s"]
    print(f"control, the Python boundary alone (mirror hits): 1 thread {c1:,.0f} calls/s, 4 threads {c4:,.0f} ({c4 / c1:.2f}x)")


def report(out):
    d2h = RESULTS["d2h"]
    lines = []
    big = max(d2h) if d2h else None
    if big:
        r = d2h[big]
        drv = r.get("driver cuMemcpyDtoH pinned")
        lines.append(f"D2H {big >> 20} MiB GB/s: " + ", ".join(f"{k}={v:.2f}" for k, v in r.items()))
        if drv:
            lines.append(f"  with-dst / driver pinned = {r['pinstage copy_d2h(dst=pinned)'] / drv:.3f} (goal >= 0.98)")
            lines.append(f"  pool / with-dst = {r['pinstage copy_d2h() pool'] / r['pinstage copy_d2h(dst=pinned)']:.3f} (goal >= 0.95)")
            if "jax np.asarray" in r:
                lines.append(f"  pool / jax np.asarray = {r['pinstage copy_d2h() pool'] / r['jax np.asarray']:.1f}x (goal >= 25)")
            if "driver cuMemcpyDtoH pageable" in r:
                lines.append(
                    f"  pageable dst / driver pageable = {r['pinstage copy_d2h(dst=pageable)'] / r['driver cuMemcpyDtoH pageable']:.2f}x (goal >= 1.5)"
                )
    for nb in sorted(d2h):
        if nb <= (1 << 20) and "torch copy_ pinned" in d2h[nb]:
            lines.append(
                f"  {nb >> 10} KiB: pinstage with-dst / torch into pinned = "
                f"{d2h[nb]['pinstage copy_d2h(dst=pinned)'] / d2h[nb]['torch copy_ pinned']:.2f} (goal >= 1)"
            )
    h2d = RESULTS["h2d"]
    for nb in sorted(h2d):
        r = h2d[nb]
        if "pinstage copy_h2d from pageable" in r and "torch copy_ from pinned" in r:
            lines.append(
                f"  H2D {nb >> 20} MiB: copy_h2d from pageable {r['pinstage copy_h2d from pageable']:.2f} GB/s = "
                f"{r['pinstage copy_h2d from pageable'] / r['torch copy_ from pinned']:.2f}x torch from pinned, "
                f"{r['pinstage copy_h2d from pageable'] / r['torch copy_ from pageable']:.2f}x torch from pageable; "
                f"from pinned {r['pinstage copy_h2d from pinned'] / r['torch copy_ from pinned']:.3f}x"
            )
    s = RESULTS["small"]
    if s:
        best_peer = min(v for k, v in s.items() if not k.startswith("pinstage") and "side" not in k)
        if RESULTS["failed"]:
            lines.append("peers that could not run: " + "; ".join(RESULTS["failed"]))
        lines.append(f"  Python boundary + mirror compare alone (mirror hit): {s['pinstage bound target, mirror hit (no copy)']:.2f} us")
        lines.append(
            f"small H2D us/call: bound target {s['pinstage bound target']:.2f} (goal <= 2.5), copy_ {s['pinstage copy_(dst, ...)']:.2f} "
            f"(goal <= 5), best peer {best_peer:.2f} ({best_peer / s['pinstage bound target']:.1f}x slower)  [loop of calls]"
        )
        lines.append(f"  copy_(dst, ...) with a mirror hit (import + values + compare, no copy): {s['pinstage copy_(dst, ...), mirror hit (no copy)']:.2f} us")
        c = RESULTS.get("driver costs ns", {})
        if c:
            floor = (c["cuMemcpyHtoDAsync 16 KiB pinned WC"] + c["cuEventRecord"]) / 1e3
            lines.append(
                f"  driver floor in this run: cuMemcpyHtoDAsync 16 KiB {c['cuMemcpyHtoDAsync 16 KiB pinned WC'] / 1e3:.2f} us + "
                f"cuEventRecord {c['cuEventRecord'] / 1e3:.2f} us = {floor:.2f} us; Rust PinnedStager::copy_ "
                f"{c['PinnedStager::copy_ 256 of 4096 int32 padded'] / 1e3:.2f} us ({c['PinnedStager::copy_ 256 of 4096 int32 padded'] / 1e3 - floor:+.2f} over the floor); "
                f"bound target {s['pinstage bound target'] - floor:+.2f} us over the floor"
            )
        pa = RESULTS.get("small paced", {})
        if pa:
            lines.append("  paced, calls 10 us apart: " + ", ".join(f"{k} {v:.2f}" for k, v in pa.items()))
    th = RESULTS["threads"]
    if th:
        for where in ("one stream", "own streams"):
            r1, r4 = th[f"1 thread, {where}, calls/s"], th[f"4 threads, {where}, calls/s"]
            lines.append(f"one stager, {where}: 4 threads / 1 thread = {r4 / r1:.2f} (goal >= 1)")
        c1, c4 = th["control 1 thread, mirror hits, calls/s"], th["control 4 threads, mirror hits, calls/s"]
        lines.append(f"  control, Python boundary alone (mirror hits, no driver): 4 threads / 1 thread = {c4 / c1:.2f}")
        r1 = th["1 thread, one stream, calls/s"]
        lines.append(
            f"  one stream: GIL hand-overs {th['4 threads, one stream, GIL hand-overs/s']:,.0f}/s; 50 ms switch interval "
            f"{th['4 threads, one stream, switch interval 50 ms, calls/s'] / r1:.2f}x; the 4 threads one after another "
            f"{th['4 threads, one stream, one after another, calls/s'] / r1:.2f}x"
        )
    print("\n=== pinstage bench summary")
    print("\n".join(lines))
    with open(f"{out}/bench.json", "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        for ax, key, title in ((axes[0], "d2h", "device -> host"), (axes[1], "h2d", "host -> device")):
            table = RESULTS[key]
            names = sorted({k for r in table.values() for k in r})
            for name in names:
                xs = [nb for nb in sorted(table) if name in table[nb]]
                ax.plot(xs, [table[nb][name] for nb in xs], marker="o", label=name, lw=2.5 if name.startswith("pinstage") else 1)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("bytes")
            ax.set_ylabel("GB/s")
            ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(f"{out}/bench.png", dpi=110)
    except Exception as e:  # noqa: BLE001
        print("plot failed:", e)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--small-only", action="store_true", help="only the small-copy and thread benches")
    a = p.parse_args()
    import torch

    try:
        import cupy as cp
    except Exception:  # noqa: BLE001
        cp = None
    try:
        import jax

        jax.config.update("jax_platforms", "cuda")
    except Exception:  # noqa: BLE001
        jax = None
    try:
        from cuda.bindings import driver as drv

        def call(fn):
            def wrapped(*args):
                r = fn(*args)
                err = r[0] if isinstance(r, tuple) else r
                if int(err) != 0:
                    raise RuntimeError(f"{fn.__name__}: {err}")
                return r

            return wrapped

        class D:
            cuMemcpyDtoH = staticmethod(call(drv.cuMemcpyDtoH))
            cuMemcpyHtoDAsync = staticmethod(call(drv.cuMemcpyHtoDAsync))
            cuEventCreate = staticmethod(call(drv.cuEventCreate))
            cuEventRecord = staticmethod(call(drv.cuEventRecord))
            cuEventSynchronize = staticmethod(call(drv.cuEventSynchronize))

        cuda_drv = (D, None)
    except Exception as e:  # noqa: BLE001
        print("cuda.bindings unavailable:", e)
        cuda_drv = None
    torch.cuda.init()
    print("device:", torch.cuda.get_device_name(0), "| pinstage", pinstage.__version__, "| torch", torch.__version__)
    sizes = [64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30]
    if a.quick:
        sizes = [64 << 10, 1 << 20, 16 << 20]
    bench_small(torch, cuda_drv)
    bench_threads(torch)
    if a.small_only:
        report(a.out)
        return
    bench_graph(torch)
    bench_d2h(torch, cp, jax, cuda_drv, sizes)
    bench_h2d_large(torch, cp, sizes)
    RESULTS["memory"]["pool"] = pinstage.pool_stats()
    report(a.out)


if __name__ == "__main__":
    main()
