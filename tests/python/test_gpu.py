"""GPU tests (marker `gpu`), run on the H200 by scripts/gpu-run with PINSTAGE_REQUIRE_GPU=1.
Elsewhere they are skipped with the reason."""

import gc
import threading
import time

import numpy as np
import pytest

import pinstage
from conftest import DTYPES, SIZES, np_dtype, pad_for, rand_values

pytestmark = pytest.mark.gpu
POISON = 0xA5

TORCH_DT = {
    "bool": "bool", "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
    "uint8": "uint8", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
    "float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "float64": "float64",
    "complex64": "complex64", "complex128": "complex128",
}


def torch_poisoned(torch, name, n, extra=3):
    dt = getattr(torch, TORCH_DT[name])
    item = np_dtype(name).itemsize
    raw = torch.full(((n + extra) * item,), POISON, dtype=torch.uint8, device="cuda")
    return raw, raw.view(dt)


def host_bytes(t):
    return t.cpu().contiguous().view(-1).view(__import__("torch").uint8).numpy()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", DTYPES)
def test_torch_stager_matrix(gpu, name, size):
    torch = pytest.importorskip("torch")
    st = pinstage.PinnedStager(name if name != "bfloat16" else torch.bfloat16, 256, 2)
    item = np_dtype(name).itemsize
    for nvals, pad in [(size, None), (size // 2, pad_for(name)), (size // 2, None)]:
        raw, full = torch_poisoned(torch, name, size)
        dst = full[:size]
        vals = rand_values(name, nvals, seed=size * 3 + nvals)
        st.copy_(dst, vals, pad_value=pad)
        torch.cuda.synchronize()
        got = raw.cpu().numpy()
        assert (got[: nvals * item] == vals.view(np.uint8)).all(), "values differ"
        touched = size if pad is not None else nvals
        if pad is not None:
            expect = np.full(size - nvals, pad, dtype=np_dtype(name)).view(np.uint8)
            assert (got[nvals * item : size * item] == expect).all(), "padding differs"
        assert (got[touched * item :] == POISON).all(), "bytes past the copy were touched"


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", DTYPES)
def test_torch_copy_d2h_matrix(gpu, name, size):
    torch = pytest.importorskip("torch")
    vals = rand_values(name, size, seed=size + 11)
    tdt = getattr(torch, TORCH_DT[name])
    if size:
        src = torch.from_numpy(vals.view(np.uint8).copy()).cuda().view(tdt)
    else:
        src = torch.empty(0, dtype=tdt, device="cuda")
    out = pinstage.copy_d2h(src)
    assert out.shape == tuple(src.shape) and out.flags.writeable
    assert out.dtype == np_dtype(name)
    assert (out.view(np.uint8) == vals.view(np.uint8)).all()
    if size:
        assert pinstage.is_pinned(out)
    dst = pinstage.empty_pinned(size * np_dtype(name).itemsize + 5, np.uint8)
    dst[:] = POISON
    out2 = pinstage.copy_d2h(src, dst)
    assert (out2.view(np.uint8) == vals.view(np.uint8)).all()
    assert (dst[size * np_dtype(name).itemsize :] == POISON).all()


@pytest.mark.parametrize("name", ["int32", "float64", "uint8", "complex64", "bool"])
def test_cupy_stager_and_d2h(gpu, name):
    cp = pytest.importorskip("cupy")
    n = 4096
    raw = cp.full(((n + 3) * np_dtype(name).itemsize,), POISON, dtype=cp.uint8)
    dst = raw.view(np_dtype(name))[:n]
    st = pinstage.PinnedStager(cp.dtype(name), 256, 4)
    vals = rand_values(name, 300, 5)
    s = cp.cuda.Stream(non_blocking=True)
    st.copy_(dst, vals, pad_value=pad_for(name), stream=s)
    s.synchronize()
    got = cp.asnumpy(dst)
    np.testing.assert_array_equal(got[:300], vals)
    np.testing.assert_array_equal(got[300:], np.full(n - 300, pad_for(name), np_dtype(name)))
    assert (cp.asnumpy(raw)[n * np_dtype(name).itemsize :] == POISON).all()
    out = pinstage.copy_d2h(dst)
    np.testing.assert_array_equal(out, got)


@pytest.mark.parametrize("name", ["int32", "float32", "bfloat16", "int8", "complex64"])
def test_jax_copy_d2h(gpu, name):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    vals = rand_values(name, 100_003, 9)
    x = jax.device_put(jnp.asarray(vals), jax.devices("gpu")[0])
    out = pinstage.copy_d2h(x)
    assert out.dtype == np_dtype(name)
    np.testing.assert_array_equal(out.view(np.uint8), vals.view(np.uint8))
    p = pinstage.copy_d2h_async(x * 1 if name != "bool" else x)
    np.testing.assert_array_equal(p.wait().view(np.uint8), np.asarray(x).view(np.uint8))


def test_default_stream_is_torchs_current_stream(gpu):
    torch = pytest.importorskip("torch")
    side = torch.cuda.Stream()
    n = 1 << 20
    dst = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    st = pinstage.PinnedStager(torch.int32, 256, 2)
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the side stream busy (~25 ms)
        src = torch.arange(n, dtype=torch.int32, device="cuda") * 3  # made on the side stream
        out = pinstage.copy_d2h(src)  # stream=None: torch's current stream, no manual sync
        np.testing.assert_array_equal(out, np.arange(n, dtype=np.int32) * 3)
        torch.cuda._sleep(50_000_000)
        st.copy_(dst, [7, 8, 9], pad_value=5)  # ordered after the sleep on `side`
        dst.add_(1)  # a later kernel on `side` must see our copy
    side.synchronize()
    got = dst.cpu().numpy()
    assert got[:3].tolist() == [8, 9, 10] and (got[3:] == 6).all()


def test_bound_target_mirror_and_plan_thread(gpu):
    torch = pytest.importorskip("torch")
    dst = torch.full((4096,), -9, dtype=torch.int32, device="cuda")
    st = pinstage.PinnedStager(torch.int32, 256, 8)
    t = st.target(dst, pad_value=0, skip_unchanged=True)
    vals = np.arange(1, 257, dtype=np.int32)
    assert t.copy_(vals)
    assert not t.copy_(vals)
    assert st.stats()["skipped_copies"] == 1
    errors = []

    def plan():  # a plan thread that never touched CUDA: no current context
        try:
            for i in range(100):
                t.copy_(vals + i)
        except Exception as e:
            errors.append(e)

    th = threading.Thread(target=plan)
    th.start()
    th.join()
    assert not errors
    torch.cuda.synchronize()
    got = dst.cpu().numpy()
    np.testing.assert_array_equal(got[:256], vals + 99)
    assert (got[256:] == 0).all()


@pytest.mark.parametrize("stream_kind", ["legacy", "side"])
def test_one_query_serves_several_claims(gpu, stream_kind):
    """400 padded copies through a ring of 8 to 400 slices, synchronized every 4 copies: every
    slice holds its own values, and the stager asked the driver about far fewer slots than it
    reused (the stream's completion watermark)."""
    torch = pytest.importorskip("torch")
    n, width, copies = 24, 64, 400
    big = torch.full((copies * width,), -12345, dtype=torch.int32, device="cuda")
    st = pinstage.PinnedStager(torch.int32, width, 8)
    side = torch.cuda.Stream() if stream_kind == "side" else None
    with torch.cuda.stream(side) if side is not None else torch.cuda.stream(torch.cuda.default_stream()):
        for k in range(copies):
            st.copy_(big[k * width : (k + 1) * width], np.arange(n, dtype=np.int32) + 1000 * k + 1, pad_value=-k - 1)
            if k % 4 == 3:
                torch.cuda.current_stream().synchronize()
    torch.cuda.synchronize()
    got = big.cpu().numpy().reshape(copies, width)
    for k in range(copies):
        np.testing.assert_array_equal(got[k, :n], np.arange(n, dtype=np.int32) + 1000 * k + 1)
        assert (got[k, n:] == -k - 1).all(), k
    s = st.stats()
    assert s["copies"] == copies and s["waits"] == 0
    assert s["queries"] <= (copies - 8) // 3, s


def test_capture_is_refused(gpu):
    torch = pytest.importorskip("torch")
    dst = torch.zeros(16, dtype=torch.int32, device="cuda")
    st = pinstage.PinnedStager(torch.int32, 16, 2)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        dst.add_(1)  # warm up on the side stream
    torch.cuda.synchronize()
    with pytest.raises(pinstage.StreamCaptureError, match="capturing a CUDA graph"):
        with torch.cuda.graph(g, stream=s):
            dst.add_(1)
            st.copy_(dst, [5])
    assert st.stats()["copies"] == 0


def test_pool_reuse_and_budget(gpu):
    """Counts relative to what is in use when the test starts: a result of an earlier test may
    still be alive (seen under compute-sanitizer, where pytest ran a different test order)."""
    torch = pytest.importorskip("torch")
    gc.collect()
    pinstage.empty_cache()
    base = pinstage.pool_stats()["in_use_bytes"]
    src = torch.arange(1 << 20, dtype=torch.float32, device="cuda") + 0.5
    a = pinstage.copy_d2h(src)
    s1 = pinstage.pool_stats()
    del a
    b = pinstage.copy_d2h(src)
    s2 = pinstage.pool_stats()
    assert s2["hits"] == s1["hits"] + 1 and s2["misses"] == s1["misses"]
    np.testing.assert_array_equal(b, src.cpu().numpy())
    view = b[10:20]
    del b
    assert pinstage.pool_stats()["in_use_bytes"] > base, "a view keeps the block"
    del view
    assert pinstage.pool_stats()["in_use_bytes"] == base
    pinstage.set_pool_budget(base + (2 << 20))
    try:
        big = pinstage.copy_d2h(torch.ones(1 << 20, dtype=torch.float64, device="cuda"))
        assert (big == 1).all()
        s = pinstage.pool_stats()
        assert s["pageable_fallbacks"] >= 1
        assert s["in_use_bytes"] + s["pooled_bytes"] <= base + (2 << 20)
    finally:
        pinstage.set_pool_budget(4 << 30)


def test_two_threads_on_one_slot_behind_gpu_work_neither_deadlock_nor_lose_a_copy(gpu):
    """Two Python threads copy through a stager of depth 1, each copy queued behind ~1 ms of GPU
    work on its thread's stream and neither thread waiting for its own copies until the end. So
    a thread that claims the slot waits ~1 ms for the OTHER thread's copy, and meanwhile that
    thread comes back for the slot. A copy that holds the GIL deadlocks there: the waiter needs
    the GIL back to return, the returning thread spins for the slot holding it. The threads run
    in a child process with a time limit. Every copy of both threads lands in its own poisoned
    row and is read back at the end (values distinct per copy and thread, a pad)."""
    import subprocess
    import sys
    import textwrap

    pytest.importorskip("torch")
    code = textwrap.dedent(
        """
        import threading
        import numpy as np, torch, pinstage
        N = 100
        st = pinstage.PinnedStager(np.int32, 1024, 1)
        errors, copies = [], [0, 0]
        def work(k):
            try:
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    rows = torch.full((N, 1024), -7, dtype=torch.int32, device="cuda")
                    views = [rows[i] for i in range(N)]
                    s.synchronize()
                    for i in range(N):
                        torch.cuda._sleep(2_000_000)
                        st.copy_(views[i], np.full(1000, k * 100000 + i, np.int32), -1, stream=s)
                        copies[k] += 1
                    got = rows.cpu().numpy()
                for i in range(N):
                    v = k * 100000 + i
                    if not ((got[i, :1000] == v).all() and (got[i, 1000:] == -1).all()):
                        errors.append(f"thread {k} copy {i}: {got[i, :3]} ... {got[i, -3:]}")
            except Exception as e:
                errors.append(repr(e))
        ts = [threading.Thread(target=work, args=(k,)) for k in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        print("copies", copies, "errors", len(errors), errors[:5])
        print("ok" if not errors and copies == [N, N] else "FAILED")
        """
    )
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=45)
    except subprocess.TimeoutExpired:
        pytest.fail("two threads copying through one slot did not finish in 45 s (deadlock)")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_async_d2h_overlaps_and_releases_gil(gpu):
    """The copy is issued at once; while `wait()` blocks, another Python thread runs (the GIL
    is released): it ticks many times before `wait()` returns."""
    torch = pytest.importorskip("torch")
    src = torch.randn(64 << 20, device="cuda")  # 256 MiB
    pinstage.copy_d2h(src)  # warm the pool: the timed call must not pay cuMemHostAlloc
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the copy waits behind ~100 ms of GPU time
    t0 = time.perf_counter()
    p = pinstage.copy_d2h_async(src)
    issue = time.perf_counter() - t0
    assert not p.done(), "the copy is queued behind the sleep"
    ticks = []
    th = threading.Thread(target=lambda: [ticks.append(time.perf_counter()) or time.sleep(0.001) for _ in range(40)])
    th.start()
    out = p.wait()
    returned = time.perf_counter()
    th.join()
    assert p.done()
    during = sum(t < returned for t in ticks)
    assert during >= 20, f"only {during} ticks while wait() blocked: the GIL was held"
    assert issue < (returned - t0) / 4, f"issue {issue*1e3:.2f} ms vs total {(returned - t0)*1e3:.2f} ms"
    np.testing.assert_array_equal(out, src.cpu().numpy())
    with pytest.raises(TimeoutError):
        torch.cuda._sleep(200_000_000)
        pinstage.copy_d2h_async(src).wait(timeout=0.001)
    torch.cuda.synchronize()


@pytest.mark.parametrize("nbytes", [4, 1024, 256 << 10])
@pytest.mark.parametrize("kind", ["pinned", "torch pinned", "pageable"])
def test_small_copy_d2h_behind_gpu_work_releases_the_gil_and_lands(gpu, nbytes, kind):
    """A small copy into pinned memory waited for at once is issued with the GIL held and spun
    for briefly; queued behind ~50 ms of GPU work it must let other Python threads run while it
    waits, return only once its bytes are there (a poisoned destination), and hand back every
    byte. A pageable destination (the bounce ring, which waits behind the stream's work) releases
    the GIL first."""
    torch = pytest.importorskip("torch")
    n = nbytes // 4
    src = torch.arange(1, n + 1, dtype=torch.int32, device="cuda") * 7
    want = src.cpu().numpy()
    if kind == "pinned":
        dst = pinstage.empty_pinned(n, np.int32)
    elif kind == "torch pinned":
        dst = torch.empty(n, dtype=torch.int32).pin_memory().numpy()
    else:
        dst = np.empty(n, np.int32)
    for _ in range(3):
        dst.fill(-1)
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time before the copy
        ticks = []
        th = threading.Thread(
            target=lambda: [ticks.append(time.perf_counter()) or time.sleep(0.001) for _ in range(30)]
        )
        t0 = time.perf_counter()
        th.start()
        out = pinstage.copy_d2h(src, dst)
        returned = time.perf_counter()
        th.join()
        assert returned - t0 > 0.01, "returned before the GPU work ahead of the copy ran"
        assert sum(t < returned for t in ticks) >= 5, "the GIL was held while waiting"
        assert out is dst
        np.testing.assert_array_equal(dst, want)
    torch.cuda.synchronize()


def _interrupt_after(seconds):
    import _thread

    t = threading.Timer(seconds, _thread.interrupt_main)
    t.start()
    return t


def test_pending_copy_wait_answers_ctrl_c_and_stays_guarded(gpu):
    torch = pytest.importorskip("torch")
    src = torch.arange(1 << 20, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time before the copy
    p = pinstage.copy_d2h_async(src)
    timer = _interrupt_after(0.05)
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        p.wait()
    late = time.perf_counter() - t0 - 0.05
    timer.join()
    assert late < 0.1, f"KeyboardInterrupt came {late*1e3:.0f} ms after Ctrl-C"
    assert not p.done(), "the copy is still queued"
    out = p.wait()  # still guarded: waiting again gives the right data
    np.testing.assert_array_equal(out, np.arange(1 << 20, dtype=np.int32))


def test_slot_wait_answers_ctrl_c_and_releases_the_gil(gpu):
    torch = pytest.importorskip("torch")
    dst = torch.full((4096,), -5, dtype=torch.int32, device="cuda")
    st = pinstage.PinnedStager(torch.int32, 256, 1)  # one slot: the second copy must wait
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    first = np.arange(1, 257, dtype=np.int32)
    st.copy_(dst, first, pad_value=-1)
    ticks = []
    th = threading.Thread(target=lambda: [ticks.append(time.perf_counter()) or time.sleep(0.001) for _ in range(30)])
    th.start()
    timer = _interrupt_after(0.08)
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        st.copy_(dst, first + 1000, pad_value=-2)
    interrupted = time.perf_counter()
    timer.join()
    th.join()
    assert interrupted - t0 - 0.08 < 0.1, "Ctrl-C answered late"
    assert sum(t < interrupted for t in ticks) >= 20, "the GIL was held while waiting for the slot"
    assert st.stats()["copies"] == 1 and st.stats()["waits"] == 1
    torch.cuda.synchronize()
    got = dst.cpu().numpy()
    np.testing.assert_array_equal(got[:256], first)
    assert (got[256:] == -1).all(), "the interrupted copy wrote nothing"
    st.copy_(dst, first + 7, pad_value=-3)  # the slot is usable again
    torch.cuda.synchronize()
    got = dst.cpu().numpy()
    np.testing.assert_array_equal(got[:256], first + 7)
    assert (got[256:] == -3).all()


@pytest.mark.parametrize("kind", ["torch", "cupy", "cuda_stream_protocol", "int"])
def test_copies_run_on_the_stream_given(gpu, kind):
    """On stream s: a long sleep, then a fill of dst with 7, then pinstage's copy. On s the copy
    lands after the fill; on any other (idle) stream it would land first and be overwritten."""
    torch = pytest.importorskip("torch")
    s = torch.cuda.Stream()
    if kind == "torch":
        arg = s
    elif kind == "cupy":
        cp = pytest.importorskip("cupy")
        arg = cp.cuda.ExternalStream(s.cuda_stream)
    elif kind == "cuda_stream_protocol":

        class Proto:
            def __cuda_stream__(self):
                return (0, s.cuda_stream)

        arg = Proto()
    else:
        arg = s.cuda_stream
    dst = torch.full((4096,), -5, dtype=torch.int32, device="cuda")
    st = pinstage.PinnedStager(torch.int32, 256, 4)
    vals = np.arange(1, 301, dtype=np.int32)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)
        dst.fill_(7)
    st.copy_(dst, vals, pad_value=-9, stream=arg)
    t = st.target(dst, pad_value=-8)
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)
        dst.fill_(7)
    t.copy_(vals + 1, stream=arg)
    s.synchronize()
    got = dst.cpu().numpy()
    np.testing.assert_array_equal(got[:300], vals + 1)
    assert (got[300:] == -8).all()
    src = torch.arange(1 << 16, dtype=torch.int32, device="cuda")
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)
        src.add_(3)
    out = pinstage.copy_d2h(src, stream=arg)  # ordered after the add on s
    np.testing.assert_array_equal(out, np.arange(1 << 16, dtype=np.int32) + 3)


def test_driver_refusals_are_cuda_driver_errors(gpu):
    """A producer that claims CUDA memory at an address no allocation holds: the driver refuses
    the copy, pinstage raises CudaDriverError naming the call, and the stager stays usable. In a
    subprocess: should a driver accept such a copy and fault, the context of this process must
    not be the one poisoned."""
    import subprocess
    import sys

    code = r"""
import sys, numpy as np, torch, pinstage
sys.path.insert(0, "tests/python")
from conftest import CapsuleProducer, make_capsule
st = pinstage.PinnedStager(np.int32, 16, 1)
keep = np.zeros(1)
bogus = CapsuleProducer(make_capsule(keep, data=0x10, device=(2, 0), shape=(16,)))
try:
    st.copy_(bogus, [1, 2])
    print("accepted")
except pinstage.CudaDriverError as e:
    print("CudaDriverError", str(e)[:80])
assert st.stats()["copies"] == 0
d = torch.full((16,), -1, dtype=torch.int32, device="cuda")
st.copy_(d, [1, 2], pad_value=0)
torch.cuda.synchronize()
assert d.tolist() == [1, 2] + [0] * 14, d.tolist()
print("slot released")
"""
    root = __import__("pathlib").Path(__file__).parents[2]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "CudaDriverError" in r.stdout and "cuMemcpyHtoDAsync" in r.stdout, r.stdout
    assert "slot released" in r.stdout, r.stdout


def test_pinned_helpers_on_the_gpu(gpu):
    """alloc_pinned_numpy's success path, PinnedBlock's properties, is_pinned with an address
    and a False answer, the stager's properties and pool_stats(device)."""
    a = pinstage.alloc_pinned_numpy(64, "int32", (2, 8))
    assert a.shape == (2, 8) and a.dtype == np.int32 and a.flags.writeable
    a[:] = 7
    blk = a.base
    assert isinstance(blk, pinstage.PinnedBlock)
    assert blk.nbytes == 64 and blk.pinned and blk.address == a.ctypes.data
    assert pinstage.is_pinned(a) and pinstage.is_pinned(a.ctypes.data)
    assert not pinstage.is_pinned(np.zeros(16)) and not pinstage.is_pinned(np.zeros(16).ctypes.data)
    st = pinstage.PinnedStager(np.int16, 32, 3, device=0)
    assert (st.numel, st.depth, st.device, st.cuda, st.dtype) == (32, 3, 0, True, "int16")
    assert set(pinstage.pool_stats(device=0)) == set(pinstage.pool_stats(device="cuda:0"))
    info = pinstage.driver_info()
    assert info["available"] and info["reason"] is None and info["device_count"] >= 1
    assert info["driver_version"] >= 12080


def test_jax_device_arrays_are_never_written(gpu):
    jax = pytest.importorskip("jax")
    x = jax.device_put(jax.numpy.arange(64, dtype=jax.numpy.int32), jax.devices("gpu")[0])
    st = pinstage.PinnedStager(np.int32, 64, 2)
    with pytest.raises(ValueError, match="JAX arrays are immutable"):
        st.copy_(x, [9, 9, 9])
    with pytest.raises(ValueError, match="JAX arrays are immutable"):
        st.target(x)
    assert np.asarray(x).tolist() == list(range(64))


def test_wrong_device_and_pageable_dst(gpu):
    torch = pytest.importorskip("torch")
    src = torch.arange(10_000_000, dtype=torch.int64, device="cuda")
    dst = np.full(10_000_000, -1, np.int64)  # pageable: bounce ring
    out = pinstage.copy_d2h(src, dst)
    np.testing.assert_array_equal(dst, np.arange(10_000_000))
    assert out is dst  # dst has src's dtype and shape: it is the result
    view = pinstage.copy_d2h(src[:1000], np.full(8000, 0xFF, np.uint8))  # another dtype: a view
    assert view.dtype == np.int64 and view.base is not None
    np.testing.assert_array_equal(view, np.arange(1000))
    st = pinstage.PinnedStager(torch.int64, 16, 2, device=0)
    if torch.cuda.device_count() > 1:
        other = torch.zeros(4, dtype=torch.int64, device="cuda:1")
        with pytest.raises(ValueError, match="device 1"):
            st.copy_(other, [1])


def test_many_python_threads_one_stager(gpu):
    """8 threads (torch and cupy destinations) share one ring of 4; every copy goes to its own
    slice of a poisoned buffer, and every slice is checked: values, then the thread's pad."""
    torch = pytest.importorskip("torch")
    cp = pytest.importorskip("cupy")
    st = pinstage.PinnedStager(np.int32, 64, 4)
    per, width = 300, 512
    tbig = [torch.full((per * width,), -77777, dtype=torch.int32, device="cuda") for _ in range(4)]
    cbig = [cp.full((per * width,), -77777, dtype=cp.int32) for _ in range(4)]
    sent = {}
    errors = []

    def work(k, big):
        try:
            rng = np.random.default_rng(k)
            for i in range(per):
                n = int(rng.integers(1, width))
                v = rng.integers(-1000, 1000, n, dtype=np.int32)
                st.copy_(big[i * width : (i + 1) * width], v, pad_value=-k - 1)
                sent[(k, i)] = v
        except Exception as e:
            errors.append(e)

    ths = [threading.Thread(target=work, args=(k, d)) for k, d in enumerate(tbig + cbig)]
    [t.start() for t in ths]
    [t.join() for t in ths]
    assert not errors
    torch.cuda.synchronize()
    cp.cuda.runtime.deviceSynchronize()
    for k, d in enumerate(tbig + cbig):
        got = (d.cpu().numpy() if hasattr(d, "cpu") else cp.asnumpy(d)).reshape(per, width)
        for i in range(per):
            v = sent[(k, i)]
            np.testing.assert_array_equal(got[i, : len(v)], v, err_msg=f"thread {k} copy {i}")
            assert (got[i, len(v) :] == -k - 1).all(), f"thread {k} copy {i} pad"
    assert st.stats()["copies"] == 8 * per


def test_fork_child_gets_a_clear_error(gpu):
    import os

    pinstage.empty_pinned(16, np.uint8)  # CUDA initialised in the parent
    pid = os.fork()
    if pid == 0:  # child: every CUDA entry must raise, nothing may hang
        code = 1
        try:
            pinstage.empty_pinned(16, np.uint8)
        except pinstage.CudaUnavailableError as e:
            code = 0 if "fork" in str(e) else 2
        except BaseException:
            code = 3
        os._exit(code)
    deadline = time.time() + 20
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        os.kill(pid, 9)
        pytest.fail("forked child hung")
    assert os.WEXITSTATUS(status) == 0, f"child exit {os.WEXITSTATUS(status)}"


def test_leaks_pinned_arrays_pool_blocks_and_stagers(gpu):
    torch = pytest.importorskip("torch")

    def rss():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) * 1024

    # Collected first, then emptied: empty_cache() waits for the frees of what was collected.
    gc.collect()
    pinstage.empty_cache()
    base_pinned, base_rss = pinstage.pinned_bytes(), rss()
    for i in range(100_000):
        a = pinstage.empty_pinned(64, np.int32)
        a[0] = i
    src = torch.arange(1024, dtype=torch.int32, device="cuda")
    budget = pinstage.pool_stats()["max_outstanding_bytes"]
    for i in range(100_000):
        b = pinstage.copy_d2h(src)
        assert b[5] == 5
        s = pinstage.pool_stats()
        assert s["in_use_bytes"] + s["pooled_bytes"] <= budget
    del a, b
    for i in range(1000):
        st = pinstage.PinnedStager(np.int32, 256, 8)
        st.copy_(src, np.full(16, i, np.int32))
        del st
    torch.cuda.synchronize()
    gc.collect()
    pinstage.empty_cache()
    assert pinstage.pinned_bytes() == base_pinned, (pinstage.pinned_bytes(), base_pinned)
    assert rss() - base_rss < 64 << 20, f"RSS grew by {(rss() - base_rss) >> 20} MiB"


def test_lifetimes_drop_while_in_flight(gpu):
    torch = pytest.importorskip("torch")

    big = torch.randn(32 << 20, device="cuda")
    big2 = torch.randn(32 << 20, device="cuda")
    side = torch.cuda.Stream()
    for _ in range(3):
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)
        p = pinstage.copy_d2h_async(big)
        t0 = time.perf_counter()
        del p  # never blocks: pinstage keeps the block and the source until the copy completed
        assert time.perf_counter() - t0 < 0.005
        # A result of the same size on an idle stream: had the block in flight gone back to the
        # pool, this copy would get it and the queued one would overwrite it later.
        other = pinstage.copy_d2h(big2, stream=side)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(other, big2.cpu().numpy())
        torch.cuda._sleep(20_000_000)
        dst = pinstage.empty_pinned(big.numel(), np.float32)
        p = pinstage.copy_d2h_async(big, dst)
        del dst  # the PendingCopy's array keeps dst alive
        out = p.wait()
        np.testing.assert_array_equal(out, big.cpu().numpy())
        d = torch.zeros(4096, dtype=torch.int32, device="cuda")
        st = pinstage.PinnedStager(torch.int32, 256, 2)
        t = st.target(d, pad_value=1)
        torch.cuda._sleep(20_000_000)
        t.copy_(np.arange(256, dtype=np.int32))
        del st, t  # the target keeps the stager; dropping both waits for the ring
        gc.collect()
        torch.cuda.synchronize()
        got = d.cpu().numpy()
        assert (got[:256] == np.arange(256)).all() and (got[256:] == 1).all()


@pytest.mark.two_gpus
def test_two_gpus(gpu):
    """4 threads per GPU, each its own stager's copies to distinct slices: every copy checked."""
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.fail("needs two GPUs (run with -m 'not two_gpus' on one GPU)")
    stagers = [pinstage.PinnedStager(torch.int64, 64, 4, device=i) for i in range(2)]
    per, width = 500, 128
    bigs = [[torch.full((per * width,), -5, dtype=torch.int64, device=f"cuda:{i}") for _ in range(4)] for i in range(2)]
    errors = []

    def value(dev, k, i):
        return np.arange(100, dtype=np.int64) + i * 1000 + dev * 10**9 + k * 10**6

    def work(dev, k):
        try:
            for i in range(per):
                stagers[dev].copy_(bigs[dev][k][i * width : (i + 1) * width], value(dev, k, i), pad_value=-dev - 1)
            out = pinstage.copy_d2h(bigs[dev][k])
            assert out.shape == (per * width,)
        except Exception as e:
            errors.append(e)

    ths = [threading.Thread(target=work, args=(d, k)) for d in range(2) for k in range(4)]
    [t.start() for t in ths]
    [t.join() for t in ths]
    assert not errors, errors
    for d in range(2):
        torch.cuda.synchronize(d)
        for k in range(4):
            got = bigs[d][k].cpu().numpy().reshape(per, width)
            for i in range(per):
                np.testing.assert_array_equal(got[i, :100], value(d, k, i))
                assert (got[i, 100:] == -d - 1).all()
    with pytest.raises(ValueError, match="device 1, but this stager serves device 0"):
        stagers[0].copy_(bigs[1][0], [1])


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", [d for d in DTYPES if d != "bfloat16"])
def test_cupy_matrix(gpu, name, size):
    cp = pytest.importorskip("cupy")
    item = np_dtype(name).itemsize
    raw = cp.full(((size + 3) * item,), POISON, dtype=cp.uint8)
    dst = raw.view(np_dtype(name))[:size]
    st = pinstage.PinnedStager(cp.dtype(name), 256, 2)
    nvals = size // 2
    vals = rand_values(name, nvals, seed=size + 17)
    st.copy_(dst, vals, pad_value=pad_for(name))
    cp.cuda.runtime.deviceSynchronize()
    got = cp.asnumpy(raw)
    assert (got[: nvals * item] == vals.view(np.uint8)).all()
    expect = np.full(size - nvals, pad_for(name), dtype=np_dtype(name)).view(np.uint8)
    assert (got[nvals * item : size * item] == expect).all()
    assert (got[size * item :] == POISON).all()
    out = pinstage.copy_d2h(dst)
    assert (out.view(np.uint8) == got[: size * item]).all()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", DTYPES)
def test_jax_gpu_matrix(gpu, name, size):
    jax = pytest.importorskip("jax")
    vals = rand_values(name, size, seed=size + 23)
    with jax.enable_x64(True):
        x = jax.device_put(jax.numpy.asarray(vals), jax.devices("gpu")[0])
        out = pinstage.copy_d2h(x)
    assert out.dtype == vals.dtype and out.shape == vals.shape
    assert (out.view(np.uint8) == vals.view(np.uint8)).all()


_HANDLE_CHILD = r"""
import gc, sys, numpy as np, cupy as cp, torch, pinstage
case = sys.argv[1]
keep = [bytearray(256) for _ in range(4)]
big = np.empty(1 << 20, np.uint8)
if case == "closed-cupy":
    s = cp.cuda.Stream(non_blocking=True)
    h = s.ptr
    del s  # cupy destroys the stream
    gc.collect()
elif case == "used-then-closed-cupy":
    # Taken as a live stream first (pinstage remembers live handles), then destroyed.
    s = cp.cuda.Stream(non_blocking=True)
    h = s.ptr
    pinstage.copy_h2d(torch.zeros(4, dtype=torch.int32, device="cuda"), np.arange(4, dtype=np.int32), stream=h)
    s.synchronize()  # idle, so the driver frees it at once
    del s
    gc.collect()
elif case == "garbage":
    h = 0xDEAD0000
elif case == "python-object":
    h = id(keep[2]) & ~7
elif case == "numpy-data":
    h = big.ctypes.data + 4096
elif case == "event":
    ev = cp.cuda.Event()
    h = ev.ptr
elif case.startswith("heap"):
    lo, hi = next(
        [int(x, 16) for x in l.split()[0].split("-")]
        for l in open("/proc/self/maps") if l.rstrip().endswith("[heap]")
    )
    h = (lo + 0x1000 if case == "heap-start" else (lo + hi) // 2) & ~7
else:
    raise SystemExit("unknown case " + case)
if len(sys.argv) > 2 and sys.argv[2] == "protocol":
    # The same handle from an object with __cuda_stream__ that is no torch or cupy stream.
    class Proto:
        def __init__(self, h):
            self.h = h

        def __cuda_stream__(self):
            return (0, self.h)

    raw, h = h, Proto(h)
else:
    raw = h
dst = torch.full((16,), -7, dtype=torch.int32, device="cuda")
src = np.arange(16, dtype=np.int32) + 100
step = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 16)}), depth=2)
step.stage({"ids": [5, 6, 7]})
ps = pinstage.PinnedStager("int32", 16, 2)
calls = {
    "PinnedStager.copy_": lambda: ps.copy_(dst, [1, 2], stream=h),
    "StepStager.stage": lambda: step.stage({"ids": [1]}, stream=h),
    "StepStager.step": lambda: step.step(stream=h),
    "copy_h2d": lambda: pinstage.copy_h2d(dst, src, stream=h),
    "to_device": lambda: pinstage.to_device(src, "torch", stream=h),
    "copy_d2h": lambda: pinstage.copy_d2h(dst, stream=h),
    # DLPack's stream argument is an int: the protocol case passes the int itself.
    "StepTensor.__dlpack__": lambda: step.field("ids").__dlpack__(stream=raw),
}
for name, call in calls.items():
    try:
        call()
        print(name, "accepted", flush=True)
    except pinstage.PinstageError as e:
        print(name, "raised", type(e).__name__, str(e)[:100], flush=True)
torch.cuda.synchronize()
assert (dst.cpu().numpy() == -7).all(), "a refused copy wrote"
assert step.read_field("ids")[:3].tolist() == [5, 6, 7], "a refused step wrote"
print("alive", flush=True)
"""


@pytest.mark.parametrize(
    "case, wrap",
    [(c, "int") for c in ["closed-cupy", "used-then-closed-cupy", "garbage", "python-object", "numpy-data",
                          "event", "heap-start", "heap-middle"]]
    + [(c, "protocol") for c in ["closed-cupy", "garbage", "python-object"]],
)
def test_integers_that_are_no_live_stream_are_refused(gpu, case, wrap):
    """The driver dereferences a stream handle without validating it: an int into ordinary memory
    (a Python object, the heap, an event, a destroyed stream) crashed the process on driver 580.
    Every entry that takes a stream refuses such an int with a typed error and writes nothing, and
    so does an object whose ``__cuda_stream__()`` gives one ("protocol"; torch and cupy stream
    objects are trusted). Each case runs in a child process, so a crash fails the test instead of
    ending pytest."""
    pytest.importorskip("cupy")
    pytest.importorskip("torch")
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", _HANDLE_CHILD, case, wrap], capture_output=True, text=True, timeout=120
    )
    print(r.stdout, r.stderr[-2000:])
    assert r.returncode == 0, f"the process died (rc {r.returncode}): {r.stdout} {r.stderr[-500:]}"
    assert "alive" in r.stdout
    lines = [line for line in r.stdout.splitlines() if " raised " in line or " accepted" in line]
    assert len(lines) == 7, r.stdout
    for line in lines:
        assert " raised PinstageValueError" in line and "stream" in line, line


def test_live_stream_integers_are_accepted(gpu):
    """The other side of the check: the integer handles of live torch and cupy streams (and the
    special 0, 1, 2) are taken, and copies on them land."""
    torch = pytest.importorskip("torch")
    cp = pytest.importorskip("cupy")
    ts = torch.cuda.Stream()
    cs = cp.cuda.Stream(non_blocking=True)
    blocking = cp.cuda.Stream()  # cupy's default: a blocking stream
    step = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 16)}), depth=2)
    for i, h in enumerate([ts.cuda_stream, cs.ptr, blocking.ptr, torch.cuda.current_stream().cuda_stream, 1, 2]):
        dst = torch.full((16,), -7, dtype=torch.int32, device="cuda")
        src = np.arange(16, dtype=np.int32) * 3 + i
        pinstage.copy_h2d(dst, src, stream=h)
        assert (dst.cpu().numpy() == src).all()
        step.stage({"ids": [i + 11, i + 12]}, stream=h)
        if h > 2:
            torch.cuda.ExternalStream(h).synchronize()
        torch.cuda.synchronize()
        assert step.read_field("ids")[:2].tolist() == [i + 11, i + 12]
        out = pinstage.copy_d2h(dst, stream=h)
        assert (out == src).all()
