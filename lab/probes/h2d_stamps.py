"""Probe: where the start of one `copy_h2d` from pageable memory goes, on the calling thread.

The trace of run 2026-12-07-h200-f (64 MiB, cold) has the first 128 KiB unit filled 57 us and its
copy issued 78 us after the bounced path began, and the Python call returning 65 us after that
path did: ~6% of the goal's budget before the copy engine starts. A rayon spawn from outside
the pool wakes a sleeping copy thread per spawn, on the caller, before the caller's own fill.

With the lab variant `stamps` (`PINSTAGE_VARIANTS=stamps scripts/gpu-build`, `gpu-run
variant-stamps` with `PINSTAGE_VARIANT_RUNS=h2d_stamps`) each call's timestamps on the calling
thread are read after it (`pinstage._lab._stamps`): the Python entry, the imports,
`start_h2d` (the GIL released), the context entered, the cut, the event, the slots, the job,
the copy threads staffed (11 wakes), the caller's first unit filled, its part done, the copy
threads gone, the event recorded, the return. Printed per row: the median ns between
consecutive stamps and the wall time (Python in, synchronised out) against torch `copy_` from
pinned memory in the same state. In any other build only the wall times are printed. The
`fanout` row (one copy thread woken by the caller, the rest by it) of runs 2026-12-07-h100-o and
-p moved neither the first unit nor the wall: that lab knob is gone. Nor did `prewake` (every
copy thread woken at the Python entry, spinning until the copy staffed it) in run
2026-12-07-h100-za: 64 MiB 1746 against 1747 µs, 16 MiB 661 against 678 (15 shuffled rounds);
gone too.

Every call's destination is poisoned first and compared with the source after (0 failures
printed at the end, or an AssertionError). With COLD=1 every CPU sweeps 1 GiB (read + write,
`bench_h2d.py`'s `Sweeper`) before each call, pinstage's and torch's alike, untimed.

Usage: python3 lab/probes/h2d_stamps.py      (env COLD=1, SIZES_MIB (default 1,64), REPS (9))
"""

import os
import random
import statistics
import time

import torch

import pinstage
from labmod import cold_sweep, int32_copy_case, lab

STAMPS = getattr(lab, "_stamps", None)
REPS = int(os.environ.get("REPS", "9"))
POISON = -7
COLD = os.environ.get("COLD") == "1"
SIZES = [int(m) << 20 for m in os.environ.get("SIZES_MIB", "1,64").split(",")]
sweep = cold_sweep()
TUNINGS = [
    ("default", {}),
]


def one(fn, dst, ref):
    """One call: the destination poisoned, the cold sweep, the call timed to its synchronise,
    the result checked. Returns (wall us, the caller's stamps or None)."""
    dst.fill_(POISON)
    torch.cuda.synchronize()
    if sweep is not None:
        sweep()
    if STAMPS is not None:
        STAMPS()  # clears what earlier calls on this thread left
    t0 = time.perf_counter()
    fn()
    stamps = STAMPS() if STAMPS is not None else None
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e6
    if not torch.equal(dst, ref):
        raise AssertionError("wrong result")
    return wall, stamps


print(f"pinstage {pinstage.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}; "
      f"state: {'cold (1 GiB swept before each call)' if COLD else 'hot'}; "
      f"stamps: {'yes' if STAMPS else 'no (not the stamps variant)'}", flush=True)
checked = 0
for nb in SIZES:
    vals, ref, dst, tpin = int32_copy_case(nb)
    rows = [("torch copy_ from pinned", None, lambda: dst.copy_(tpin, non_blocking=True))]
    rows += [(name, kw, lambda: pinstage.copy_h2d(dst, vals)) for name, kw in TUNINGS]
    walls = {name: [] for name, _, _ in rows}
    stamps = {name: [] for name, _, _ in rows}
    # Rounds in a shuffled order: no row always follows the same other.
    order = random.Random(nb)
    for r in range(REPS + 2):
        for name, kw, fn in order.sample(rows, len(rows)):
            if kw is not None:
                lab._set_h2d_tuning(**kw)
            wall, st = one(fn, dst, ref)
            checked += 1
            if r >= 2:  # two warm-up rounds
                walls[name].append(wall)
                if st and kw is not None:
                    stamps[name].append(st)
    lab._set_h2d_tuning()
    pin = statistics.median(walls["torch copy_ from pinned"])
    print(f"== {nb >> 20} MiB: torch copy_ from pinned {pin:.0f} us ({nb / pin / 1e3:.2f} GB/s), "
          f"median of {REPS}", flush=True)
    for name, kw, _ in rows[1:]:
        w = sorted(walls[name])
        print(f"  {name}: wall {statistics.median(w):.0f} us [{w[0]:.0f} {w[-1]:.0f}], "
              f"{pin / statistics.median(w):.3f} of torch pinned", flush=True)
        if stamps[name]:
            labels = [label for label, _ in stamps[name][0]]
            same = [s for s in stamps[name] if [label for label, _ in s] == labels]
            parts = []
            for i, label in enumerate(labels):
                if i == 0:
                    continue
                parts.append(f"{label} {statistics.median(s[i][1] for s in same) / 1e3:.1f}")
            total = statistics.median(sum(ns for _, ns in s) for s in same) / 1e3
            print(f"    caller's stamps, median us since the stamp before ({len(same)} calls): "
                  + "; ".join(parts) + f"; in all {total:.1f}", flush=True)
    del tpin
print(f"checks: 0 failures ({checked} calls checked, each destination poisoned first)")
