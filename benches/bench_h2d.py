"""Host-to-device of whole arrays, side by side in one run: `copy_h2d` (pageable and pinned
sources) against torch and cupy, and `to_device` (fresh torch, JAX and cupy arrays) against
`torch.as_tensor(x, device="cuda")`, `jax.device_put(x)` and `cupy.asarray(x)`.

Discipline, the same for pinstage and every peer: each timed call starts with the GPU idle
(synchronised), its destination poisoned first (copies: `fill_`; fresh arrays: an array of the
same size full of poison made and dropped just before, so the allocator hands that memory to the
timed call), and ends with a synchronisation (`torch.cuda.synchronize()`,
`block_until_ready()`, the cupy device's `synchronize()`); every timed result is checked against
the source on the device after the timing. Median of `reps` timed calls. GB/s = bytes / time.

Usage: python3 benches/bench_h2d.py [--out DIR] [--quick]
"""

import argparse
import gc
import json
import statistics
import time

import numpy as np

import h2d_timing
import pinstage

GB = 1e9
POISON = -7
RESULTS = {"copy": {}, "to_device": {}, "pinned small": {}, "ratios": []}


def median_gbs(nbytes, ts):
    return nbytes / statistics.median(ts) / GB


def timed_into(torch, name, nb, fn, dst, ref, reps):
    """Seconds per call of `fn`, `reps` calls, each into `dst` poisoned first, synchronised
    before and after, and checked against `ref` after the timing."""
    return h2d_timing.timed_into(torch, fn, dst, ref, reps, what=f"{name} at {nb} bytes", poison=POISON)


def bench_copy(torch, cp, sizes, reps):
    print("== copy into an existing tensor, GB/s")
    for nb in sizes:
        n = nb // 4
        vals = np.random.default_rng(nb).integers(-(2**31), 2**31 - 1, n, dtype=np.int32)
        ref = torch.from_numpy(vals).cuda()
        dst = torch.empty(n, dtype=torch.int32, device="cuda")
        tpin = torch.from_numpy(vals).pin_memory()
        tpage = torch.from_numpy(vals)
        pin = pinstage.empty_pinned(n, np.int32)
        pin[:] = vals
        impls = {
            "pinstage copy_h2d from pageable": lambda: pinstage.copy_h2d(dst, vals),
            "pinstage copy_h2d from pinned": lambda: pinstage.copy_h2d(dst, pin),
            "torch copy_ from pinned": lambda: dst.copy_(tpin, non_blocking=True),
            "torch copy_ from pageable": lambda: dst.copy_(tpage),
        }
        if cp is not None:
            cdst = cp.from_dlpack(dst)
            impls["cupy set from pageable"] = lambda: cdst.set(vals)
        row = {}
        for name, fn in impls.items():
            fn()
            row[name] = median_gbs(nb, timed_into(torch, name, nb, fn, dst, ref, reps))
        RESULTS["copy"][nb] = row
        print(f"  {nb:>13,d} B: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
        del tpin, pin, ref, dst


def bench_to_device(torch, jax, cp, sizes, reps):
    print("== a fresh device array from a pageable numpy array, GB/s")
    jnp = jax.numpy if jax else None
    for nb in sizes:
        n = nb // 4
        vals = np.random.default_rng(nb + 1).integers(-(2**31), 2**31 - 1, n, dtype=np.int32)
        poison = np.full(n, POISON, np.int32)
        ref_t = torch.from_numpy(vals).cuda()
        impls = {
            "pinstage to_device torch": (
                lambda: pinstage.to_device(vals, "torch"),
                lambda: torch.full((n,), POISON, dtype=torch.int32, device="cuda"),
                lambda out: torch.cuda.synchronize(),
                lambda out: torch.equal(out, ref_t),
            ),
            "torch.as_tensor(cuda)": (
                lambda: torch.as_tensor(vals, device="cuda"),
                lambda: torch.full((n,), POISON, dtype=torch.int32, device="cuda"),
                lambda out: torch.cuda.synchronize(),
                lambda out: torch.equal(out, ref_t),
            ),
        }
        if jax is not None:
            ref_j = jax.device_put(vals)
            impls["pinstage to_device jax"] = (
                lambda: pinstage.to_device(vals, "jax"),
                lambda: pinstage.to_device(poison, "jax"),
                lambda out: out.block_until_ready(),
                lambda out: bool((out == ref_j).all()),
            )
            impls["jax.device_put"] = (
                lambda: jax.device_put(vals),
                lambda: jnp.full((n,), POISON, dtype=jnp.int32).block_until_ready(),
                lambda out: out.block_until_ready(),
                lambda out: bool((out == ref_j).all()),
            )
        if cp is not None:
            ref_c = cp.asarray(vals)
            impls["pinstage to_device cupy"] = (
                lambda: pinstage.to_device(vals, "cupy"),
                lambda: cp.full(n, POISON, dtype=cp.int32),
                lambda out: cp.cuda.Device().synchronize(),
                lambda out: bool((out == ref_c).all()),
            )
            impls["cupy.asarray"] = (
                lambda: cp.asarray(vals),
                lambda: cp.full(n, POISON, dtype=cp.int32),
                lambda out: cp.cuda.Device().synchronize(),
                lambda out: bool((out == ref_c).all()),
            )
        row = {}
        for name, (fn, poison_fn, sync, ok) in impls.items():
            out = fn()
            sync(out)
            del out
            ts = []
            for _ in range(reps):
                p = poison_fn()
                del p  # the allocator hands this poisoned memory to the timed call
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = fn()
                sync(out)
                ts.append(time.perf_counter() - t0)
                if not ok(out):
                    raise AssertionError(f"{name} at {nb} bytes: wrong result")
                del out
            row[name] = median_gbs(nb, ts)
            gc.collect()
        RESULTS["to_device"][nb] = row
        print(f"  {nb:>13,d} B: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)


def bench_pinned_small(torch, reps=300):
    """One copy from pinned memory and its synchronisation at a time: pinstage's fixed cost per
    call against torch's."""
    print("== from pinned memory, one copy + synchronize at a time: GB/s (us per call)")
    for nb in (4 << 10, 64 << 10, 1 << 20):
        n = nb // 4
        vals = np.random.default_rng(nb + 2).integers(1, 1 << 30, n, dtype=np.int32)
        ref = torch.from_numpy(vals).cuda()
        dst = torch.empty(n, dtype=torch.int32, device="cuda")
        pin = pinstage.empty_pinned(n, np.int32)
        pin[:] = vals
        tpin = torch.from_numpy(vals).pin_memory()
        row = {}
        for name, fn in (
            ("pinstage copy_h2d from pinned", lambda: pinstage.copy_h2d(dst, pin)),
            ("torch copy_ from pinned", lambda: dst.copy_(tpin, non_blocking=True)),
        ):
            row[name] = statistics.median(timed_into(torch, name, nb, fn, dst, ref, reps)) * 1e6
        RESULTS["pinned small"][nb] = row
        a, b = row["pinstage copy_h2d from pinned"], row["torch copy_ from pinned"]
        print(f"  {nb >> 10:>5} KiB: copy_h2d {a:.1f} us ({nb / a / 1e3:.2f} GB/s), torch {b:.1f} us "
              f"({nb / b / 1e3:.2f} GB/s); pinstage / torch speed {b / a:.3f}", flush=True)


def ratios():
    out = RESULTS["ratios"]
    for nb, r in RESULTS["copy"].items():
        pp, tp = r["pinstage copy_h2d from pageable"], r["torch copy_ from pinned"]
        out.append(
            f"copy {nb >> 20} MiB: copy_h2d from pageable / torch from pinned {pp / tp:.3f} (goal >= 0.85 at 64 MiB, 1 GiB); "
            f"/ torch from pageable {pp / r['torch copy_ from pageable']:.2f}x (goal >= 6); "
            f"from pinned / torch from pinned {r['pinstage copy_h2d from pinned'] / tp:.3f} (goal >= 0.98; 1 MiB: >= 1)"
        )
    for nb, r in RESULTS["to_device"].items():
        s = f"to_device {nb >> 20} MiB: torch / as_tensor {r['pinstage to_device torch'] / r['torch.as_tensor(cuda)']:.2f}x (goal >= 4)"
        if "jax.device_put" in r:
            s += f"; jax / device_put {r['pinstage to_device jax'] / r['jax.device_put']:.2f}x (goal >= 5)"
        if "cupy.asarray" in r:
            s += f"; cupy / cupy.asarray {r['pinstage to_device cupy'] / r['cupy.asarray']:.2f}x"
        out.append(s)
    print("\n=== bench_h2d summary")
    print("\n".join(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    import torch

    try:
        import cupy as cp
    except Exception:  # noqa: BLE001
        cp = None
    try:
        import jax

        jax.config.update("jax_platforms", "cuda")
    except Exception:  # noqa: BLE001
        jax = None
    torch.cuda.init()
    print("device:", torch.cuda.get_device_name(0), "| pinstage", pinstage.__version__, "| torch",
          torch.__version__, "| jax", getattr(jax, "__version__", None), "| cupy", getattr(cp, "__version__", None))
    sizes = [1 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]
    reps = 10
    if a.quick:
        sizes, reps = [1 << 20, 64 << 20], 5
    bench_pinned_small(torch)
    bench_copy(torch, cp, sizes, reps)
    bench_to_device(torch, jax, cp, sizes, reps)
    ratios()
    with open(f"{a.out}/bench_h2d.json", "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    main()
