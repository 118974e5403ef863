"""Where a background BlockMover call's extra host time goes, second try (blocks_bg_sched.py, run
2026-12-03-h200-o: the calling thread's CPU time is as long as its wall time, ~290 us against
plan()'s ~62 us for 2048 ids, and it is not preempted: the extra is work ON the calling thread).

Questions, each a row (median wall us / thread-CPU us of 200 calls, minor page faults per call;
64 tensors of 8192 blocks of 4 KiB each side, default scheduling, each move waited for, untimed):
- does the extra follow the ids or the copies? 2048 random ids (131,072 copies) against 2048
  ids in one run (64 copies) and 32 runs of 64 ids (2,048 copies);
- is it driver work left over from the previous move (bookkeeping of its copies done by the next
  driver call of any thread)? the first driver call after the wait (torch Stream.query, timed),
  and the move after such a call (untimed);
- is it memory (page faults of the caller's allocations)? ru_minflt of the calling thread.

    python3 lab/probes/blocks_bg_parts.py
"""

import resource
import statistics
import time

import numpy as np
import torch

import pinstage
from kvpool import B, L, NB, mover, stream

s = stream
rng = np.random.default_rng(3)
N = 2048
ids = {
    "2048 random ids": (rng.permutation(NB)[:N], rng.permutation(NB)[:N]),
    "2048 ids in 1 run": (np.arange(N), np.arange(N) + 4096),
    "2048 ids in 32 runs of 64": (
        (rng.permutation(NB // 64)[:32][:, None] * 64 + np.arange(64)).ravel(),
        (rng.permutation(NB // 64)[:32][:, None] * 64 + np.arange(64)).ravel()),
}
ids = {k: (a.astype(np.int64), b.astype(np.int64)) for k, (a, b) in ids.items()}
print(f"pinstage {pinstage.__version__}, torch {torch.__version__}: {L} tensors x {NB} blocks of "
      f"{B} B; median of 50 calls: wall us / thread-CPU us / minor faults per call")


def faults():
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def measure(f, before=None, n=50):
    wall, cpu = [], []
    f0 = faults()
    for _ in range(n):
        if before is not None:
            before()
        t0 = time.perf_counter_ns()
        c0 = time.thread_time_ns()
        r = f()
        c1 = time.thread_time_ns()
        t1 = time.perf_counter_ns()
        wall.append(t1 - t0)
        cpu.append(c1 - c0)
        if r is not None and hasattr(r, "wait"):
            r.wait()
        del r
    return statistics.median(wall) / 1e3, statistics.median(cpu) / 1e3, (faults() - f0) / n


rows = []
with torch.cuda.stream(s):
    for rnd in range(1):
        for name, (d, h) in ids.items():
            p = mover.plan("offload", d, h)
            tag = f"{name} ({p['copies']} copies, {p['strategy']})"
            rows.append((f"plan()  {tag}", measure(lambda: (mover.plan("offload", d, h), None)[1])))
            rows.append((f"offload background  {tag}",
                         measure(lambda: mover.offload(d, h, stream=s, background=True))))
            rows.append((f"offload background, after an untimed s.query()  {tag}",
                         measure(lambda: mover.offload(d, h, stream=s, background=True),
                                 before=s.query)))
            rows.append((f"offload background, after 2 ms asleep  {tag}",
                         measure(lambda: mover.offload(d, h, stream=s, background=True),
                                 before=lambda: time.sleep(0.002))))

            def query_after_move():
                mover.offload(d, h, stream=s, background=True).wait()
                return None

            rows.append((f"s.query() right after a waited move (move untimed)  {tag}",
                         measure(s.query, before=query_after_move)))
for name, (w, c, f) in rows:
    print(f"  {name:100s} {w:8.1f} {c:8.1f} {f:7.2f}")
