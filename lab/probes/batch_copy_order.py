"""Probe: does the ORDER of a batch's copies set its rate? In bench_blocks.py pinstage's batch ran
0.86-0.90x the batch peer's at 32 KiB loads (runs 2026-12-06-h100-i, -m; its timed one-thread
batch 31.1 against the peer's 37.1 GB/s in run -o), with the same call, attributes and copies.
One difference: the peer issues the (tensor, run) copies in the ids' random order; pinstage
sorts the runs by destination id. The bench's shape (64 tensors of one allocation per side, 8 GiB,
a quarter of the blocks moved, random ids on both sides), one cuMemcpyBatchAsync (order STREAM)
through the bench's own BatchPeer, tensor-major, runs ordered:
  random   as drawn (the peer)
  by-dst   sorted by destination id (pinstage's order)
  by-src   sorted by source id
Round-robin over the orders, 7 calls each per size and direction, each timed from the call to
its stream's synchronize (as the bench times both); median GB/s (min-max). Every call's
destination is poisoned before and every moved block compared after (untimed).
"""

import pathlib
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benches"))
from bench_blocks import CAP, L, POISON, BatchPeer, runs_of  # noqa: E402

REPS = 7
torch.cuda.init()
n = CAP // 4
dev = torch.empty(n, dtype=torch.int32, device="cuda")
hdev = torch.empty(n, dtype=torch.int32, device="cuda")
rand = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
host = torch.empty(n, dtype=torch.int32, pin_memory=True)
peer = BatchPeer()
s = torch.cuda.Stream()
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
bad = 0
rows = []
for B in (16 << 10, 32 << 10, 64 << 10):
    W, NB = B // 4, min(8192, CAP // (L * B))
    M = NB // 4
    d3 = dev[: L * NB * W].view(L, NB, W)
    h3 = host[: L * NB * W].view(L, NB, W)
    hd3 = hdev[: L * NB * W].view(L, NB, W)
    r3 = rand[: L * NB * W].view(L, NB, W)
    dbase = np.array([t.data_ptr() for t in d3.unbind(0)], np.uint64)
    hbase = np.array([t.data_ptr() for t in h3.unbind(0)], np.uint64)
    rng = np.random.default_rng(0x0D3 + B)
    nbytes = L * M * B
    for direction in ("load", "offload"):
        rates = {o: [] for o in ("random", "by-dst", "by-src")}
        for rep in range(REPS):
            for order in rates:
                d = rng.permutation(NB)[:M].astype(np.int64)
                h = rng.permutation(NB)[:M].astype(np.int64)
                src, dst = (h, d) if direction == "load" else (d, h)
                if order == "by-dst":
                    k = np.argsort(dst, kind="stable")
                    src, dst = src[k], dst[k]
                elif order == "by-src":
                    k = np.argsort(src, kind="stable")
                    src, dst = src[k], dst[k]
                salt = rep * 7 + len(rows) + 1
                if direction == "load":
                    torch.add(r3, salt, out=hd3)
                    h3.copy_(hd3)
                    d3.fill_(POISON)
                else:
                    torch.add(r3, salt, out=d3)
                    hd3.fill_(POISON)
                    h3.copy_(hd3)
                torch.cuda.synchronize()
                sb, db = (hbase, dbase) if direction == "load" else (dbase, hbase)
                t0 = time.perf_counter_ns()
                peer.issue(sb, db, B, B, src, dst, s.cuda_stream)
                s.synchronize()
                t1 = time.perf_counter_ns()
                rates[order].append(nbytes / (t1 - t0))
                # check (untimed): every moved block, on the device
                dt = torch.from_numpy(d).cuda()
                ht = torch.from_numpy(h).cuda()
                if direction == "load":
                    ok = torch.equal(d3.index_select(1, dt), hd3.index_select(1, ht))
                else:
                    hd3.copy_(h3)
                    ok = torch.equal(hd3.index_select(1, ht), d3.index_select(1, dt))
                if not ok:
                    bad += 1
                    print(f"CHECK FAILED {B >> 10} KiB {direction} {order} rep {rep}", flush=True)
        for o, xs in rates.items():
            line = (f"{B >> 10:3d} KiB {direction:7s} {o:7s} {statistics.median(xs):6.2f} GB/s "
                    f"({min(xs):.2f}-{max(xs):.2f}); copies {len(runs_of(src, dst)[0]) * L}")
            rows.append(line)
            print(line, flush=True)
print("checks:", "all passed" if bad == 0 else f"{bad} FAILED")
sys.exit(1 if bad else 0)
