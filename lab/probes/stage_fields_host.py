"""Probe (no GPU needed): what `StepStager.stage` itself costs per further field, with the
slot writes told apart. Without a driver the stager keeps its slots in host memory and copies
nothing, so only pinstage's and Python's host work and the writes are timed:
  k=1         one field of 256 int32 (1 KiB)
  k=32        32 fields of 1 KiB (bench_step.py's k sweep, exact numpy arrays)
  one 32 KiB  one field of 8192 int32: the same bytes as k=32 in one field
(k=32 - one 32 KiB) / 31 is the cost of a further field beyond its bytes. Each figure: the median
over ROUNDS of the mean µs per `stage` over 64 steps (64 value dicts, values distinct per step and
field); depth 8 as bench_step.py. Checks (untimed): in the warm-up every step's arena is read
back (`read_field`) and compared field by field; in the timed rounds the arena after each round
(the round's last step). A cost probe, not a correctness test. Run with no driver:
python3 lab/probes/stage_fields_host.py.
"""

import os
import statistics
import sys
import time

import numpy as np

import pinstage

ROUNDS = int(os.environ.get("ROUNDS", "30"))


def bench(nfields, rows, depth=8):
    spec = {f"f{i}": ("int32", rows) for i in range(nfields)}
    st = pinstage.StepStager(pinstage.StepLayout(spec), depth=depth)
    vals = [{f"f{i}": np.arange(rows, dtype=np.int32) * 7 + s * 100003 + i * 1009 for i in range(nfields)}
            for s in range(64)]
    def check(v, where):
        for name, want in v.items():
            got = st.read_field(name)
            if not np.array_equal(got, want):
                raise SystemExit(f"WRONG: {nfields} fields of {rows} rows, {where}, field {name}")

    for v in vals:  # warm-up, every step checked
        st.stage(v)
        check(v, "warm-up")
    per = []
    for r in range(ROUNDS):
        t = time.perf_counter_ns()
        for v in vals:
            st.stage(v)
        per.append((time.perf_counter_ns() - t) / len(vals) / 1000)
        check(vals[-1], f"round {r}")
    return statistics.median(per), min(per), max(per)


def main():
    print("pinstage", pinstage.__version__, "| driver:", pinstage.cuda_available(), "| python", sys.version.split()[0])
    if pinstage.cuda_available():
        print("a driver is present: this probe times the host-memory mode; run it without one")
        return 1
    for rep in range(3):
        k1, k32, one = bench(1, 256), bench(32, 256), bench(1, 256 * 32)
        print(f"rep {rep}: k=1 {k1[0]:.2f} us ({k1[1]:.2f}-{k1[2]:.2f}), k=32 {k32[0]:.2f} ({k32[1]:.2f}-{k32[2]:.2f}), "
              f"one 32 KiB field {one[0]:.2f} ({one[1]:.2f}-{one[2]:.2f}); a further field beyond its bytes "
              f"{(k32[0] - one[0]) / 31 * 1000:.0f} ns; 31 KiB more in one field {(one[0] - k1[0]) * 1000:.0f} ns", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
