"""What does the first driver call after the wait for a block move cost, and whose doing is it?

Run 2026-12-05-h100-n measured torch's own `Event.record(s)` at 2.0 us hot but 10.0 us right
after the wait for a pinstage move of 128 ids and 52.6 after 2048 ids: a call made then (a
BlockMover call included) runs in a slow state. Controls, each timed as the record alone
(median us over ROUNDS rounds of PER calls, the rounds' min and max; the move untimed before
each call), for n = 1, 128, 2048 random ids of 64 tensors x 8192 blocks of 4 KiB:

- after pinstage's background offload + `wait()` (the state the probes time calls in);
- the same, waited by asking `done()` in a Python loop (no yield, no sleep);
- the same, `background=False` (the copies issued on this thread); and that move waited with
  torch's `s.synchronize()` (the driver's own wait; the copies are on `s`);
- the same, then an untimed `cuCtxSynchronize()` (returns at once: the work is done);
- the same, waited with `stream_wait(s)` + torch's `s.synchronize()` instead of `wait()`;
- the same, then one untimed record first: does the first call absorb the cost (the second
  record is the one timed)?
- the same, then an untimed `cuStreamQuery(s)` on this thread (a cheap call that touches the
  stream's queue);
- the same, then an untimed `cuStreamQuery` of ANOTHER stream made by another thread, this one
  waiting for it: can a helper thread take the cost off the caller?
- the same, then 200 us of sleep: does the state decay by itself?
- after n `cuMemcpy2DAsync` (ctypes, the same 2D copies pinstage's strided path issues:
  one per id, 64 rows of 4 KiB) and torch's `s.synchronize()`: the same copies without pinstage;
- after one torch copy of the same bytes and `s.synchronize()`: one copy, the same bytes.
Host time only: nothing moved is checked here (bench_blocks.py checks the moves).
`PWS_ONLY=regex` keeps the rows whose name matches (a short run).

    python3 lab/probes/post_wait_state.py
"""

import ctypes
import os
import pathlib
import re
import statistics
import sys
import threading
import time

import numpy as np
import torch

import pinstage

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benches"))
from bench_blocks import Memcpy2D  # noqa: E402  (CUDA_MEMCPY2D for ctypes)

CUDA = ctypes.CDLL("libcuda.so.1")
CUDA.cuStreamQuery.argtypes = [ctypes.c_void_p]
CUDA.cuMemcpy2DAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p]

L, NB, B = 64, 8192, 4096
W = B // 4
dev_all = torch.zeros((L, NB, W), dtype=torch.int32, device="cuda")
host_all = pinstage.empty_host((L, NB, W), np.int32)
mover = pinstage.BlockMover([dev_all[i] for i in range(L)], [host_all[i] for i in range(L)],
                            block_dim=0)
s = torch.cuda.Stream()
other = torch.cuda.Stream()
ev = torch.cuda.Event()
rng = np.random.default_rng(7)
ROUNDS, PER = 5, 40
dev_flat = dev_all.reshape(-1)
pinned_flat = torch.empty(2048 * L * W, dtype=torch.int32, pin_memory=True)
print(f"pinstage {pinstage.__version__}, torch {torch.__version__}: {L} tensors x {NB} blocks "
      f"of {B} B; us of one torch Event.record(s), {ROUNDS} rounds of {PER}")


def check(rc):
    assert rc in (0, 600), f"CUresult {rc}"  # success, or not ready (a query)


# A helper thread that makes one driver call on request (on `other`), the caller waiting for it.
ask, done = threading.Event(), threading.Event()


def helper():
    torch.cuda.set_device(0)
    torch.cuda.current_stream().query()  # the context current on this thread
    h = ctypes.c_void_p(other.cuda_stream)
    while True:
        ask.wait()
        ask.clear()
        check(CUDA.cuStreamQuery(h))
        done.set()


threading.Thread(target=helper, daemon=True).start()
S = ctypes.c_void_p(s.cuda_stream)


def by_helper():
    ask.set()
    done.wait()
    done.clear()


def copies_2d(d, h):
    """One cuMemcpy2DAsync per id on `s`: 64 rows of B bytes, device block d[i] to host h[i]."""
    p = Memcpy2D()
    p.srcMemoryType, p.dstMemoryType = 2, 1  # device to host
    p.srcPitch = p.dstPitch = NB * B
    p.WidthInBytes, p.Height = B, L
    base_d, base_h = dev_all.data_ptr(), host_all.ctypes.data
    for a, b in zip(d.tolist(), h.tolist()):
        p.srcDevice = base_d + a * B
        p.dstHost = base_h + b * B
        check(CUDA.cuMemcpy2DAsync_v2(ctypes.byref(p), S))


rows = []
for n in (1, 128, 2048):
    d = rng.permutation(NB)[:n].astype(np.int64)
    h = rng.permutation(NB)[:n].astype(np.int64)

    def move(bg=True, d=d, h=h):
        mover.offload(d, h, stream=s, background=bg).wait()

    def move_stream_wait(d=d, h=h):
        p = mover.offload(d, h, stream=s, background=True)
        p.stream_wait(s)
        s.synchronize()

    def move_polled(d=d, h=h):
        p = mover.offload(d, h, stream=s, background=True)
        while not p.done():  # the event asked in a loop, no yield, no sleep
            pass

    def move_torch_waits(d=d, h=h):
        mover.offload(d, h, stream=s, background=False)  # the copies on s
        s.synchronize()

    nw = n * L * W
    rows += [
        (f"{n} ids: after the move + done() asked in a loop", move_polled),
        (f"{n} ids: after the move issued on this thread + s.synchronize()", move_torch_waits),
        (f"{n} ids: after the move + wait() + cuCtxSynchronize here",
         lambda m=move: (m(), check(CUDA.cuCtxSynchronize()))),
        (f"{n} ids: after pinstage's background move + wait()", move),
        (f"{n} ids: after the move issued on this thread + wait()", lambda m=move: m(False)),
        (f"{n} ids: after the move + stream_wait(s) + s.synchronize()", move_stream_wait),
        (f"{n} ids: after the move + wait(), the second record", lambda m=move: (m(), ev.record(s))),
        (f"{n} ids: after the move + wait() + cuStreamQuery(s) here",
         lambda m=move: (m(), check(CUDA.cuStreamQuery(S)))),
        (f"{n} ids: after the move + wait() + cuStreamQuery(other) by a helper thread",
         lambda m=move: (m(), by_helper())),
        (f"{n} ids: after the move + wait() + 200 us sleep", lambda m=move: (m(), time.sleep(2e-4))),
        (f"{n} ids: after {n} cuMemcpy2DAsync (ctypes) + s.synchronize()",
         lambda d=d, h=h: (copies_2d(d, h), s.synchronize())),
        (f"{n} ids: after one torch copy of the same bytes + s.synchronize()",
         lambda nw=nw: (pinned_flat[:nw].copy_(dev_flat[:nw], non_blocking=True), s.synchronize())),
    ]
rows.append(("hot: after a record", lambda: ev.record(s)))
if os.environ.get("PWS_ONLY"):
    rows = [r for r in rows if re.search(os.environ["PWS_ONLY"], r[0])]

times = {name: [] for name, _ in rows}
meds = {name: [] for name, _ in rows}
for r in range(ROUNDS + 1):
    for name, before in rows:
        t = []
        with torch.cuda.stream(s):
            for _ in range(PER):
                before()
                t0 = time.perf_counter_ns()
                ev.record(s)
                t.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
        if r:  # round 0 warms up
            times[name] += t
            meds[name].append(statistics.median(t) / 1e3)
print(f"  {'':78s} {'median':>7s} {'p10':>6s} {'p90':>6s} {'rounds min':>10s} {'max':>6s}")
for name, _ in rows:
    t = sorted(times[name])
    print(f"  {name:78s} {statistics.median(t) / 1e3:7.1f} {t[len(t) // 10] / 1e3:6.1f} "
          f"{t[len(t) * 9 // 10] / 1e3:6.1f} {min(meds[name]):10.1f} {max(meds[name]):6.1f}")
