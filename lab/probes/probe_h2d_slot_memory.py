"""Probe: does the kind of pinned memory the bounce slots are made of change the copy engine's
read rate? pinstage pins by registering mmap'd pages (huge pages where offered) by default; torch
and `cuMemHostAlloc` give driver-allocated pinned memory. Measured in one process, the same timed
loop as `bench_h2d.py` (poisoned destination, synchronised, checked after every call):

1. one DMA from pinned memory at 4 and 64 MiB, and 16 DMAs of 4 MiB: from torch's pinned tensor,
   from pinstage's registered pages, from pinstage's `cuMemHostAlloc` pages (lab switch);
2. `copy_h2d` from pageable memory with the bounce slots made each way (slots freed between).

Needs the lab wheel (`_set_pin_by_register`). Usage: python3 lab/probes/probe_h2d_slot_memory.py
"""

import pathlib
import sys

import statistics

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benches"))
import h2d_timing  # noqa: E402  (benches/h2d_timing.py)
import pinstage
from labmod import lab

REPS = 11


def rate(fn, dst, ref):
    fn()
    fn()
    ts = h2d_timing.timed_into(torch, fn, dst, ref, REPS)
    return ref.numel() * 4 / statistics.median(ts) / 1e9


def pinned_from(kind, vals):
    if kind == "torch":
        return torch.from_numpy(vals).pin_memory()
    was = lab._set_pin_by_register(kind == "registered")
    try:
        a = pinstage.empty_pinned(vals.shape, np.int32)
    finally:
        lab._set_pin_by_register(was)
    a[:] = vals
    assert pinstage.is_pinned(a)
    return torch.from_numpy(a)


print("pin by register (default):", lab._set_pin_by_register(True), flush=True)
for nb in (4 << 20, 64 << 20):
    n = nb // 4
    vals = np.random.default_rng(nb).integers(-(2**31), 2**31 - 1, n, dtype=np.int32)
    ref = torch.from_numpy(vals).cuda()
    dst = torch.empty(n, dtype=torch.int32, device="cuda")
    row = []
    for kind in ("torch", "registered", "cuMemHostAlloc"):
        src = pinned_from(kind, vals)
        one = rate(lambda: dst.copy_(src, non_blocking=True), dst, ref)
        piece = (4 << 20) // 4

        def pieces():
            for off in range(0, n, piece):
                dst[off : off + piece].copy_(src[off : off + piece], non_blocking=True)

        many = rate(pieces, dst, ref) if nb > 4 << 20 else one
        row.append(f"{kind}: one copy {one:.2f}, 4 MiB pieces {many:.2f}")
        del src
        pinstage.empty_cache()
    print(f"{nb >> 20:>4} MiB DMA from pinned memory, GB/s: " + "; ".join(row), flush=True)

for nb in (16 << 20, 64 << 20, 1 << 30):
    n = nb // 4
    vals = np.random.default_rng(nb + 1).integers(-(2**31), 2**31 - 1, n, dtype=np.int32)
    ref = torch.from_numpy(vals).cuda()
    dst = torch.empty(n, dtype=torch.int32, device="cuda")
    tpin = torch.from_numpy(vals).pin_memory()
    pin = rate(lambda: dst.copy_(tpin, non_blocking=True), dst, ref)
    row = []
    for kind in ("registered", "cuMemHostAlloc", "registered"):
        pinstage.empty_cache()
        was = lab._set_pin_by_register(kind == "registered")
        try:
            g = rate(lambda: pinstage.copy_h2d(dst, vals), dst, ref)
        finally:
            lab._set_pin_by_register(was)
        row.append(f"slots {kind} {g:.2f} ({g / pin:.3f})")
    pinstage.empty_cache()
    print(f"{nb >> 20:>5} MiB copy_h2d from pageable, GB/s (/ torch from pinned {pin:.2f}): " + "; ".join(row), flush=True)
    del tpin
