"""Probe: why `to_device(x, "jax")` of pageable numpy runs below `to_device(x, "torch")` at 16
and 64 MiB (run 2026-12-06-h100-w, hot: 16.79 against 22.67 GB/s at 16 MiB, 30.46 against
35.82 at 64 MiB; at 1 GiB both ~50). Each call is timed as bench_h2d.py times it (from the call
to a `torch.cuda.synchronize()` after it) with the source hot, and split where it can be:
  copy_h2d          `copy_h2d(dst, x)` into a torch tensor made before (the copy alone)
  to_device torch   `to_device(x, "torch")`
  to_device dlpack  `to_device(x, "dlpack")` (pinstage's own part of the JAX path: pool memory,
                    the copy on pinstage's stream), then the synchronize
  dlpack+torch      the same, then `torch.from_dlpack(arr)` (another consumer's import: is the
                    gap JAX's?)
  dlpack+from       the same, then `jax.dlpack.from_dlpack(arr)` (no block_until_ready)
  to_device jax     `to_device(x, "jax").block_until_ready()` (the bench's row)
  jax parts         the bench's row cut by stamps: to_device(.., "dlpack") | from_dlpack |
                    block_until_ready | synchronize
Before each call the memory it will take is poisoned the bench's way (a poisoned result of the
same kind made and dropped), and each result is compared with the source after the clock stops.
Also printed: pinstage's device pool before and after each size (its allocations grow?).
Median over ROUNDS rounds of each round's median µs per call (min-max). jax, torch, numpy.
"""

import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import pinstage  # noqa: E402

jax.config.update("jax_platforms", "cuda")
ROUNDS = int(os.environ.get("ROUNDS", "5"))
CALLS = int(os.environ.get("CALLS", "8"))
POISON = 0xA5
SIZES = [int(s) << 20 for s in os.environ.get("SIZES_MIB", "16,64").split(",")]


def main():
    print("device:", torch.cuda.get_device_name(0), "| jax", jax.__version__, "| torch", torch.__version__, flush=True)
    bad = 0
    for n in SIZES:
        k_src = 4
        srcs = [((np.arange(n, dtype=np.uint64) * (2 * i + 3) + i) % 251).astype(np.uint8) for i in range(k_src)]
        exp = [torch.from_numpy(s).cuda() for s in srcs]
        poison_np = np.full(n, POISON, dtype=np.uint8)
        dst = torch.empty(n, dtype=torch.uint8, device="cuda")
        calls = {}

        def t_copy(x):
            dst.fill_(POISON)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pinstage.copy_h2d(dst, x)
            torch.cuda.synchronize()
            return [time.perf_counter() - t0], dst

        def poison_torch():
            p = pinstage.to_device(poison_np, "torch")
            torch.cuda.synchronize()
            del p

        def poison_jax():
            p = pinstage.to_device(poison_np, "jax").block_until_ready()
            torch.cuda.synchronize()
            del p

        def timed(poison, call):
            """`call(x)` timed to a synchronize after it, its memory poisoned first."""
            def t(x):
                poison()
                t0 = time.perf_counter()
                o = call(x)
                torch.cuda.synchronize()
                return [time.perf_counter() - t0], o
            return t

        t_torch = timed(poison_torch, lambda x: pinstage.to_device(x, "torch"))
        t_dlpack = timed(poison_jax, lambda x: pinstage.to_device(x, "dlpack"))
        t_dlpack_torch = timed(poison_jax, lambda x: torch.from_dlpack(pinstage.to_device(x, "dlpack")))
        t_dlpack_from = timed(poison_jax, lambda x: jax.dlpack.from_dlpack(pinstage.to_device(x, "dlpack")))
        t_jax = timed(poison_jax, lambda x: pinstage.to_device(x, "jax").block_until_ready())

        def t_parts(x):
            poison_jax()
            t0 = time.perf_counter()
            a = pinstage.to_device(x, "dlpack")
            t1 = time.perf_counter()
            o = jax.dlpack.from_dlpack(a)
            t2 = time.perf_counter()
            o.block_until_ready()
            t3 = time.perf_counter()
            torch.cuda.synchronize()
            t4 = time.perf_counter()
            return [t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3], o

        calls = {
            "copy_h2d": t_copy,
            "to_device torch": t_torch,
            "to_device dlpack": t_dlpack,
            "dlpack+torch": t_dlpack_torch,
            "dlpack+from": t_dlpack_from,
            "to_device jax": t_jax,
            "jax parts": t_parts,
        }
        med = {name: [] for name in calls}
        parts = []
        print(f"\n{n >> 20} MiB: pool before", pinstage.device_pool_stats(), flush=True)
        names = list(calls)
        i = 0
        for r in range(ROUNDS + 1):  # round 0: warm-up, checked, not counted
            rot = r % len(names)
            per = {name: [] for name in names}
            for name in names[rot:] + names[:rot]:
                for c in range(CALLS):
                    k = i % k_src
                    i += 1
                    x = srcs[k]
                    x.sum()  # the source hot in the caches, as the bench's hot rows
                    ts, o = calls[name](x)
                    got = o if isinstance(o, torch.Tensor) else torch.from_dlpack(o)
                    if not torch.equal(got, exp[k]):
                        bad += 1
                        print(f"WRONG: {name} {n >> 20} MiB round {r} call {c}", flush=True)
                    del o, got
                    per[name].append(ts[0])
                    if name == "jax parts" and r > 0:
                        parts.append(ts)
            if r > 0:
                for name in names:
                    med[name].append(statistics.median(per[name]))
        print(f"{n >> 20} MiB: pool after", pinstage.device_pool_stats(), flush=True)
        ref = statistics.median(med["copy_h2d"])
        for name in names:
            m = med[name]
            us = statistics.median(m) * 1e6
            print(f"  {name:18s} {us:9.1f} us ({min(m) * 1e6:.1f}-{max(m) * 1e6:.1f})  {n / statistics.median(m) / 1e9:6.2f} GB/s"
                  f"  x copy_h2d time {statistics.median(m) / ref:.3f}", flush=True)
        cols = list(zip(*parts))
        print("  jax parts, median us: all {:.1f} | to_device dlpack {:.1f} | from_dlpack {:.1f} | block_until_ready {:.1f} | synchronize {:.1f}".format(
            *[statistics.median(c) * 1e6 for c in cols]), flush=True)
    print(f"\nchecked: every call's result against its source; {bad} wrong", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
