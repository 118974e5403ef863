"""What a BlockMover call costs the calling thread before any driver call: reading the ids,
checking them and merging runs, measured through `plan()` (the same checks as a move, no copy)
on a host-memory mover (runs anywhere). Median of 2000 calls per case, in microseconds.

    python3 lab/probes/blocks_call_cost.py
"""

import statistics
import time

import numpy as np

import pinstage

L, NB, W = 64, 8192, 4
dev = [np.zeros((NB, W), np.int32) for _ in range(L)]
host = [np.zeros((NB, W), np.int32) for _ in range(L)]
mover = pinstage.BlockMover(dev, host, block_dim=0)
rng = np.random.default_rng(1)
print(f"pinstage {pinstage.__version__}: plan() of a random move, {L} tensors of {NB} blocks")
for n in (128, 512, 2048):
    d = rng.permutation(NB)[:n].astype(np.int64)
    h = rng.permutation(NB)[:n].astype(np.int64)
    for kind, (a, b) in (("numpy int64", (d, h)), ("list", (d.tolist(), h.tolist()))):
        t = []
        for _ in range(2000):
            t0 = time.perf_counter_ns()
            mover.plan("offload", a, b)
            t.append(time.perf_counter_ns() - t0)
        med = statistics.median(t) / 1e3
        print(f"  {n:5d} ids, {kind:11s}: {med:7.1f} us  ({med * 1e3 / n:5.1f} ns per id; "
              f"goal for a whole call: {2 + 0.05 * n:.1f} us)")
