"""Small device-to-host copies into pinned memory, one copy and its wait at a time (a sampler
pulling each step's ids): pinstage `copy_d2h(src, dst)` against torch `copy_(non_blocking=True)`
+ the stream's synchronize, cupy `get(out=pinned)` + synchronize, and the C driver floor
(`benches/c/d2h_roundtrip.c`, built with nvcc and run in the same job).

Every timed call's destination is poisoned first and checked after. Median of `reps` calls.
Usage: python3 benches/bench_d2h_small.py [--c-binary PATH]
"""

import argparse
import statistics
import subprocess
import time

import numpy as np
import torch

import pinstage

ap = argparse.ArgumentParser()
ap.add_argument("--c-binary", default=None)
ap.add_argument("--reps", type=int, default=3000)
a = ap.parse_args()
try:
    import cupy as cp
except Exception:  # noqa: BLE001
    cp = None

c_floor = {}
if a.c_binary:
    out = subprocess.run([a.c_binary], capture_output=True, text=True, check=True).stdout
    print(out, end="")
    for line in out.splitlines():  # "C d2h 1024 B event sync: 7.31 us"
        head, us = line.rsplit(": ", 1)
        n = int(head.split()[2])
        c_floor.setdefault(n, {})[head.split(" B ")[1]] = float(us.split()[0])

rows = {}
for n in (1024, 64 << 10, 1 << 20):
    vals = np.random.default_rng(n).integers(1, 1 << 30, n // 4, dtype=np.int32)
    src = torch.from_numpy(vals).cuda()
    pin = pinstage.empty_pinned(n // 4, np.int32)
    tpin = torch.empty(n // 4, dtype=torch.int32).pin_memory()
    tpin_np = tpin.numpy()
    cur = torch.cuda.current_stream()
    impls = {
        "pinstage copy_d2h(src, dst)": (lambda: pinstage.copy_d2h(src, pin), pin),
        "torch copy_ + stream synchronize": (lambda: (tpin.copy_(src, non_blocking=True), cur.synchronize()), tpin_np),
    }
    if cp is not None:
        csrc = cp.from_dlpack(src)
        cpin = pinstage.empty_pinned(n // 4, np.int32)
        impls["cupy get(out=pinned) + synchronize"] = (
            lambda: (csrc.get(out=cpin), cp.cuda.get_current_stream().synchronize()), cpin)
    torch.cuda.synchronize()
    row = {}
    for name, (fn, dst) in impls.items():
        ts = []
        for i in range(a.reps + 200):
            dst.fill(-1)
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            if not np.array_equal(dst, vals):
                raise AssertionError(f"{name} at {n} bytes: wrong result")
            if i >= 200:
                ts.append(t1 - t0)
        row[name] = statistics.median(ts) * 1e6
    rows[n] = row
    print(f"{n:>8,d} B, us per round trip: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)

print("\n=== bench_d2h_small summary")
for n, row in rows.items():
    p, t = row["pinstage copy_d2h(src, dst)"], row["torch copy_ + stream synchronize"]
    s = f"{n >> 10:>5} KiB: pinstage / torch speed {t / p:.3f} (goal >= 1 at 64 KiB, 1 MiB)"
    if n in c_floor:
        ev = c_floor[n].get("event sync")
        spin = c_floor[n].get("spin on a written flag")
        s += f"; pinstage {p:.2f} us vs C {ev:.2f} (event) / {spin:.2f} (flag): +{p - ev:.2f} / +{p - spin:.2f} us"
        lev = c_floor[n].get("event sync legacy stream")
        lspin = c_floor[n].get("spin on a written flag legacy stream")
        if lev is not None:
            s += f"; on the legacy stream (torch's default, where pinstage copies) C {lev:.2f} / {lspin:.2f}: +{p - lev:.2f} / +{p - lspin:.2f} us"
        if n == 1024:
            s += " (goal: <= C + 1)"
    print(s)
