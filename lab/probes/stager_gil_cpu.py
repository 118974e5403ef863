"""Does releasing the GIL around a small PinnedStager.copy_ cost the single thread anything, and
does holding it hold up other threads? (run p: a graph timed beside a copying thread +167%.)
CPU-only (numpy destinations): works without a GPU.

1. Host us per copy_ of 200 int32 (+ pad) into a numpy array, 7 rounds of 100k calls: median
   (min-max). Run it against two wheels (PYTHONPATH) for the A/B.
2. The longest gap of a thread sleeping 1 ms at a time, 20 times, while another thread runs the
   named work in a loop, under a 200 ms switch interval: ~200 ms means the work holds the GIL.

    python3 lab/probes/stager_gil_cpu.py
"""

import statistics
import sys
import threading
import time

import numpy as np

import pinstage

st = pinstage.PinnedStager(np.int32, 256, 4)
dst = np.zeros(256, np.int32)
vals = np.arange(200, dtype=np.int32)
r = []
for _ in range(7):
    t = time.perf_counter()
    for _ in range(100000):
        st.copy_(dst, vals, pad_value=-1)
    r.append((time.perf_counter() - t) / 100000 * 1e6)
print(f"pinstage {pinstage.__version__} ({pinstage.__file__}): copy_ {statistics.median(r):.2f} us "
      f"({min(r):.2f}-{max(r):.2f})")


def longest_gap(work):
    stop = threading.Event()
    done = [0]

    def loop():
        while not stop.is_set():
            work()
            done[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.2)
    t = threading.Thread(target=loop)
    t.start()
    while done[0] < 10:
        time.sleep(0.001)
    gaps = []
    last = time.perf_counter()
    for _ in range(20):
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    stop.set()
    t.join()
    sys.setswitchinterval(old)
    return max(gaps) * 1e3


print(f"longest 1 ms sleep beside copy_ in a loop: {longest_gap(lambda: st.copy_(dst, vals, pad_value=-1)):.1f} ms")
print(f"control, beside a pure-Python loop: {longest_gap(lambda: sum(range(100))):.1f} ms")
