"""CuPy: bound target with padding and mirror on a cupy stream, copy_d2h and async D2H.

python examples/interop_cupy.py
"""

import cupy as cp
import numpy as np

import pinstage

dst = cp.full(4096, -1, dtype=cp.int64)
stager = pinstage.PinnedStager(cp.int64, numel=256, depth=8)
stream = cp.cuda.Stream(non_blocking=True)
target = stager.target(dst, pad_value=0, skip_unchanged=True)
vals = np.arange(100, dtype=np.int64)
target.copy_(vals, stream=stream)  # a cupy stream object is accepted as is
assert not target.copy_(vals, stream=stream)  # mirror: already there
stager.copy_(dst, [7, 8], stream=stream.ptr)  # or a raw handle; no pad: only 2 elements change
stream.synchronize()
got = cp.asnumpy(dst)
assert got[:2].tolist() == [7, 8] and (got[2:100] == vals[2:]).all() and (got[100:] == 0).all()
print("dst[:4] =", got[:4].tolist())
out = pinstage.copy_d2h(dst, stream=stream)
assert np.array_equal(out, got)
p = pinstage.copy_d2h_async(cp.arange(1 << 20, dtype=cp.float32))
print("async ok:", np.array_equal(p.wait(), np.arange(1 << 20, dtype=np.float32)))
