"""Where a background BlockMover call's host time goes, on a GPU (bench_blocks.py measured
195-288 us for 2048 ids against a goal of 2 + 0.05 us per id = 104 us).

Each row: median (p10, p90) host us of the call alone (its move then waited for, untimed), 200 calls
in ROUNDS rounds of 40 that go through every row in turn (controls included), after a warm-up round
untimed, so a change of the core's clock during the run moves every row alike (the min and max of
the rounds' medians are printed too),
64 tensors of 8192 blocks of 4 KiB on each side, random ids, one torch stream `s`:
- plan() of n ids (n = 1, 128, 2048) as numpy int64, a list, a CPU torch tensor: reading and
  checking the ids, merging runs, building the copy list (no driver call);
- a move of the same numpy ids, in the background and (up to 128 ids) on the calling thread,
  also right after the GPU was idle for 1 ms (the bench's pattern: synchronize, then call);
- control: torch's own fixed cost on the same stream (an event record, `current_stream()`),
  and the floor of a pinstage call from Python (`cuda_available()`: no argument, no driver call),
  the record and the floor also after 1 ms idle (what a call costs where the core's caches went
  cold, beside the moves' idle rows), and the record right after the wait for a move of n ids
  (the move untimed: the state in which the rows above time their calls), or after torch
  copied as many bytes in one copy and synchronized (the same state without pinstage).
Host time only: the moved bytes are not checked here (bench_blocks.py checks every block of
the same calls). Beside each row's wall time: the calling thread's CPU time over the same
window (`time.thread_time_ns`, read just outside it) and how many calls saw the thread switched
out (`getrusage(RUSAGE_THREAD)`'s voluntary + involuntary switches): a call that waited off the
CPU shows wall time well above its CPU time. Rows marked "previous dropped first" let go of the
previous call's PendingCopy before timing the call (the other rows drop it inside the timed
window, at `r = f()`, as a loop does). With the lab variant `stamps`
(`PINSTAGE_VARIANTS=stamps scripts/gpu-build`, `gpu-run variant-stamps`), each row's median ns
between the call's timestamps is printed too. Rows "moves waited by s.synchronize()" end each
move's wait with `stream_wait(s)` + `s.synchronize()` before `wait()` (which then returns at
once): the call's own cost apart from the state an event wait leaves behind a large move
(lab/probes/post_wait_state.py).

    python3 lab/probes/blocks_bg_cost.py
"""

import resource
import statistics
import time

import numpy as np
import torch

import pinstage

try:
    from labmod import lab  # the lab wheel's second module (scripts/gpu-run puts it first)
    STAMPS = getattr(lab, "_stamps", None)  # only in the variant `stamps`
except ImportError:
    STAMPS = None

L, NB, B = 64, 8192, 4096
W = B // 4
dev_all = torch.zeros((L, NB, W), dtype=torch.int32, device="cuda")
host_all = pinstage.empty_host((L, NB, W), np.int32)
devs = [dev_all[i] for i in range(L)]
hosts = [host_all[i] for i in range(L)]
mover = pinstage.BlockMover(devs, hosts, block_dim=0)
s = torch.cuda.Stream()
rng = np.random.default_rng(1)
ROUNDS, PER = 5, 40
print(f"pinstage {pinstage.__version__}, torch {torch.__version__}: {L} tensors x {NB} blocks "
      f"of {B} B; host us per call, {ROUNDS} rounds of {PER} calls per row")


def switches():
    ru = resource.getrusage(resource.RUSAGE_THREAD)
    return ru.ru_nvcsw + ru.ru_nivcsw


def sample(f, n, idle=False, drop=False, before=None, settle=False):
    """(wall ns, thread CPU ns, switched) per call, and the stamps of each call (variant).
    `settle`: each call's move is waited for by `stream_wait(s)` + `s.synchronize()` before
    `wait()` (the next call then finds the state a stream synchronize leaves, cheaper after a
    large move: lab/probes/post_wait_state.py)."""
    t, parts = [], []
    r = None
    for _ in range(n):
        if idle:
            torch.cuda.synchronize()
            time.sleep(0.001)
        if before:
            before()
            if STAMPS:
                STAMPS()  # the untimed move's stamps are not the timed call's
        sw0, c0 = switches(), time.thread_time_ns()
        t0 = time.perf_counter_ns()
        r = f()
        t1 = time.perf_counter_ns()
        c1, sw1 = time.thread_time_ns(), switches()
        t.append((t1 - t0, c1 - c0, sw1 != sw0))
        if STAMPS:
            parts.append(STAMPS())
        if r is not None:
            if settle:
                r.stream_wait(s)
                s.synchronize()
            r.wait()
        if drop:
            r = None
    return t, parts


def row(f, idle=False, drop=False, before=None, settle=False):
    """A row's call, whether 1 ms of idle comes before each, whether the previous call's result
    is let go before the next is timed, what runs untimed before each, whether each move is
    waited for by a stream synchronize; sampled in rounds below, under `torch.cuda.stream(s)`."""
    return (f, idle, drop, before, settle)


ev = torch.cuda.Event()
# The torch control's bytes: as many as a move of 2048 ids, one contiguous copy into torch's
# own pinned memory.
dev_flat = dev_all.reshape(-1)
pinned_flat = torch.empty(2048 * L * W, dtype=torch.int32, pin_memory=True)
# Each row's call binds its ids now (default arguments): the rows run later, in rounds.
rows = []
for n in (1, 128, 2048):
    d = rng.permutation(NB)[:n].astype(np.int64)
    h = rng.permutation(NB)[:n].astype(np.int64)
    kinds = {"numpy": (d, h), "list": (d.tolist(), h.tolist()),
             "torch": (torch.from_numpy(d), torch.from_numpy(h))}
    for kind, (a, b) in kinds.items():
        rows.append((f"plan() {n} ids {kind}", row(lambda a=a, b=b: (mover.plan("offload", a, b), None)[1])))
    a, b = kinds["numpy"]
    for bg in (True, False):
        if not bg and n > 128:
            continue  # the calling thread's cost is the bench's (ms at 2048 ids)
        rows.append((f"offload {n} ids numpy, background={bg}",
                     row(lambda a=a, b=b, bg=bg: mover.offload(a, b, stream=s, background=bg))))
        rows.append((f"offload {n} ids numpy, background={bg}, after 1 ms idle",
                     row(lambda a=a, b=b, bg=bg: mover.offload(a, b, stream=s, background=bg), idle=True)))
    rows.append((f"load {n} ids numpy, background=True",
                 row(lambda a=a, b=b: mover.load(b, a, stream=s, background=True))))
    # The call's own cost apart from the state an event wait leaves (post_wait_state.py).
    rows.append((f"offload {n} ids numpy, background=True, moves waited by s.synchronize()",
                 row(lambda a=a, b=b: mover.offload(a, b, stream=s, background=True), settle=True)))
    rows.append((f"load {n} ids numpy, background=True, moves waited by s.synchronize()",
                 row(lambda a=a, b=b: mover.load(b, a, stream=s, background=True), settle=True)))
    for name, f in ((f"offload {n} ids numpy, background=True",
                     lambda a=a, b=b: mover.offload(a, b, stream=s, background=True)),
                    (f"load {n} ids numpy, background=True",
                     lambda a=a, b=b: mover.load(b, a, stream=s, background=True))):
        rows.append((name + ", previous dropped first", row(f, drop=True)))
    rows.append((f"load {n} ids numpy, background=True, after 1 ms idle",
                 row(lambda a=a, b=b: mover.load(b, a, stream=s, background=True), idle=True)))
    # The control of the state a row's call finds: torch's record timed right after the wait
    # for this row's move (the move untimed), where a move's call is timed in the rows above;
    # and after torch moved as many bytes in one copy and waited with its own synchronize (is
    # the state pinstage's doing, its wait's or its many copies', or any such move's?).
    rows.append((f"control: torch Event.record(s), after the wait for an offload of {n} ids",
                 row(lambda: (ev.record(s), None)[1],
                     before=lambda a=a, b=b: mover.offload(a, b, stream=s, background=True).wait())))
    nw = n * L * W
    rows.append((f"control: torch Event.record(s), after torch copied {n} ids' bytes, synchronized",
                 row(lambda: (ev.record(s), None)[1],
                     before=lambda nw=nw: (pinned_flat[:nw].copy_(dev_flat[:nw], non_blocking=True),
                                           s.synchronize()))))
    if n <= 128:  # the load issued on the calling thread: is the load's extra cost its own?
        rows.append((f"load {n} ids numpy, background=False",
                     row(lambda a=a, b=b: mover.load(b, a, stream=s, background=False))))
    rows.append((f"offload {n} ids numpy, background=True, stream= omitted",
                 row(lambda a=a, b=b: mover.offload(a, b, background=True))))
    rows.append((f"offload {n} ids numpy, background=True, stream=int handle",
                 row(lambda a=a, b=b: mover.offload(a, b, stream=s.cuda_stream, background=True))))
rows.append(("control: torch Event.record(s)", row(lambda: (ev.record(s), None)[1])))
rows.append(("control: torch Event.record(s), after 1 ms idle",
             row(lambda: (ev.record(s), None)[1], idle=True)))
rows.append(("control: torch.cuda.current_stream()",
             row(lambda: (torch.cuda.current_stream(), None)[1])))
# The floor of a Python call into pinstage (no argument, no driver call); `plan()` above is
# the one that reads and checks the ids.
rows.append(("control: pinstage.cuda_available()",
             row(lambda: (pinstage.cuda_available(), None)[1])))
rows.append(("control: pinstage.cuda_available(), after 1 ms idle",
             row(lambda: (pinstage.cuda_available(), None)[1], idle=True)))
times = {name: [] for name, _ in rows}
cpus = {name: [] for name, _ in rows}
switched = {name: 0 for name, _ in rows}
rounds = {name: [] for name, _ in rows}
stamps = {name: [] for name, _ in rows}
for r in range(ROUNDS + 1):
    for name, (f, idle, drop, before, settle) in rows:
        with torch.cuda.stream(s):
            t, parts = sample(f, PER, idle, drop, before, settle)
        if r:  # round 0 warms up (clock, caches, the mover's threads)
            times[name] += [w for w, _, _ in t]
            cpus[name] += [c for _, c, _ in t]
            switched[name] += sum(x for _, _, x in t)
            rounds[name].append(statistics.median(w for w, _, _ in t) / 1e3)
            stamps[name] += parts
print(f"  {'':68s} {'median':>8s} {'p10':>6s} {'p90':>6s} {'rounds min':>10s} {'max':>6s}"
      f" {'cpu':>6s} {'switched':>8s}")
for name, _ in rows:
    t = sorted(times[name])
    us, p10, p90 = statistics.median(t) / 1e3, t[len(t) // 10] / 1e3, t[len(t) * 9 // 10] / 1e3
    cpu = statistics.median(cpus[name]) / 1e3
    print(f"  {name:68s} {us:8.1f} {p10:6.1f} {p90:6.1f} {min(rounds[name]):10.1f}"
          f" {max(rounds[name]):6.1f} {cpu:6.1f} {switched[name]:5d}/{len(t)}")
if STAMPS:
    print("\nvariant stamps: median ns from the stamp before, per row (calls whose stamps have "
          "another sequence of labels are counted apart)")
    for name, _ in rows:
        calls = [c for c in stamps[name] if c and c[0][0].startswith(">")]
        if not calls:
            continue
        seqs = {}
        for c in calls:
            seqs.setdefault(tuple(label for label, _ in c), []).append(c)
        for seq, cs in seqs.items():
            meds = [statistics.median(c[i][1] for c in cs) for i in range(len(seq))]
            parts = "  ".join(f"{label} {m:.0f}" for label, m in zip(seq, meds))
            print(f"  {name} ({len(cs)} calls): {parts}")
