"""Probe: the bounce slots of `copy_h2d` from pageable memory, their size and count and the
stores that fill them (non-temporal: straight to DRAM, read back by the copy engine; regular:
small slots may stay in the CPU's caches), in one process under the same discipline. Each timed
copy goes into a poisoned destination, synchronised, checked after; median of `REPS`. Source
states: "bench" (nothing between copies, as `bench_h2d.py`), "warm" (the CPU read the whole
source just before), "cold" (1 GiB of other memory written just before: the source comes from
DRAM, under write-back pressure). The bounce slots are freed between tunings (`empty_cache`) and
each tuning warms up first, so no timed call allocates slots.

Run r (`--as-run-r`) measured 4 MiB x 12 (the default) against smaller slots, in the "warm" and
"cold" states only; 1 MiB x 16 was then made the default, and run s (`--as-run-s`; its first entry
was then the default) showed it slower in the "bench" state at 64 MiB-1 GiB, so 4 MiB x 12 is
the default again. Run v (`--as-run-v`) compared the fill units: the workers filling each piece
together, unit by unit (the default since), against whole pieces, one worker each (before).
Run w compared a tapered end (the last pieces halving; no gain, and the option is gone: its
list, and run x's "tapered" entry, need that run's commit), the stores and worker counts (12
workers, the default since run x, gained most with the source in the caches or in DRAM); run x
(`--as-run-x`) the default against 8 workers; run z (`--as-run-z`)
regular stores into small slots (which might stay in the CPU's caches, so the copy engine
would read them there; they did not: half the rate) against non-temporal stores into 4 MiB
slots; run zb (`--as-run-zb`) fewer slots, to keep the fill from running far ahead of the copy
engine (no gain). Until run zc the pieces were about two per worker (2.7 MiB with 12 workers
at 64 MiB); the default list compares whole 4 MiB pieces (fewer copies; the default since).
Run zm (`--demote`) compared regular stores followed by `cldemote` of each unit (not adopted;
the switch and that list are gone: commit 2d78d6b has them). Run zq (`--streams`) compared the
copies alternating over two or three streams against one (not adopted: commit 815b874 has it).
Needs the lab wheel (`_set_h2d_tuning`).
Usage: python3 lab/probes/probe_h2d_slots.py [--streams | --as-run-r | --as-run-s | --as-run-v | --as-run-x | --as-run-z | --as-run-zb]
"""

import statistics
import sys

import numpy as np
import torch

import h2d_timing
import pinstage
from labmod import lab

REPS = 9
scratch = np.ones(1 << 30, dtype=np.uint8)

OLD = dict(max_piece=4 << 20, slots=12)  # the default (briefly 1 MiB x 16 before run s)
TUNINGS = [
    ("the default: 12 workers, whole 4 MiB pieces, 12 slots", dict(workers=12, max_piece=4 << 20, slots=12, unit=256 << 10, per_worker=0)),
    ("two pieces per worker (before run zc)", dict(per_worker=2)),
    ("8 workers", dict(workers=8)),
    ("8 workers, two pieces per worker", dict(workers=8, per_worker=2)),
]

# Run zq's list (`--streams`; the `streams` tuning is gone: commit 815b874 has it): the pieces'
# copies alternating over the caller's stream and streams made for the copy, so more than one
# copy engine may read the slots at once.
TUNINGS_STREAMS = [
    ("the default: one stream", dict()),
    ("two streams", dict(streams=2)),
    ("three streams", dict(streams=3)),
    ("two streams, 8 workers", dict(streams=2, workers=8)),
]
if "--streams" in sys.argv:
    TUNINGS = TUNINGS_STREAMS

# Run zb's list (`--as-run-zb`; two pieces per worker then).
TUNINGS_ZB = [
    ("the default: 12 workers, 4 MiB x 12, units of 256 KiB", dict(workers=12, max_piece=4 << 20, slots=12, unit=256 << 10, per_worker=2)),
    ("8 workers", dict(workers=8, per_worker=2)),
    ("4 MiB x 3", dict(slots=3, per_worker=2)),
    ("4 MiB x 4", dict(slots=4, per_worker=2)),
    ("4 MiB x 6", dict(slots=6, per_worker=2)),
    ("8 workers, 4 MiB x 4", dict(workers=8, slots=4, per_worker=2)),
    ("8 workers, 4 MiB x 6", dict(workers=8, slots=6, per_worker=2)),
    ("8 MiB x 3", dict(max_piece=8 << 20, slots=3, per_worker=2)),
]
if "--as-run-zb" in sys.argv:
    TUNINGS = TUNINGS_ZB

# Run z's list (`--as-run-z`).
TUNINGS_Z = [
    ("the default: 12 workers, 4 MiB x 12, units of 256 KiB", dict(workers=12, max_piece=4 << 20, slots=12, unit=256 << 10, per_worker=2)),
    ("8 workers", dict(workers=8, per_worker=2)),
    ("8 workers, regular stores, 1 MiB x 12", dict(workers=8, nt_upto=0, max_piece=1 << 20, slots=12, per_worker=2)),
    ("8 workers, regular stores, 512 KiB x 16", dict(workers=8, nt_upto=0, max_piece=512 << 10, slots=16, per_worker=2)),
    ("12 workers, regular stores, 512 KiB x 16", dict(workers=12, nt_upto=0, max_piece=512 << 10, slots=16, per_worker=2)),
    ("8 workers, regular stores, 2 MiB x 8", dict(workers=8, nt_upto=0, max_piece=2 << 20, slots=8, per_worker=2)),
    ("8 workers, 1 MiB x 12", dict(workers=8, max_piece=1 << 20, slots=12, per_worker=2)),
]
if "--as-run-z" in sys.argv:
    TUNINGS = TUNINGS_Z

# Run x's list (`--as-run-x`).
TUNINGS_X = [
    ("the default: 12 workers, 4 MiB x 12, units of 256 KiB", dict(workers=12, max_piece=4 << 20, slots=12, unit=256 << 10, per_worker=2)),
    ("8 workers (run w's default)", dict(workers=8, per_worker=2)),
    ("8 workers, whole pieces, one worker each (before run v)", dict(workers=8, unit=4 << 20, per_worker=2)),
]
if "--as-run-x" in sys.argv:
    TUNINGS = TUNINGS_X

# Run v's list (`--as-run-v`).
TUNINGS_V = [
    ("4 MiB x 12, units of 256 KiB (the default)", dict(max_piece=4 << 20, slots=12, unit=256 << 10, workers=8, per_worker=2)),
    ("whole pieces, one worker each", dict(max_piece=4 << 20, slots=12, unit=4 << 20, workers=8, per_worker=2)),
    ("units of 128 KiB", dict(unit=128 << 10, workers=8, per_worker=2)),
    ("units of 1 MiB", dict(unit=1 << 20, workers=8, per_worker=2)),
    ("units of 256 KiB, 12 workers", dict(unit=256 << 10, workers=12, per_worker=2)),
    ("8 MiB x 8, units of 256 KiB", dict(max_piece=8 << 20, slots=8, unit=256 << 10, workers=8, per_worker=2)),
]
if "--as-run-v" in sys.argv:
    TUNINGS = TUNINGS_V

# Run s's list (`--as-run-s`; its whole pieces, one worker each, were then the only way).
TUNINGS_S = [
    ("1 MiB slots x 16, non-temporal up to 128 MiB", dict(max_piece=1 << 20, slots=16, unit=1 << 20, workers=8, per_worker=2)),
    ("4 MiB x 12 (the default)", dict(OLD, unit=4 << 20, workers=8, per_worker=2)),
    ("1 MiB x 16, regular", dict(max_piece=1 << 20, slots=16, nt_upto=0, unit=1 << 20, workers=8, per_worker=2)),
    ("2 MiB x 12", dict(max_piece=2 << 20, slots=12, unit=2 << 20, workers=8, per_worker=2)),
    ("512 KiB x 16", dict(max_piece=512 << 10, slots=16, unit=512 << 10, workers=8, per_worker=2)),
]
if "--as-run-s" in sys.argv:
    TUNINGS = TUNINGS_S


# Run r's list (`--as-run-r`: its tunings and source states; its defaults were 4 MiB x 12;
# whole pieces, one worker each).
TUNINGS_R = [
    ("default: 4 MiB slots x 12, non-temporal", dict(OLD, unit=4 << 20, workers=8, per_worker=2)),
    ("1 MiB x 16, regular", dict(max_piece=1 << 20, slots=16, nt_upto=0, unit=1 << 20, workers=8, per_worker=2)),
    ("512 KiB x 16, regular", dict(max_piece=512 << 10, slots=16, nt_upto=0, unit=512 << 10, workers=8, per_worker=2)),
    ("512 KiB x 24, regular, 12 workers", dict(max_piece=512 << 10, slots=24, nt_upto=0, workers=12, unit=512 << 10, per_worker=2)),
    ("256 KiB x 32, regular", dict(max_piece=256 << 10, min_piece=128 << 10, slots=32, nt_upto=0, unit=256 << 10, workers=8, per_worker=2)),
    ("1 MiB x 16, non-temporal", dict(max_piece=1 << 20, slots=16, unit=1 << 20, workers=8, per_worker=2)),
    ("512 KiB x 16, non-temporal", dict(max_piece=512 << 10, slots=16, unit=512 << 10, workers=8, per_worker=2)),
]
AS_RUN_R = "--as-run-r" in sys.argv
if AS_RUN_R:
    TUNINGS = TUNINGS_R


def timed(fn, dst, ref, state, vals):
    fn()
    fn()

    def before(i):
        if state == "warm":
            int(vals.sum())
        elif state == "cold":
            scratch.fill(i & 0xFF)

    ts = h2d_timing.timed_into(torch, fn, dst, ref, REPS, before=before)
    return ref.numel() * 4 / statistics.median(ts) / 1e9


print("defaults:", lab._set_h2d_tuning(), flush=True)
for nb in (16 << 20, 64 << 20, 256 << 20, 1 << 30):
    n = nb // 4
    vals = np.random.default_rng(nb).integers(-(2**31), 2**31 - 1, n, dtype=np.int32)
    ref = torch.from_numpy(vals).cuda()
    dst = torch.empty(n, dtype=torch.int32, device="cuda")
    tpin = torch.from_numpy(vals).pin_memory()
    states = ("bench", "warm", "cold") if nb <= 64 << 20 else ("bench", "cold")
    if AS_RUN_R:
        states = ("warm", "cold") if nb <= 64 << 20 else ("cold",)
    for state in states:
        pin = timed(lambda: dst.copy_(tpin, non_blocking=True), dst, ref, state, vals)
        row = []
        for name, kw in TUNINGS:
            pinstage.empty_cache()
            lab._set_h2d_tuning(**kw)
            g = timed(lambda: pinstage.copy_h2d(dst, vals), dst, ref, state, vals)
            row.append(f"{name} {g:.2f} ({g / pin:.3f})")
        pinstage.empty_cache()
        lab._set_h2d_tuning()
        where = {"bench": "as bench_h2d.py leaves it", "warm": "in the caches", "cold": "in DRAM"}[state]
        print(f"{nb >> 20:>5} MiB, source {where}: "
              f"torch pinned {pin:.2f}; " + "; ".join(row), flush=True)
    del tpin
