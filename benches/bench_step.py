"""Step staging on the GPU, side by side with its peers in one run.

Host microseconds per step, loop (steps back to back), values changing every step (64 value
sets cycled); and paced (the stream synchronized before each step, outside the timing, as a step
arrives while an engine's GPU is idle or busy elsewhere), once with every step's result checked
after it and once with the last step's checked after the run (reads between steps evict what
the next step would find in the caches). Every timed batch starts on poisoned device fields and its result is checked
after it (pinstage's and every peer's). Each implementation runs in each of `--rounds` rounds;
the tables give the median round.

    python3 benches/bench_step.py [--out DIR] [--steps N] [--rounds R]
"""

import argparse
import json
import os
import statistics
import threading
import time

import numpy as np

import pinstage

ENGINE = {
    "input_ids": ("int32", 8192, 256),
    "positions": ("int64", 8192, 256),
    "slot_mapping": ("int64", 8192, 256),
    "seq_lens": ("int32", 256, 64),
    "query_start_loc": ("int32", 257, 65),
    "block_table": ("int32", (256, 128), 64),
}
R = {"engine": {}, "ksweep": {}, "jax": {}, "zero_copy": {}, "graph": {}, "failed": []}


def value_sets(n=64, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        v = {}
        for name, (dt, cap, used) in ENGINE.items():
            shape = (used, cap[1]) if isinstance(cap, tuple) else (used,)
            v[name] = rng.integers(1, 1 << 30, shape).astype(dt)
        out.append(v)
    return out


def layout():
    return pinstage.StepLayout({n: (dt, cap) for n, (dt, cap, _) in ENGINE.items()})


def timed(fn, steps, sets):
    for i in range(100):
        fn(sets[i % len(sets)])
    t0 = time.perf_counter()
    for i in range(steps):
        fn(sets[i % len(sets)])
    return (time.perf_counter() - t0) / steps * 1e6


def timed_paced(fn, steps, sets, idle, check=None):
    """Host us of each call of `fn` issued while the GPU is idle (`idle()` waits for it, outside
    the timing), as a step arrives while an engine's GPU is busy elsewhere: the median and the
    mean. `check(i, values)`, if given, runs after each step (outside the timing)."""
    for i in range(20):
        fn(sets[i % len(sets)])
    ts = []
    clock = time.perf_counter_ns
    for i in range(steps):
        v = sets[i % len(sets)]
        idle()
        t0 = clock()
        fn(v)
        ts.append(clock() - t0)
        if check is not None:
            check(i, v)
    return statistics.median(ts) / 1e3, statistics.fmean(ts) / 1e3


def bench_engine(torch, steps, rounds):
    sets = value_sets()
    last = sets[(steps - 1) % len(sets)]
    L = layout()
    s = torch.cuda.Stream()
    # pinstage: one arena, fields imported once.
    st = pinstage.StepStager(L, depth=8)
    arena = {n: torch.from_dlpack(st.field(n)) for n in ENGINE}
    # Peers' destinations: ordinary device tensors of the fields' capacities.
    dev = {
        n: torch.empty(cap if isinstance(cap, tuple) else (cap,), dtype=getattr(torch, dt), device="cuda")
        for n, (dt, cap, _) in ENGINE.items()
    }
    # The torch idiom: a persistent pinned CPU tensor per field, written in place, then one
    # non_blocking copy per field.
    pinned = {n: torch.empty_like(t, device="cpu").pin_memory() for n, t in dev.items()}
    pinned_np = {n: t.numpy() for n, t in pinned.items()}

    def torch_idiom(v):
        with torch.cuda.stream(s):
            for n, x in v.items():
                k = len(x)
                pinned_np[n][:k] = x
                dev[n][:k].copy_(pinned[n][:k], non_blocking=True)

    stagers = {dt: pinstage.PinnedStager(dt, 256 * 128, depth=16) for dt in ("int32", "int64")}
    targets = {n: stagers[ENGINE[n][0]].target(dev[n]) for n in ENGINE}
    sh = s.cuda_stream

    def six_targets(v):
        for n, x in v.items():
            targets[n].copy_(x, stream=sh)

    def stage(v):
        st.stage(v, stream=s)

    def step_put(v):
        with st.step(stream=s) as step:
            for n, x in v.items():
                step.put(n, x)

    def step_views(v):
        with st.step(stream=s) as step:
            for n, x in v.items():
                step.view(n, rows=len(x))[:] = x

    impls = {
        "torch pinned-buffer idiom (6 copy_)": (torch_idiom, dev),
        "six pinstage bound targets": (six_targets, dev),
        "StepStager.stage (one call)": (stage, arena),
        "StepStager step + 6 put": (step_put, arena),
        "StepStager step + 6 views written": (step_views, arena),
    }
    res = {k: [] for k in impls}
    for _ in range(rounds):
        for name, (fn, out) in impls.items():
            for t in out.values():
                t.fill_(-77)
            torch.cuda.synchronize()
            us = timed(fn, steps, sets)
            torch.cuda.synchronize()
            for n, x in last.items():
                got = out[n][: len(x)].cpu().numpy()
                if not np.array_equal(got, x):
                    raise AssertionError(f"{name}: field {n} wrong after the timed batch")
            res[name].append(us)
    med = {k: statistics.median(v) for k, v in res.items()}
    R["engine"] = {"us_per_step": med, "stats": st.stats()}
    base = med["StepStager.stage (one call)"]
    print("\n== engine step (6 fields, 38 KiB used), host us per step, loop")
    for k, v in med.items():
        print(f"  {k:<40} {v:8.2f} us   stage is {v / base:5.2f}x faster")
    print(f"  stats: {st.stats()}")

    # Paced: each step issued while the stream is idle, every step's fields checked.
    n_paced = min(steps, 2000)

    def checker(out):
        def check(i, v):
            s.synchronize()
            for n, x in v.items():
                if not np.array_equal(out[n][: len(x)].cpu().numpy(), x):
                    raise AssertionError(f"paced step {i}: field {n} wrong")

        return check

    def last_checked(name, out, n):
        s.synchronize()
        for f, x in sets[(n - 1) % len(sets)].items():
            if not np.array_equal(out[f][: len(x)].cpu().numpy(), x):
                raise AssertionError(f"paced {name}: field {f} wrong after the run")

    for each in (True, False):
        paced = {"empty call (the timer)": timed_paced(lambda v: None, n_paced, sets, s.synchronize)}
        for name, (fn, out) in impls.items():
            for t in out.values():
                t.fill_(-77)
            torch.cuda.synchronize()
            paced[name] = timed_paced(fn, n_paced, sets, s.synchronize, checker(out) if each else None)
            last_checked(name, out, n_paced)
        R["engine"]["paced_us" if each else "paced_quiet_us"] = paced
        pbase = paced["StepStager.stage (one call)"][0]
        how = "every step checked after it" if each else "the last step checked after the run"
        print(f"\n== engine step, paced (the stream idle as each step arrives; {how}), host us, median / mean of {n_paced}")
        for k, (m, mean) in paced.items():
            print(f"  {k:<40} {m:8.2f} / {mean:8.2f} us   stage is {m / pbase:5.2f}x faster")


def bench_ksweep(torch, steps, rounds):
    res = {}
    paced = {}
    device = {}
    s = torch.cuda.Stream()
    for k in (1, 2, 4, 8, 16, 32):
        L = pinstage.StepLayout({f"f{i}": ("int32", 256) for i in range(k)})
        st = pinstage.StepStager(L, depth=8)
        rng = np.random.default_rng(k)
        sets = [{f"f{i}": rng.integers(1, 1 << 30, 256).astype(np.int32) for i in range(k)} for _ in range(64)]
        last = sets[(steps - 1) % 64]
        outs = [torch.from_dlpack(st.field(f"f{i}")) for i in range(k)]
        times = []
        for _ in range(rounds):
            for t in outs:
                t.fill_(-1)
            torch.cuda.synchronize()
            times.append(timed(lambda v: st.stage(v, stream=s), steps, sets))
            torch.cuda.synchronize()
            for i in range(k):
                if not np.array_equal(outs[i].cpu().numpy(), last[f"f{i}"]):
                    raise AssertionError(f"k={k}: field {i} wrong")
        res[k] = statistics.median(times)

        n_paced = min(steps, 2000)
        for t in outs:
            t.fill_(-1)
        torch.cuda.synchronize()
        paced[k] = timed_paced(lambda v: st.stage(v, stream=s), n_paced, sets, s.synchronize)
        s.synchronize()
        for i in range(k):
            if not np.array_equal(outs[i].cpu().numpy(), sets[(n_paced - 1) % 64][f"f{i}"]):
                raise AssertionError(f"paced k={k}: field {i} wrong after the run")
        device[k] = ksweep_device_us(torch, L, sets)
    R["ksweep"] = res
    R["ksweep_paced"] = paced
    R["ksweep_device"] = device
    print("\n== k fields of 1 KiB, StepStager.stage, host us per step: loop; paced median / mean (the last step checked after the run);"
          "\n   the copy engine's us per step (64 steps queued behind a stall, then drained back to back; every step checked)")
    for k, v in res.items():
        m, mean = paced[k]
        d = device[k]
        print(f"  k={k:<3} {v:8.2f} us   ({v / res[1]:.2f}x k=1);   paced {m:6.2f} / {mean:6.2f} us   ({m / paced[1][0]:.2f}x k=1);"
              f"   device {d:6.2f} us   ({d / device[1]:.2f}x k=1)")


def ksweep_device_us(torch, L, sets, n=64, rounds=5):
    """The copy engine's time per step in a loop: `n` steps issued behind a stall on one stream
    (one stager per step, so the host never waits for a slot), timed by events around them once
    the stall ends. A loop of steps back to back cannot run faster than this whatever the host
    does. Every step lands in its own bound arena, checked after the run."""
    names = list(sets[0])
    s = torch.cuda.Stream()
    arenas = [torch.empty(L.nbytes, dtype=torch.uint8, device="cuda") for _ in range(n)]
    bound = [pinstage.StepStager(L, arena=a, depth=1) for a in arenas]
    out = []
    for _ in range(rounds):
        for a in arenas:
            a.fill_(0xA5)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(s):
            torch.cuda._sleep(20_000_000)
            e0.record(s)
        for i in range(n):
            bound[i].stage(sets[i % len(sets)], stream=s)
        e1.record(s)
        if e0.query():
            raise AssertionError("the stall ended before every step was issued: the device time would include the host's")
        s.synchronize()
        out.append(e0.elapsed_time(e1) * 1e3 / n)
        for i in range(n):
            v = sets[i % len(sets)]
            for name in names:
                got = torch.from_dlpack(bound[i].field(name)).cpu().numpy()
                if not np.array_equal(got[: len(v[name])], v[name]):
                    raise AssertionError(f"device sweep: step {i} field {name} wrong")
    return statistics.median(out)


def bench_jax(jax, steps, rounds):
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    sets = value_sets(seed=5)
    L = layout()
    st = pinstage.StepStager(L, mode="fresh", depth=8)
    dev = jax.devices("gpu")[0]
    steps = max(200, steps // 10)
    last = sets[(steps - 1) % len(sets)]
    out = {}

    def device_put(v):
        out["x"] = [jax.device_put(x, dev) for x in v.values()]

    def staged(v):
        out["x"] = jax.dlpack.from_dlpack(st.stage(v))

    unpack = jax.jit(L.unpack)
    res = {"six jax.device_put": [], "StepStager fresh + one from_dlpack": []}
    for _ in range(rounds):
        for name, fn in (("six jax.device_put", device_put), ("StepStager fresh + one from_dlpack", staged)):
            us = timed(fn, steps, sets)
            x = out["x"]
            got = dict(zip(ENGINE, x)) if isinstance(x, list) else {n: a[: len(last[n])] for n, a in unpack(x).items()}
            for n, want in last.items():
                if not np.array_equal(np.asarray(got[n]), want):
                    raise AssertionError(f"{name}: field {n} wrong after the timed batch")
            res[name].append(us)
    med = {k: statistics.median(v) for k, v in res.items()}
    R["jax"] = med
    base = med["StepStager fresh + one from_dlpack"]
    print("\n== JAX: the engine step into fresh device arrays, host us per step")
    for k, v in med.items():
        print(f"  {k:<40} {v:8.2f} us   pinstage is {v / base:5.2f}x faster")
    del jnp


def bench_zero_copy(torch, steps, rounds):
    """Zero-copy: kernels read the pinned slot in place. The consumer's kernel (a sum of every
    field into results[k]) runs in every step of the check run; the host-time rows time
    pinstage's calls alone (step + writes + commit), as the consumer's launches are its own."""
    L = pinstage.StepLayout({n: (dt, cap) for n, (dt, cap, _) in ENGINE.items()})
    depth = 4
    st = pinstage.StepStager(L, mode="zero_copy", depth=depth)
    s = torch.cuda.Stream()
    slot_t = [{n: torch.from_dlpack(st.slot_field(k, n)) for n in ENGINE} for k in range(depth)]
    sets = value_sets(seed=9)
    n_check = 500
    results = torch.zeros(n_check, dtype=torch.int64, device="cuda")
    for k in range(n_check):
        v = sets[k % 64]
        with st.step(stream=s) as step:
            for n, x in v.items():
                step.put(n, x)
            t = slot_t[step.slot]
            with torch.cuda.stream(s):
                acc = t["input_ids"][:256].sum(dtype=torch.int64)
                for n in ("positions", "slot_mapping", "seq_lens", "query_start_loc", "block_table"):
                    acc = acc + t[n][: len(v[n])].sum(dtype=torch.int64)
                results[k] = acc
    s.synchronize()
    want = [sum(int(x.astype(np.int64).sum()) for x in sets[k % 64].values()) for k in range(n_check)]
    if results.cpu().tolist() != want:
        raise AssertionError("zero-copy: a kernel read wrong values")

    def slots_now():
        """Every slot's fields as the host last wrote them (read by the GPU from the slot)."""
        s.synchronize()
        return [{n: slot_t[k][n].cpu().numpy() for n in ENGINE} for k in range(depth)]

    def check_stage(last_sets):
        # The last `depth` steps went to the `depth` slots, one each, in some order.
        found = []
        for k, got in enumerate(slots_now()):
            match = [i for i, v in enumerate(last_sets) if all(np.array_equal(got[n][: len(x)], x) for n, x in v.items())]
            if len(match) != 1:
                raise AssertionError(f"zero-copy stage: slot {k} holds none of the last {depth} steps' values")
            found.append(match[0])
        if sorted(found) != list(range(depth)):
            raise AssertionError(f"zero-copy stage: the last {depth} steps are not in the {depth} slots ({found})")

    def stage(v):
        st.stage(v, stream=s)

    count = [0]

    def one_write(v):
        # As the Rust row: claim, one value written in place, commit (the event recorded).
        count[0] += 1
        step = st.step(stream=s)
        step.view("seq_lens", rows=1)[0] = count[0]
        step.commit()

    def check_one_write():
        got = sorted(int(x["seq_lens"][0]) for x in slots_now())
        want = list(range(count[0] - depth + 1, count[0] + 1))
        if got != want:
            raise AssertionError(f"zero-copy one write: slots hold seq_lens[0] {got}, want {want}")

    def bare(v):
        step = st.step(stream=s)
        step.commit()

    def poison():
        s.synchronize()
        for t in slot_t:
            for x in t.values():
                x.fill_(-5)
        torch.cuda.synchronize()

    rows = ("zero-copy stage (6 fields' values written)", "zero-copy step + one value written in place + commit",
            "zero-copy bare step + commit (nothing written)")
    res = {k: [] for k in rows}
    for _ in range(rounds):
        poison()
        res[rows[0]].append(timed(stage, steps, sets))
        # timed() runs 100 warm-up calls, then `steps`: its last calls used these sets.
        check_stage([sets[(steps - depth + i) % len(sets)] for i in range(depth)])
        count[0] = 0
        poison()
        res[rows[1]].append(timed(one_write, steps, sets))
        check_one_write()
        before = st.stats()
        res[rows[2]].append(timed(bare, steps, sets))
        after = st.stats()
        if after["steps"] - before["steps"] != steps + 100 or after["copies"] != before["copies"]:
            raise AssertionError(f"zero-copy bare steps: stats {before} -> {after}")
    torch.cuda.synchronize()
    med = {k: statistics.median(v) for k, v in res.items()}
    R["zero_copy"] = {"us_per_step": med, "checked_steps": n_check}
    print(f"\n== zero-copy ({n_check} steps read by a kernel, every sum checked; each timed batch checked in the slots after it), host us per step")
    for k, v in med.items():
        print(f"  {k:<52} {v:8.2f} us")


def bench_graph(torch, seconds=2.0):
    """A ~4 ms CUDA graph replayed while steps are committed at full rate on another stream."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    gs = torch.cuda.Stream()
    with torch.cuda.stream(gs):
        for _ in range(3):
            c = a @ b
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=gs):
        for _ in range(26):
            c = a @ b  # noqa: F841

    def time_graph(reps=60):
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

    side = torch.cuda.Stream()
    st = pinstage.StepStager(layout(), depth=8)
    sets = value_sets(seed=3)
    dev = {n: torch.empty(cap if isinstance(cap, tuple) else (cap,), dtype=getattr(torch, dt), device="cuda") for n, (dt, cap, _) in ENGINE.items()}
    pinned = {n: torch.empty_like(t, device="cpu").pin_memory() for n, t in dev.items()}

    def with_load(work):
        stop = threading.Event()
        count = [0]

        def loop():
            i = 0
            while not stop.is_set():
                work(sets[i % 64])
                i += 1
            count[0] = i

        th = threading.Thread(target=loop)
        th.start()
        time.sleep(0.05)
        t = time_graph()
        stop.set()
        th.join()
        torch.cuda.synchronize()
        return t, count[0]

    def torch_idiom(v):
        with torch.cuda.stream(side):
            for n, x in v.items():
                pinned[n].numpy()[: len(x)] = x
                dev[n][: len(x)].copy_(pinned[n][: len(x)], non_blocking=True)

    def busy(v):
        x = 0
        for i in range(50):
            x += i

    base = time_graph()
    t_step, n_step = with_load(lambda v: st.stage(v, stream=side))
    base2 = time_graph()
    t_torch, n_torch = with_load(torch_idiom)
    t_busy, _ = with_load(busy)
    torch.cuda.synchronize()
    last = sets[(n_step - 1) % 64]
    for n, x in last.items():
        if not np.array_equal(st.read_field(n)[: len(x)], x):
            raise AssertionError(f"graph load: field {n} wrong after the loop")
    R["graph"] = {
        "graph ms": base,
        "graph ms (again, between loads)": base2,
        "beside StepStager.stage": t_step / base - 1,
        "steps committed": n_step,
        "beside the torch idiom": t_torch / base - 1,
        "torch idiom steps": n_torch,
        "beside a Python loop holding the GIL (no GPU work; control)": t_busy / base - 1,
    }
    print(
        f"\n== graph {base:.3f} ms alone ({base2:.3f} ms again); beside steps committed at full rate: "
        f"{100 * (t_step / base - 1):+.2f}% ({n_step} steps); beside the torch idiom "
        f"{100 * (t_torch / base - 1):+.2f}% ({n_torch} steps); beside a pure-Python loop (control, "
        f"no GPU work) {100 * (t_busy / base - 1):+.2f}%"
    )


def probe(torch, steps, rounds):
    """Where the Python step's microseconds go: stage with the automatic plan and with one span,
    a bare step, and k=1, each on a torch stream and on the legacy stream."""
    sets = value_sets()
    s = torch.cuda.Stream()
    out = {}
    for name, kw in (("auto plan", {}), ("one span", {"max_gap": 1 << 30}), ("exact spans", {"max_gap": 0})):
        st = pinstage.StepStager(layout(), depth=8, **kw)
        for sname, stream in (("torch stream", s), ("legacy", None)):
            out[f"stage, {name}, {sname}"] = statistics.median(
                timed(lambda v: st.stage(v, stream=stream), steps, sets) for _ in range(rounds)
            )
        torch.cuda.synchronize()
        out[f"stats {name}"] = st.stats()
    st = pinstage.StepStager(layout(), depth=8)
    out["empty step + commit"] = statistics.median(
        timed(lambda v: st.step(stream=s).commit(), steps, sets) for _ in range(rounds)
    )
    L1 = pinstage.StepLayout({"ids": ("int32", 256)})
    st1 = pinstage.StepStager(L1, depth=8)
    one = [{"ids": v["input_ids"]} for v in sets]
    out["k=1 stage"] = statistics.median(timed(lambda v: st1.stage(v, stream=s), steps, one) for _ in range(rounds))
    torch.cuda.synchronize()
    for k, v in out.items():
        print(f"  {k:<40} {v if isinstance(v, dict) else f'{v:8.2f} us'}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--probe", action="store_true", help="the engine step's Python cost alone")
    args = ap.parse_args()
    import torch

    print("pinstage", pinstage.__version__, "| torch", torch.__version__, "|", torch.cuda.get_device_name(0))
    if args.probe:
        probe(torch, args.steps, args.rounds)
        return
    bench_engine(torch, args.steps, args.rounds)
    bench_ksweep(torch, args.steps, args.rounds)
    bench_zero_copy(torch, args.steps, args.rounds)
    bench_graph(torch)
    try:
        import jax
    except ImportError:
        jax = None
    if jax is not None:
        bench_jax(jax, args.steps, args.rounds)
    e = R["engine"]["us_per_step"]
    ratios = {
        "stage us": e["StepStager.stage (one call)"],
        "torch idiom / stage": e["torch pinned-buffer idiom (6 copy_)"] / e["StepStager.stage (one call)"],
        "six targets / stage": e["six pinstage bound targets"] / e["StepStager.stage (one call)"],
        "k=32 / k=1": R["ksweep"][32] / R["ksweep"][1],
        "paced stage us": R["engine"]["paced_us"]["StepStager.stage (one call)"][0],
        "paced torch idiom / stage": R["engine"]["paced_us"]["torch pinned-buffer idiom (6 copy_)"][0]
        / R["engine"]["paced_us"]["StepStager.stage (one call)"][0],
        "paced six targets / stage": R["engine"]["paced_us"]["six pinstage bound targets"][0]
        / R["engine"]["paced_us"]["StepStager.stage (one call)"][0],
        "paced k=32 / k=1": R["ksweep_paced"][32][0] / R["ksweep_paced"][1][0],
        "device k=32 / k=1": R["ksweep_device"][32] / R["ksweep_device"][1],
        "paced quiet stage us": R["engine"]["paced_quiet_us"]["StepStager.stage (one call)"][0],
    }
    if R["jax"]:
        ratios["six device_put / staged"] = R["jax"]["six jax.device_put"] / R["jax"]["StepStager fresh + one from_dlpack"]
    R["ratios"] = ratios
    print("\n== ratios")
    for k, v in ratios.items():
        print(f"  {k:<28} {v:8.2f}")
    if args.out:
        with open(os.path.join(args.out, "bench-step.json"), "w") as f:
            json.dump(R, f, indent=1, default=str)


if __name__ == "__main__":
    main()
