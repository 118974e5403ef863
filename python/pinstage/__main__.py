"""``python -m pinstage``: what pinstage sees, and a short demo with checked results.

Prints the driver, devices and frameworks found; runs the stager and copy_d2h on every framework
present (torch, jax, cupy), checks every result, and times pinstage against the framework's own
path. Without a GPU it says so and demonstrates the numpy fallback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

import numpy as np

import pinstage


def _progress(it, label, total):
    """A minimal progress bar on stderr (no dependency)."""
    width = 28
    start = time.perf_counter()
    for i, x in enumerate(it, 1):
        yield x
        done = int(width * i / total)
        sys.stderr.write(f"\r  {label:<34} [{'#' * done}{'.' * (width - done)}] {i}/{total}")
        sys.stderr.flush()
    sys.stderr.write(f"  {time.perf_counter() - start:.2f}s\n")


def _median_us(fn, reps=200, sync=None):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2] * 1e6


def _frameworks():
    found = {}
    for name in ("torch", "jax", "cupy"):
        try:
            found[name] = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a broken install is "absent" for the demo
            pass
    return found


def _cpu_demo():
    print("\nNo usable CUDA GPU: demonstrating the numpy fallback.")
    st = pinstage.PinnedStager("int32", numel=256, depth=8)
    dst = np.full(16, -7, dtype=np.int32)
    vals = np.arange(1, 6, dtype=np.int32)
    st.copy_(dst, vals, pad_value=0)
    assert dst.tolist() == [1, 2, 3, 4, 5] + [0] * 11
    print(f"  stager into a host array:   {dst.tolist()}  (checked)")
    src = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    out = pinstage.copy_d2h(src)
    assert np.array_equal(out, src) and out.flags.writeable and out.ctypes.data != src.ctypes.data
    print(f"  copy_d2h(numpy) -> writable copy {out.shape} {out.dtype}  (checked)")
    try:
        pinstage.empty_pinned(16)
    except pinstage.CudaUnavailableError as e:
        print(f"  empty_pinned() -> CudaUnavailableError: {e}")


def _gpu_demo(fw, quick):
    def reps(k):  # repetitions: a tenth with --quick
        return max(5, k // 10) if quick else k

    rows = []
    if "torch" in fw:
        torch = fw["torch"]
        sync = torch.cuda.synchronize
        dst = torch.full((4096,), -1, dtype=torch.int32, device="cuda")
        st = pinstage.PinnedStager(torch.int32, numel=256, depth=8)
        target = st.target(dst, pad_value=0)
        sets = [np.random.default_rng(i).integers(1, 1 << 30, 256, dtype=np.int32) for i in range(16)]
        for i in _progress(range(reps(2000)), "torch: padded H2D copies", reps(2000)):
            target.copy_(sets[i % 16])
        sync()
        got = dst.cpu().numpy()
        assert np.array_equal(got[:256], sets[(reps(2000) - 1) % 16]) and (got[256:] == 0).all()
        k = [0]

        def ours():
            k[0] += 1
            target.copy_(sets[k[0] % 16])

        head, tail = dst[:256], dst[256:]

        def theirs():
            k[0] += 1
            head.copy_(torch.from_numpy(sets[k[0] % 16]), non_blocking=True)
            tail.fill_(0)

        rows.append(("torch", "256 of 4096 int32, padded H2D (host us/call)", _median_us(ours, reps(200)), _median_us(theirs, reps(200)), "copy_ + fill_"))
        n = (16 << 20) // 4
        src = torch.randint(-1000, 1000, (n,), dtype=torch.int32, device="cuda")
        ref = src.cpu().numpy()
        for _ in _progress(range(reps(20)), "torch: copy_d2h 16 MiB", reps(20)):
            out = pinstage.copy_d2h(src)
        assert np.array_equal(out, ref)
        t_ours = _median_us(lambda: pinstage.copy_d2h(src), reps(20))
        t_theirs = _median_us(lambda: src.cpu(), reps(20))
        rows.append(("torch", "16 MiB D2H (GB/s)", 16.78 / t_ours * 1e3, 16.78 / t_theirs * 1e3, ".cpu()"))
        pend = pinstage.copy_d2h_async(src)
        assert np.array_equal(pend.wait(), ref)
    if "jax" in fw:
        jax = fw["jax"]
        try:
            x = jax.device_put(np.arange(4 << 20, dtype=np.float32), jax.devices("gpu")[0])
            ref = np.arange(4 << 20, dtype=np.float32)
            for _ in _progress(range(reps(10)), "jax: copy_d2h 16 MiB", reps(10)):
                out = pinstage.copy_d2h(x)
            assert np.array_equal(out, ref)
            t_ours = _median_us(lambda: pinstage.copy_d2h(x), 10)
            fresh = [x + 0 for _ in range(10)]
            [f.block_until_ready() for f in fresh]
            t_theirs = _median_us(lambda: np.asarray(fresh.pop()), 10)
            rows.append(("jax", "16 MiB D2H (GB/s)", 16.78 / t_ours * 1e3, 16.78 / t_theirs * 1e3, "np.asarray"))
        except Exception as e:  # noqa: BLE001
            print(f"  jax: skipped ({e})")
    if "cupy" in fw:
        cp = fw["cupy"]
        dst = cp.full(4096, -1, dtype=cp.int32)
        st = pinstage.PinnedStager(cp.int32, 256, 8)
        vals = np.arange(1, 257, dtype=np.int32)
        for _ in _progress(range(reps(500)), "cupy: padded H2D copies", reps(500)):
            st.copy_(dst, vals, pad_value=9)
        cp.cuda.runtime.deviceSynchronize()
        got = cp.asnumpy(dst)
        assert np.array_equal(got[:256], vals) and (got[256:] == 9).all()
        src = cp.arange(4 << 20, dtype=cp.float32)
        out = pinstage.copy_d2h(src)
        assert np.array_equal(out, np.arange(4 << 20, dtype=np.float32))
        t_ours = _median_us(lambda: pinstage.copy_d2h(src), 10)
        t_theirs = _median_us(lambda: src.get(), 10)
        rows.append(("cupy", "16 MiB D2H (GB/s)", 16.78 / t_ours * 1e3, 16.78 / t_theirs * 1e3, ".get()"))
    if rows:
        print("\n  framework  work                                         pinstage      peer   peer path")
        for fwn, work, a, b, peer in rows:
            print(f"  {fwn:<9}  {work:<44} {a:>9.2f} {b:>9.2f}   {peer}")
        print("  (every result above was checked element by element)")
    else:
        print("  no framework found (torch, jax, cupy): nothing to demo on the GPU")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m pinstage", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a tenth of the repetitions")
    a = p.parse_args(argv)
    info = pinstage.driver_info()
    print(f"pinstage {pinstage.__version__}")
    if info["available"]:
        v = info["driver_version"]
        print(f"  CUDA driver: {v // 1000}.{(v % 1000) // 10}, {info['device_count']} device(s)")
    else:
        print(f"  CUDA driver: not usable ({info['reason']})")
    fw = _frameworks()
    print("  frameworks:  " + (", ".join(f"{k} {getattr(m, '__version__', '?')}" for k, m in fw.items()) or "none"))
    if not info["available"]:
        _cpu_demo()
        return 0
    if "torch" in fw:
        print(f"  device 0:    {fw['torch'].cuda.get_device_name(0)}")
    _gpu_demo(fw, a.quick)
    print(f"\n  pinned memory held by pinstage: {pinstage.pinned_bytes() / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
