"""Does cuMemcpyBatchAsync block the calling thread while its stream is busy, and does the source
access order decide it? Pinned (cuMemHostAlloc) sources of 4 spans, host µs per call behind
~200 ms of queued work (torch.cuda._sleep) and with the stream idle: the batch with
srcAccessOrder STREAM and ANY, and four cuMemcpyHtoDAsync. Every copy's bytes checked."""

import ctypes
import time

import numpy as np
import torch
from cuda.bindings import driver as cu


def ok(r):
    err = r[0] if isinstance(r, tuple) else r
    assert err == cu.CUresult.CUDA_SUCCESS, err
    return r[1] if isinstance(r, tuple) and len(r) == 2 else r


torch.cuda.init()
s = torch.cuda.Stream()
hs = cu.CUstream(s.cuda_stream)
SPANS, N = 4, 16 << 10
host = ok(cu.cuMemHostAlloc(SPANS * N, 0))
harr = np.ctypeslib.as_array((ctypes.c_uint8 * (SPANS * N)).from_address(int(host)))
dev = torch.empty(SPANS * N * 2, dtype=torch.uint8, device="cuda")


def batch(order):
    a = cu.CUmemcpyAttributes()
    a.srcAccessOrder = order
    dsts = [cu.CUdeviceptr(dev.data_ptr() + 2 * i * N) for i in range(SPANS)]
    srcs = [cu.CUdeviceptr(int(host) + i * N) for i in range(SPANS)]
    return lambda: ok(cu.cuMemcpyBatchAsync(dsts, srcs, [N] * SPANS, SPANS, [a], [0], 1, hs))


def singles():
    for i in range(SPANS):
        ok(cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(dev.data_ptr() + 2 * i * N), int(host) + i * N, N, hs))


O = cu.CUmemcpySrcAccessOrder
variants = {"batch STREAM": batch(O.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM),
            "batch ANY": batch(O.CU_MEMCPY_SRC_ACCESS_ORDER_ANY),
            "4 x cuMemcpyHtoDAsync": singles}
bad = 0
for k, (name, fn) in enumerate(variants.items()):
    for busy in (False, True):
        harr[:] = (k * 2 + busy + 1) * 7 % 251 + 1
        dev.fill_(0xA5)
        torch.cuda.synchronize()
        if busy:
            with torch.cuda.stream(s):
                torch.cuda._sleep(400_000_000)
        t0 = time.perf_counter()
        fn()
        t = (time.perf_counter() - t0) * 1e6
        s.synchronize()
        got = dev.view(SPANS, 2 * N)[:, :N].cpu().numpy().reshape(-1)
        good = bool((got == harr).all())
        bad += not good
        print(f"{name:24s} stream {'busy' if busy else 'idle'}: {t:12.1f} µs  {'ok' if good else 'WRONG'}")
raise SystemExit(1 if bad else 0)
