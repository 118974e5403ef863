"""Probe: why `StepStager.stage` of k = 32 fields of 1 KiB costs 2.6x k = 1 in bench_step.py's
k sweep while C doing the same driver work (lab/c/step_k.c, run 2026-12-06-h100-z) costs 1.65-1.79x
(75 ns a further field against pinstage's ~170). Two things in the bench grow with k besides the
call: its values (bench_step.gen: 2000 steps, k rows of 1 KiB each, 64 MiB at k = 32: read from
DRAM, where step_k.c reuses 64 hot value sets) and its per-step check (torch.cat of the k fields'
views after each call, untimed, its host work between the calls). Each is varied alone:
  layouts   k=1, k=8, k=32 (fields of 256 int32) and "one 32K" (one field of 8192 int32: k=32's
            bytes in one field, so (k=32 - one 32K) / 31 is a further field's cost beyond its bytes)
  values    cold: bench_step.gen's values (every step its own rows, as the bench);
            hot:  64 value sets reused as step_k.c does, each step's own number written into the
                  first two int32 of every field just before the call (untimed), so no two steps
                  of a batch are alike
  check     cat: the bench's torch.cat of the k views into the step's history row;
            one: one copy_ of the used bytes (the fields are adjacent in the arena)
  regime    loop (calls back to back; the mean of the calls) and paced (the stream synchronized
            before each call, untimed; the median), as bench_step.py.
Every step of every batch is checked (arena and history poisoned with 0xA5 before each batch, every
history row compared after it). Figures: the median over ROUNDS rounds (variants interleaved per
round) of each batch's figure, min-max. With the lab variant `stamps` the median ns between the
call's stamps (claimed / written / committed) is printed for the loop rows.
Environment: VALUES (default "cold,hot"), CHECKS ("cat,one"), LAYOUTS ("k=1,k=8,k=32,one 32K"),
PIN=1 (the calling thread kept on the core it starts on, as step_k.c keeps itself; default 0:
free to migrate, as bench_step.py runs), N, ROUNDS.
"""

import ctypes
import gc
import os
import pathlib
import statistics
import sys
import time

import numpy as np
import torch

import pinstage

try:
    from labmod import lab

    STAMPS = getattr(lab, "_stamps", None)
except ImportError:
    STAMPS = None

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benches"))
from bench_step import POISON, expected, gen, hot_maker  # noqa: E402

N, ROUNDS, DEPTH = int(os.environ.get("N", "2000")), int(os.environ.get("ROUNDS", "5")), 8
LAYOUTS = {"k=1": (1, 256), "k=8": (8, 256), "k=32": (32, 256), "one 32K": (1, 8192)}
LAYOUTS = {n: LAYOUTS[n] for n in os.environ.get("LAYOUTS", ",".join(LAYOUTS)).split(",")}
VALUES = os.environ.get("VALUES", "cold,hot").split(",")
CHECKS = os.environ.get("CHECKS", "cat,one").split(",")
PIN = os.environ.get("PIN", "0") == "1"


def spec_of(k, rows):
    return {f"f{i}": ("int32", (rows,)) for i in range(k)}


class Layout:
    def __init__(self, name, k, rows, s):
        self.name, self.spec = name, spec_of(k, rows)
        self.L = pinstage.StepLayout({n: ("int32", rows) for n in self.spec})
        self.st = pinstage.StepStager(self.L, depth=DEPTH)
        self.A = torch.from_dlpack(self.st.arena())
        self.used = k * rows * 4
        off = [f["offset"] for f in self.L.fields]
        if off != [i * rows * 4 for i in range(k)]:
            raise SystemExit(f"{name}: fields not adjacent in the arena ({off[:4]}...): 'one' cannot check")
        self.views = [self.A[o: o + rows * 4] for o in off]
        self.hist = torch.empty((N, self.used), dtype=torch.uint8, device="cuda")
        self.s = s


def values(lay, kind, r):
    """(steps, warm, E): each step (its dict, the untimed hook run just before its call), the
    warm-up's steps, the expected rows. Hot: bench_step.hot_maker, the bench's own."""
    if kind == "cold":
        vals, steps = gen(lay.spec, N, salt=r * 100_003 + 17)
        steps = [(d, lambda: None) for d in steps]
        return steps, steps[:64], expected(vals, N)
    return hot_maker(lay.spec, N, 29)(r)


def batch(lay, kind, check, paced, r):
    steps, warm, E = values(lay, kind, r)
    st, s, hist = lay.st, lay.s, lay.hist
    for d, before in warm:  # untimed, unchecked
        before()
        st.stage(d, stream=s)
    s.synchronize()
    lay.A.fill_(POISON)
    hist.fill_(POISON)
    torch.cuda.synchronize()
    if STAMPS:
        STAMPS()
    ts, parts = np.empty(N, np.int64), []
    gc.collect()
    gc.disable()
    try:
        for i, (d, before) in enumerate(steps):
            before()
            if paced:
                s.synchronize()
            t0 = time.perf_counter_ns()
            st.stage(d, stream=s)
            ts[i] = time.perf_counter_ns() - t0
            if STAMPS and not paced:
                parts.append(STAMPS())
            if check == "cat":
                torch.cat(lay.views, out=hist[i])
            else:
                hist[i].copy_(lay.A[: lay.used])
    finally:
        gc.enable()
    torch.cuda.synchronize()
    bad = np.flatnonzero((hist.cpu().numpy() != E).any(axis=1))
    us = ts / 1e3
    per = {}
    for call in parts:
        if call and call[0][0] == ">stage":
            for label, ns in call[1:]:
                per.setdefault(label, []).append(ns)
    return float(us.mean() if not paced else np.median(us)), bad, {k: float(np.median(v)) for k, v in per.items()}


def main():
    s = torch.cuda.Stream()
    torch.cuda.set_stream(s)
    if PIN:  # this thread only (torch's and pinstage's threads keep their cores)
        os.sched_setaffinity(0, {ctypes.CDLL(None).sched_getcpu()})
    print(f"pinstage {pinstage.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}; "
          f"N={N} calls a batch, {ROUNDS} rounds, depth {DEPTH}; stamps: {'yes' if STAMPS else 'no'}; "
          f"pinned: {sorted(os.sched_getaffinity(0)) if PIN else 'no'}", flush=True)
    lays = [Layout(n, k, rows, s) for n, (k, rows) in LAYOUTS.items()]
    res, stamps, wrong, t0 = {}, {}, 0, time.time()
    for r in range(ROUNDS):
        for kind in VALUES:
            for check in CHECKS:
                for lay in lays:
                    for paced in (False, True):
                        v, bad, st = batch(lay, kind, check, paced, r)
                        key = (lay.name, kind, check, "paced" if paced else "loop")
                        if bad.size:
                            wrong += int(bad.size)
                            print(f"CHECK FAILED: {key} round {r}: {bad.size} of {N} steps wrong (first {bad[0]})")
                            continue
                        res.setdefault(key, []).append(v)
                        for label, ns in st.items():
                            stamps.setdefault(key, {}).setdefault(label, []).append(ns)
        print(f"round {r} done, {time.time() - t0:.0f} s", flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    print("\nus per call: median over rounds [min..max]; loop: mean of the calls, paced: their median")
    print(f"{'layout':8s} {'values':6s} {'check':5s} {'loop':>22s} {'paced':>22s}")
    for kind in VALUES:
        for check in CHECKS:
            for lay in lays:
                row = f"{lay.name:8s} {kind:6s} {check:5s}"
                for mode in ("loop", "paced"):
                    v = res.get((lay.name, kind, check, mode))
                    row += f" {med[(lay.name, kind, check, mode)]:8.2f} [{min(v):.2f}..{max(v):.2f}]" if v else f" {'n/a':>22s}"
                print(row)
    print("\nratios (medians):  k=32 / k=1 | a further field beyond its bytes, (k=32 - one 32K) / 31 | "
          "31 KiB more in one field, one 32K - k=1")
    for kind in VALUES:
        for check in CHECKS:
            for mode in ("loop", "paced"):
                g = lambda n: med.get((n, kind, check, mode))  # noqa: E731
                if None in (g("k=1"), g("k=32"), g("one 32K")):
                    continue
                print(f"  {kind:4s} {check:3s} {mode:5s}  {g('k=32') / g('k=1'):.2f}x | "
                      f"{(g('k=32') - g('one 32K')) / 31 * 1e3:5.0f} ns | {(g('one 32K') - g('k=1')) * 1e3:5.0f} ns")
    if stamps:
        print("\nstamps (loop rows): median over rounds of each batch's median ns from the stamp before")
        for key, d in stamps.items():
            print(f"  {' '.join(key[:3]):22s} " + "  ".join(f"{lb} {statistics.median(v):6.0f}" for lb, v in d.items()))
    print(f"\nevery step checked: {wrong} wrong")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
