"""copy_h2d: whole host arrays into device tensors (GPU), and the host-destination path and
every refusal (everywhere)."""

import threading
import time

import numpy as np
import pytest

import pinstage
from conftest import DTYPES, np_dtype, rand_values

POISON = 0xA5


@pytest.mark.parametrize("name", [d for d in DTYPES if d != "bfloat16"])
def test_host_destination_is_a_plain_copy(name):
    dt = np_dtype(name)
    src = rand_values(name, 1001, seed=3)
    raw = np.full(1001 * dt.itemsize + 8, POISON, np.uint8)
    dst = raw[: 1001 * dt.itemsize].view(dt).reshape(7, 143)
    pinstage.copy_h2d(dst, src)
    assert dst.reshape(-1).tobytes() == src.tobytes()
    assert (raw[1001 * dt.itemsize :] == POISON).all()
    raw[:] = POISON
    p = pinstage.copy_h2d_async(dst, src)
    assert p.done() and p.wait() is dst
    assert dst.reshape(-1).tobytes() == src.tobytes()
    assert (raw[1001 * dt.itemsize :] == POISON).all()


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda a: a, id="ndarray"),
        pytest.param(lambda a: (a.setflags(write=False), a)[1], id="read-only"),
        pytest.param(lambda a: a.reshape(13, 77), id="2-D"),
        pytest.param(lambda a: a.view(_Sub), id="subclass"),
        pytest.param(lambda a: a.astype(a.dtype.newbyteorder(">")), id="big-endian"),
    ],
)
def test_numpy_sources_read_directly_or_through_dlpack(make):
    """Exact, C-contiguous numpy arrays of numpy's own dtypes are read without DLPack (read-only
    ones too); others (subclasses) take DLPack; big-endian ones are refused. Every element
    checked, the destination's tail poisoned."""
    vals = rand_values("int32", 1001, seed=5)
    src = make(vals.copy())
    raw = np.full(1001 * 4 + 8, POISON, np.uint8)
    dst = raw[: 1001 * 4].view(np.int32)
    if src.dtype.byteorder == ">":
        with pytest.raises(pinstage.PinstageError):
            pinstage.copy_h2d(dst, src)
        assert (raw == POISON).all()
        return
    before = _Sub.dlpack_calls
    pinstage.copy_h2d(dst, src)
    np.testing.assert_array_equal(dst, vals)
    assert (raw[1001 * 4 :] == POISON).all()
    # A subclass is read through its DLPack export (an exact ndarray's cannot be observed).
    assert _Sub.dlpack_calls - before == (1 if isinstance(src, _Sub) else 0)


class _Sub(np.ndarray):
    dlpack_calls = 0

    def __dlpack__(self, *args, **kwargs):
        _Sub.dlpack_calls += 1
        return super().__dlpack__(*args, **kwargs)


@pytest.mark.parametrize(
    "dst,src,exc,match",
    [
        (np.zeros(4, np.int32), np.zeros(4, np.int64), TypeError, "dtype must be int32; got int64"),
        (np.zeros(4, np.uint8), np.zeros(4, np.bool_), TypeError, "dtype must be uint8; got bool"),
        (np.zeros(4, np.int16), np.zeros(4, np.uint16), TypeError, "dtype must be int16; got uint16"),
        (np.zeros(6, np.int32), np.zeros((2, 3), np.int32, order="F"), ValueError, "not contiguous"),
        (np.zeros(4, np.int32), np.zeros(5, np.int32), ValueError, "src has 5 elements"),
        (np.zeros(4, np.int32), [1, 2, 3, 4], TypeError, "src must be a host array"),
        (np.zeros(4, np.int32), np.zeros(8, np.int32)[::2], ValueError, "not contiguous"),
        (np.zeros(8, np.int32)[::2], np.zeros(4, np.int32), ValueError, "not contiguous"),
        (None, np.zeros(4, np.int32), TypeError, "expected a DLPack producer"),
    ],
)
def test_refusals_write_nothing(dst, src, exc, match):
    before = None if dst is None else dst.copy()
    with pytest.raises(exc, match=match) as info:
        pinstage.copy_h2d(dst, src)
    assert isinstance(info.value, pinstage.PinstageError)
    if before is not None:
        np.testing.assert_array_equal(dst, before)


def test_read_only_and_jax_destinations_are_refused():
    ro = np.zeros(4, np.int32)
    ro.flags.writeable = False
    with pytest.raises((ValueError, TypeError), match="read"):
        pinstage.copy_h2d(ro, np.ones(4, np.int32))
    jnp = pytest.importorskip("jax.numpy")
    x = jnp.zeros(4, dtype=jnp.int32)
    with pytest.raises(ValueError, match="JAX arrays are immutable"):
        pinstage.copy_h2d(x, np.ones(4, np.int32))
    assert np.asarray(x).tolist() == [0, 0, 0, 0]


# --- on a GPU --------------------------------------------------------------------------------

SIZES = [0, 1, 4097, (8 << 20) // 4 + 3, 3 * (8 << 20) // 4 + 12345]  # elements: 0, 1, odd, > 1 and > 3 bounce chunks


@pytest.mark.gpu
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", ["int32", "float64", "uint8", "bool", "complex64", "float16", "int64"])
@pytest.mark.parametrize("pinned", [False, True])
def test_torch_destination_every_size(gpu, name, n, pinned):
    torch = pytest.importorskip("torch")
    dt = np_dtype(name)
    src = rand_values(name, n, seed=n + 1)
    if pinned:
        host = pinstage.empty_pinned(n, dt)
        host[:] = src
        src = host
    raw = torch.full((n * dt.itemsize + 16,), POISON, dtype=torch.uint8, device="cuda")
    dst = raw[: n * dt.itemsize].view(getattr(torch, name))
    p = pinstage.copy_h2d_async(dst, src)
    assert p.wait() is dst
    torch.cuda.synchronize()
    got = raw.cpu().numpy()
    assert got[: n * dt.itemsize].tobytes() == src.tobytes()
    assert (got[n * dt.itemsize :] == POISON).all()


@pytest.mark.gpu
def test_pageable_source_may_change_at_once_pinned_after_wait(gpu):
    torch = pytest.importorskip("torch")
    n = 5 << 20
    vals = np.arange(n, dtype=np.int32) * 3 + 1
    src = vals.copy()
    dst = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # the copies queue behind ~50 ms of GPU time
    p = pinstage.copy_h2d_async(dst, src)
    # The copies from the bounce slots (48 MiB of them: no slot reused) are queued behind the
    # sleep: the call returned without waiting for them, having read all of the source.
    assert not p.done(), "the pieces' copies are queued behind the sleep"
    src[:] = -7  # documented: a pageable source may change as soon as the call returned
    assert p.wait() is dst  # the pieces land
    torch.cuda.synchronize()
    np.testing.assert_array_equal(dst.cpu().numpy(), vals)
    pin = pinstage.empty_pinned(n, np.int32)
    pin[:] = vals + 5
    dst.fill_(-1)
    torch.cuda._sleep(100_000_000)
    p = pinstage.copy_h2d_async(dst, pin)
    assert not p.done(), "one DMA from pinned memory, queued behind the sleep"
    p.wait()
    pin[:] = -9  # after wait() the pinned source may change
    torch.cuda.synchronize()
    np.testing.assert_array_equal(dst.cpu().numpy(), vals + 5)
    # copy_h2d completes: behind the same sleep, it returns only once the pinned source may change.
    pin[:] = vals + 11
    dst.fill_(-1)
    torch.cuda._sleep(100_000_000)
    pinstage.copy_h2d(dst, pin)
    pin[:] = -13
    torch.cuda.synchronize()
    np.testing.assert_array_equal(dst.cpu().numpy(), vals + 11)


@pytest.mark.gpu
def test_stream_order_and_cupy_and_torch_cpu_sources(gpu):
    torch = pytest.importorskip("torch")
    cp = pytest.importorskip("cupy")
    s = torch.cuda.Stream()
    dst = torch.full((1 << 20,), -1, dtype=torch.float32, device="cuda")
    src = torch.arange(1 << 20, dtype=torch.float32)  # a torch CPU tensor
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)
        dst.fill_(7)
        pinstage.copy_h2d(dst, src)  # stream=None: torch's current stream, `s`: after the fill
    s.synchronize()
    np.testing.assert_array_equal(dst.cpu().numpy(), src.numpy())
    c = cp.full(4096, -1, dtype=cp.int16)
    cs = cp.cuda.Stream(non_blocking=True)
    pinstage.copy_h2d(c, np.arange(4096, dtype=np.int16), stream=cs)
    cs.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(c), np.arange(4096, dtype=np.int16))


@pytest.mark.gpu
def test_large_pageable_copy_releases_the_gil(gpu):
    torch = pytest.importorskip("torch")
    n = 64 << 20  # 256 MiB of float32
    src = np.random.default_rng(5).random(n, dtype=np.float32)
    dst = torch.empty(n, dtype=torch.float32, device="cuda")
    ticks = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    th = threading.Thread(target=tick)
    th.start()
    t0 = time.perf_counter()
    pinstage.copy_h2d(dst, src)
    t1 = time.perf_counter()
    stop.set()
    th.join()
    assert sum(t0 < t < t1 for t in ticks) >= 3, "the GIL was held during the copy"
    assert torch.equal(dst, torch.from_numpy(src).cuda())
