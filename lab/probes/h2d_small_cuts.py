"""Probe: `copy_h2d` from pageable memory at 1-8 MiB under other cuts of the copy, beside torch
from pinned memory, source cold and hot (the 1 MiB goal's control from pinstage's side).

`lab/c/h2d_floor.c` (run 2026-12-06-h100-zk, two passes, threads spinning before each call)
found the ramped pipeline pinstage uses (pieces of 128 KiB, 256, 512, ..., each its own copy) the
slowest cut at 1 MiB in C: 0.26-0.43x one pinned copy (43-48 µs), against 0.46-0.62x for the whole
copy filled by 4-8 threads together and sent as ONE copy, and 0.46-0.57x for two halves. Here the
same cuts in pinstage (the lab's `_set_h2d_tuning`, per size n; pinstage wakes its parked copy
threads, and `workers_for` gives a copy below 8 MiB 4 threads, the caller one of them):
  default   the product's tuning (since run 2026-12-06-h100-zl: halves up to 8 MiB, else the ramp)
  ramp      the ramp from 128 KiB, units of 256 KiB (the product's cut at every size before)
  whole     no ramp, one piece of n bytes in 4 units of n/4 (C's "whole, T=4"): ONE copy
  halves    no ramp, two pieces of n/2 in units of n/8: two copies
  driver    the driver's own pageable path (one cuMemcpyHtoDAsync from the pageable array)
  alone     the caller's thread alone (no copy thread woken), ramped; "alone, whole": one piece
  cached    the product's cut, the slots filled with ordinary (cached) stores instead of
            non-temporal ones (`nt_upto=0`)
  NT ring 8 x 1 MiB  non-temporal stores into 8 slots of 1 MiB (pieces of at most 1 MiB)
  cached ring S x P  ordinary stores into a ring of S slots of P bytes small enough to stay in
            the caches, so the copy engine reads the slots from the L3 instead of DRAM (the fill
            then costs memory traffic for the source only). The "demoted" rows (each unit's
            lines moved to the L3 by `cldemote`) lost on the H200 (run 2026-12-07-h200-g) and
            `fill_dma.c` found the engine reading demoted lines at 0.28-0.56 of its rate on an
            H100 host (run 2026-12-07-h100-n): that knob is gone
  16 workers  more copy threads than the pool's 12: only in the lab variant `copy16`
            (`PINSTAGE_VARIANTS=copy16 scripts/gpu-build`, `gpu-run variant-copy16` with
            PINSTAGE_VARIANT_RUNS=h2d_small_cuts); elsewhere 13 (12 + the caller)
  3 / 4 / 6 slots  the product's cut with fewer slots: the fill can run at most that many pieces
            ahead of the copy engine, so it cannot take memory bandwidth from the engine's reads
            for pieces the engine reaches only later (a fill far ahead gains nothing once the
            engine bounds the copy; run zb of 2026-12-01 found 4 slots no faster with the cut of
            that time)
  8 / 10 workers  the product's cut with fewer copy threads (12 by default from 24 MiB up; fewer
            fill more slowly but take less of the memory bandwidth the copy engine reads with:
            `fill_dma.c` on an H200 host, 12 threads fill at 54 GB/s while the DMA gets 47.8, 8 fill
            at 45 while it gets 54)
Compare µs, not the ratios with C's: the cold reference here (torch from pinned, ~217 µs at 1 MiB
in bench_h2d.py on that host) pays for torch's own cold code, C's pinned copy does not.
and the references: torch `copy_` from pinned (the goal's), `copy_h2d` from pinned (pinstage's
fixed cost), torch `copy_` from pageable.

Discipline as benches/bench_h2d.py: each call into a destination poisoned first, timed to a
`torch.cuda.synchronize()`, compared on the device with its source's expected copy (K = 32
sources per size, all distinct, rotated, and the first 8 bytes of every 64 KiB stamped with the
call's number before the call: a call that copied nothing, an earlier source or a slot's stale
bytes fails);
COLD: every CPU sweeps 1 GiB (read + write) before the call; CLEAN: the same sweep, read only
(the caches hold no dirty lines); HOT: the source is read just before (env STATES, default
cold,hot).
Variants interleave within each round, in an order shuffled per round and state (seeded; a
fixed rotation made each variant always follow the same one, whose trace it then paid); median
of ROUNDS calls, min-max.
Usage (lab wheel): python3 lab/probes/h2d_small_cuts.py      (env ROUNDS, SIZES_MIB, STATES, CUTS)
"""

import os
import pathlib
import random
import statistics
import sys

import numpy as np
import torch

import pinstage
from labmod import bench_module, lab

HERE = pathlib.Path(__file__).resolve()
bench = bench_module("bench_h2d")
sys.path.insert(0, str(HERE.parents[2] / "benches"))
import h2d_timing  # noqa: E402  (benches/h2d_timing.py: poison, synchronize, time, check)

ROUNDS = int(os.environ.get("ROUNDS", "9"))
SIZES = [int(s) << 20 for s in os.environ.get("SIZES_MIB", "1,2,4,8").split(",")]
STATES = os.environ.get("STATES", "cold,hot").split(",")
CUTS = os.environ.get("CUTS")  # the cut rows to run, names separated by ";" (default: all)
POISON = 0xA5
K = 32


def cuts(n):
    flat = dict(halves_upto=0)  # the cut as named, not the product's halves below 8 MiB
    return {
        "default": {},
        "ramp": flat,
        "whole": dict(flat, ramp=False, max_piece=n, unit=n // 4),
        "halves": dict(flat, ramp=False, max_piece=n // 2, unit=n // 8),
        "driver": dict(driver_below=64 << 20),
        "alone": dict(flat, workers=1),
        "alone, whole": dict(flat, workers=1, ramp=False, max_piece=n),
        "cached": dict(nt_upto=0),
        "8 workers": dict(workers=8),
        "10 workers": dict(workers=10),
        "NT ring 8 x 1 MiB": dict(max_piece=1 << 20, slots=8),
        "cached ring 4 x 1 MiB": dict(nt_upto=0, max_piece=1 << 20, slots=4),
        "cached ring 8 x 1 MiB": dict(nt_upto=0, max_piece=1 << 20, slots=8),
        "16 workers": dict(workers=16),
        "3 slots": dict(slots=3),
        "4 slots": dict(slots=4),
        "6 slots": dict(slots=6),
        "4 slots, 8 workers": dict(slots=4, workers=8),
        "6 slots, 8 workers": dict(slots=6, workers=8),
    }


sweeper = bench.Sweeper(1 << 30)
failures = 0


def run(n):
    global failures
    rng = np.random.default_rng(n)
    pg = rng.integers(1, 256, (K, n), dtype=np.uint8)
    pg[pg == POISON] = 1
    exp = torch.from_numpy(pg).cuda()
    pin_t = torch.from_numpy(pg).pin_memory()
    pin_np = pin_t.numpy()
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    rows = {}
    for name, kw in cuts(n).items():
        if CUTS and name not in CUTS.split(";") and name != "default":
            continue
        rows[f"copy_h2d pageable, {name}"] = (kw, lambda k: pinstage.copy_h2d(dst, pg[k]), "pageable")
    rows["copy_h2d pinned"] = ({}, lambda k: pinstage.copy_h2d(dst, pin_np[k]), "pinned")
    rows["torch copy_ pinned"] = ({}, lambda k: dst.copy_(pin_t[k], non_blocking=True), "pinned")
    rows["torch copy_ pageable"] = ({}, lambda k: dst.copy_(torch.from_numpy(pg[k])), "pageable")
    names = list(rows)
    times = {(s, m): [] for s in STATES for m in names}
    call = 0
    shuffle = random.Random(n)
    for r in range(ROUNDS + 1):  # round 0: warm-up, not counted
        for state in STATES:
            order = names[:]
            shuffle.shuffle(order)  # no variant always follows the same one
            for m in order:
                kw, fn, kind = rows[m]
                lab._set_h2d_tuning(**kw)
                k = call % K
                call += 1
                v = 1 + call % 254
                word = np.full(8, 0xA6 if v == POISON else v, np.uint8)
                pg[k].reshape(-1, 65536)[:, :8] = word
                pin_np[k].reshape(-1, 65536)[:, :8] = word
                exp[k].view(-1, 65536)[:, :8] = torch.from_numpy(word).cuda()
                src = pg[k] if kind == "pageable" else pin_np[k]
                if state == "hot":
                    cache = lambda s=src: int(s.view(np.uint64).sum())  # noqa: E731
                else:
                    cache = lambda clean=state == "clean": sweeper(clean=clean)  # noqa: E731
                try:
                    (t,) = h2d_timing.timed_into(torch, lambda: fn(k), dst, exp[k], 1,
                                                 before=lambda _: cache(), what=m, poison=POISON)
                except AssertionError:
                    failures += 1
                    print(f"CHECK FAILED: {m} {state} {n} bytes, source {k}", flush=True)
                    continue
                if r > 0:
                    times[(state, m)].append(t)
    lab._set_h2d_tuning()
    print(f"\n{n >> 20} MiB: GB/s, median of {ROUNDS} [min max] (us); x torch copy_ pinned in the same state")
    for state in STATES:
        ref = statistics.median(times[(state, "torch copy_ pinned")] or [float("nan")])
        for m in names:
            ts = times[(state, m)]
            if not ts:
                print(f"  {state:<4} {m:<30} no call passed its check")
                continue
            med = statistics.median(ts)
            print(f"  {state:<4} {m:<30} {n / med / 1e9:6.2f} [{n / max(ts) / 1e9:6.2f} {n / min(ts) / 1e9:6.2f}]"
                  f" ({med * 1e6:6.0f} us)  {ref / med:.3f}x", flush=True)


print("defaults:", lab._set_h2d_tuning(), flush=True)
for n in SIZES:
    run(n)
print(f"\nchecks: {failures} failures" + ("" if failures else " (every call checked)"))
sys.exit(1 if failures else 0)
