"""Two GPUs copying from and to pageable host memory at once (nvidia-h200-x2): the aggregate
GB/s of both against one GPU alone, for pinstage (`copy_h2d` from a pageable numpy array,
`copy_d2h` into one) and torch (`copy_` from / into a pageable CPU tensor), in the same run.

Each rep: every destination is poisoned (a device fill for H2D, a host fill for D2H), the
threads meet at a barrier, each copies once and synchronises its device, and they meet again;
the rep's time is from the first barrier to the second (two threads: the slower one sets it).
Every copy of every rep is checked after the rep (outside the timing). Median of `reps`.
Usage: python3 benches/bench_two_gpus.py [--mib 256] [--reps 9] [--out DIR]
"""

import argparse
import json
import os
import statistics
import threading
import time

import numpy as np
import torch

import pinstage

ap = argparse.ArgumentParser()
ap.add_argument("--mib", type=int, nargs="+", default=[256, 1024])
ap.add_argument("--reps", type=int, default=9)
ap.add_argument("--out", default=None)
a = ap.parse_args()

POISON = -7
ngpu = torch.cuda.device_count()
if ngpu < 2:
    raise SystemExit(f"needs two GPUs, this machine has {ngpu}")


def run(copy, check, poison, devices, reps):
    """Median aggregate GB/s of `copy(d)` on each of `devices` at once."""
    nb = NB
    times = []
    bar = threading.Barrier(len(devices) + 1)
    stop = [False]
    errors = []

    def worker(d):
        torch.cuda.set_device(d)
        while True:
            bar.wait()
            if stop[0]:
                return
            try:
                copy(d)
                torch.cuda.synchronize(d)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
            bar.wait()

    ths = [threading.Thread(target=worker, args=(d,)) for d in devices]
    for t in ths:
        t.start()
    try:
        for r in range(reps + 1):
            for d in devices:
                poison(d)
                torch.cuda.synchronize(d)
            t0 = time.perf_counter()
            bar.wait()  # start
            bar.wait()  # all copied
            dt = time.perf_counter() - t0
            if errors:
                raise errors[0]
            for d in devices:
                if not check(d):
                    raise AssertionError(f"wrong result on cuda:{d}, rep {r}")
            if r > 0:  # the first rep warms up
                times.append(dt)
    finally:
        stop[0] = True
        bar.wait()
        for t in ths:
            t.join()
    return len(devices) * nb / statistics.median(times) / 1e9


RESULTS = {}
for mib in a.mib:
    NB = mib << 20
    n = NB // 4
    host = {}
    dev = {}
    ref = {}
    dst_host = {}
    for d in range(2):
        vals = np.random.default_rng(d + mib).integers(-(2**31), 2**31 - 1, n, dtype=np.int32)
        host[d] = vals
        ref[d] = torch.from_numpy(vals).to(f"cuda:{d}")
        dev[d] = torch.empty(n, dtype=torch.int32, device=f"cuda:{d}")
        dst_host[d] = np.empty(n, dtype=np.int32)
        dst_host[d].fill(POISON)
    torch.cuda.synchronize()

    h2d = {
        "pinstage copy_h2d": lambda d: pinstage.copy_h2d(dev[d], host[d]),
        "torch copy_": lambda d: dev[d].copy_(torch.from_numpy(host[d])),
    }
    d2h = {
        "pinstage copy_d2h": lambda d: pinstage.copy_d2h(ref[d], dst_host[d]),
        "torch copy_": lambda d: torch.from_numpy(dst_host[d]).copy_(ref[d]),
    }

    def h2d_poison(d):
        dev[d].fill_(POISON)

    def h2d_check(d):
        return torch.equal(dev[d], ref[d])

    def d2h_poison(d):
        dst_host[d].fill(POISON)

    def d2h_check(d):
        return np.array_equal(dst_host[d], host[d])

    row = {}
    for direction, impls, poison, check in (
        ("H2D from pageable", h2d, h2d_poison, h2d_check),
        ("D2H into pageable", d2h, d2h_poison, d2h_check),
    ):
        for name, fn in impls.items():
            one = run(fn, check, poison, [0], a.reps)
            two = run(fn, check, poison, [0, 1], a.reps)
            row[f"{direction}: {name}"] = {"one GPU": one, "two GPUs": two}
            print(f"{mib:>5} MiB {direction}, {name}: one GPU {one:.2f} GB/s, two GPUs at once "
                  f"{two:.2f} GB/s aggregate ({two / one:.2f}x)", flush=True)
    RESULTS[mib] = row

print("\n=== bench_two_gpus summary (goal: aggregate >= 1.6x one GPU and >= 3x torch's aggregate)")
for mib, row in RESULTS.items():
    for direction in ("H2D from pageable", "D2H into pageable"):
        p = row[f"{direction}: pinstage copy_{'h2d' if direction.startswith('H2D') else 'd2h'}"]
        t = row[f"{direction}: torch copy_"]
        print(f"{mib:>5} MiB {direction}: pinstage two GPUs {p['two GPUs']:.2f} GB/s = "
              f"{p['two GPUs'] / p['one GPU']:.2f}x one GPU ({p['one GPU']:.2f}); torch two GPUs "
              f"{t['two GPUs']:.2f} GB/s: pinstage / torch {p['two GPUs'] / t['two GPUs']:.2f}x")
if a.out:
    with open(os.path.join(a.out, "bench_two_gpus.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
