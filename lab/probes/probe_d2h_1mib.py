"""Probe: why a 1 MiB copy_d2h into pinned memory trails torch (bench_d2h_small, run h): the
destination's kind (registered pages vs cuMemHostAlloc vs torch's pinned tensor) and whether it
was just written by the CPU (poisoned) before each copy. Needs the lab wheel.
Usage: python3 lab/probes/probe_d2h_1mib.py
"""

import statistics
import time

import numpy as np
import torch

import pinstage
from labmod import lab

n = 1 << 20
vals = np.random.default_rng(1).integers(1, 1 << 30, n // 4, dtype=np.int32)
src = torch.from_numpy(vals).cuda()
cur = torch.cuda.current_stream()
lab._set_pin_by_register(True)
reg = pinstage.empty_pinned(n // 4, np.int32)
lab._set_pin_by_register(False)
host = pinstage.empty_pinned(n // 4, np.int32)
lab._set_pin_by_register(True)
tpin = torch.empty(n // 4, dtype=torch.int32).pin_memory()
cases = {
    "pinstage into registered pages": (lambda: pinstage.copy_d2h(src, reg), reg),
    "pinstage into cuMemHostAlloc": (lambda: pinstage.copy_d2h(src, host), host),
    "pinstage into torch's pinned tensor": (lambda: pinstage.copy_d2h(src, tpin.numpy()), tpin.numpy()),
    "torch copy_ + stream synchronize": (lambda: (tpin.copy_(src, non_blocking=True), cur.synchronize()), tpin.numpy()),
}
for poison in (True, False):
    print(f"== 1 MiB D2H, destination {'poisoned by the CPU' if poison else 'untouched'} before each copy, us")
    for name, (fn, dst) in cases.items():
        ts = []
        for i in range(2200):
            if poison:
                dst.fill(-1)
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
            if poison and not np.array_equal(dst, vals):
                raise AssertionError(name)
        print(f"  {name:<40} {statistics.median(ts[200:]) * 1e6:8.2f}", flush=True)
