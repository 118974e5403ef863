"""The Python per-field cost of `StepStager.stage` on the host path (no GPU needed): k fields of
1 KiB (int32 x 256), one exact numpy array each, `stage(dict)` in a loop into a host arena
(depth 8); median us per step of 5 rounds of 20000 steps after 2000 warm-up steps. The per-field
cost is (us(k=32) - us(k=1)) / 31. Steps alternate between two value sets, and the arena is
checked after each round (the last step's set). No copy engine and no pinned slot here: on a
GPU the slot stores (15-25 GB/s into a slot the copy engine read, lab/c/slot_stores.c) come on
top.

    python3 lab/probes/step_field_cost.py
"""

import statistics
import time

import numpy as np

import pinstage


def run(k, n=20000):
    layout = pinstage.StepLayout({f"f{i}": ("int32", 256) for i in range(k)})
    st = pinstage.StepStager(layout, depth=8)
    sets = [{f"f{i}": np.arange(256, dtype=np.int32) * 7 + 1000 * i + j for i in range(k)}
            for j in (1, 2)]
    for m in range(2000):
        st.stage(sets[m % 2])
    res = []
    for r in range(5):
        last = sets[(n - 1 + r) % 2]  # the set of this round's last step
        t0 = time.perf_counter_ns()
        for m in range(n):
            st.stage(sets[(m + r) % 2])
        res.append((time.perf_counter_ns() - t0) / n / 1e3)
        # Every field of the round's last step landed in the arena.
        for i in range(k):
            assert st.read_field(f"f{i}").tolist() == last[f"f{i}"].tolist(), (k, r, i)
    return statistics.median(res), min(res), max(res)


if __name__ == "__main__":
    print(f"pinstage {pinstage.__version__}, cuda_available={pinstage.cuda_available()}")
    got = {}
    for k in (1, 2, 8, 32):
        got[k] = run(k)
        print(f"k={k:2d}: {got[k][0]:.3f} us per step (min {got[k][1]:.3f}, max {got[k][2]:.3f})")
    print(f"per field: {(got[32][0] - got[1][0]) / 31 * 1e3:.0f} ns; k=32 / k=1 = {got[32][0] / got[1][0]:.2f}x")
