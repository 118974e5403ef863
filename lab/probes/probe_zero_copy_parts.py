"""Where a Python zero-copy step's host time goes (the #11 goal: <= 2 us for a step, one value
written in place, and its commit).

Rows, each timed in a loop of N steps, interleaved over R rounds (median round, ns per step):
the bench's one-write step (as `bench_step.py`: `step(stream=s)`, `view("seq_lens", 1)[0] = i`,
`commit()`), the same without the write, without the view (a bare step), a bare step on the
legacy default stream (no stream object), and a call floor: three pyo3 calls that do nothing
(`stager.depth` read three times), the Python cost of three calls of pinstage. Beside them the
driver calls a zero-copy step makes, timed in Rust by the lab build (`_driver_costs`): the
slot's event queried (claim; with the thread's capture mode relaxed around the query, also timed
alone), recorded (commit), and the capture check.

Each one-write batch is checked: the slots are poisoned before it (through the GPU), and the last
`depth` steps' values must be found in the `depth` slots after it.

    PYTHONPATH=<lab wheel> python3 lab/probes/probe_zero_copy_parts.py [--steps N] [--rounds R]
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

import pinstage
from labmod import lab

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402  (the engine step's fields)

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=20000)
ap.add_argument("--rounds", type=int, default=7)
args = ap.parse_args()

# The engine step's fields, as bench_step.py lays them out (dtype, capacity).
ENGINE = {n: (dt, cap) for n, (dt, cap, _) in bench_step.ENGINE.items()}
depth = 4
st = pinstage.StepStager(pinstage.StepLayout(ENGINE), mode="zero_copy", depth=depth)
s = torch.cuda.Stream()
seq = [torch.from_dlpack(st.slot_field(k, "seq_lens")) for k in range(depth)]
count = [0]


def one_write():
    count[0] += 1
    step = st.step(stream=s)
    step.view("seq_lens", rows=1)[0] = count[0]
    step.commit()


def view_no_write():
    step = st.step(stream=s)
    step.view("seq_lens", rows=1)
    step.commit()


def bare():
    step = st.step(stream=s)
    step.commit()


def bare_legacy():
    step = st.step()
    step.commit()


def three_calls():
    st.depth
    st.depth
    st.depth


def poison():
    s.synchronize()
    for t in seq:
        t.fill_(-5)
    torch.cuda.synchronize()


def check():
    s.synchronize()
    got = sorted(int(t[0]) for t in seq)
    want = list(range(count[0] - depth + 1, count[0] + 1))
    if got != want:
        raise AssertionError(f"one write: slots hold seq_lens[0] {got}, want {want}")


rows = {
    "step + view + one write + commit (the bench's row)": one_write,
    "step + view + commit (no write)": view_no_write,
    "bare step + commit": bare,
    "bare step + commit, legacy default stream": bare_legacy,
    "three pyo3 calls that do nothing (st.depth x3)": three_calls,
}
res = {k: [] for k in rows}
for _ in range(args.rounds):
    for name, fn in rows.items():
        if fn is one_write:
            poison()
            count[0] = 0
        for _ in range(200):
            fn()
        t0 = time.perf_counter_ns()
        for _ in range(args.steps):
            fn()
        res[name].append((time.perf_counter_ns() - t0) / args.steps)
        if fn is one_write:
            check()
torch.cuda.synchronize()
costs = dict(lab._driver_costs(20000))
print(f"== Python zero-copy step, host ns per step ({args.steps} steps x {args.rounds} rounds, median round; "
      f"min..max of rounds); every one-write batch checked in the slots after it")
for name, v in res.items():
    print(f"  {name:<55} {statistics.median(v):8.0f}   ({min(v):.0f}..{max(v):.0f})")
print("== the driver calls a zero-copy step makes, timed in Rust (`_driver_costs`), ns per call")
for k in ("cuEventQuery (complete)", "capture mode relaxed and restored (2 calls)", "cuEventRecord",
          "cuStreamIsCapturing", "cuCtxGetCurrent"):
    print(f"  {k:<55} {costs[k]:8.0f}")
floor = costs["cuEventQuery (complete)"] + costs["cuEventRecord"] + costs["cuStreamIsCapturing"]
one = statistics.median(res["step + view + one write + commit (the bench's row)"])
calls = statistics.median(res["three pyo3 calls that do nothing (st.depth x3)"])
print(f"  query + record + capture check: {floor:.0f} ns; + three calls' floor: {floor + calls:.0f} ns; "
      f"the one-write step: {one:.0f} ns ({one / 1000:.2f} us against the 2 us goal)")
