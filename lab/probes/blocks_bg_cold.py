"""Is a background BlockMover call's extra host time the calling core waking cold? (run p,
blocks_bg_parts.py: the extra is CPU time of the calling thread, grows with the ids and not with
the copies, and is larger after 2 ms asleep.) Between two timed calls a bench waits for the move
(~10-30 ms asleep in a futex): the core idles, its caches and clock cool down.

The control: plan() (no driver call, no thread; the ids checked as a move checks them) timed the
same ways. If plan() after a wait costs what the background move costs after a wait, the extra is
the cold core, not the background path. Rows: median wall / thread-CPU us of 100 calls; 64
tensors of 8192 blocks of 4 KiB, 2048 random numpy ids; moves not checked (bench_blocks.py does).

    python3 lab/probes/blocks_bg_cold.py
"""

import statistics
import time

import numpy as np
import torch

import pinstage
from kvpool import NB, mover, stream

s = stream
rng = np.random.default_rng(4)
d = rng.permutation(NB)[:2048].astype(np.int64)
h = rng.permutation(NB)[:2048].astype(np.int64)
print(f"pinstage {pinstage.__version__}: median of 100 calls, wall us / thread-CPU us")


def spin(us):
    t = time.perf_counter_ns() + us * 1000
    while time.perf_counter_ns() < t:
        pass


def measure(f, before=None, n=100, wait=True):
    wall, cpu, keep = [], [], []
    for _ in range(n):
        if before is not None:
            before()
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        r = f()
        c1, t1 = time.thread_time_ns(), time.perf_counter_ns()
        wall.append(t1 - t0)
        cpu.append(c1 - c0)
        if r is not None and wait:
            r.wait()
        keep.append(r)
    return statistics.median(wall) / 1e3, statistics.median(cpu) / 1e3


def plan():
    mover.plan("offload", d, h)


def move():
    return mover.offload(d, h, stream=s, background=True)


def wait_move():
    move().wait()


rows = []
with torch.cuda.stream(s):
    for rnd in range(2):
        rows += [
            ("plan() back to back (hot)", measure(plan)),
            ("plan() after a background move waited for (untimed)", measure(plan, wait_move)),
            ("plan() after 2 ms asleep", measure(plan, lambda: time.sleep(0.002))),
            ("plan() after 2 ms spinning", measure(plan, lambda: spin(2000))),
            ("background offload after the previous one waited for",
             measure(move)),
            ("background offload after 2 ms asleep ",
             measure(move, lambda: time.sleep(0.002))),
            ("background offload after 2 ms spinning ",
             measure(move, lambda: spin(2000))),
            ("background offload back to back, not waited for (hot)", measure(move, n=20, wait=False)),
        ]
        torch.cuda.synchronize()
for name, (w, c) in rows:
    print(f"  {name:70s} {w:8.1f} {c:8.1f}")
