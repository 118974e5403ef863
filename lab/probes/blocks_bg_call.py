"""A background BlockMover call's host time from Python, with no framework: device memory from
`pinstage.to_device(..., framework="dlpack")`, so it runs against the simulated driver too
(`eval "export $(scripts/fake-gpu env)"`: host figures only; the driver calls then cost what the
simulation costs) and on a GPU.

Rows: median host us of 600 calls of `offload(a, b, background=True)` for n random numpy int64
ids (one tensor [1, 8192, 16] int32 per side), next to `plan()` of the same ids (the ids read and
merged, no driver call): "after wait", each call right after waiting for the move before (a
bench's pattern); "back to back", 20 calls queued between waits.

    python3 lab/probes/blocks_bg_call.py
"""

import numpy as np

import pinstage
import time

d = pinstage.to_device(np.zeros((1, 8192, 16), np.int32), framework="dlpack")
h = pinstage.empty_host((1, 8192, 16), np.int32)
m = pinstage.BlockMover([d], [h], block_dim=1)
rng = np.random.default_rng(1)
print(f"pinstage {pinstage.__version__}: median host us per call of 600")


def med(f, after):
    t = []
    for _ in range(600):
        t0 = time.perf_counter_ns()
        p = f()
        t.append(time.perf_counter_ns() - t0)
        after(p)
    t.sort()
    return t[len(t) // 2] / 1e3


for n in (1, 128, 2048):
    a = rng.permutation(8192)[:n].astype(np.int64)
    b = rng.permutation(8192)[:n].astype(np.int64)
    plan = med(lambda: m.plan("offload", a, b), lambda p: None)
    waited = med(lambda: m.offload(a, b, background=True), lambda p: p.wait())
    keep = []

    def later(p):
        keep.append(p)
        if len(keep) == 20:
            for q in keep:
                q.wait()
            keep.clear()

    queued = med(lambda: m.offload(a, b, background=True), later)
    for q in keep:
        q.wait()
    print(f"  {n:5d} ids: plan() {plan:6.1f}  background, after wait {waited:6.1f}  "
          f"back to back {queued:6.1f}")
