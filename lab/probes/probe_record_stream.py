"""Whether a torch result of to_device(stream=s), freed while its fill waits on s, has its block
handed to the next allocation (the caching allocator must know the tensor was used on s).
Prints, for pinstage and for torch's own idiom (record_stream + copy_ on s), whether the block
was reused while s was still busy. Lab probe (run on a GPU)."""

import numpy as np
import torch

import pinstage

n = 1 << 18
src = pinstage.empty_pinned(n, "float32")
src[:] = np.arange(n, dtype=np.float32)
s = torch.cuda.Stream()


def trial(name, make):
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)
    x = make()
    ev = torch.cuda.Event()
    ev.record(s)
    freed = x.data_ptr()
    del x
    y = torch.empty(n, dtype=torch.float32, device="cuda")
    pending = not ev.query()
    print(f"{name:44} reused={y.data_ptr() == freed} s still busy={pending}")
    torch.cuda.synchronize()


def torch_idiom(record):
    x = torch.empty(n, dtype=torch.float32, device="cuda")
    if record:
        x.record_stream(s)
    with torch.cuda.stream(s):
        x.copy_(torch.from_numpy(src), non_blocking=True)
    return x


trial("torch copy_ on s, no record_stream", lambda: torch_idiom(False))
trial("torch copy_ on s, record_stream", lambda: torch_idiom(True))
trial("pinstage to_device(stream=s)", lambda: pinstage.to_device(src, "torch", stream=s))
trial("pinstage to_device(stream=int)", lambda: pinstage.to_device(src, "torch", stream=s.cuda_stream))
