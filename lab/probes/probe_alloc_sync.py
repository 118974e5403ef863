"""Does torch's allocation wait for a busy legacy default stream? (Why the to_device allocator
test found its fill stream drained: run 2026-12-02 g.)

The legacy default stream is kept busy (~0.5 s of `torch.cuda._sleep`); then, on a torch stream
created for the purpose (its own free-block cache, empty), `torch.empty` of 1 MiB is timed:
once with the cache empty (torch asks the driver for a new segment), once after the same size was
allocated and freed on that stream (served from the cache). A device allocation is one of
CUDA's implicit synchronization points, so the first is expected to wait for the sleep.

    python3 lab/probes/probe_alloc_sync.py
"""

import time

import torch

n = 1 << 18
for warm in (False, True):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    s = torch.cuda.Stream()
    if warm:
        with torch.cuda.stream(s):
            t = torch.empty(n, dtype=torch.float32, device="cuda")
            del t
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.default_stream()):
        torch.cuda._sleep(1_000_000_000)
    busy = torch.cuda.Event()
    busy.record(torch.cuda.default_stream())
    with torch.cuda.stream(s):
        t0 = time.perf_counter()
        x = torch.empty(n, dtype=torch.float32, device="cuda")
        ms = (time.perf_counter() - t0) * 1e3
    still_busy = not busy.query()
    torch.cuda.synchronize()
    x.fill_(3.0)
    assert float(x.sum()) == 3.0 * n
    print(f"torch.empty(1 MiB) on a new stream, cache {'warm' if warm else 'empty'}: {ms:8.3f} ms; "
          f"the legacy default stream still busy after it: {still_busy}")
