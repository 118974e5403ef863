"""Probe: what pinned memory costs to get, a block of a host memory pool (pinstage's default
where the driver makes one) and `cuMemHostAlloc` against pinstage's registered pages
(mapped with transparent huge pages, populated by several threads, `cuMemHostRegister`), and
what that does to the calls that grow pinned memory: a cold `copy_d2h_async` of 4 MiB (the
pool empty), `empty_pinned`, the first pageable `copy_h2d` (bounce slots made), and the copy
rate from each kind of memory.

Needs the lab wheel (`_pinned_costs`, `_set_pin_by_register`, `_set_pin_from_pool`).
Usage: python3 lab/probes/probe_pinned.py
"""

import statistics
import time

import numpy as np
import torch

import pinstage
from labmod import lab

MiB = 1 << 20
sizes = [4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB]
print("== pinned memory costs, ms (ms per MiB)")
costs = dict(lab._pinned_costs(sizes))  # medians of 3, after the copy threads started
print(f"  copy threads started (once per process): {costs.pop('copy threads started ms'):.2f} ms")
for n in sizes:
    mib = n // MiB
    row = {k.split(" MiB ", 1)[1]: v for k, v in costs.items() if k.split(" MiB ", 1)[0] == str(mib)}
    print(f"  {mib:>6.0f} MiB: " + ", ".join(f"{k} {v:.2f} ({v / mib:.3f})" for k, v in row.items()), flush=True)

src = torch.arange(MiB, dtype=torch.int32, device="cuda")  # 4 MiB
ref = src.cpu().numpy()
big = torch.arange(256 * MiB, dtype=torch.int32, device="cuda")  # 1 GiB
vals = np.random.default_rng(1).integers(0, 1 << 30, 64 * MiB, dtype=np.int32)  # 256 MiB
dst = torch.empty(64 * MiB, dtype=torch.int32, device="cuda")
for name in ("host pool", "registered pages", "cuMemHostAlloc"):
    lab._set_pin_from_pool(name == "host pool")
    lab._set_pin_by_register(name != "cuMemHostAlloc")
    print(f"== {name}")
    ts = []
    for _ in range(10):
        pinstage.empty_cache()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        p = pinstage.copy_d2h_async(src)
        ts.append(time.perf_counter() - t0)
        out = p.wait()
        assert np.array_equal(out, ref)
        del p, out
    print(f"  cold copy_d2h_async 4 MiB returns after {statistics.median(ts) * 1e3:.3f} ms (median of 10)")
    for n in (4 * MiB, 64 * MiB):
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            a = pinstage.empty_pinned(n, np.uint8)
            ts.append(time.perf_counter() - t0)
            assert pinstage.is_pinned(a)
            del a
        print(f"  empty_pinned {n >> 20} MiB {statistics.median(ts) * 1e3:.3f} ms")
    ts = []
    for _ in range(3):
        pinstage.empty_cache()  # bounce slots too
        dst.fill_(-1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pinstage.copy_h2d(dst, vals)
        ts.append(time.perf_counter() - t0)
        assert torch.equal(dst, torch.from_numpy(vals).cuda())
    print(f"  first pageable copy_h2d 256 MiB (bounce slots made) {statistics.median(ts) * 1e3:.2f} ms")
    out = pinstage.copy_d2h(big)
    ts = []
    for _ in range(5):
        out.fill(-1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pinstage.copy_d2h(big, out)
        ts.append(time.perf_counter() - t0)
        assert out[12345] == 12345 and out[-1] == 256 * MiB - 1
    print(f"  copy_d2h 1 GiB into a pool block {big.numel() * 4 / statistics.median(ts) / 1e9:.2f} GB/s")
    pin = pinstage.empty_pinned(64 * MiB, np.int32)
    pin[:] = vals
    ts = []
    for _ in range(5):
        dst.fill_(-1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pinstage.copy_h2d(dst, pin)
        ts.append(time.perf_counter() - t0)
    assert torch.equal(dst, torch.from_numpy(vals).cuda())
    print(f"  copy_h2d 256 MiB from empty_pinned {vals.nbytes / statistics.median(ts) / 1e9:.2f} GB/s")
    del out, pin
lab._set_pin_by_register(True)
lab._set_pin_from_pool(True)
