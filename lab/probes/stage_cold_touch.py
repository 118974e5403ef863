"""Probe (no GPU needed): which part of values made long before the call makes `StepStager.stage`
slow: the step dicts, the numpy arrays' headers, or their data. bench_step.py's k sweep makes
2000 steps' values before each batch (64 MiB at k = 32, out of the caches); each step here is
touched before its call (untimed) in one of four ways: none | dict (its keys walked) | headers
(each array's shape read) | all (each array's shape and data read: `sum()`), then staged (timed).
Without a driver the stager keeps its slots in host memory and copies nothing: only the host work
and the writes are timed. Layouts: k=1 and k=32 fields of 256 int32, one field of 8192 int32.
Each figure: the median over 5 rounds of the mean µs per call over 2000 steps; after each round
the last step's fields are read back and compared. Run with no driver:
python3 lab/probes/stage_cold_touch.py (benches/ beside it for bench_step.gen).
"""

import pathlib
import statistics
import sys
import time

import numpy as np

import pinstage

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benches"))
from bench_step import gen  # noqa: E402

N = 2000
LAYOUTS = {"k=1": (1, 256), "k=32": (32, 256), "one 32K": (1, 8192)}


def run(k, rows, touch, rounds=5):
    spec = {f"f{i}": ("int32", (rows,)) for i in range(k)}
    st = pinstage.StepStager(pinstage.StepLayout({n: ("int32", rows) for n in spec}), depth=8)
    per = []
    for r in range(rounds):
        _, steps = gen(spec, N, salt=r)
        tot = 0
        for d in steps:
            if touch == "dict":
                list(d)
            elif touch == "headers":
                for a in d.values():
                    a.shape
            elif touch == "all":
                for a in d.values():
                    a.shape
                    a.sum()
            t = time.perf_counter_ns()
            st.stage(d)
            tot += time.perf_counter_ns() - t
        per.append(tot / N / 1e3)
        for name, want in steps[-1].items():
            if not np.array_equal(st.read_field(name), want):
                raise SystemExit(f"WRONG: {k} fields of {rows}, round {r}, field {name}")
    return statistics.median(per)


def main():
    print("pinstage", pinstage.__version__, "| driver:", pinstage.cuda_available())
    if pinstage.cuda_available():
        print("a driver is present: this probe times the host-memory mode; run it without one")
        return 1
    for touch in ("none", "dict", "headers", "all"):
        r = {nm: run(k, rows, touch) for nm, (k, rows) in LAYOUTS.items()}
        print(f"touched: {touch:7s} " + "  ".join(f"{nm} {v:.2f} us" for nm, v in r.items())
              + f"  | k=32 / k=1 {r['k=32'] / r['k=1']:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
