"""Probe: `copy_h2d` from pageable memory at 16 and 64 MiB, where the source's cache state may
decide between non-temporal and regular stores into the bounce slots. Each timed copy goes into
a poisoned destination, synchronised, checked after; median of `reps`.

Source states: "warm" (the CPU read the whole source just before the copy: it sits in the
caches, as an array the program just built does) and "cold" (1 GiB of other memory written
between copies: the source comes from DRAM, as a batch read from disk long ago does).
Needs the lab wheel (`_set_h2d_tuning`). Usage: python3 lab/probes/probe_h2d_cache.py
"""

import statistics

import numpy as np
import torch

import h2d_timing
import pinstage
from labmod import lab

REPS = 9
scratch = np.ones(1 << 30, dtype=np.uint8)


def timed(fn, dst, ref, state, vals):
    fn()

    def before(i):
        if state == "warm":
            int(vals.sum())
        else:
            scratch.fill(i & 0xFF)

    ts = h2d_timing.timed_into(torch, fn, dst, ref, REPS, before=before)
    return ref.numel() * 4 / statistics.median(ts) / 1e9


def run(label):
    print(f"== {label}: GB/s (copy_h2d from pageable / torch copy_ from pinned)", flush=True)
    for nb in (16 << 20, 64 << 20):
        n = nb // 4
        vals = np.random.default_rng(nb).integers(-(2**31), 2**31 - 1, n, dtype=np.int32)
        ref = torch.from_numpy(vals).cuda()
        dst = torch.empty(n, dtype=torch.int32, device="cuda")
        tpin = torch.from_numpy(vals).pin_memory()
        for state in ("warm", "cold"):
            pin = timed(lambda: dst.copy_(tpin, non_blocking=True), dst, ref, state, vals)
            row = []
            for name, kw in (
                ("default", {}),
                ("regular stores", dict(nt_upto=0)),
                ("12 workers", dict(workers=12)),
                ("2 MiB pieces", dict(max_piece=2 << 20, slots=24)),
                ("regular, 12 workers", dict(nt_upto=0, workers=12)),
            ):
                lab._set_h2d_tuning(**kw)
                g = timed(lambda: pinstage.copy_h2d(dst, vals), dst, ref, state, vals)
                row.append(f"{name} {g:.2f} ({g / pin:.3f})")
            lab._set_h2d_tuning()
            print(f"  {nb >> 20:>3} MiB {state}: torch pinned {pin:.2f}; " + ", ".join(row), flush=True)


print("defaults:", lab._set_h2d_tuning(), flush=True)
run("torch and pinstage only")
import cupy  # noqa: E402,F401
import jax  # noqa: E402

jax.numpy.ones(4).block_until_ready()
run("after importing cupy and jax (as bench_h2d.py does)")
