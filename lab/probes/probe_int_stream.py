"""Where to_device(stream=<int handle>) spends its time with the stream busy (lab probe)."""
import time

import numpy as np
import torch

import pinstage

n = 1 << 18
src = pinstage.empty_pinned(n, "float32")
src[:] = 1
dst = torch.empty(n, device="cuda")


def busy(s):
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(1_000_000_000)


for label, arg in (("object", lambda s: s), ("int", lambda s: s.cuda_stream)):
    for what, fn in (
        ("copy_h2d", lambda a: pinstage.copy_h2d(dst, src, stream=a)),
        ("to_device", lambda a: pinstage.to_device(src, "torch", stream=a)),
        ("ExternalStream", lambda a: torch.cuda.ExternalStream(a) if isinstance(a, int) else a),
        ("dst.__dlpack__", lambda a: dst.__dlpack__(stream=a if isinstance(a, int) else a.cuda_stream)),
    ):
        s = torch.cuda.Stream()
        busy(s)
        t0 = time.perf_counter()
        fn(arg(s))
        dt = time.perf_counter() - t0
        ev = torch.cuda.Event()
        ev.record(s)
        print(f"{label:7} {what:16} {dt * 1e3:9.3f} ms   s still busy after: {not ev.query()}")
        torch.cuda.synchronize()
