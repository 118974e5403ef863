"""A framework-agnostic sampler loop: batches are made on the GPU by whichever framework is
present (torch, cupy or jax) and pulled off with double-buffered copy_d2h_async while the next
batch computes. Prints samples/s against np.asarray-style pulls. Falls back to numpy batches
without a GPU.

python examples/sampler.py [--steps 50] [--batch 65536] [--width 1024]
"""

import argparse
import time

import numpy as np

import pinstage


def make_backend(width, batch):
    try:
        import torch

        if torch.cuda.is_available():
            w = torch.randn(width, width, device="cuda")
            x0 = torch.randn(batch, width, device="cuda")
            return "torch", (lambda s: torch.tanh(x0 @ w + s)), (lambda t: t.cpu().numpy()), torch.cuda.synchronize
    except ImportError:
        pass
    try:
        import cupy as cp

        w = cp.random.standard_normal((width, width), dtype=cp.float32)
        x0 = cp.random.standard_normal((batch, width), dtype=cp.float32)
        return "cupy", (lambda s: cp.tanh(x0 @ w + s)), (lambda t: t.get()), cp.cuda.runtime.deviceSynchronize
    except Exception:  # noqa: BLE001
        pass
    try:
        import jax
        import jax.numpy as jnp

        if jax.devices()[0].platform == "gpu":
            w = jax.random.normal(jax.random.PRNGKey(0), (width, width))
            x0 = jax.random.normal(jax.random.PRNGKey(1), (batch, width))
            f = jax.jit(lambda s: jnp.tanh(x0 @ w + s))
            return "jax", f, np.asarray, lambda: None
    except Exception:  # noqa: BLE001
        pass
    rng = np.random.default_rng(0)
    w = rng.standard_normal((width, width), dtype=np.float32)
    x0 = rng.standard_normal((batch, width), dtype=np.float32)
    return "numpy (no GPU)", (lambda s: np.tanh(x0 @ w + s)), np.array, lambda: None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--width", type=int, default=1024)
    a = ap.parse_args()
    name, step, peer_pull, sync = make_backend(a.width, a.batch)
    print(f"backend: {name}, batch {a.batch} x {a.width} float32 ({a.batch * a.width * 4 / 2**20:.0f} MiB)")

    # Peer: compute, then pull with the framework's own host copy.
    sync()
    t0 = time.perf_counter()
    for s in range(a.steps):
        host = peer_pull(step(float(s)))
    peer = a.steps * a.batch / (time.perf_counter() - t0)
    ref = host

    # pinstage: pull batch N asynchronously while batch N+1 computes (double-buffered).
    sync()
    t0 = time.perf_counter()
    pending = None
    for s in range(a.steps):
        batch = step(float(s))
        nxt = pinstage.copy_d2h_async(batch)
        if pending is not None:
            host = pending.wait()
        pending = nxt
    host = pending.wait()
    ours = a.steps * a.batch / (time.perf_counter() - t0)
    assert np.allclose(host, ref, atol=1e-5), "pinstage and the peer disagree"
    print(f"samples/s: pinstage {ours:,.0f} vs framework pull {peer:,.0f} ({ours / peer:.2f}x); last batch checked")


if __name__ == "__main__":
    main()
