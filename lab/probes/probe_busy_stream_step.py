"""Does a step commit block while its stream is busy? Host µs of StepStager.stage behind ~200 ms
of queued GPU work (torch.cuda._sleep), for one span and for several spans (cuMemcpyBatchAsync
with batch=True, separate copies with batch=False), arena and fresh mode; and the same with the
stream idle. Every step's values are checked after the stream drained (arena: the last; fresh:
each block)."""

import time

import numpy as np
import torch

import pinstage

LAYOUTS = {
    "one span": {"a": ("int32", 1024)},
    "spans": {"ids": ("int32", 1024), "pos": ("int64", 1024), "lens": ("int32", 64), "table": ("int32", (64, 32))},
}


def values(name, k):
    if name == "one span":
        return {"a": np.arange(100, dtype=np.int32) + k * 1000 + 1}
    return {
        "ids": np.arange(100, dtype=np.int32) + k * 1000 + 1,
        "pos": np.arange(100, dtype=np.int64) + k * 1000 + 2,
        "lens": np.arange(16, dtype=np.int32) + k + 3,
        "table": np.full((8, 32), k + 4, np.int32),
    }


s = torch.cuda.Stream()
bad = 0
for lname, fields in LAYOUTS.items():
    layout = pinstage.StepLayout(fields)
    for mode in ("arena", "fresh"):
        for batch in (True, False):
            st = pinstage.StepStager(layout, depth=8, mode=mode, batch=batch)
            for k in range(20):  # warm
                st.stage(values(lname, k), stream=s)
            s.synchronize()
            for busy in (False, True):
                if busy:
                    with torch.cuda.stream(s):
                        torch.cuda._sleep(400_000_000)  # ~200 ms
                times, blocks = [], []
                for k in range(4):
                    t0 = time.perf_counter()
                    b = st.stage(values(lname, 100 + k), stream=s)
                    times.append((time.perf_counter() - t0) * 1e6)
                    blocks.append(b)
                s.synchronize()
                if mode == "fresh":
                    for k, b in enumerate(blocks):
                        f = layout.unpack(pinstage.copy_d2h(b))
                        for n, v in values(lname, 100 + k).items():
                            if not np.array_equal(f[n][: len(v)], v):
                                bad += 1
                else:
                    for n, v in values(lname, 103).items():
                        if not np.array_equal(st.read_field(n)[: len(v)], v):
                            bad += 1
                print(f"{lname:8s} {mode:5s} batch={batch!s:5s} stream {'busy' if busy else 'idle'}: "
                      f"stage µs {' '.join(f'{t:9.1f}' for t in times)}  stats {dict((k2, st.stats()[k2]) for k2 in ('copies', 'batches', 'waits'))}")
print("wrong values:", bad)
raise SystemExit(1 if bad else 0)
