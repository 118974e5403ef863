"""Whole arrays host to device: `copy_h2d` and `to_device` against torch and JAX, source cold and hot.

What is timed (host seconds, perf_counter), one call at a time, the GPU idle before the clock
starts and a device-wide synchronisation (`torch.cuda.synchronize()`, after JAX's
`block_until_ready()`) before it stops, at 1 MiB, 16 MiB, 64 MiB and 1 GiB:

  copies into an existing device tensor `dst` (uint8):
    torch copy_ from pinned     dst.copy_(pinned_t, non_blocking=True)      (the line-rate reference)
    torch copy_ from pageable   dst.copy_(torch.from_numpy(pageable))
    copy_h2d from pageable      pinstage.copy_h2d(dst, pageable)
    copy_h2d from pinned        pinstage.copy_h2d(dst, pinned_np)           (same memory as pinned_t)
  a fresh device array from a pageable numpy array:
    to_device torch / to_device jax    pinstage.to_device(pageable, "torch" | "jax")
    torch from_numpy().to(cuda), torch.as_tensor(cuda), jax.device_put   (torch's best of its two
    idioms is the peer)

Source state: COLD: before the call (outside the timing) every CPU of the process sweeps
(read + write) a separate 1 GiB buffer (`--sweep-mib`), and consecutive calls never read the
same source buffer (K buffers rotate: 64 at 1 and 16 MiB, 20 at 64 MiB, 2 at 1 GiB), so no cache
holds the source; the caches are left full of the sweep's dirty lines, which whatever reads the
source through the CPU writes back to memory as it goes (a DMA from pinned memory does not).
CLEAN: the same, but the sweep only reads its buffer: the source is as far (in DRAM) and the
caches hold clean lines. HOT: the call's source is read completely (a numpy sum) just before the
clock starts. `--states` picks them (default all three).

Checks, every timed call: the destination is poisoned first (copies: `dst.fill_(0xA5)`; fresh
arrays: an array of the same size full of 0xA5 made by the same framework/pinstage and dropped
just before, so the allocator hands that memory to the call); sources hold nonzero bytes in
1..163 (never the poison), distinct per rotating buffer, and three 8-byte words of the source
(first, last, one at random) get a per-call stamp before each call (the device's expected copy
gets the same stamp), so every call copies contents no earlier call copied; after the call the
result is compared with the expected copy on the device (torch.equal; JAX results through
DLPack); a wrong call's time is dropped. Each figure is the median of `--rounds` calls (>= 5)
with min-max; the variants are interleaved in each round, in an order shuffled per round and state
(seeded), so no variant always follows the same one.
GB/s = bytes / time; ratios are of medians, against the peer in the same source state.

Goals: copy_h2d from pageable, cold, / torch from pinned (cold): >= 0.5 at 1 MiB, >= 0.88 at
64 MiB, >= 0.92 at 1 GiB (judged in both cold states, each line printed); to_device / the
framework's best pageable idiom >= 3x at 16 MiB.

    python3 benches/bench_h2d.py [--rounds 5] [--sizes-mib 1,16,64,1024] [--states cold,clean,hot]
                                 [--no-jax] [--out DIR]

Exit status 1 when any check failed (or a call raised); the summary table is printed last.
"""

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.35")  # JAX leaves torch room

import numpy as np

import pinstage

POISON = 0xA5
GB = 1e9
REF = "torch copy_ from pinned"
COPY_GOALS = {1 << 20: 0.5, 64 << 20: 0.88, 1 << 30: 0.92}  # copy_h2d pageable cold / REF cold
TO_DEVICE_GOAL = (16 << 20, 3.0)
TORCH_IDIOMS = ("torch from_numpy().to(cuda)", "torch.as_tensor(cuda)")  # the peer: the faster one


def label(nbytes):
    return f"{nbytes >> 30} GiB" if nbytes >= 1 << 30 else f"{nbytes >> 20} MiB"


class Sweeper:
    """Read + write (or, `clean`, a read) of a separate buffer by as many threads as the
    process has CPUs (numpy releases the GIL), so every core's caches and every L3 slice they
    reach lose the source."""

    def __init__(self, nbytes):
        self.buf = np.ones(nbytes // 8, np.uint64)
        threads = max(1, min(32, len(os.sched_getaffinity(0))))
        self.chunks = np.array_split(self.buf, threads * 4)
        self.pool = ThreadPoolExecutor(threads)

    def __call__(self, clean=False):
        if clean:
            list(self.pool.map(lambda c: np.bitwise_or.reduce(c), self.chunks))
        else:
            list(self.pool.map(lambda c: np.add(c, 1, out=c), self.chunks))


class Sources:
    """K source buffers of n bytes, pageable (numpy) and pinned (torch; numpy view of the same
    memory), identical contents, and their expected device copy `exp`."""

    def __init__(self, torch, n, salt):
        self.torch, self.n = torch, n
        self.K = max(2, min(64, math.ceil((5 << 28) / n)))  # 64, 64, 20, 2 at 1, 16, 64, 1024 MiB
        base = torch.arange(n, device="cuda", dtype=torch.int32) % 163
        self.exp = torch.empty((self.K, n), dtype=torch.uint8, device="cuda")
        for k in range(self.K):  # ((7 i + 31 k + salt) mod 163) + 1: 1..163, rows distinct
            self.exp[k] = ((base * 7 + (31 * k + salt)) % 163 + 1).to(torch.uint8)
        del base
        self.pg = np.empty((self.K, n), np.uint8)
        torch.from_numpy(self.pg).copy_(self.exp)
        self.pin_t = torch.empty((self.K, n), dtype=torch.uint8, pin_memory=True)
        self.pin_t.copy_(self.exp)
        self.pin_np = self.pin_t.numpy()
        self.pg_rows, self.pin_rows_np = list(self.pg), list(self.pin_np)
        self.pin_rows_t = list(self.pin_t.unbind(0))
        self.poison_pinned = pinstage.empty_pinned(n, np.uint8)
        self.poison_pinned.fill(POISON)
        torch.cuda.synchronize()
        self.rng = np.random.default_rng(n)
        self.calls = 0

    def stamp(self, k):
        """Three new 8-byte words (first, last, one at random) in source k, pageable and pinned,
        and in its expected device copy."""
        self.calls += 1
        word = (np.frombuffer(np.uint64(self.calls * 0x9E3779B97F4A7C15 % (1 << 64)).tobytes(),
                              np.uint8) % 163 + 1).astype(np.uint8)
        w_t = self.torch.from_numpy(word).cuda()
        for p in (0, self.n - 8, 8 * int(self.rng.integers(1, self.n // 8 - 1))):
            self.pg[k, p:p + 8] = word
            self.pin_np[k, p:p + 8] = word
            self.exp[k, p:p + 8].copy_(w_t)
        self.torch.cuda.synchronize()

    def touch(self, kind, k):
        """Reads source k completely (the hot state)."""
        row = self.pg[k] if kind == "pageable" else self.pin_np[k]
        return int(row.view(np.uint64).sum())


def variants(torch, jax, src):
    """[(name, kind of source, prepare() -> destination or None, call(k, dst) -> result,
    wait(result), check(k, result) -> bool)]; `prepare` poisons the memory the call will write."""
    n = src.n
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")

    def fill():
        dst.fill_(POISON)
        return dst

    def drop(make):  # a poisoned array of the size, dropped so the allocator hands it on
        def prepare():
            p = make()
            torch.cuda.synchronize()
            del p
        return prepare

    def into_dst(k, o):
        return torch.equal(dst, src.exp[k])

    def fresh(k, o):
        return torch.equal(o, src.exp[k])

    def none(o):
        return None

    t_poison = drop(lambda: torch.full((n,), POISON, dtype=torch.uint8, device="cuda"))
    pg, pin_t, pin_np = src.pg_rows, src.pin_rows_t, src.pin_rows_np
    v = [
        (REF, "pinned", fill, lambda k, d: d.copy_(pin_t[k], non_blocking=True), none, into_dst),
        ("torch copy_ from pageable", "pageable", fill, lambda k, d: d.copy_(torch.from_numpy(pg[k])), none,
         into_dst),
        ("copy_h2d from pageable", "pageable", fill, lambda k, d: pinstage.copy_h2d(d, pg[k]), none, into_dst),
        ("copy_h2d from pinned", "pinned", fill, lambda k, d: pinstage.copy_h2d(d, pin_np[k]), none, into_dst),
        ("to_device torch", "pageable", drop(lambda: pinstage.to_device(src.poison_pinned, "torch")),
         lambda k, d: pinstage.to_device(pg[k], "torch"), none, fresh),
        ("torch from_numpy().to(cuda)", "pageable", t_poison, lambda k, d: torch.from_numpy(pg[k]).to("cuda"),
         none, fresh),
        ("torch.as_tensor(cuda)", "pageable", t_poison, lambda k, d: torch.as_tensor(pg[k], device="cuda"),
         none, fresh),
    ]
    if jax is not None:
        jnp = jax.numpy

        def jax_eq(k, o):
            try:
                return torch.equal(torch.from_dlpack(o), src.exp[k])
            except Exception:  # noqa: BLE001 (no DLPack exchange: compare on the host)
                return bool(np.array_equal(np.asarray(o), src.exp[k].cpu().numpy()))

        def ready(o):
            o.block_until_ready()

        ps_poison = drop(lambda: pinstage.to_device(src.poison_pinned, "jax").block_until_ready())
        v += [
            ("to_device jax", "pageable", ps_poison, lambda k, d: pinstage.to_device(pg[k], "jax"), ready, jax_eq),
            ("jax.device_put", "pageable", drop(lambda: jnp.full((n,), POISON, dtype=jnp.uint8).block_until_ready()),
             lambda k, d: jax.device_put(pg[k]), ready, jax_eq),
        ]
    return v


def bench_size(torch, jax, nbytes, args, sweep, failed):
    src = Sources(torch, nbytes, salt=(nbytes >> 20) % 157)
    vs = variants(torch, jax, src)
    times = {st: {v[0]: [] for v in vs} for st in args.states}
    dead = set()

    def one(i, state, where):
        name, kind, prep, call, wait, check = vs[i]
        k = src.calls % src.K  # consecutive calls never share a source buffer
        o = d = None
        try:
            d = prep()  # untimed: poison, stamp, cache state
            torch.cuda.synchronize()
            src.stamp(k)
            if state in ("cold", "clean"):
                sweep(clean=state == "clean")
            else:
                src.touch(kind, k)
            t0 = time.perf_counter()
            o = call(k, d)
            wait(o)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            ok = check(k, o)
        except Exception as e:  # noqa: BLE001 (reported as a failure)
            failed.append(f"{name} {label(nbytes)} {state} {where}: raised {type(e).__name__}: {e}")
            dead.add(i)
            return None
        finally:
            o = d = None  # noqa: F841 (the result goes before the next call's poisoning)
        if not ok:  # a wrong call's time is no figure
            failed.append(f"{name} {label(nbytes)} {state} {where}: wrong result")
            return None
        return dt

    for i in range(len(vs)):  # warm-up (allocators, JAX programs), checked, untimed
        one(i, "hot", "warm-up")
    shuffle = random.Random(nbytes)
    for r in range(args.rounds):
        for state in args.states:
            # A fresh order per round and state: no variant always follows the same one (the
            # one before leaves its trace).
            idx = list(range(len(vs)))
            shuffle.shuffle(idx)
            for i in idx:
                if i not in dead:
                    dt = one(i, state, f"round {r}")
                    if dt is not None:
                        times[state][vs[i][0]].append(dt)
        gc.collect()
    info = {"sources": src.K, "pageable_align_4k": int(src.pg.ctypes.data % 4096)}
    del src, vs
    gc.collect()
    torch.cuda.empty_cache()
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
    return times, info


def stats(nbytes, ts):
    if not ts:
        return None
    g = [nbytes / t / GB for t in ts]
    return {"median_gbs": statistics.median(g), "min_gbs": min(g), "max_gbs": max(g), "seconds": ts}


def cell(s):
    return f"{'--':>22s}" if s is None else f"{s['median_gbs']:.2f} ({s['min_gbs']:.2f}-{s['max_gbs']:.2f})".rjust(22)


def ratio(res, nb, st, a, b):
    x, y = res[nb][st].get(a), res[nb][st].get(b)
    return None if not x or not y else x["median_gbs"] / y["median_gbs"]


def summary(res, infos, sizes, failed, args, seconds):
    lines = [f"\n=== bench_h2d summary: GB/s, median of {args.rounds} calls (min-max); ratios of medians"]
    goals = []
    for st in args.states:
        lines.append(f"{'-- source ' + st.upper():34s}" + "".join(f"{label(b):>22s}" for b in sizes))
        for name in res[sizes[0]][st]:
            lines.append(f"{name:34s}" + "".join(cell(res[b][st].get(name)) for b in sizes))
        rows = [("copy_h2d pageable / torch pinned", "copy_h2d from pageable", REF),
                ("copy_h2d pinned / torch pinned", "copy_h2d from pinned", REF),
                ("copy_h2d pageable / torch pageable", "copy_h2d from pageable", "torch copy_ from pageable"),
                ("to_device torch / best torch idiom", "to_device torch", None),
                ("to_device jax / jax.device_put", "to_device jax", "jax.device_put")]
        if "jax.device_put" not in res[sizes[0]][st]:
            rows.pop()
        for title, a, b in rows:
            cells = []
            for nb in sizes:
                if b is None:
                    best = max((res[nb][st][x]["median_gbs"] for x in TORCH_IDIOMS if res[nb][st].get(x)),
                               default=None)
                    q = res[nb][st].get(a)
                    r = None if not q or not best else q["median_gbs"] / best
                else:
                    r = ratio(res, nb, st, a, b)
                goal = None
                if title.startswith("copy_h2d pageable / torch pinned") and st in ("cold", "clean"):
                    goal = COPY_GOALS.get(nb)
                elif title.startswith("to_device") and nb == TO_DEVICE_GOAL[0]:
                    goal = TO_DEVICE_GOAL[1]
                txt = "--" if r is None else f"{r:.3f}" if r < 2 else f"{r:.2f}x"
                if goal is not None:
                    ok = r is not None and r >= goal
                    goals.append((f"{title} {label(nb)} {st} >= {goal}", ok, r))
                    txt += f" {'PASS' if ok else 'MISS'}"
                cells.append(f"{txt:>22s}")
            lines.append(f"{title:34s}" + "".join(cells))
    for g, ok, r in goals:
        lines.append(f"goal: {g}: {'PASS' if ok else 'MISS'} ({'--' if r is None else f'{r:.3f}'})")
    rot = ", ".join(f"{label(b)} {infos[b]['sources']}" for b in sizes)
    lines.append(f"source buffers rotated per size: {rot}; cold: {args.sweep_mib} MiB swept (read + write) "
                 f"by all CPUs before each call; clean: the same read only; {seconds:.0f} s in all")
    lines.append(f"checked: every timed and warm-up call against a poisoned destination; {len(failed)} failures"
                 + (": " + "; ".join(failed[:4]) if failed else ""))
    print("\n".join(lines), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes-mib", default="1,16,64,1024")
    ap.add_argument("--sweep-mib", type=int, default=1024)
    ap.add_argument("--states", default="cold,clean,hot", type=lambda x: x.split(","))
    ap.add_argument("--no-jax", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t_start = time.time()
    import torch

    jax = None
    if not args.no_jax:
        try:
            import jax

            jax.config.update("jax_platforms", "cuda")
            jax.devices()
        except Exception as e:  # noqa: BLE001
            print(f"jax unavailable ({type(e).__name__}: {e}); its rows are left out", flush=True)
            jax = None
    torch.cuda.init()
    print("device:", torch.cuda.get_device_name(0), "| pinstage", pinstage.__version__, "| torch", torch.__version__,
          "| jax", getattr(jax, "__version__", None), "| python", sys.version.split()[0], flush=True)
    sizes = [int(x) << 20 for x in args.sizes_mib.split(",")]
    sweep = Sweeper(args.sweep_mib << 20)
    res, infos, failed = {}, {}, []
    for nb in sizes:
        t0 = time.time()
        times, infos[nb] = bench_size(torch, jax, nb, args, sweep, failed)
        res[nb] = {st: {name: stats(nb, ts) for name, ts in by.items()} for st, by in times.items()}
        print(f"  {label(nb)} done in {time.time() - t0:.1f} s", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_h2d.json"), "w") as f:
            json.dump({"results": {str(k): v for k, v in res.items()}, "info": {str(k): v for k, v in infos.items()},
                       "rounds": args.rounds, "failed": failed, "seconds": time.time() - t_start}, f, indent=1)
    summary(res, infos, sizes, failed, args, time.time() - t_start)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
