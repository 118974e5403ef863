"""Step staging on the GPU beside its peers, every step of every timed batch checked.

    python3 benches/bench_step.py [--out DIR] [--steps N] [--rounds R] [--sections engine,ksweep,...]

Timed: the host us of each step call alone (perf_counter_ns around it; GC off during a batch).
Loop: steps back to back; paced: the stream synchronized before each step, untimed. A run's
figure is the mean of its calls (loop: throughput, slot waits included) or their median (paced);
each figure is the median of --rounds runs (>= 5) with min..max; ratios are taken between
medians; variants interleave within each round.
Checked, untimed, alike for all: step values derive from the step index and never repeat within
a batch (never 0, never the poison). The engine step and the k sweep run twice: with the values
made before the batch (75 MiB for the engine step, 64 MiB at k=32: read from DRAM) and hot (64
value sets reused, each step's number written into every field just before its call, untimed:
as an engine's just-computed values and as the C controls' in lab/c). The destination (arena, a
peer's device buffer, a zero-copy slot) and a device history are filled with 0xA5 before each
batch; after each step's call, on its stream, one kernel (torch.cat) snapshots every field's
used rows into that step's history row (zero-copy: from the slot's device view, before the
commit); after the batch every row must equal its step's values. JAX: every step's arrays stay
alive to the batch's end and are compared.
Peers do the same work (values, depth, stream, layout offsets; a slot rewritten only after its
copy's event): torch (pinned ring, ONE copy_ of the used extent, the bytes pinstage's one-span
plan sends; the old six-copy_ peer for reference) and cuda.bindings (cuMemHostAlloc ring,
cuMemcpyHtoDAsync, cuEventRecord/Synchronize). A goal is met only when it holds in the median
over runs of these checked runs. Rust vs C: benches/gpu_step.rs (not here).
"""
import argparse
import gc
import json
import os
import random
import statistics
import sys
import threading
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX shares the GPU with torch

import numpy as np

import pinstage
from _stepbench_peers import Ring  # benches/: the torch and cuda.bindings rings

ENGINE = {  # name: (dtype, capacity, rows used per step): 6 fields, 37.5 KiB used
    "input_ids": ("int32", 8192, 256),
    "positions": ("int64", 8192, 256),
    "slot_mapping": ("int64", 8192, 256),
    "seq_lens": ("int32", 256, 64),
    "query_start_loc": ("int32", 257, 65),
    "block_table": ("int32", (256, 128), 64),
}
KS = (1, 2, 4, 8, 16, 32)
PRIME, MOD, POISON, WARM = 1_000_003, 2**31 - 1, 0xA5, 64
STAGE, PUT, VIEWS = "pinstage StepStager.stage (1 call)", "pinstage step + 6 put", "pinstage step + 6 views written"
TPACK, TSIX, CUB = "torch packed ring (1 copy_)", "torch ring, 6 copy_ (old peer)", "cuda.bindings packed ring"
TGT = "pinstage PinnedStager, 6 targets (ref.)"
JST, JPK, JSIX = "pinstage fresh + from_dlpack + jit unpack", "packed jax.device_put + jit unpack", "six jax.device_put (ref.)"
# The controls: JAX's own part of each path, its input made before the clock (pinstage's block
# staged, the peer's packed array put): what is left for the staging or the put to win.
JCST, JCPK = "control: from_dlpack + jit unpack (block staged before)", "control: jit unpack (packed array put before)"
R = {"config": {}, "engine": {}, "ksweep": {}, "ksweep_hot": {}, "ksweep_device_us": {}, "zero_copy": {}, "graph": {}, "jax": {},
     "goals": [], "failed": [], "notes": []}
clock = time.perf_counter_ns
torch = None  # imported in main()


# ---------------------------------------------------------------- values, layouts, checks
def engine_spec():
    """{name: (dtype, used shape)}."""
    return {n: (dt, (u, cap[1]) if isinstance(cap, tuple) else (u,)) for n, (dt, cap, u) in ENGINE.items()}


def engine_layout():
    return pinstage.StepLayout({n: (dt, cap) for n, (dt, cap, _) in ENGINE.items()})


def nbytes(dt, shape):
    return int(np.dtype(dt).itemsize * np.prod(shape))


def offsets(L):
    return {f["name"]: f["offset"] for f in L.fields}


def gen(spec, n, salt):
    """n steps: field j of step i holds (i*PRIME + salt + j*104729 + position) % MOD + 1. MOD is
    prime, so no two steps' values are alike; never 0; positive, so never the 0xA5 poison."""
    vals, idx = {}, np.arange(n, dtype=np.int64)[:, None]
    for j, (name, (dt, shape)) in enumerate(spec.items()):
        pos = np.arange(int(np.prod(shape)), dtype=np.int64)[None, :]
        vals[name] = ((idx * PRIME + (salt * 7919 + j * 104729) + pos) % MOD + 1).astype(dt).reshape((n, *shape))
    return vals, [{k: a[i] for k, a in vals.items()} for i in range(n)]


def expected(vals, n):
    """(n, used bytes): each step's used rows, field after field (a history row's layout)."""
    return np.concatenate([a[:n].reshape(n, -1).view(np.uint8) for a in vals.values()], axis=1)


def maker(spec, n, tag):
    def make(r):
        vals, steps = gen(spec, n + WARM, salt=r * 100_003 + tag)
        return steps[:n], steps[n:], expected(vals, n)
    return make


HOT_SETS = 64


def hot_maker(spec, n, tag):
    """As `maker`, with the values as an engine holds them when it stages a step (just computed,
    in the CPU's caches) and as the C controls read them: HOT_SETS value sets reused, each step's
    own number written into the first two elements of every field just before its call
    (untimed, by `Hot`), so no two steps of a batch are alike. A step is (values, before)."""
    def make(r):
        vals, sets = gen(spec, HOT_SETS, salt=r * 100_003 + tag)
        big, word = list(vals.values()), 1_000_000 + 10_000 * r  # below MOD: positive, never the poison
        flat = [a.reshape(HOT_SETS, -1) for a in big]  # views: a write through one lands in `sets`

        def step(i):
            row = i % HOT_SETS

            def before():
                for f in flat:
                    f[row, 0], f[row, 1] = word + i, word - i
            return sets[row], before
        rows, nums = np.arange(n) % HOT_SETS, np.arange(n)
        E = []
        for f in flat:
            e = f[rows]  # a copy: (n, elements)
            e[:, 0], e[:, 1] = word + nums, word - nums
            E.append(e.view(np.uint8))
        return [step(i) for i in range(n)], [step(n + i) for i in range(WARM)], np.concatenate(E, axis=1)
    return make


def used_views(base, L, spec):
    """uint8 views of each field's used bytes in `base` (a uint8 device tensor laid out as L)."""
    off = offsets(L)
    return [base[off[n]: off[n] + nbytes(*spec[n])] for n in spec]


def compare(got, E, what):
    bad = np.flatnonzero((got != E).any(axis=1))
    return (True, "") if bad.size == 0 else (False, f"{what}: {bad.size} of {len(E)} steps wrong (first: row {bad[0]})")


def fail(msg):
    R["failed"].append(msg)
    print("CHECK FAILED:", msg, flush=True)


# ---------------------------------------------------------------- variants, the runner, the peers' and pinstage's rows
class Var:
    """`call(v)` timed alone, then `srcs` snapshotted into hist[i]; or `run(i, v, hist) -> ns`."""

    def __init__(self, name, call=None, srcs=None, poison=None, run=None, verify=None, bps=None):
        self.name, self.call, self.srcs, self.verify, self.bps = name, call, srcs, verify, bps
        self.poison, self.run = poison or (lambda: None), run or self._run

    def _run(self, i, v, hist):
        t0 = clock()
        self.call(v)
        t = clock() - t0
        torch.cat(self.srcs, out=hist[i])
        return t


class Hot:
    """A variant run on `hot_maker`'s steps, (values, before): `before()` writes the step's values
    (untimed) just before the variant's timed call."""

    def __init__(self, var):
        self.var, self.name, self.poison, self.verify = var, var.name, var.poison, var.verify

    def run(self, i, v, hist):
        values, before = v
        before()
        return self.var.run(i, values, hist)


def batch(var, steps, warm, hist, paced, sync):
    for i, v in enumerate(warm):
        var.run(i % len(steps), v, hist)
    sync()
    var.poison()
    hist.fill_(POISON)
    torch.cuda.synchronize()
    ts, run = np.empty(len(steps), np.int64), var.run
    gc.collect()
    gc.disable()
    try:
        for i, v in enumerate(steps):
            if paced:
                sync()
            ts[i] = run(i, v, hist)
    finally:
        gc.enable()
    torch.cuda.synchronize()
    return ts


def record(store, name, mode, ts_ns, ok):
    us = np.asarray(ts_ns) / 1e3
    d = store.setdefault(name, {"loop": [], "paced": [], "loop_median": [], "paced_mean": [], "ok": True})
    d[mode].append(float(us.mean() if mode == "loop" else np.median(us)))
    d["loop_median" if mode == "loop" else "paced_mean"].append(float(np.median(us) if mode == "loop" else us.mean()))
    d["ok"] = d["ok"] and ok


def run_rounds(store, groups, rounds, sync):
    """groups: [(variants, make(round) -> (steps, warm, E), hist)]; all interleave per round."""
    for r in range(rounds):
        for variants, make, hist in groups:
            steps, warm, E = make(r)
            for var in variants:
                for mode in ("loop", "paced"):
                    ts = batch(var, steps, warm, hist, mode == "paced", sync)
                    ok, msg = var.verify(hist, E) if var.verify else compare(hist.cpu().numpy(), E, "history")
                    if not ok:
                        fail(f"{var.name} ({mode}, round {r}): {msg}")
                    record(store, var.name, mode, ts, ok)


def summ(xs):
    xs = [x for x in xs if x is not None]  # a run whose check failed, or an invalid one, is None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": len(xs)} if xs else None


def fmt(xs):
    s = summ(xs)
    return "n/a" if s is None else f"{s['median']:.2f} [{s['min']:.2f}..{s['max']:.2f}]"


def med(store, name, mode):
    d = store.get(name)
    return statistics.median(d[mode]) if d and d[mode] and d["ok"] else None


def ratio(a, b):
    return None if a is None or b is None else a / b


def ring_var(name, L, spec, depth, stream, **kw):
    try:
        p = Ring(torch, L, spec, depth, stream, **kw)
    except Exception as e:  # noqa: BLE001 (cuda.bindings missing: the row and its goal say so)
        R["notes"].append(f"{name}: unavailable ({e!r})")
        return None
    return Var(name, p.call, used_views(p.dev, L, spec), lambda: p.dev.fill_(POISON), bps=p.bps)


def pinstage_var(name, L, spec, depth, mk_call):
    st = pinstage.StepStager(L, depth=depth)
    A = torch.from_dlpack(st.arena())
    var = Var(name, mk_call(st), used_views(A, L, spec), lambda: A.fill_(POISON))
    var.bps, var.stager = (lambda: st.stats()["bytes"] / max(1, st.stats()["steps"])), st
    return var


def engine_variants(L, spec, depth, s):
    def put(st):
        def f(v):
            with st.step(stream=s) as step:
                for n, x in v.items():
                    step.put(n, x)
        return f

    def views(st):
        def f(v):
            with st.step(stream=s) as step:
                for n, x in v.items():
                    step.view(n, rows=len(x))[:] = x
        return f

    out = [pinstage_var(STAGE, L, spec, depth, lambda st: (lambda v: st.stage(v, stream=s))),
           pinstage_var(PUT, L, spec, depth, put), pinstage_var(VIEWS, L, spec, depth, views),
           ring_var(TPACK, L, spec, depth, s), ring_var(TSIX, L, spec, depth, s, six=True),
           ring_var(CUB, L, spec, depth, s, kind="cuda")]
    dev, off = torch.empty(L.nbytes, dtype=torch.uint8, device="cuda"), offsets(L)
    stagers = {dt: pinstage.PinnedStager(dt, 256 * 128, depth=16) for dt in ("int32", "int64")}
    tg = {}
    for n, (dt, cap, _) in ENGINE.items():
        shape = cap if isinstance(cap, tuple) else (cap,)
        tg[n] = stagers[dt].target(dev[off[n]: off[n] + nbytes(dt, shape)].view(getattr(torch, dt)).reshape(shape))

    def targets(v):
        for n, x in v.items():
            tg[n].copy_(x, stream=s)

    out.append(Var(TGT, targets, used_views(dev, L, spec), lambda: dev.fill_(POISON), bps=sum(nbytes(*x) for x in spec.values())))
    return [v for v in out if v is not None]


# ---------------------------------------------------------------- sections
def bench_engine(args):
    L, spec, s = engine_layout(), engine_spec(), torch.cuda.Stream()
    torch.cuda.set_stream(s)
    variants = engine_variants(L, spec, args.depth, s)
    hist = torch.empty((args.steps, sum(nbytes(*x) for x in spec.values())), dtype=torch.uint8, device="cuda")
    run_rounds(R["engine"].setdefault("rows", {}), [(variants, maker(spec, args.steps, 1), hist)], args.rounds, s.synchronize)
    # The same variants with the values hot (as an engine's just-computed values and the C floor's).
    run_rounds(R["engine"].setdefault("rows_hot", {}), [([Hot(v) for v in variants], hot_maker(spec, args.steps, 2), hist)],
               args.rounds, s.synchronize)
    R["engine"]["bytes_per_step"] = {v.name: (v.bps() if callable(v.bps) else v.bps) for v in variants}
    R["engine"]["stats"] = {v.name: v.stager.stats() for v in variants if hasattr(v, "stager")}


def kspec(k):
    spec = {f"f{i}": ("int32", (256,)) for i in range(k)}
    return pinstage.StepLayout({n: ("int32", 256) for n in spec}), spec


def bench_ksweep(args):
    """Twice: with the values pre-generated for the whole batch (`maker`: 64 MiB at k=32, read
    from DRAM) and hot (`hot_maker`, as an engine's step values and as the C control's)."""
    s = torch.cuda.Stream()
    torch.cuda.set_stream(s)
    for store, make, wrap in ((R["ksweep"], maker, lambda v: v), (R["ksweep_hot"], hot_maker, Hot)):
        groups = []
        for k in KS:
            L, spec = kspec(k)
            var = wrap(pinstage_var(f"k={k}", L, spec, args.depth, lambda st: (lambda v: st.stage(v, stream=s))))
            groups.append(([var], make(spec, args.steps, 1000 + k), torch.empty((args.steps, k * 1024), dtype=torch.uint8, device="cuda")))
        run_rounds(store, groups, args.rounds, s.synchronize)
    for k in KS:
        R["ksweep_device_us"][k] = ksweep_device_us(*kspec(k), k)


def ksweep_device_us(L, spec, k, n=64, reps=5):
    """The copy engine's us per step: n steps issued behind a stall (one bound stager per step,
    so the host never waits), timed by events once the stall ends; every step checked."""
    s = torch.cuda.Stream()
    arenas = [torch.empty(L.nbytes, dtype=torch.uint8, device="cuda") for _ in range(n)]
    bound = [pinstage.StepStager(L, arena=a, depth=1) for a in arenas]
    out = []
    for r in range(reps):
        vals, steps = gen(spec, n, salt=5000 + 100 * k + r)
        for a in arenas:
            a.fill_(POISON)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(s):
            torch.cuda._sleep(20_000_000)
            e0.record(s)
        for i in range(n):
            bound[i].stage(steps[i], stream=s)
        e1.record(s)
        stalled = not e0.query()
        s.synchronize()
        out.append(e0.elapsed_time(e1) * 1e3 / n if stalled else None)
        ok, msg = compare(torch.stack([torch.cat(used_views(a, L, spec)) for a in arenas]).cpu().numpy(), expected(vals, n), "arenas")
        if not ok:
            fail(f"k={k} device sweep rep {r}: {msg}")
    if None in out:
        R["notes"].append(f"k={k} device sweep: the stall ended before every step was issued in some reps (dropped)")
    return summ(out)


def bench_zero_copy(args):
    """Kernels read the pinned slot in place: each step's consumer (the snapshot) reads the slot's
    device view between the writes and the commit; timed: claim + writes, and the commit."""
    L, spec, depth, n, s = engine_layout(), engine_spec(), args.depth, args.steps, torch.cuda.Stream()
    torch.cuda.set_stream(s)
    st, st_bare = (pinstage.StepStager(L, mode="zero_copy", depth=depth) for _ in range(2))
    slot = [{f: torch.from_dlpack(st.slot_field(k, f)) for f in spec} for k in range(depth)]
    srcs = [[d[f][: spec[f][1][0]].reshape(-1).view(torch.uint8) for f in spec] for d in slot]
    one = [[d["seq_lens"][:1].view(torch.uint8)] for d in slot]

    def poison():
        for d in slot:
            for t in d.values():
                t.view(torch.uint8).fill_(POISON)

    def zc_run(write, src):
        def run(i, v, hist):
            t0 = clock()
            step = st.step(stream=s)
            write(step, v)
            t1 = clock()
            torch.cat(src[step.slot], out=hist[i])
            t2 = clock()
            step.commit()
            return t1 - t0 + clock() - t2

        return run

    def put6(step, v):
        for f, x in v.items():
            step.put(f, x)

    def one_value(step, v):  # as the Rust row: one value written in place
        step.view("seq_lens", rows=1)[0] = v["seq_lens"][0]

    bare = {"n": 0, "stats": st_bare.stats()}

    def run_bare(i, v, hist):
        t0 = clock()
        st_bare.step(stream=s).commit()
        t = clock() - t0
        bare["n"] += 1
        return t

    def verify_bare(hist, E):
        now, before = st_bare.stats(), bare["stats"]
        ok = now["steps"] - before["steps"] == bare["n"] and now["copies"] == before["copies"]
        bare.update(n=0, stats=now)
        return ok, f"stats {before} -> {now}"

    U = sum(nbytes(*x) for x in spec.values())
    groups = [([Var("zero-copy step + 6 put + commit", run=zc_run(put6, srcs), poison=poison)], maker(spec, n, 2),
               torch.empty((n, U), dtype=torch.uint8, device="cuda")),
              ([Var("zero-copy step + 1 value in place + commit", run=zc_run(one_value, one), poison=poison),
                Var("zero-copy bare step + commit (stats-checked)", run=run_bare, verify=verify_bare)],
               maker({"seq_lens": ("int32", (1,))}, n, 3), torch.empty((n, 4), dtype=torch.uint8, device="cuda"))]
    run_rounds(R["zero_copy"], groups, args.rounds, s.synchronize)


def bench_graph(args):
    """A ~4 ms CUDA graph reading the arena (its first node gathers the arena's used rows into
    `out`, snapshotted after every replay, all checked), then matmuls. In order: step i staged on
    the graph's stream, then replayed (GPU ms of copy + graph, vs the graph alone). Beside: steps
    at full rate on another stream into another buffer, from a thread, while the graph replays;
    every replay and the thread's last --steps steps checked."""
    L, spec, depth, reps, n = engine_layout(), engine_spec(), args.depth, args.graph_reps, args.steps
    U = sum(nbytes(*x) for x in spec.values())
    gs, side = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.set_stream(gs)
    st = pinstage.StepStager(L, depth=depth)
    av = used_views(torch.from_dlpack(st.arena()), L, spec)
    a, b = (torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty(U, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        torch.cat(av, out=out)
        c = a @ b
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=gs):
        torch.cat(av, out=out)
        for _ in range(26):
            c = a @ b  # noqa: F841
    hist, h2 = (torch.empty((m, U), dtype=torch.uint8, device="cuda") for m in (reps, n))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]

    def replays(steps, E, staged, label):
        hist.fill_(POISON)
        torch.cuda.synchronize()
        for i in range(reps):
            ev[i][0].record(gs)
            if staged:
                st.stage(steps[i], stream=gs)
            g.replay()
            ev[i][1].record(gs)
            hist[i].copy_(out)
        torch.cuda.synchronize()
        ok, msg = compare(hist.cpu().numpy(), E, "history")
        if not ok:
            fail(f"graph {label}: replays read wrong arena values: {msg}")
        return statistics.median(e0.elapsed_time(e1) for e0, e1 in ev) if ok else None

    st2 = pinstage.StepStager(L, depth=depth)
    B = torch.from_dlpack(st2.arena())

    loads = [Var("pinstage stage", lambda v: st2.stage(v, stream=side), used_views(B, L, spec), lambda: B.fill_(POISON)),
             ring_var("torch packed ring", L, spec, depth, side), Var("a Python loop holding the GIL (control)", run=lambda i, v, h: sum(range(50)) * 0)]
    loads, G = [x for x in loads if x is not None], R["graph"]
    for r in range(args.rounds):
        vals, steps = gen(spec, reps + 1, salt=900 + r)
        E, fixed = expected(vals, reps), steps[reps]
        Efix = np.tile(expected({k: x[reps:] for k, x in vals.items()}, 1), (reps, 1))
        st.stage(fixed, stream=gs)
        G.setdefault("graph alone ms", []).append(replays(steps, Efix, False, "alone"))
        G.setdefault("in order: copy + graph ms", []).append(replays(steps, E, True, "in order"))
        lvals, lsteps = gen(spec, n, salt=950 + r)
        LE = expected(lvals, n)
        for var in loads:
            st.stage(fixed, stream=gs)
            var.poison()
            h2.fill_(POISON)
            torch.cuda.synchronize()
            stop, count = threading.Event(), [0]

            def loop(var=var, stop=stop, count=count):
                torch.cuda.set_stream(side)
                i = 0
                while not stop.is_set():
                    var.run(i % n, lsteps[i % n], h2)
                    i += 1
                count[0] = i

            th = threading.Thread(target=loop)
            th.start()
            time.sleep(0.02)
            ms = replays(steps, Efix, False, f"beside {var.name}")
            stop.set()
            th.join()
            torch.cuda.synchronize()
            if var.srcs is not None:
                rows = sorted({i % n for i in range(max(0, count[0] - n), count[0])})
                ok, msg = compare(h2.cpu().numpy()[rows], LE[rows], "load steps")
                if not ok:
                    fail(f"graph beside {var.name} round {r}: {msg}")
            G.setdefault(f"beside {var.name} ms", []).append(ms)
            G.setdefault(f"beside {var.name}: steps", []).append(count[0])


def bench_jax(args):
    import jax
    jax.config.update("jax_enable_x64", True)
    R["config"]["jax"] = jax.__version__
    L, spec = engine_layout(), engine_spec()
    names, gpu, n = list(spec), jax.devices("gpu")[0], args.jax_steps
    st = pinstage.StepStager(L, mode="fresh", depth=args.depth)
    unpack, dense, o = jax.jit(L.unpack), [], 0
    for nm in names:
        dense.append((nm, o, nbytes(*spec[nm]), np.dtype(spec[nm][0]), spec[nm][1]))
        o += nbytes(*spec[nm])

    def dense_unpack(p):  # the peer's arrays: jnp slicing + bitcast inside jit, as layout.unpack
        return {nm: jax.lax.bitcast_convert_type(p[a: a + b].reshape(-1, dt.itemsize), dt).reshape(shape)
                for nm, a, b, dt, shape in dense}

    dunpack = jax.jit(dense_unpack)
    packed = lambda v: np.concatenate([x.reshape(-1).view(np.uint8) for x in v.values()])  # noqa: E731
    fns = {JST: lambda v: unpack(jax.dlpack.from_dlpack(st.stage(v))),
           JPK: lambda v: dunpack(jax.device_put(packed(v), gpu)),
           JSIX: lambda v: [jax.device_put(x, gpu) for x in v.values()],
           JCST: lambda b: unpack(jax.dlpack.from_dlpack(b)),
           JCPK: dunpack}
    # The controls' inputs, made per step before the clock starts (the batch's whole list).
    before = {JCST: st.stage, JCPK: lambda v: jax.block_until_ready(jax.device_put(packed(v), gpu))}

    def row(h):  # a step's used bytes; jit returns dicts with sorted keys: index by name
        parts = [h[nm] for nm in names] if isinstance(h, dict) else h
        return np.concatenate([np.asarray(p)[: spec[nm][1][0]].reshape(-1).view(np.uint8) for nm, p in zip(names, parts)])

    make = maker(spec, n, 7)
    order = list(fns.items())
    shuffle = random.Random(n)
    for r in range(args.rounds):
        steps, warm, E = make(r)
        # A fresh order each round: a row's place in the round (first after the round's
        # value arrays are made, or after another row's JAX work) is not its figure, and no
        # row always follows the same one.
        shuffle.shuffle(order)
        for name, fn in order:
            for mode in ("loop", "paced"):
                prep = before.get(name, lambda v: v)
                for v in warm:
                    jax.block_until_ready(fn(prep(v)))
                inputs = [prep(v) for v in steps]
                res, ts = [None] * n, np.empty(n, np.int64)
                gc.collect()
                gc.disable()
                try:
                    for i, v in enumerate(inputs):
                        if mode == "paced" and i:
                            jax.block_until_ready(res[i - 1])
                        t0 = clock()
                        res[i] = fn(v)
                        ts[i] = clock() - t0
                finally:
                    gc.enable()
                ok, msg = compare(np.stack([row(h) for h in jax.device_get(jax.block_until_ready(res))]), E, "arrays")
                if not ok:
                    fail(f"JAX {name} ({mode}, round {r}): {msg}")
                record(R["jax"], name, mode, ts, ok)
                del res, inputs


# ---------------------------------------------------------------- summary and goals
def goal(label, value, op, target, unit=""):
    met = value is not None and (value <= target if op == "<=" else value >= target)
    shown = "n/a (missing, failed check, peer unavailable or < 5 runs)" if value is None else f"{value:.2f}{unit}"
    R["goals"].append({"goal": label, "value": value, "target": f"{op} {target}", "met": met})
    return f"  {'PASS' if met else 'MISS'}  {label:<66} {shown}  (target {op} {target}{unit})"


def table(title, S, base, blabel, extra_head="", extra=lambda name: ""):
    if not S:
        return []
    xr = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    lines = ["", f"| {title} | loop us | paced us | loop / {blabel} | paced / {blabel} |{extra_head}",
             "|---|---|---|---|---|" + ("---|" if extra_head else "")]
    for name, d in S.items():
        rl, rp = ratio(med(S, name, "loop"), med(S, base, "loop")), ratio(med(S, name, "paced"), med(S, base, "paced"))
        lines.append(f"| {name}{'' if d['ok'] else ' (CHECK FAILED)'} | {fmt(d['loop'])} | {fmt(d['paced'])} | "
                     f"{xr(rl)} | {xr(rp)} |{extra(name)}")
    return lines


def summary(args):
    E, EH, K, KH = R["engine"].get("rows", {}), R["engine"].get("rows_hot", {}), R["ksweep"], R["ksweep_hot"]
    J, G = R["jax"], R["graph"]
    bps, dev = R["engine"].get("bytes_per_step", {}), R["ksweep_device_us"]
    lines = [f"\n== SUMMARY: host us per step, median of {args.rounds} runs [min..max]; a loop run's figure is the mean "
             "of its calls, a paced run's their median; every step of every timed batch checked"]
    lines += table("engine step (6 fields, 37.5 KiB used), values pre-generated", E, STAGE, "stage", " B sent/step |",
                   lambda nm: f" {bps.get(nm, 0):.0f} |")
    lines += table("engine step, values hot", EH, STAGE, "stage")
    lines += table("k fields of 1 KiB, stage, values pre-generated", K, "k=1", "k=1", " copy engine us/step |",
                   lambda nm: f" {dev[int(nm[2:])]['median']:.2f} |" if dev.get(int(nm[2:])) else " n/a |")
    lines += table("k fields of 1 KiB, stage, values hot", KH, "k=1", "k=1")
    lines += table("JAX: the engine step into fresh arrays", J, JST, "pinstage")
    for mode in ("loop", "paced"):
        ceil = ratio(med(J, JPK, mode), med(J, JCST, mode))
        if ceil is not None:
            lines.append(f"  {mode}: the packed peer / JAX's own part of pinstage's path (the control) = {ceil:.2f}x: "
                         "the most any staging that ends in from_dlpack + jit unpack can reach against this peer")
    lines += table("zero-copy (slot read in place)", R["zero_copy"], "zero-copy step + 6 put + commit", "6 put")
    alone = summ(G.get("graph alone ms", []))
    if alone:
        lines.append(f"\ngraph reading the arena (every replay checked), GPU ms: alone {fmt(G['graph alone ms'])}")
        for k, v in G.items():
            if k.endswith(" ms") and k != "graph alone ms" and summ(v):
                lines.append(f"  {k:<60} {fmt(v)}  ({100 * (summ(v)['median'] / alone['median'] - 1):+.2f}%)")
    lines.append("Rust vs C (one step): see benches/gpu_step.rs (cargo bench); not measured here.")
    gv = (lambda x: None) if args.rounds < 5 else (lambda x: x)
    lines.append(f"\n== GOALS (median over {args.rounds} runs, checked runs)")
    for vals, S in (("pre-generated", E), ("hot", EH)):
        lines += [goal(f"stage, engine step, values {vals}, paced <= 5 us", gv(med(S, STAGE, "paced")), "<=", 5, " us"),
                  goal(f"stage, engine step, values {vals}, loop <= 6 us", gv(med(S, STAGE, "loop")), "<=", 6, " us")]
    for label, S, a, b, op, t in (("torch packed ring / stage, values pre-generated", E, TPACK, STAGE, ">=", 4),
                                  ("torch packed ring / stage, values hot", EH, TPACK, STAGE, ">=", 4),
                                  ("cuda.bindings packed ring / stage, values pre-generated", E, CUB, STAGE, ">=", 2),
                                  ("cuda.bindings packed ring / stage, values hot", EH, CUB, STAGE, ">=", 2),
                                  ("k=32 / k=1, values pre-generated", K, "k=32", "k=1", "<=", 2),
                                  ("k=32 / k=1, values hot", KH, "k=32", "k=1", "<=", 2),
                                  ("JAX packed device_put / pinstage fresh", J, JPK, JST, ">=", 2.5)):
        for mode in ("loop", "paced"):
            lines.append(goal(f"{label}, {mode} {op} {t}x", gv(ratio(med(S, a, mode), med(S, b, mode))), op, t, "x"))
    lines += [f"note: {x}" for x in R["notes"]]
    nf = len(R["failed"])
    lines.append("checks: ALL PASSED" if not nf else f"checks: {nf} FAILED (first: {R['failed'][0][:300]})")
    return "\n".join(lines)


def main():
    global torch
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="directory for bench-step.json and bench-step-summary.md")
    ap.add_argument("--steps", type=int, default=2000, help="steps per timed batch (torch sections)")
    ap.add_argument("--jax-steps", type=int, default=500, help="steps per timed JAX batch")
    ap.add_argument("--rounds", type=int, default=7, help="runs per figure (the goals need >= 5)")
    ap.add_argument("--depth", type=int, default=8, help="slots in flight, pinstage and every peer")
    ap.add_argument("--graph-reps", type=int, default=40, help="graph replays per timed run")
    ap.add_argument("--sections", default="engine,ksweep,zero_copy,graph,jax")
    args = ap.parse_args()
    import torch as _torch
    torch, t_start = _torch, time.perf_counter()
    R["config"] = {"pinstage": pinstage.__version__, "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                   "python": sys.version.split()[0], **vars(args)}
    try:
        from cuda import bindings
        R["config"]["cuda.bindings"] = getattr(bindings, "__version__", "?")
    except ImportError:
        pass
    print("pinstage", pinstage.__version__, "| torch", torch.__version__, "|", R["config"]["device"], flush=True)
    sections = {"engine": bench_engine, "ksweep": bench_ksweep, "zero_copy": bench_zero_copy, "graph": bench_graph, "jax": bench_jax}
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            sections[name](args)
        except Exception:  # noqa: BLE001 (one section's crash must not hide the others')
            fail(f"section {name} crashed: {traceback.format_exc(limit=6)}")
        torch.cuda.set_stream(torch.cuda.default_stream())
        torch.cuda.synchronize()
        R["config"][f"seconds {name}"] = round(time.perf_counter() - t0, 1)
        print(f"-- {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    text = summary(args)
    R["config"]["seconds total"] = round(time.perf_counter() - t_start, 1)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench-step.json"), "w") as f:
            json.dump(R, f, indent=1, default=str)
        with open(os.path.join(args.out, "bench-step-summary.md"), "w") as f:
            f.write(text + "\n")
    print(text)
    print(f"total {time.perf_counter() - t_start:.1f} s")
    sys.exit(1 if R["failed"] else 0)


if __name__ == "__main__":
    main()
