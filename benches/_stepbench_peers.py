"""The peers of benches/bench_step.py: a pinned ring driven from Python by torch or by
cuda.bindings, doing a StepStager step's work the way each is best used."""

import ctypes

import numpy as np


def cu_ok(res):
    if res[0]:
        raise RuntimeError(f"cuda.bindings: {res[0]!r}")
    return res[1] if len(res) == 2 else None


class Ring:
    """A ring of `depth` pinned uint8 slots laid out as the StepLayout `L` (its fields'
    offsets); `spec` is {name: (dtype, used shape)}. Each step (`call(values)`): wait for the
    slot's event, write the values through numpy views, ONE copy of the used extent (the bytes
    from the first used byte to the last) into `dev` (six=True: one copy per field's used rows,
    the old peer), record the slot's event on `stream`.
    kind "torch": pinned torch tensors, copy_(non_blocking=True) on the current stream (the
    caller sets `stream` current once, as an engine does), torch.cuda.Event.
    kind "cuda": cuda.bindings.driver: cuMemHostAlloc slots, cuMemcpyHtoDAsync, cuEventRecord,
    cuEventSynchronize; the destination is a torch device buffer (what a graph would read)."""

    def __init__(self, torch, L, spec, depth, stream, kind="torch", six=False):
        off = {f["name"]: f["offset"] for f in L.fields}
        nb = {n: int(np.dtype(dt).itemsize * np.prod(shape)) for n, (dt, shape) in spec.items()}
        lo, hi = min(off[n] for n in spec), max(off[n] + nb[n] for n in spec)
        spans = [(off[n], off[n] + nb[n]) for n in spec] if six else [(lo, hi)]
        self.dev = torch.empty(L.nbytes, dtype=torch.uint8, device="cuda")
        self.depth, self.k, self.stream, self.bps = depth, 0, stream, sum(b - a for a, b in spans)
        if kind == "cuda":
            if six:
                raise ValueError("the cuda.bindings ring is the packed one")
            from cuda.bindings import driver as cu

            cu_ok(cu.cuInit(0))
            ctx = cu_ok(cu.cuDevicePrimaryCtxRetain(cu_ok(cu.cuDeviceGet(torch.cuda.current_device()))))
            cu_ok(cu.cuCtxSetCurrent(ctx))  # torch's context is the primary one
            ptrs = [cu_ok(cu.cuMemHostAlloc(hi, 0)) for _ in range(depth)]
            hosts = [np.ctypeslib.as_array((ctypes.c_ubyte * hi).from_address(p)) for p in ptrs]
            self.events = [cu_ok(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)) for _ in range(depth)]
            self.src, self.n = [p + lo for p in ptrs], hi - lo
            self.dst, self.hs = cu.CUdeviceptr(self.dev.data_ptr() + lo), cu.CUstream(stream.cuda_stream)
            self.memcpy, self.rec, self.sync = cu.cuMemcpyHtoDAsync, cu.cuEventRecord, cu.cuEventSynchronize
            self.call = self.call_cuda
        else:
            pinned = [torch.empty(hi, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
            hosts = [h.numpy() for h in pinned]
            self.pairs = [[(self.dev[a:b], h[a:b]) for a, b in spans] for h in pinned]
            self.events = [torch.cuda.Event() for _ in range(depth)]
            self.call = self.call_torch
        self.views = [{n: a[off[n]: off[n] + nb[n]].view(spec[n][0]).reshape(spec[n][1]) for n in spec} for a in hosts]

    def call_torch(self, v):
        k = self.k
        self.k = (k + 1) % self.depth
        ev = self.events[k]
        ev.synchronize()  # the slot's last copy has read it (a no-op before its first record)
        views = self.views[k]
        for n, x in v.items():
            views[n][...] = x
        for d, h in self.pairs[k]:
            d.copy_(h, non_blocking=True)
        ev.record(self.stream)

    def call_cuda(self, v):
        k = self.k
        self.k = (k + 1) % self.depth
        ev = self.events[k]
        if self.sync(ev)[0]:
            raise RuntimeError("cuEventSynchronize failed")
        views = self.views[k]
        for n, x in v.items():
            views[n][...] = x
        if self.memcpy(self.dst, self.src[k], self.n, self.hs)[0] or self.rec(ev, self.hs)[0]:
            raise RuntimeError("cuMemcpyHtoDAsync or cuEventRecord failed")
