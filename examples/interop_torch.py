"""PyTorch: a bound target with padding and mirror, copy_ on a side stream, copy_d2h and async D2H.

python examples/interop_torch.py
"""

import numpy as np
import torch

import pinstage

assert torch.cuda.is_available(), "this example needs a CUDA GPU"
slots = torch.full((4096,), -1, dtype=torch.int32, device="cuda")
stager = pinstage.PinnedStager(torch.int32, numel=256, depth=8)

# Bound target: imported once; with skip_unchanged=True its own mirror skips copies of values
# it last copied (sound only while the target is the only writer of slots).
target = stager.target(slots, pad_value=0, skip_unchanged=True)
plan = np.arange(1, 257, dtype=np.int32)
assert target.copy_(plan)  # one non-blocking H2D copy: values + padding
assert not target.copy_(plan)  # same values: skipped by the mirror

# Unbound copy on a side stream; stream=None would mean torch's current stream.
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    stager.copy_(slots, [5, 6, 7], pad_value=-2)  # torch's current stream is `side`
    slots.add_(1)  # ordered after our copy on the same stream
side.synchronize()
print("slots[:5] =", slots[:5].tolist())

# D2H: result in pinned memory, no manual sync needed.
logits = torch.randn(64, 32000, device="cuda")
host = pinstage.copy_d2h(logits)
assert np.array_equal(host, logits.cpu().numpy())
pending = pinstage.copy_d2h_async(logits * 2)
print("async done yet?", pending.done())
print("async result ok:", np.array_equal(pending.wait(), (logits * 2).cpu().numpy()))
print("stager stats:", stager.stats())
print("pool:", pinstage.pool_stats())
