"""Why is `copy_d2h` slower than torch on the legacy default stream? (run p, bench_gpu.py, which
copies on the current stream, the legacy one: 1 MiB into pinned memory 39.8 us against torch's
`copy_` + synchronize 31.2; 64 KiB 20.0 against 18.0. bench_waits.py, on a side stream: 26.5
against 27.8 at 1 MiB, run l.)

Rows: host us per call (copy + its wait + `torch.cuda.synchronize()`, as bench_gpu times it),
median of 300 calls, 64 KiB and 1 MiB of int32 into a pinned numpy/torch destination, on the
legacy stream and on a torch side stream; pinstage with its landing word (the default) and with
an event instead (`_set_d2h_tuning(landing=False)`); torch `copy_(non_blocking=True)`. One
check per row of its last copy's bytes (a poisoned destination): the probe times, bench_gpu.py
checks. Also with JAX and cupy imported first (bench_gpu imports both: do their streams, created
blocking, make the legacy stream's calls dearer?).

    python3 lab/probes/d2h_legacy_stream.py   (then again in a child with --frameworks)
"""

import statistics
import sys
import time

import numpy as np
import torch

import pinstage
from labmod import lab

if "--frameworks" in sys.argv:
    import cupy  # noqa: F401
    import jax

    jax.numpy.zeros(1).block_until_ready()
    cupy.zeros(1)


def med(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1e3


side = torch.cuda.Stream()
print(f"pinstage {pinstage.__version__}, torch {torch.__version__}, frameworks imported: "
      f"{'--frameworks' in sys.argv}")
for nbytes in (64 << 10, 1 << 20):
    n = nbytes // 4
    src = torch.arange(1, n + 1, dtype=torch.int32, device="cuda") * 3
    want = src.cpu().numpy()
    dst = pinstage.empty_pinned(n, np.int32)
    tdst = torch.empty(n, dtype=torch.int32, pin_memory=True)
    for sname, stream in (("legacy", None), ("side", side)):
        ctx = torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(torch.cuda.default_stream())
        with ctx:
            rows = []
            for landing in (True, False):
                lab._set_d2h_tuning(landing=landing)
                if stream is None:
                    f = lambda: pinstage.copy_d2h(src, dst)  # noqa: E731
                else:
                    f = lambda: pinstage.copy_d2h(src, dst, stream=stream)  # noqa: E731
                us = med(f)
                dst.fill(-7)
                f()
                ok = np.array_equal(dst, want)
                rows.append((f"pinstage copy_d2h, landing={landing}", us, ok))
            lab._set_d2h_tuning()
            tf = lambda: tdst.copy_(src, non_blocking=True)  # noqa: E731
            us = med(tf)
            tdst.fill_(-7)
            tf()
            torch.cuda.synchronize()
            rows.append(("torch copy_(non_blocking=True)", us, np.array_equal(tdst.numpy(), want)))
        for name, us, ok in rows:
            print(f"  {nbytes >> 10:5d} KiB {sname:6s} {name:40s} {us:8.1f} us  {'ok' if ok else 'WRONG'}")

if "--frameworks" not in sys.argv:
    import subprocess

    sys.stdout.flush()
    subprocess.run([sys.executable, __file__, "--frameworks"], check=False)
