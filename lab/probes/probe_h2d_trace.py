"""Probe: where the time of one `copy_h2d` from pageable memory goes. The lab wheel traces each
bounce piece (when its last unit was filled, when its copy was issued, from the start of the
bounced path) and the path's return; this prints, per size and worker count, the median call's
timeline against the wall time of the whole call (Python in, synchronised out) and against torch
`copy_` from pinned memory in the same state (the source as the previous call left it; each
destination poisoned first and checked after). Each piece's landing comes from a timing event
recorded after its copy (`_h2d_trace_landed`; the GPU clock aligned to the call's start by an
event recorded on the idle stream there): the copy engine's rate over the pieces it found queued,
and the time it sat waiting for the next issue, measured instead of inferred. Run y traced 12
and 8 workers (its first two tunings), run z those and 8 workers with regular stores into 512
KiB x 16 slots, run zb 12 and 8 workers with 12 and with 4 slots (all with two pieces per
worker, the rule until run zc). Env TUNINGS: the row numbers to run (comma-separated, 0 the
default; all by default).

With COLD=1 every CPU sweeps 1 GiB (read + write, `bench_h2d.py`'s `Sweeper`) before each call
(pinstage's and torch's alike, untimed), so the source comes from DRAM: the cold state the goal
is judged in.

Usage: python3 lab/probes/probe_h2d_trace.py      (env COLD=1, SIZES_MIB, default 16,64,1024)
"""

import os
import statistics
import time

import torch

import pinstage
from labmod import cold_sweep, int32_copy_case, lab

REPS = 9
POISON = -7
COLD = os.environ.get("COLD") == "1"
SIZES = [int(m) << 20 for m in os.environ.get("SIZES_MIB", "16,64,1024").split(",")]
sweep = cold_sweep()
ALL_TUNINGS = [
    ("12 workers, whole 4 MiB pieces (the default)", dict(workers=12)),
    ("8 workers", dict(workers=8)),
    ("10 workers", dict(workers=10)),
    ("4 slots", dict(slots=4)),
    ("6 slots", dict(slots=6)),
]
TUNINGS = [ALL_TUNINGS[int(i)] for i in os.environ["TUNINGS"].split(",")] if os.environ.get("TUNINGS") else ALL_TUNINGS


def one(fn, dst, ref, trace):
    dst.fill_(POISON)
    torch.cuda.synchronize()
    if sweep is not None:
        sweep()
    if trace:
        lab._h2d_trace_set(True)
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    tr = lab._h2d_trace() if trace else []
    landed = dict(lab._h2d_trace_landed()) if trace else {}
    lab._h2d_trace_set(False)
    if not torch.equal(dst, ref):
        raise AssertionError("wrong result")
    return (t2 - t0) * 1e6, (t1 - t0) * 1e6, tr, landed


def engine(pieces, landed):
    """The copy engine from the landing events: (its median rate over the pieces it found queued,
    GB/s, intervals beyond 60 GB/s left out; µs it waited for an issue after finishing a piece;
    the last landing). Run 2026-12-07-h100-w printed 1623 GB/s before that cut: two pieces
    issued 5 µs apart by two threads, the first's event recorded after both copies."""
    done = sorted((landed[p[0]], p) for p in pieces if p[0] in landed)
    rates, idle = [], 0.0
    for (prev, _), (at, p) in zip(done, done[1:]):
        if p[3] < prev:  # issued before the one before it landed: the engine went straight on
            rate = p[1] / max(at - prev, 1e-3) / 1e3
            # Beyond the link: the event before was recorded after this piece's copy too (two
            # threads issuing at once), so the interval is not this piece's copy.
            if rate <= 60:
                rates.append(rate)
        else:
            idle += p[3] - prev
    return (statistics.median(rates) if rates else float("nan")), idle, (done[-1][0] if done else float("nan"))


print("state:", "cold (1 GiB swept before each call)" if COLD else "hot (the same source every call)", flush=True)
for nb in SIZES:
    vals, ref, dst, tpin = int32_copy_case(nb)
    for _ in range(2):
        one(lambda: dst.copy_(tpin, non_blocking=True), dst, ref, False)
    pin = statistics.median(one(lambda: dst.copy_(tpin, non_blocking=True), dst, ref, False)[0] for _ in range(REPS))
    print(f"== {nb >> 20} MiB: torch copy_ from pinned {pin:.0f} us ({nb / pin / 1e3:.2f} GB/s)", flush=True)
    for name, kw in TUNINGS:
        lab._set_h2d_tuning(**kw)
        for _ in range(2):
            one(lambda: pinstage.copy_h2d(dst, vals), dst, ref, False)
        runs = sorted((one(lambda: pinstage.copy_h2d(dst, vals), dst, ref, True) for _ in range(REPS)), key=lambda r: r[0])
        wall, ret, tr, landed = runs[len(runs) // 2]
        pieces = sorted((p for p in tr if p[0] >= 0), key=lambda p: p[3])
        back = [p[2] for p in tr if p[0] < 0][0]
        first_issue = pieces[0][3]
        last_fill = max(p[2] for p in pieces)
        last_issue = pieces[-1][3]
        print(f"  {name}: wall {wall:.0f} us ({nb / wall / 1e3:.2f} GB/s, {pin / wall:.3f} of torch pinned); "
              f"python call returned at {ret:.0f}; bounced path: first copy issued at {first_issue:.0f}, "
              f"last unit filled at {last_fill:.0f} (fill {nb / last_fill / 1e3:.1f} GB/s), last copy issued at "
              f"{last_issue:.0f}, returned at {back:.0f}; after the return until synchronised {wall - ret:.0f} us; "
              f"the link alone from the first issue would end at {first_issue + nb / 55e3:.0f}", flush=True)
        rate, idle, last = engine(pieces, landed)
        print(f"    copy engine (landing events): {rate:.1f} GB/s over the pieces it found queued; idle "
              f"{idle:.0f} us waiting for issues; last piece landed at {last:.0f}", flush=True)
        if nb == 64 << 20:
            print("    piece, KiB, filled us, issued us, landed us: " + "; ".join(
                f"{p[0]} {p[1] >> 10} {p[2]:.0f} {p[3]:.0f} {landed.get(p[0], float('nan')):.0f}" for p in pieces),
                flush=True)
        walls = [r[0] for r in runs]
        print(f"    wall us of the {REPS} calls: " + " ".join(f"{w:.0f}" for w in walls), flush=True)
    lab._set_h2d_tuning()
    del tpin
