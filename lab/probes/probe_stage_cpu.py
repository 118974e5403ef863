"""Probe: the host cost of `StepStager.stage` per field, k fields of 256 int32 (1 KiB) with names
built at run time (not interned), on host memory (run it where no driver is, or with
PINSTAGE_DISABLE_CUDA=1): best of 5 rounds of 20,000 calls, µs per call.
Usage: PINSTAGE_DISABLE_CUDA=1 python3 lab/probes/probe_stage_cpu.py
"""
import time, numpy as np, pinstage
for k in (1, 2, 8, 32):
    L = pinstage.StepLayout({f"f{i}": ("int32", 256) for i in range(k)})
    st = pinstage.StepStager(L, depth=8)
    rng = np.random.default_rng(k)
    sets = [{f"f{i}": rng.integers(1, 1 << 30, 256).astype(np.int32) for i in range(k)} for _ in range(64)]
    for _ in range(2000): st.stage(sets[_ % 64])
    best = 1e9
    for r in range(5):
        t = time.perf_counter()
        for i in range(20000): st.stage(sets[i % 64])
        best = min(best, (time.perf_counter() - t) / 20000 * 1e6)
    print(k, f"{best:.2f} us", f"per field {(best)/k:.3f}")
