"""JAX: copy_d2h of jax arrays (about 30x np.asarray on an H200), async D2H, bfloat16 results.

JAX arrays are immutable, so they are sources here; stage H2D into torch or cupy buffers.
python examples/interop_jax.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import pinstage

x = jnp.arange(1 << 22, dtype=jnp.float32) * 0.5
out = pinstage.copy_d2h(x)  # pinned, writable, x's shape and dtype
assert np.array_equal(out, np.asarray(x))
p = pinstage.copy_d2h_async(x + 1)
print("async:", np.array_equal(p.wait(), np.asarray(x + 1)))
b = pinstage.copy_d2h(x.astype(jnp.bfloat16))  # needs ml_dtypes
print("bfloat16 result dtype:", b.dtype)

# A stager serves host destinations too (and CUDA ones from torch/cupy).
st = pinstage.PinnedStager(jnp.int32, 256, 8)
host = np.zeros(16, np.int32)
st.copy_(host, [1, 2, 3], pad_value=-1)
print("host destination:", host.tolist())
