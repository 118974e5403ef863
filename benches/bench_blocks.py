"""KV-cache blocks between device memory and pinned host memory: pinstage's `BlockMover` against
the idioms an engine writes itself, every block of every timed call checked.

Workload (issue #31): L = 64 device tensors (32 layers x K/V) of NB blocks of B bytes each,
int32, laid out `[NB, B/4]` per tensor (block_dim 0), and L pinned host tensors of the same
shape; a call moves M = NB/4 blocks of every tensor, device ids and host ids random (two fixed-seed
permutations, a new draw per call). NB = min(8192, CAP / (L * B)) so each side stays within CAP
(8 GiB): B = 4, 16 KiB hold 8192 blocks per tensor, 32 KiB 4096, 64 KiB 2048, 256 KiB 512.
Each side is ONE allocation split into per-layer views (as engines allocate a KV pool), so
pinstage may move small blocks as 2D copies across all tensors (the summary names the strategy
it took); tensors in separate allocations are moved batched, like the batch peer.

Variants, one torch stream `s`, a call = issue + `s.synchronize()` (wall time, perf_counter_ns):
  pinstage     mover.offload(dev_ids, host_ids, stream=s) / mover.load(host_ids, dev_ids, ...)
  pinstage-bg  the same with background=True (a thread of the mover issues; the call is timed
               to the move's wait()); small blocks go through staging there (plan(...,
               background=True) says "staged": 2D gathers or scatters inside device memory, one
               copy per 16 MiB chunk across the link, the host blocks moved by copy threads)
  batch-peer   vLLM's DMA idiom: the (tensor, block) pairs merged into runs with numpy and ONE
               cuMemcpyBatchAsync (ctypes, srcAccessOrder STREAM, arrays built per call)
  2d-peer      with each side one allocation (as here): one cuMemcpy2DAsync per run across all
               tensors (height L, pitch the tensor stride; ctypes), what pinstage's "strided" does
  copy-loop    torch `copy_(non_blocking=True)` per (tensor, run)
  sm-gather    torch index_select / index_copy_ on the device (an SM kernel) + one contiguous
               copy to or from a packed pinned staging tensor (host ids 0..M-1; for reference)
  contiguous   one copy of the same bytes between a packed device tensor and packed pinned
               memory (the link's rate for this many bytes: the >= 0.9x goal's denominator)
  control      no move: one torch `Event.record(s)` (one driver call) timed in the state the
               calls above are timed in (prepared the same way: sources filled, the destination
               side poisoned, the device synchronized): the host-time floor of any call that
               makes a driver call there, beside pinstage's background host time
Checks, outside the timing, after every call: the destination side was poisoned (0xEEEEEEEE)
before it, sources changed per call (random int32 + call number); afterwards every moved block
equals its source block and every other destination block still holds the poison (the host side
is copied to the device for the comparison). A round is one call of every variant, in an
order shuffled per round (seeded: no variant always follows the same one); figures are medians
over --rounds rounds (min-max). Ratios: pinstage / peer.

Also: offload and load at once (pinstage, two streams, disjoint ids; issued from two threads, and
in the background from one) against either alone, and its control, one contiguous copy each way of
the same bytes at once (what the link carries both ways with nothing scattered), and with
--pair-modes the pair in the background under each staging mode (a mover per mode, in this
process: both staged, neither, and under "auto" the offload's or the load's first); host time per
pinstage call (issue only, on the calling thread and in the background); and a ~4 ms CUDA graph
(matmuls) replayed back to back on its own stream while another thread alternates quiet windows
and moves, each about one move long (3 moves a sequence, disjoint host ids, every move checked,
the host blocks no move writes still poisoned): each move's replays against the replays of the
quiet windows on both sides of it in the same sequence, so the clocks' and the temperature's
drift cancel. Peers: pinstage's offload (on the calling thread, and in the background to its
wait), the 2D peer's, the sm-gather peer (3 gathers into one packed staging buffer: only the last
can be checked, the graph figure is not a copy figure), one contiguous copy of the same bytes
(whether the copies' shape matters) and a null control whose windows move nothing (the
method's own spread: a slowdown within it is not separable from noise).

    python3 benches/bench_blocks.py [--rounds 5] [--sizes 4,16,32,64,256] [--graph-kib 32]
                                    [--only-graph] [--only-background] [--out DIR]
                                    [--staging auto|always|never] [--chunk-mib 16]
                                    [--pair-modes]

Exit status 1 when any check failed or a call raised; the summary table is printed last.
"""

import argparse
import ctypes
import json
import os
import random
import statistics
import sys
import threading
import time

import numpy as np
import torch

import pinstage

L = 64
CAP = 8 << 30
POISON = -286331154  # 0xEEEEEEEE as int32
failures = []


def fail(msg):
    failures.append(msg)
    print("CHECK FAILED:", msg, flush=True)


# ---------------------------------------------------------------- the batched-DMA peer (ctypes)
class MemcpyAttributes(ctypes.Structure):
    # CUmemcpyAttributes (CUDA 12.8): srcAccessOrder, srcLocHint {type, id}, dstLocHint, flags
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcType", ctypes.c_int),
        ("srcId", ctypes.c_int),
        ("dstType", ctypes.c_int),
        ("dstId", ctypes.c_int),
        ("flags", ctypes.c_uint),
    ]


class BatchPeer:
    """One cuMemcpyBatchAsync of every (tensor, run) pair, as vLLM's DMA path issues it."""

    def __init__(self):
        cuda = ctypes.CDLL("libcuda.so.1")
        # The CUDA 12.8 entry point (with failIdx), as pinstage and vLLM's extension load it.
        fn, status = ctypes.c_void_p(), ctypes.c_int()
        get = cuda.cuGetProcAddress_v2
        get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                        ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
        rc = get(b"cuMemcpyBatchAsync", ctypes.byref(fn), 12080, 0, ctypes.byref(status))
        if rc != 0 or not fn.value:
            raise RuntimeError(f"cuGetProcAddress(cuMemcpyBatchAsync): CUresult {rc}")
        p = ctypes.c_void_p
        proto = ctypes.CFUNCTYPE(ctypes.c_int, p, p, p, ctypes.c_size_t, p, p, ctypes.c_size_t,
                                 p, p)
        self.f = proto(fn.value)
        self.attr = MemcpyAttributes(1, 0, 0, 0, 0, 0)  # order STREAM, no hints
        self.idx = (ctypes.c_size_t * 1)(0)
        self.fail = ctypes.c_size_t(0)

    def issue(self, src_base, dst_base, stride, B, src_ids, dst_ids, stream):
        """src_base/dst_base: (L,) uint64 tensor base addresses; stride: bytes per block."""
        starts, lens = runs_of(src_ids, dst_ids)
        s0 = src_ids[starts].astype(np.uint64) * np.uint64(stride)
        d0 = dst_ids[starts].astype(np.uint64) * np.uint64(stride)
        srcs = (src_base[:, None] + s0[None, :]).ravel()
        dsts = (dst_base[:, None] + d0[None, :]).ravel()
        sizes = np.tile(lens.astype(np.uint64) * np.uint64(B), len(src_base))
        rc = self.f(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(sizes),
                    ctypes.byref(self.attr), self.idx, 1, ctypes.byref(self.fail),
                    ctypes.c_void_p(stream))
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync: CUresult {rc}")
        return len(sizes)


class Memcpy2D(ctypes.Structure):
    # CUDA_MEMCPY2D
    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


class TwoDPeer:
    """The idiom a user with one pool allocation per side can write: one cuMemcpy2DAsync per
    (run) across every tensor (height L, pitch the tensor stride), through ctypes."""

    HOST, DEVICE = 1, 2

    def __init__(self):
        cuda = ctypes.CDLL("libcuda.so.1")
        self.f = cuda.cuMemcpy2DAsync_v2
        self.f.argtypes = [ctypes.POINTER(Memcpy2D), ctypes.c_void_p]
        self.f.restype = ctypes.c_int
        self.c = Memcpy2D()

    def issue(self, src_base, dst_base, pitch, B, src_ids, dst_ids, src_host, stream):
        c = self.c
        c.srcMemoryType = self.HOST if src_host else self.DEVICE
        c.dstMemoryType = self.DEVICE if src_host else self.HOST
        c.srcPitch = c.dstPitch = pitch
        c.Height = L
        starts, lens = runs_of(src_ids, dst_ids)
        for a, n in zip(starts.tolist(), lens.tolist()):
            src = src_base + int(src_ids[a]) * B
            dst = dst_base + int(dst_ids[a]) * B
            if src_host:
                c.srcHost, c.srcDevice, c.dstHost, c.dstDevice = src, 0, None, dst
            else:
                c.srcHost, c.srcDevice, c.dstHost, c.dstDevice = None, src, dst, 0
            c.WidthInBytes = n * B
            rc = self.f(ctypes.byref(c), ctypes.c_void_p(stream))
            if rc != 0:
                raise RuntimeError(f"cuMemcpy2DAsync: CUresult {rc}")


def runs_of(src_ids, dst_ids):
    """Starts (indices) and lengths of the runs where both id lists step by one."""
    n = len(src_ids)
    brk = np.ones(n, bool)
    brk[1:] = (np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)
    starts = np.flatnonzero(brk)
    lens = np.diff(np.append(starts, n))
    return starts, lens


# ---------------------------------------------------------------- one block size
class Case:
    def __init__(self, pool, B, staging="auto", chunk=16 << 20):
        self.B = B
        self.W = B // 4
        self.NB = min(8192, CAP // (L * B))
        self.M = self.NB // 4
        n = L * self.NB * self.W
        self.dev = pool["dev"][:n].view(L, self.NB, self.W)
        self.host = pool["host"][:n].view(L, self.NB, self.W)
        self.hdev = pool["hdev"][:n].view(L, self.NB, self.W)  # host side's device mirror
        m = L * self.M * self.W
        self.gdev = pool["gdev"][:m].view(L, self.M, self.W)  # packed device blocks
        self.stage = pool["stage"][:m].view(L, self.M, self.W)  # packed pinned blocks
        self.rand = pool["rand"][:n].view(L, self.NB, self.W)
        self.devs = list(self.dev.unbind(0))
        self.hosts = list(self.host.unbind(0))
        self.mover = pinstage.BlockMover(self.devs, self.hosts, block_dim=0, staging=staging,
                                         staging_chunk=chunk)
        self.dev_base = np.array([t.data_ptr() for t in self.devs], np.uint64)
        self.host_base = np.array([t.data_ptr() for t in self.hosts], np.uint64)
        self.bytes = L * self.M * B
        self.rng = np.random.default_rng(0xB10C5 + B)
        self.salt = 0

    def draw(self):
        d = self.rng.permutation(self.NB)[: self.M].astype(np.int64)
        h = self.rng.permutation(self.NB)[: self.M].astype(np.int64)
        return d, h

    # -- fills (outside the timing)
    def fill_source(self, side):
        self.salt += 1
        if side == "dev":
            torch.add(self.rand, self.salt, out=self.dev)
        else:
            torch.add(self.rand, self.salt, out=self.hdev)
            self.host.copy_(self.hdev)
        torch.cuda.synchronize()

    def poison(self, side):
        if side == "dev":
            self.dev.fill_(POISON)
        else:
            self.hdev.fill_(POISON)
            self.host.copy_(self.hdev)
        torch.cuda.synchronize()

    # -- checks (outside the timing)
    def check(self, name, direction, d_ids, h_ids):
        if direction == "offload":
            self.hdev.copy_(self.host)
            src, dst, s_ids, t_ids = self.dev, self.hdev, d_ids, h_ids
        else:
            src, dst, s_ids, t_ids = self.hdev, self.dev, h_ids, d_ids
        si = torch.from_numpy(s_ids).cuda()
        ti = torch.from_numpy(t_ids).cuda()
        ok = torch.equal(dst.index_select(1, ti), src.index_select(1, si))
        mask = torch.ones(self.NB, dtype=torch.bool, device="cuda")
        mask[ti] = False
        rest = dst[:, mask]
        ok_rest = bool((rest == POISON).all())
        if not (ok and ok_rest):
            fail(f"{name} {direction} {self.B >> 10} KiB: moved blocks "
                 f"{'ok' if ok else 'WRONG'}, other blocks {'ok' if ok_rest else 'WRITTEN'}")

    def check_packed(self, name, direction, d_ids):
        """sm-gather / contiguous: host blocks 0..M-1 of the packed staging tensor."""
        di = torch.from_numpy(d_ids).cuda()
        if direction == "offload":
            got = self.stage.cuda()
            want = self.dev.index_select(1, di) if name == "sm-gather" else self.gdev
        else:
            got = self.dev.index_select(1, di) if name == "sm-gather" else self.gdev
            want = self.stage.cuda()
        if not torch.equal(got, want):
            fail(f"{name} {direction} {self.B >> 10} KiB: WRONG")
        if name == "sm-gather" and direction == "load":
            mask = torch.ones(self.NB, dtype=torch.bool, device="cuda")
            mask[di] = False
            if not bool((self.dev[:, mask] == POISON).all()):
                fail(f"{name} load {self.B >> 10} KiB: other blocks WRITTEN")


def one_call(case, name, direction, s, peer, timings, host_us, peer2d=None):
    """Prepare, time one call of `name`, check it."""
    d_ids, h_ids = case.draw()
    src_side = "dev" if direction == "offload" else "host"
    dst_side = "host" if direction == "offload" else "dev"
    packed = name in ("sm-gather", "contiguous")
    # sources hold new values, destinations the poison
    if packed:
        case.fill_source("dev")
        if direction == "offload":
            case.gdev.copy_(case.dev[:, : case.M])
            case.hdev.fill_(POISON)
            case.stage.copy_(case.hdev[:, : case.M])
        else:
            case.gdev.copy_(case.dev[:, : case.M])
            case.gdev.add_(7)
            case.stage.copy_(case.gdev)
            case.dev.fill_(POISON)
            case.gdev.fill_(POISON)
        torch.cuda.synchronize()
    else:
        case.fill_source(src_side)
        case.poison(dst_side)
    di_t = torch.from_numpy(d_ids).cuda() if name == "sm-gather" else None
    torch.cuda.synchronize()
    ev = torch.cuda.Event() if name == "control" else None
    with torch.cuda.stream(s):
        t0 = time.perf_counter_ns()
        if name == "control":
            ev.record(s)
            t1 = time.perf_counter_ns()
            s.synchronize()
        elif name in ("pinstage", "pinstage-bg"):
            bg = name == "pinstage-bg"
            if direction == "offload":
                p = case.mover.offload(d_ids, h_ids, stream=s, background=bg)
            else:
                p = case.mover.load(h_ids, d_ids, stream=s, background=bg)
            t1 = time.perf_counter_ns()
            s.synchronize()
            p.wait()
        elif name == "batch-peer":
            if direction == "offload":
                peer.issue(case.dev_base, case.host_base, case.B, case.B, d_ids, h_ids, s.cuda_stream)
            else:
                peer.issue(case.host_base, case.dev_base, case.B, case.B, h_ids, d_ids, s.cuda_stream)
            t1 = time.perf_counter_ns()
            s.synchronize()
        elif name == "2d-peer":
            pitch = case.NB * case.B  # the tensors of each side are one allocation, this apart
            d0, h0 = int(case.dev_base[0]), int(case.host_base[0])
            if direction == "offload":
                peer2d.issue(d0, h0, pitch, case.B, d_ids, h_ids, False, s.cuda_stream)
            else:
                peer2d.issue(h0, d0, pitch, case.B, h_ids, d_ids, True, s.cuda_stream)
            t1 = time.perf_counter_ns()
            s.synchronize()
        elif name == "copy-loop":
            src_ids, dst_ids = (d_ids, h_ids) if direction == "offload" else (h_ids, d_ids)
            starts, lens = runs_of(src_ids, dst_ids)
            src_l = case.devs if direction == "offload" else case.hosts
            dst_l = case.hosts if direction == "offload" else case.devs
            sl = [(int(src_ids[a]), int(dst_ids[a]), int(n)) for a, n in zip(starts, lens)]
            for st, dt in zip(src_l, dst_l):
                for a, b, n in sl:
                    dt[b : b + n].copy_(st[a : a + n], non_blocking=True)
            t1 = time.perf_counter_ns()
            s.synchronize()
        elif name == "sm-gather":
            if direction == "offload":
                torch.index_select(case.dev, 1, di_t, out=case.gdev)
                case.stage.copy_(case.gdev, non_blocking=True)
            else:
                case.gdev.copy_(case.stage, non_blocking=True)
                case.dev.index_copy_(1, di_t, case.gdev)
            t1 = time.perf_counter_ns()
            s.synchronize()
        else:  # contiguous
            if direction == "offload":
                case.stage.copy_(case.gdev, non_blocking=True)
            else:
                case.gdev.copy_(case.stage, non_blocking=True)
            t1 = time.perf_counter_ns()
            s.synchronize()
        t2 = time.perf_counter_ns()
    if name != "control":  # nothing moved: no rate
        timings.append(case.bytes / (t2 - t0))  # GB/s (bytes per ns)
    host_us.append((t1 - t0) / 1e3)
    if packed:
        case.check_packed(name, direction, d_ids)
    elif name != "control":  # nothing moved
        case.check(name, direction, d_ids, h_ids)


def both_at_once(case, s, s2, rounds, background=False, load_first=False):
    """pinstage offload (stream s) and load (stream s2) at once, disjoint ids; checked.
    background: both issued in the background from this thread (the offload first, or the load
    with load_first: under staging "auto" the first takes the staging turn)."""
    out = []
    for _ in range(rounds):
        perm_d = case.rng.permutation(case.NB)
        perm_h = case.rng.permutation(case.NB)
        d_out, d_in = perm_d[: case.M], perm_d[case.M : 2 * case.M]
        h_out, h_in = perm_h[: case.M], perm_h[case.M : 2 * case.M]
        case.fill_source("dev")
        # host blocks h_in carry values; the rest of the host side the poison
        case.salt += 1
        torch.add(case.rand, case.salt, out=case.hdev)
        hmask = torch.zeros(case.NB, dtype=torch.bool, device="cuda")
        hmask[torch.from_numpy(h_in).cuda()] = True
        case.hdev[:, ~hmask] = POISON
        case.host.copy_(case.hdev)
        want_host_in = case.hdev.index_select(1, torch.from_numpy(h_in).cuda()).clone()
        want_dev_out = case.dev.index_select(1, torch.from_numpy(d_out).cuda()).clone()
        torch.cuda.synchronize()
        # Issued from two threads (a move's call releases the GIL; issuing a batch of small
        # copies takes the driver as long as the copies take), as an engine would.
        got = {}

        def load():
            try:
                got["b"] = case.mover.load(h_in, d_in, stream=s2)
            except Exception as e:  # noqa: BLE001 -- reported below
                got["error"] = e

        t0 = time.perf_counter_ns()
        if background and load_first:
            got["b"] = case.mover.load(h_in, d_in, stream=s2, background=True)
            a = case.mover.offload(d_out, h_out, stream=s, background=True)
        elif background:
            a = case.mover.offload(d_out, h_out, stream=s, background=True)
            got["b"] = case.mover.load(h_in, d_in, stream=s2, background=True)
        else:
            th = threading.Thread(target=load)
            th.start()
            a = case.mover.offload(d_out, h_out, stream=s)
            th.join()
        if "error" in got:
            raise got["error"]
        s.synchronize()
        s2.synchronize()
        a.wait()
        got["b"].wait()
        t2 = time.perf_counter_ns()
        out.append(2 * case.bytes / (t2 - t0))
        case.hdev.copy_(case.host)
        got_host = case.hdev.index_select(1, torch.from_numpy(h_out).cuda())
        got_dev = case.dev.index_select(1, torch.from_numpy(d_in).cuda())
        if not (torch.equal(got_host, want_dev_out) and torch.equal(got_dev, want_host_in)):
            fail(f"both at once {case.B >> 10} KiB: WRONG")
    return out


def contiguous_both(case, s, s2, rounds):
    """The control of both at once: one contiguous copy each way of a move's bytes, at once (the
    packed device blocks into the packed pinned blocks on s; the first bytes of the host tensor
    into the first bytes of the device tensor on s2); both destinations poisoned before, checked
    after. What the link carries both ways with nothing scattered."""
    out = []
    m = case.gdev.numel()
    dflat = case.dev.reshape(-1)[:m]
    hflat = case.host.reshape(-1)[:m]
    hdflat = case.hdev.reshape(-1)[:m]
    rflat = case.rand.reshape(-1)[:m]
    for _ in range(rounds):
        case.salt += 1
        torch.add(rflat, case.salt, out=case.gdev.reshape(-1))
        torch.add(rflat, case.salt + 1000, out=hdflat)
        hflat.copy_(hdflat)
        case.stage.fill_(POISON)
        dflat.fill_(POISON)
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        with torch.cuda.stream(s):
            case.stage.copy_(case.gdev, non_blocking=True)
        with torch.cuda.stream(s2):
            dflat.copy_(hflat, non_blocking=True)
        s.synchronize()
        s2.synchronize()
        t2 = time.perf_counter_ns()
        out.append(2 * case.bytes / (t2 - t0))
        if not (torch.equal(case.stage.cuda(), case.gdev) and torch.equal(dflat, hdflat)):
            fail(f"contiguous both at once {case.B >> 10} KiB: WRONG")
    return out


def graph_beside(case, s, rounds, peer2d):
    """A ~4 ms graph replayed back to back on its own stream while another thread alternates
    quiet windows and moves (each about one move long): each move's replays against the quiet
    windows on both sides of it, in the same sequence (clock and thermal drift cancel), per
    peer: pinstage's offload (on the caller's thread, and in the background: staged for small
    blocks, each move to its wait), the 2D peer (the same copies by ctypes), the sm-gather peer,
    one contiguous copy of the same bytes (does the copies' shape matter?), and a null control whose
    "moves" only sleep (the method's own spread)."""
    g_stream = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    with torch.cuda.stream(g_stream):
        for _ in range(3):
            torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    reps = 1
    while True:  # ~4 ms of matmuls in the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=g_stream):
            for _ in range(reps):
                torch.matmul(a, b, out=c)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(g_stream):
            e0.record(g_stream)
            graph.replay()
            e1.record(g_stream)
        torch.cuda.synchronize()
        ms = e0.elapsed_time(e1)
        if ms >= 3.5 or reps > 4096:
            break
        reps = max(reps + 1, int(reps * 4.0 / max(ms, 1e-3)))

    def replays(n):
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        with torch.cuda.stream(g_stream):
            evs[0].record(g_stream)
            for i in range(n):
                graph.replay()
                evs[i + 1].record(g_stream)
        return evs

    # One move's duration sets the windows (the move is the same work every time). The mover
    # times its first moves of a kind every way before it settles: those are warm-up here too.
    for _ in range(7):
        case.fill_source("dev")
        case.poison("host")
        d_ids, h_ids = case.draw()
        t0 = time.perf_counter()
        case.mover.offload(d_ids, h_ids, stream=s).wait()
        window = max(time.perf_counter() - t0, 0.02)
        case.check("graph-warm-up", "offload", d_ids, h_ids)
    for _ in range(3):  # the background's first moves (its staging ring made) are warm-up too
        case.fill_source("dev")
        case.poison("host")
        d_ids, h_ids = case.draw()
        case.mover.offload(d_ids, h_ids, stream=s, background=True).wait()
        case.check("graph-warm-up-bg", "offload", d_ids, h_ids)
    # 3 moves of M = NB / 4 disjoint host ids: a quarter of the host blocks must keep the poison.
    moves, warm = 3, 3  # the first replays after an idle GPU run faster (clocks): not compared
    n = warm + int((2 * moves + 1) * window * 1e3 / ms * 1.5) + 8
    res = {"graph_ms": ms, "window_ms": window * 1e3, "ratios": {}, "replays": {}, "short": 0,
           "quiet": []}
    replays(2 * warm)  # warm-up
    torch.cuda.synchronize()
    peers = ["pinstage", "pinstage-bg", "2d-peer", "sm-gather", "contiguous", "none"]
    pitch = case.NB * case.B  # the 2D peer: each side's tensors one allocation, this apart
    d0, h0 = int(case.dev_base[0]), int(case.host_base[0])
    order = random.Random(7)
    for _ in range(rounds):
        order.shuffle(peers)
        for peer in peers:
            perm = case.rng.permutation(case.NB)
            d_list = [case.rng.permutation(case.NB)[: case.M] for _ in range(moves)]
            h_list = [perm[k * case.M : (k + 1) * case.M] for k in range(moves)]
            case.fill_source("dev")
            case.poison("host")
            if peer == "contiguous":
                case.gdev.copy_(case.dev[:, : case.M])  # the packed source: new values
            if peer in ("sm-gather", "contiguous"):
                case.stage.fill_(POISON)  # the packed destination
            dis = [torch.from_numpy(d).cuda() for d in d_list]
            torch.cuda.synchronize()
            spans = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                     for _ in range(moves)]
            held, raised = [], []
            started = threading.Event()

            def move():
                started.wait()
                try:
                    moved(s)
                except Exception as e:  # noqa: BLE001 -- reported, the sequence skipped
                    raised.append(e)

            def moved(s):
                with torch.cuda.stream(s):
                    for k in range(moves):
                        time.sleep(window)  # the quiet window before move k
                        spans[k][0].record(s)
                        if peer == "pinstage":
                            held.append(case.mover.offload(d_list[k], h_list[k], stream=s))
                        elif peer == "pinstage-bg":  # the move's span: to its wait
                            held.append(case.mover.offload(d_list[k], h_list[k], stream=s,
                                                           background=True))
                            held[-1].wait()
                        elif peer == "2d-peer":
                            peer2d.issue(d0, h0, pitch, case.B, d_list[k], h_list[k], False,
                                         s.cuda_stream)
                        elif peer == "contiguous":
                            case.stage.copy_(case.gdev, non_blocking=True)
                        elif peer == "sm-gather":
                            torch.index_select(case.dev, 1, dis[k], out=case.gdev)
                            case.stage.copy_(case.gdev, non_blocking=True)
                        else:
                            time.sleep(window)  # the null control: a window with no move
                        spans[k][1].record(s)
                        spans[k][1].synchronize()

            th = threading.Thread(target=move)
            th.start()
            # The mover starts with the sequence (its first quiet window covers the queueing,
            # which blocks once the launch queue is full: started after it, the moves began
            # near the sequence's end, run 2026-12-07-h100-x).
            started.set()
            evs = replays(n)
            th.join()
            torch.cuda.synchronize()
            if raised:
                fail(f"graph beside {peer}: the moving thread raised {raised[0]!r}")
                continue
            if peer in ("pinstage", "pinstage-bg", "2d-peer"):
                for p in held:
                    p.wait()
                # every move's host blocks (disjoint), and nothing else written
                case.check(f"graph-beside {peer}", "offload", np.concatenate(d_list),
                           np.concatenate(h_list))
            elif peer == "contiguous":
                if not torch.equal(case.stage.cuda(), case.gdev):
                    fail("graph-beside contiguous: WRONG")
            elif peer == "sm-gather":
                case.check_packed("sm-gather", "offload", d_list[-1])  # the last gather's
            # Replay i runs from at[i] to at[i+1] (ms after the sequence's first event).
            at = [evs[0].elapsed_time(e) for e in evs]
            edges = [(evs[0].elapsed_time(b), evs[0].elapsed_time(e)) for b, e in spans]
            if at[-1] < edges[-1][1] + window * 1e3 / 2:
                res["short"] += 1  # the replays ended before the last quiet window
            dur = [(at[i], at[i + 1], at[i + 1] - at[i]) for i in range(warm, n)]
            w = window * 1e3
            for k, (on0, on1) in enumerate(edges):
                # The quiet windows on both sides: up to the moves before and after, at most
                # one window long at the ends of the sequence.
                before = edges[k - 1][1] if k else on0 - w
                after = edges[k + 1][0] if k + 1 < moves else on1 + w
                inside = [d for a0, a1, d in dur if a0 >= on0 and a1 <= on1]
                quiet = [d for a0, a1, d in dur
                         if (a0 >= before and a1 <= on0) or (a0 >= on1 and a1 <= after)]
                if peer == "none":
                    res["quiet"] += quiet
                if inside and quiet:
                    r = statistics.median(inside) / statistics.median(quiet)
                    res["ratios"].setdefault(peer, []).append(r)
                    res["replays"].setdefault(peer, []).append((len(inside), len(quiet)))
    if res["quiet"]:  # the replay's own time, away from the capture's first replay
        res["graph_ms"] = statistics.median(res["quiet"])
    return res


def med(xs):
    return (statistics.median(xs), min(xs), max(xs)) if xs else (float("nan"),) * 3


def timed_calls(case, args, variants, s, s2, peer, peer2d, results):
    """Every variant both ways, the moves both at once and their control, at one block size."""
    B = case.B
    d_ids, h_ids = case.draw()
    for direction, a, b in (("offload", d_ids, h_ids), ("load", h_ids, d_ids)):
        plan = case.mover.plan(direction, a, b)
        results[(B, direction, "strategy")] = plan["strategy"]
        print(f"  pinstage's plan for a random {direction}: {plan}")
    for direction in ("offload", "load"):
        gbs = {v: [] for v in variants}
        hus = {v: [] for v in variants}
        for v in variants:  # warm-up, figures dropped (every call checked all the same)
            one_call(case, v, direction, s, peer, [], [], peer2d)
        # The mover times its first moves of a kind every way (twice each; three ways where
        # the batch is split over threads) before it settles on the faster
        # (plan()["choice"]): those moves are warm-up too, as in an engine's first steps (and
        # settle the unstaged moves of the background as well).
        for _ in range(6):
            one_call(case, "pinstage", direction, s, peer, [], [], peer2d)
        d_ids, h_ids = case.draw()
        a, b = (d_ids, h_ids) if direction == "offload" else (h_ids, d_ids)
        settled = case.mover.plan(direction, a, b)
        # The summary names the way the timed moves run (the plan before the warm-up said
        # only that the first moves would be timed).
        results[(B, direction, "strategy")] = settled["strategy"]
        print(f"  pinstage's plan after the warm-up: {settled['strategy']}, "
              f"{settled['choice']} {settled.get('measured_gbps', '')}", flush=True)
        bgplan = case.mover.plan(direction, a, b, background=True)
        results[(B, direction, "bg-strategy")] = bgplan["strategy"]
        print(f"  pinstage's plan in the background: {bgplan['strategy']} "
              f"({bgplan['copies']} copies, {bgplan['calls']} calls, {bgplan['threads']} threads)",
              flush=True)
        shuffle = random.Random(B)
        for r in range(args.rounds):
            order = variants[:]
            shuffle.shuffle(order)  # no variant always follows the same one
            for v in order:
                if v == "copy-loop" and r >= args.loop_rounds:
                    continue
                try:
                    one_call(case, v, direction, s, peer, gbs[v], hus[v], peer2d)
                except Exception as e:  # noqa: BLE001 -- reported, the bench goes on
                    fail(f"{v} {direction} {B >> 10} KiB raised {e!r}")
        results[(B, direction)] = {v: (med(gbs[v]), med(hus[v])) for v in variants}
        for v in variants:
            (g, lo, hi), (h, hlo, hhi) = results[(B, direction)][v]
            if v == "control":  # nothing moved: host time only
                print(f"  {direction:7s} {v:11s} one torch Event.record(s): host {h:9.1f} "
                      f"us/call ({hlo:.1f}-{hhi:.1f})", flush=True)
                continue
            print(f"  {direction:7s} {v:11s} {g:6.2f} GB/s ({lo:.2f}-{hi:.2f})  "
                  f"host {h:9.1f} us/call", flush=True)
    for key, bg in (("both", False), ("both-bg", True)):
        if key == "both" and "pinstage" not in variants:
            continue
        both = both_at_once(case, s, s2, args.rounds, background=bg)
        results[(B, key)] = med(both)
        print(f"  {key:8s} at once {med(both)[0]:.2f} GB/s "
              f"({med(both)[1]:.2f}-{med(both)[2]:.2f})", flush=True)
    cb = contiguous_both(case, s, s2, args.rounds)
    results[(B, "contig-both")] = med(cb)
    print(f"  contiguous both at once {med(cb)[0]:.2f} GB/s "
          f"({med(cb)[1]:.2f}-{med(cb)[2]:.2f})", flush=True)
    if args.pair_modes:
        results[(B, "pair-modes")] = pair_modes(case, args, s, s2, peer, peer2d)


PAIR_MODES = (("never", False), ("auto", False), ("auto", True), ("always", False))


def pair_modes(case, args, s, s2, peer, peer2d):
    """Both directions at once in the background under each staging mode, in this process: a
    mover per mode over the same tensors (warmed as the case's: its timing moves settled on the
    caller's thread, its staging rings made), the pair issued offload first, and under "auto"
    also load first (the first takes the staging turn, the other goes unstaged). A round is one
    pair of every mode, in an order shuffled per round; checked as both-bg is. Returns
    {(mode, load_first): (median, min, max)}."""
    kept, movers = case.mover, {}
    gbs = {key: [] for key in PAIR_MODES}
    try:
        for key in PAIR_MODES:
            case.mover = movers[key] = pinstage.BlockMover(
                case.devs, case.hosts, block_dim=0, staging=key[0],
                staging_chunk=args.chunk_mib << 20)
            for direction in ("offload", "load"):
                for _ in range(6):
                    one_call(case, "pinstage", direction, s, peer, [], [], peer2d)
                for _ in range(2):
                    one_call(case, "pinstage-bg", direction, s, peer, [], [], peer2d)
        shuffle = random.Random(case.B + 1)
        for _ in range(args.rounds):
            order = list(PAIR_MODES)
            shuffle.shuffle(order)
            for key in order:
                case.mover = movers[key]
                gbs[key] += both_at_once(case, s, s2, 1, background=True, load_first=key[1])
    finally:
        case.mover = kept
    out = {key: med(v) for key, v in gbs.items()}
    for (mode, load_first), (g, lo, hi) in out.items():
        first = "load first" if load_first else "offload first"
        print(f"  both-bg, staging {mode:6s} {first:13s} {g:6.2f} GB/s ({lo:.2f}-{hi:.2f})",
              flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="4,16,32,64,256")
    ap.add_argument("--loop-rounds", type=int, default=3)
    ap.add_argument("--graph-kib", type=int, default=32, help="block size of the graph test")
    ap.add_argument("--only-graph", action="store_true",
                    help="only the graph test (at --graph-kib blocks)")
    ap.add_argument("--only-background", action="store_true",
                    help="only pinstage-bg, the 2D peer and one contiguous copy, and both "
                         "directions at once in the background (A/B runs of lab builds)")
    ap.add_argument("--staging", choices=["auto", "always", "never"], default="auto",
                    help="the mover's staging (background moves; A/B runs)")
    ap.add_argument("--chunk-mib", type=int, default=16, help="the mover's staging chunk")
    ap.add_argument("--pair-modes", action="store_true",
                    help="also both directions at once in the background under every staging "
                         "mode, in this process (a mover per mode; under auto either first)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.cuda.init()
    sizes = [int(x) << 10 for x in args.sizes.split(",")]
    if args.only_graph:
        sizes = [args.graph_kib << 10]
    print(f"pinstage {pinstage.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}; staging {args.staging}, chunks of "
          f"{args.chunk_mib} MiB", flush=True)
    t_alloc = time.perf_counter()
    n = CAP // 4
    pool = {
        "dev": torch.empty(n, dtype=torch.int32, device="cuda"),
        "hdev": torch.empty(n, dtype=torch.int32, device="cuda"),
        "rand": torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda"),
        "host": torch.empty(n, dtype=torch.int32, pin_memory=True),
        "gdev": torch.empty(n // 4, dtype=torch.int32, device="cuda"),
        "stage": torch.empty(n // 4, dtype=torch.int32, pin_memory=True),
    }
    print(f"allocated in {time.perf_counter() - t_alloc:.1f} s", flush=True)
    peer = BatchPeer()
    peer2d = TwoDPeer()
    s, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    variants = ["pinstage", "pinstage-bg", "batch-peer", "2d-peer", "copy-loop", "sm-gather",
                "contiguous", "control"]
    if args.only_background:
        variants = ["pinstage-bg", "2d-peer", "contiguous"]
    results = {}
    for B in sizes:
        case = Case(pool, B, args.staging, args.chunk_mib << 20)
        print(f"\n== {B >> 10} KiB blocks: {L} tensors x {case.NB} blocks, {case.M} moved per "
              f"tensor ({case.bytes / 2**30:.2f} GiB a call)", flush=True)
        if not args.only_graph:
            timed_calls(case, args, variants, s, s2, peer, peer2d, results)
        if B == args.graph_kib << 10:
            print(f"  graph test at {B >> 10} KiB blocks", flush=True)
            results["graph"] = graph_beside(case, s, args.rounds, peer2d)
        del case
        torch.cuda.synchronize()

    if args.only_background:
        print("\n== summary, background only (GB/s medians, min-max)")
        for B in sizes:
            for direction in ("offload", "load"):
                r = results[(B, direction)]
                (pb, lo, hi), td, c = r["pinstage-bg"][0], r["2d-peer"][0][0], r["contiguous"][0][0]
                bgs = results[(B, direction, "bg-strategy")]
                print(f"{B >> 10:>4} KiB {direction:8} background ({bgs}) {pb:6.2f} ({lo:.2f}-{hi:.2f})"
                      f" = {pb / td:.2f}x 2d, {pb / c:.2f}x contig")
            both, alone = results[(B, "both-bg")][0], max(
                results[(B, d)]["pinstage-bg"][0][0] for d in ("offload", "load"))
            print(f"{B >> 10:>4} KiB both-bg  {both:6.2f} = {both / alone:.2f}x the faster alone")
            for (mode, lf), (g, lo, hi) in results.get((B, "pair-modes"), {}).items():
                print(f"{B >> 10:>4} KiB both-bg  staging {mode:6s} "
                      f"{'load first   ' if lf else 'offload first'} {g:6.2f} ({lo:.2f}-{hi:.2f}) = "
                      f"{g / alone:.2f}x the faster alone, {g / both:.2f}x the mover's both-bg")
        print(f"checks: {'all passed' if not failures else f'{len(failures)} FAILED'}")
        return 1 if failures else 0
    print("\n== summary (GB/s medians; ratio = pinstage / peer)")
    print(f"{'block':>7} {'dir':8} {'strategy':8} {'pinstage':>9} {'batch':>7} {'x batch':>8} "
          f"{'2d':>7} {'x 2d':>7} {'contig':>7} "
          f"{'x contig':>9} {'loop':>6} {'sm':>6} {'host us':>8} {'us/id':>6}")
    summary = []
    for B in sizes:
        if (B, "offload") not in results:
            continue
        for direction in ("offload", "load"):
            r = results[(B, direction)]
            p, bp, c = r["pinstage"][0][0], r["batch-peer"][0][0], r["contiguous"][0][0]
            td = r["2d-peer"][0][0]
            h = r["pinstage"][1][0]
            M = min(8192, CAP // (L * B)) // 4
            strategy = results[(B, direction, "strategy")]
            row = (f"{B >> 10:>4} KiB {direction:8} {strategy:8} {p:9.2f} {bp:7.2f} "
                   f"{p / bp:7.2f}x {td:7.2f} {p / td:6.2f}x {c:7.2f} "
                   f"{p / c:8.2f}x {r['copy-loop'][0][0]:6.2f} {r['sm-gather'][0][0]:6.2f} "
                   f"{h:8.1f} {h / M:6.3f}")
            print(row)
            summary.append(row)
            hb, pb = r["pinstage-bg"][1][0], r["pinstage-bg"][0][0]
            hc = r["control"][1][0]
            goal = 2 + 0.05 * M
            bgs = results[(B, direction, "bg-strategy")]
            row = (f"{B >> 10:>4} KiB {direction:8} background ({bgs}) {pb:6.2f} GB/s ({pb / p:.2f}x "
                   f"the caller's, {pb / bp:.2f}x batch, {pb / td:.2f}x 2d, {pb / c:.2f}x contig); "
                   f"host time per call for {M} ids: background {hb:.1f} us, caller "
                   f"{h:.1f} us; goal <= 2 + 0.05 x {M} = {goal:.1f} us: background "
                   f"{'MET' if hb <= goal else 'MISSED'}, caller {'MET' if h <= goal else 'MISSED'}"
                   f"; control: one torch Event.record(s) in the same state {hc:.1f} us")
            print(row)
            summary.append(row)
        for key, v in (("both", "pinstage"), ("both-bg", "pinstage-bg")):
            both = results[(B, key)][0]
            alone = max(results[(B, "offload")][v][0][0], results[(B, "load")][v][0][0])
            row = (f"{B >> 10:>4} KiB {key:8} {both:9.2f}   = {both / alone:.2f}x the faster "
                   f"direction alone ({v})")
            print(row)
            summary.append(row)
        cb = results[(B, "contig-both")][0]
        calone = max(results[(B, "offload")]["contiguous"][0][0],
                     results[(B, "load")]["contiguous"][0][0])
        row = (f"{B >> 10:>4} KiB contig-both {cb:6.2f}   = {cb / calone:.2f}x one contiguous copy "
               f"alone (control: the most both at once can reach over the faster alone)")
        print(row)
        summary.append(row)
    if "graph" in results:
        g = results["graph"]
        for peer_name in ("pinstage", "pinstage-bg", "2d-peer", "sm-gather", "contiguous",
                          "none"):
            rs = g["ratios"].get(peer_name, [])
            if rs:
                pct = sorted((r - 1) * 100 for r in rs)
                ins = statistics.median(i for i, _ in g["replays"][peer_name])
                what = {"pinstage": "beside pinstage's offloads",
                        "pinstage-bg": "beside pinstage's offloads in the background",
                        "2d-peer": "beside the 2D peer's offloads",
                        "sm-gather": "beside the sm-gather peer",
                        "contiguous": "beside one contiguous copy of the same bytes",
                        "none": "null control (windows with no move)"}[peer_name]
                row = (f"graph {g['graph_ms']:.3f} ms, windows {g['window_ms']:.1f} ms: {what}: "
                       f"{statistics.median(pct):+.2f}% ({pct[0]:+.2f}..{pct[-1]:+.2f}%, "
                       f"{len(pct)} moves, {ins:.0f} replays inside each) against the quiet "
                       f"windows on both sides")
                if peer_name in ("pinstage", "pinstage-bg"):
                    row += (f"; goal <= +1%: "
                            f"{'MET' if statistics.median(pct) <= 1.0 else 'MISSED'}")
            else:
                row = f"graph beside {peer_name}: no replay fell inside a move"
            print(row)
            summary.append(row)
        if g["short"]:
            fail(f"graph: {g['short']} sequences ended before the last quiet window")
    print(f"checks: {'all passed' if not failures else f'{len(failures)} FAILED'}")
    if args.out:
        with open(os.path.join(args.out, "bench_blocks.json"), "w") as f:
            json.dump({"summary": summary, "failures": failures,
                       "results": {str(k): v for k, v in results.items()}}, f, indent=1,
                      default=str)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
