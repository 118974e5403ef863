"""The block probes' pool: 64 tensors (32 layers x K/V) of 8192 blocks of 4 KiB (int32) on each
side, each side one allocation (per-layer views, as engines allocate a pool), a `BlockMover` over
them and a torch side stream. Importing it allocates 2 GiB on the GPU and 2 GiB pinned.

    from kvpool import L, NB, B, mover, stream
"""

import numpy as np
import torch

import pinstage

L, NB, B = 64, 8192, 4096
_dev = torch.zeros((L, NB, B // 4), dtype=torch.int32, device="cuda")
_host = pinstage.empty_host((L, NB, B // 4), np.int32)
mover = pinstage.BlockMover([_dev[i] for i in range(L)], [_host[i] for i in range(L)], block_dim=0)
stream = torch.cuda.Stream()
