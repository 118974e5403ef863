"""Probe: the pageable H2D path (`copy_h2d` from a pageable numpy array) against torch, in the
bench's discipline (each timed copy into a poisoned destination, synchronised, checked after),
under its tunings and in a process that also runs JAX, CuPy and torch CPU work.

Needs the lab wheel (`_set_h2d_tuning`). Usage: python3 lab/probes/probe_h2d.py [--quick]
Prints GB/s, median of `reps` timed copies each.
"""

import pathlib

import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benches"))
import h2d_timing  # noqa: E402  (benches/h2d_timing.py)
import pinstage
from labmod import lab

GB = 1e9
quick = "--quick" in sys.argv


def timed(nbytes, fn, dst, ref, reps):
    fn()
    ts = h2d_timing.timed_into(torch, fn, dst, ref, reps, what=f"{nbytes} bytes")
    return nbytes / statistics.median(ts) / GB


def arrays(nbytes):
    n = nbytes // 4
    vals = np.random.default_rng(nbytes).integers(-(2**31), 2**31 - 1, n, dtype=np.int32)
    return vals, torch.from_numpy(vals).cuda(), torch.empty(n, dtype=torch.int32, device="cuda")


def table(label, sizes, reps=10):
    print(f"== {label}")
    for nb in sizes:
        vals, ref, dst = arrays(nb)
        tpin = torch.from_numpy(vals).pin_memory()
        tpage = torch.from_numpy(vals)
        row = {
            "copy_h2d pageable": timed(nb, lambda: pinstage.copy_h2d(dst, vals), dst, ref, reps),
            "torch pinned": timed(nb, lambda: dst.copy_(tpin, non_blocking=True), dst, ref, reps),
            "torch pageable": timed(nb, lambda: dst.copy_(tpage), dst, ref, reps),
        }
        r = row["copy_h2d pageable"] / row["torch pinned"]
        print(f"  {nb >> 20:>5} MiB: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items())
              + f"; copy_h2d / torch pinned {r:.3f}", flush=True)
        del tpin


def sweep(nb, grid, reps=6):
    print(f"== tuning sweep at {nb >> 20} MiB: GB/s")
    vals, ref, dst = arrays(nb)
    for kw in grid:
        lab._set_h2d_tuning(**kw)
        g = timed(nb, lambda: pinstage.copy_h2d(dst, vals), dst, ref, reps)
        print(f"  {kw}: {g:.2f}", flush=True)
    lab._set_h2d_tuning()


def pinned_small():
    """Pinned sources: one DMA each; pinstage's fixed cost per call against torch's."""
    print("== from pinned memory, one copy + synchronize at a time: GB/s (us per call)")
    for nb in (4 << 10, 64 << 10, 1 << 20):
        vals, ref, dst = arrays(nb)
        pin = pinstage.empty_pinned(nb // 4, np.int32)
        pin[:] = vals
        tpin = torch.from_numpy(vals).pin_memory()
        a = timed(nb, lambda: pinstage.copy_h2d(dst, pin), dst, ref, 200)
        b = timed(nb, lambda: dst.copy_(tpin, non_blocking=True), dst, ref, 200)
        print(f"  {nb >> 10:>5} KiB: copy_h2d {a:.2f} ({nb / a / 1e3:.1f} us), torch copy_ {b:.2f} "
              f"({nb / b / 1e3:.1f} us); ratio {a / b:.3f}", flush=True)


sizes = [1 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]
print("defaults:", lab._set_h2d_tuning(), flush=True)
table("torch + pinstage only", sizes)
pinned_small()
if not quick:
    variants = [dict(), dict(nt=True), dict(ramp=True), dict(nt=True, ramp=True),
                dict(nt=True, ramp=True, slots=24), dict(nt=True, ramp=True, workers=6),
                dict(nt=True, ramp=True, workers=12), dict(nt=True, max_piece=2 << 20),
                dict(nt=True, ramp=True, max_piece=8 << 20, slots=16)]
    for nb in (16 << 20, 64 << 20, 1 << 30):
        sweep(nb, variants)
    small = [dict(), dict(nt=True), dict(nt=True, workers=4), dict(min_piece=256 << 10),
             dict(driver_below=1 << 30)]
    for nb in (256 << 10, 1 << 20, 4 << 20):
        sweep(nb, small, reps=20)
import cupy  # noqa: E402,F401
import jax  # noqa: E402

jax.numpy.ones(4).block_until_ready()
table("after importing cupy and jax", [64 << 20, 1 << 30])
a = torch.randn(2000, 2000)
(a @ a).sum().item()
table("right after torch CPU matmul", [64 << 20, 1 << 30])
