"""Is a background BlockMover call's extra host time the caller being preempted by the mover's
own issuing thread? (run m: plan() of 2048 ids 124 us, the background offload of the same ids
302-325 us; the extra grows with the move.)

Prediction if it is: the calling thread's CPU time (time.thread_time_ns) stays near plan()'s while
its wall time is ~180 us longer, its involuntary context switches (/proc/thread-self/status) rise
by about one per call, and the extra goes away when the issuing threads cannot preempt it:
SCHED_BATCH or SCHED_IDLE (CFS does not let them preempt on wake-up), or pinned to other CPUs.
If the CPU time is as long as the wall time, the extra is work on the calling thread instead.

Rows: median wall us and thread-CPU us of 200 calls, involuntary switches per call; 64 tensors of
8192 blocks of 4 KiB on each side, 2048 random numpy ids, a torch side stream; each call's move
waited for (untimed) before the next. Variants interleaved over 3 rounds. The moved bytes are not
checked here (bench_blocks.py checks every block of the same calls).

    python3 lab/probes/blocks_bg_sched.py
"""

import os
import statistics
import threading
import time

import numpy as np
import torch

import pinstage
from kvpool import B, L, NB, mover, stream

s = stream
rng = np.random.default_rng(2)
N = 2048
d_ids = rng.permutation(NB)[:N].astype(np.int64)
h_ids = rng.permutation(NB)[:N].astype(np.int64)
me = threading.get_native_id()
ncpu = os.cpu_count()


def involuntary(tid):
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("nonvoluntary_ctxt_switches"):
                return int(line.split()[1])
    return 0


def issuers():
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "pinstage-blocks":
                    out.append(int(tid))
        except OSError:
            pass
    return out


# Start both directions' issuing threads.
with torch.cuda.stream(s):
    mover.offload(d_ids, h_ids, stream=s, background=True).wait()
    mover.load(h_ids, d_ids, stream=s, background=True).wait()
threads = issuers()
print(f"pinstage {pinstage.__version__}, torch {torch.__version__}, {ncpu} CPUs; caller tid {me}, "
      f"issuing threads {threads}; {L} tensors x {NB} blocks of {B} B, {N} ids")


def setup(variant):
    everyone = set(range(ncpu))
    os.sched_setaffinity(me, everyone)
    for t in threads:
        os.sched_setaffinity(t, everyone)
        os.sched_setscheduler(t, os.SCHED_OTHER, os.sched_param(0))
    if variant == "issuers SCHED_BATCH":
        for t in threads:
            os.sched_setscheduler(t, os.SCHED_BATCH, os.sched_param(0))
    elif variant == "issuers SCHED_IDLE":
        for t in threads:
            os.sched_setscheduler(t, os.SCHED_IDLE, os.sched_param(0))
    elif variant == "caller on CPU 2, issuers on the others":
        os.sched_setaffinity(me, {2})
        for t in threads:
            os.sched_setaffinity(t, everyone - {2})
    elif variant == "caller and issuers on CPU 2 (control: forced sharing)":
        os.sched_setaffinity(me, {2})
        for t in threads:
            os.sched_setaffinity(t, {2})


def measure(f, n=200):
    wall, cpu = [], []
    inv0 = involuntary(me)
    for _ in range(n):
        t0 = time.perf_counter_ns()
        c0 = time.thread_time_ns()
        r = f()
        c1 = time.thread_time_ns()
        t1 = time.perf_counter_ns()
        wall.append(t1 - t0)
        cpu.append(c1 - c0)
        if r is not None:
            r.wait()
        del r
    return (statistics.median(wall) / 1e3, statistics.median(cpu) / 1e3,
            (involuntary(me) - inv0) / n)


variants = ["default", "issuers SCHED_BATCH", "issuers SCHED_IDLE",
            "caller on CPU 2, issuers on the others",
            "caller and issuers on CPU 2 (control: forced sharing)"]
calls = {
    "plan() offload": lambda: (mover.plan("offload", d_ids, h_ids), None)[1],
    "offload background": lambda: mover.offload(d_ids, h_ids, stream=s, background=True),
    "load background": lambda: mover.load(h_ids, d_ids, stream=s, background=True),
}
res = {}
for rnd in range(3):
    for v in variants:
        setup(v)
        with torch.cuda.stream(s):
            for name, f in calls.items():
                res.setdefault((v, name), []).append(measure(f))
setup("default")
print(f"{'variant':55s} {'call':20s} {'wall us':>18s} {'cpu us':>18s} {'invol/call':>10s}")
for (v, name), rs in res.items():
    w = [r[0] for r in rs]
    c = [r[1] for r in rs]
    i = [r[2] for r in rs]
    print(f"{v:55s} {name:20s} {statistics.median(w):7.1f} ({min(w):5.0f}-{max(w):5.0f})"
          f" {statistics.median(c):7.1f} ({min(c):5.0f}-{max(c):5.0f}) {statistics.median(i):10.2f}")
