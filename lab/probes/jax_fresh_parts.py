"""Probe: where the time of bench_step.py's JAX row goes. The row
`unpack(jax.dlpack.from_dlpack(st.stage(v)))` (fresh mode) cost ~198 us a step in run
2026-12-06-h100-q while its control, the same from_dlpack + jit unpack of a block staged before the
clock, cost ~128 us and `stage` into an arena ~7.4 us: ~70 us are unaccounted for. Rows (loop: steps
back to back, each step's results kept to the batch's end as in the bench; median of 5 rounds of
the per-round mean us a step, min-max):
  stage-arena        arena-mode `stage(v)` (reference)
  stage-fresh        fresh-mode `stage(v)`, the block kept
  stage+import       fresh `from_dlpack(stage(v))`, no unpack
  stage+wait+import  fresh `stage(v)`, `.wait()` on the host, then from_dlpack (is it the import
                     of an in-flight block?)
  import (staged)    `from_dlpack(b)` of a block staged and completed before the clock
  full               `unpack(from_dlpack(stage(v)))` (the bench's row)
  full (staged)      `unpack(from_dlpack(b))`, b staged before (the bench's control)
  stage+wait+full    `stage(v)`, `.wait()`, unpack(from_dlpack(...))
  dlpack-call        `b.__dlpack__(stream=<JAX's external-ready stream>)` of a staged block (the
                     export alone, as JAX calls it; capsule dropped)
PACED=1: each step starts once the step before finished (JAX's results waited, a fresh block
waited on the host), as bench_step.py's paced rows.
Every full row's arrays are compared with the values staged, every step. Lab wheel first on
PYTHONPATH; jax, numpy.
"""

import gc
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import numpy as np  # noqa: E402

import pinstage  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benches"))
import bench_step as B  # noqa: E402

jax.config.update("jax_enable_x64", True)
N, ROUNDS = 400, 5
L, spec = B.engine_layout(), B.engine_spec()
names = list(spec)
fresh = pinstage.StepStager(L, mode="fresh", depth=8)
arena = pinstage.StepStager(L, depth=8)
unpack = jax.jit(L.unpack)
gpu = jax.devices("gpu")[0]
make = B.maker(spec, N, 11)
clock = time.perf_counter_ns
print(f"pinstage {pinstage.__version__}, jax {jax.__version__}, {gpu.device_kind}")


def stream_of_jax():
    try:
        return gpu.get_stream_for_external_ready_events()
    except Exception as e:  # noqa: BLE001
        print("no external-ready stream:", e)
        return None


JS = stream_of_jax()


def row(h):
    parts = [h[nm] for nm in names]
    return np.concatenate([np.asarray(p)[: spec[nm][1][0]].reshape(-1).view(np.uint8) for nm, p in zip(names, parts)])


def waited(v):
    b = fresh.stage(v)
    b.wait()
    return b


ROWS = {
    "stage-arena": (None, lambda v: arena.stage(v), False),
    "stage-fresh": (None, lambda v: fresh.stage(v), False),
    "stage+import": (None, lambda v: jax.dlpack.from_dlpack(fresh.stage(v)), False),
    "stage+wait+import": (None, lambda v: jax.dlpack.from_dlpack(waited(v)), False),
    "import (staged)": (waited, lambda b: jax.dlpack.from_dlpack(b), False),
    "full": (None, lambda v: unpack(jax.dlpack.from_dlpack(fresh.stage(v))), True),
    "full (staged)": (waited, lambda b: unpack(jax.dlpack.from_dlpack(b)), True),
    "stage+wait+full": (None, lambda v: unpack(jax.dlpack.from_dlpack(waited(v))), True),
    "dlpack-call": (waited, lambda b: b.__dlpack__(stream=JS), False),
}
PACED = os.environ.get("PACED") == "1"


def settle(o):
    """Paced: the step before has finished on the GPU (JAX results waited; a DeviceArray waited
    on the host; an arena step: the device synchronized)."""
    if hasattr(o, "block_until_ready") or isinstance(o, dict):
        jax.block_until_ready(o)
    elif hasattr(o, "wait"):
        o.wait()


res_us = {k: [] for k in ROWS}
bad = 0
for r in range(ROUNDS):
    steps, warm, E = make(r)
    for name, (prep, fn, check) in ROWS.items():
        if name == "dlpack-call" and JS is None:
            continue
        for v in warm:
            jax.block_until_ready(fn(prep(v) if prep else v)) if check else fn(prep(v) if prep else v)
        inputs = [prep(v) for v in steps] if prep else steps
        out, ts = [None] * N, np.empty(N, np.int64)
        gc.collect()
        gc.disable()
        try:
            for i, v in enumerate(inputs):
                if PACED and i:
                    settle(out[i - 1])
                t0 = clock()
                out[i] = fn(v)
                ts[i] = clock() - t0
        finally:
            gc.enable()
        if check:
            got = np.stack([row(h) for h in jax.device_get(jax.block_until_ready(out))])
            ok, msg = B.compare(got, E, "arrays")
            if not ok:
                bad += 1
                print(f"CHECK FAILED {name} round {r}: {msg}")
        elif name == "stage-arena":
            pass
        else:
            jax.block_until_ready([o for o in out if hasattr(o, "block_until_ready")])
        res_us[name].append(ts.mean() / 1e3)
        del out, inputs

print(f"\n{'paced' if PACED else 'loop'}, us per step: median of {ROUNDS} rounds' means (min-max); {N} steps a round")
for name, xs in res_us.items():
    if xs:
        print(f"  {name:20s} {statistics.median(xs):8.2f} ({min(xs):.2f}-{max(xs):.2f})")
print("checks:", "all passed" if bad == 0 else f"{bad} FAILED")
sys.exit(1 if bad else 0)
