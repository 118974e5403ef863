"""Probe: where the host time of `StepStager.stage` goes, the engine step of benches/bench_step.py
(6 fields, 37.5 KiB used) into a device arena on a torch stream, depth 8.

With the lab variant `stamps` (`PINSTAGE_VARIANTS=stamps scripts/gpu-build`, `gpu-run
variant-stamps`) each call's timestamps are read after it (`pinstage._lab._stamps`) and the median
ns between consecutive stamps is printed per row; in any other build only the wall times are. Rows:
"loop" (calls one after the other, each followed by its untimed snapshot's six copy launches)
and "paced" (30 us of spinning between calls), 5 rounds of 2000
calls each, median of the rounds' medians with their range. Every step is checked: after each
timed call (untimed) the arena's fields are copied on the same stream into that step's own
snapshot, and after each round every snapshot is compared with the values staged (distinct in
every step of a round: step i's values are the base values + i).
Run on the GPU machine with the wheel (or a variant's) first on PYTHONPATH.
"""

import gc
import pathlib
import sys
import time

import numpy as np
import torch

import pinstage

try:
    from labmod import lab

    STAMPS = getattr(lab, "_stamps", None)
except ImportError:
    STAMPS = None

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benches"))
from bench_step import ENGINE  # noqa: E402  (name: (dtype, capacity, used rows), the bench's step)

N, ROUNDS, PACE_NS = 2000, 5, 30_000


def shape(cap, used):
    return (used, cap[1]) if isinstance(cap, tuple) else (used,)


L = pinstage.StepLayout({n: (dt, cap) for n, (dt, cap, _) in ENGINE.items()})
st = pinstage.StepStager(L, depth=8)
s = torch.cuda.Stream()
views = {n: torch.from_dlpack(st.field(n)) for n in ENGINE}
rng = np.random.default_rng(7)
base = {n: rng.integers(1, 1 << 28, shape(cap, u)).astype(dt) for n, (dt, cap, u) in ENGINE.items()}
steps = [{n: base[n] + i for n in ENGINE} for i in range(N)]  # distinct in every step
snaps = {n: torch.empty((N,) + shape(cap, u), dtype=views[n].dtype, device="cuda")
         for n, (dt, cap, u) in ENGINE.items()}
print(f"pinstage {pinstage.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}; "
      f"stamps: {'yes' if STAMPS else 'no (not the stamps variant)'}")


def spin(ns):
    t = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < t:
        pass


def one_round(paced):
    for n in ENGINE:
        snaps[n].fill_(-1)  # poison (no staged value is negative)
    torch.cuda.synchronize()
    walls, parts = [], []
    gc.disable()  # as bench_step.py: no collection inside a timed call
    with torch.cuda.stream(s):
        for i in range(N):
            if paced:
                spin(PACE_NS)
            t0 = time.perf_counter_ns()
            st.stage(steps[i], stream=s)
            walls.append(time.perf_counter_ns() - t0)
            if STAMPS:
                parts.append(STAMPS())
            for n, (dt, cap, u) in ENGINE.items():  # untimed: this step's snapshot
                snaps[n][i].copy_(views[n][:u], non_blocking=True)
    s.synchronize()
    gc.enable()
    bad = 0
    for n in ENGINE:
        got = snaps[n].cpu().numpy()
        want = np.stack([steps[i][n] for i in range(N)])
        bad += int((got != want).reshape(N, -1).any(axis=1).sum())
    return walls, parts, bad


for i in range(200):  # warm-up, untimed
    st.stage(steps[i], stream=s)
s.synchronize()
if STAMPS:
    STAMPS()
total_bad = 0
for paced in (False, True):
    meds, stamp_meds = [], {}
    for r in range(ROUNDS):
        walls, parts, bad = one_round(paced)
        total_bad += bad
        meds.append(np.median(walls) / 1e3)
        per = {}
        for call in parts:
            if call and call[0][0] == ">stage":
                for label, ns in call[1:]:
                    per.setdefault(label, []).append(ns)
        for label, v in per.items():
            stamp_meds.setdefault(label, []).append(np.median(v))
    row = "paced" if paced else "loop"
    print(f"{row:5s} stage: median {np.median(meds):.2f} us [rounds {min(meds):.2f}..{max(meds):.2f}]")
    for label, v in stamp_meds.items():
        print(f"        {label:14s} {np.median(v):8.0f} ns from the stamp before [{min(v):.0f}..{max(v):.0f}]")
print(f"every step checked: {2 * ROUNDS * N} steps, {total_bad} wrong")
raise SystemExit(1 if total_bad else 0)
