"""Tests that run everywhere (CI has no GPU): host destinations, numpy/jax producers, fallbacks,
fake producers and every bad argument."""

import gc
import threading

import numpy as np
import pytest

import pinstage
from conftest import DTYPES, SIZES, CapsuleProducer, make_capsule, np_dtype, pad_for, rand_values

POISON = 0xA5


def poisoned(name, n, extra=3):
    dt = np_dtype(name)
    raw = np.full((n + extra) * dt.itemsize, POISON, dtype=np.uint8)
    return raw, raw.view(dt)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", DTYPES)
def test_stager_host_destination_matrix(name, size):
    if name == "bfloat16":
        pytest.skip("numpy cannot export bfloat16 through DLPack (covered on the GPU with torch)")
    st = pinstage.PinnedStager(np_dtype(name), numel=256, depth=2)
    for nvals, pad in [(size, None), (size // 2, pad_for(name)), (size // 2, None)]:
        raw, full = poisoned(name, size)
        dst = full[:size]
        vals = rand_values(name, nvals, seed=size + nvals)
        copied = st.copy_(dst, vals, pad_value=pad)
        touched = size if pad is not None else nvals
        assert copied == (touched > 0)
        np.testing.assert_array_equal(dst[:nvals], vals)
        if pad is not None:
            np.testing.assert_array_equal(dst[nvals:], np.full(size - nvals, pad, dtype=np_dtype(name)))
        tail = raw[touched * np_dtype(name).itemsize :]
        assert (tail == POISON).all(), "bytes past the copy were touched"


def test_values_from_sequences_and_other_dtypes():
    st = pinstage.PinnedStager(np.int16, 8, 2)
    d = np.full(6, -1, np.int16)
    assert st.copy_(d, [1, 2, 3])
    assert st.copy_(d, (4, 5), pad_value=0)  # d holds 1, 2, 3, -1, -1, -1: the pad shows
    assert d.tolist() == [4, 5, 0, 0, 0, 0]
    assert st.copy_(d, np.array([7, 8], dtype=np.int64))  # converted, fits
    assert d.tolist()[:2] == [7, 8]
    f = pinstage.PinnedStager("float32")
    x = np.zeros(3, np.float32) + 9
    f.copy_(x, [0.5, 1.5, -2.25])
    assert x.tolist() == [0.5, 1.5, -2.25]
    b = pinstage.PinnedStager(bool)
    y = np.zeros(4, bool)
    b.copy_(y, [True, False, True], pad_value=True)
    assert y.tolist() == [True, False, True, True]


@pytest.mark.parametrize(
    "values,dtype,match",
    [
        ([300], np.int8, "does not fit int8"),
        ([1, 40000], np.int16, "40000 at index 1 does not fit int16"),
        ([2**31], np.int32, "does not fit int32"),
        ([256], np.uint8, "256 at index 0 does not fit uint8"),
        ([-1], np.uint16, "-1 at index 0 does not fit uint16"),
        ([1, 70000], np.uint16, "does not fit uint16"),
        ([-1], np.uint32, "does not fit uint32"),
        ([2**64], np.uint64, "does not fit uint64"),
        ([2**64], np.int64, "does not fit"),
        ([2], bool, "does not fit bool"),
        (np.array([1.5]), np.int32, "do not fit int32"),
        (np.array([1 + 2j]), np.float32, "complex"),
        (5, np.int32, "scalar"),
        (["a", "b"], np.int32, "cannot be copied"),
        ([1.0, 1e5], np.float16, "index 1 does not fit float16"),
        ([-1e39], np.float32, "does not fit float32"),
        (np.array([1.0, 7e4]), np.float16, "would become inf"),
        (np.array([3.5e38]), np.float32, "would become inf"),
    ],
)
def test_values_that_do_not_fit_are_refused_untouched(values, dtype, match):
    st = pinstage.PinnedStager(dtype, 8, 2)
    d = np.full(4, 1, dtype=dtype)
    before = d.copy()
    with pytest.raises((ValueError, TypeError, OverflowError), match=match):
        st.copy_(d, values)
    np.testing.assert_array_equal(d, before)


def test_infinities_and_nan_are_values_not_overflow():
    st = pinstage.PinnedStager(np.float16, 8, 2)
    d = np.zeros(4, np.float16)
    st.copy_(d, [float("inf"), float("-inf"), 65504.0])
    st.copy_(d[3:], np.array([np.nan]))
    assert d[0] == np.inf and d[1] == -np.inf and d[2] == 65504 and np.isnan(d[3])


def test_an_interrupt_inside_a_conversion_propagates():
    class Ctrl:
        def __array__(self, dtype=None, copy=None):
            raise KeyboardInterrupt

    st = pinstage.PinnedStager(np.int32, 8, 2)
    d = np.full(4, 5, np.int32)
    with pytest.raises(KeyboardInterrupt):
        st.copy_(d, Ctrl())
    assert (d == 5).all()
    st.copy_(d, [1, 2])  # the slot was released
    assert d[:2].tolist() == [1, 2]


def test_bad_destinations_and_arguments():
    st = pinstage.PinnedStager("int32", 8, 2)
    d = np.full(8, 3, np.int32)
    cases = [
        (lambda: st.copy_(d, np.arange(9, dtype=np.int32)), ValueError, "must fit the destination's 8 elements; got 9 values"),
        (lambda: st.copy_(np.zeros(4, np.float32), [1]), TypeError, "dtype must be int32; got float32"),
        (lambda: st.copy_(d[::2], [1]), ValueError, "not contiguous"),
        (lambda: st.copy_(d[::-1], [1]), ValueError, "not contiguous"),
        (lambda: st.copy_(object(), [1]), TypeError, "expected a DLPack producer"),
        (lambda: st.copy_(d, [1], stream="s"), TypeError, "stream must be"),
        (lambda: pinstage.PinnedStager("object"), TypeError, "dtype must be bool"),
        (lambda: pinstage.PinnedStager("int32", 8, 0), ValueError, "depth must be an int from 1 to .*; got 0"),
        (lambda: pinstage.PinnedStager("int32", device="gpu7"), ValueError, "cuda:N"),
        (lambda: st.copy_(d, [1], mirror="m"), TypeError, "H2DMirror"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()
    assert (d == 3).all()
    ro = np.arange(4, dtype=np.int32)
    ro.flags.writeable = False
    with pytest.raises((ValueError, BufferError), match="read"):
        st.copy_(ro, [1])
    assert ro.tolist() == [0, 1, 2, 3]


def test_errors_are_typed():
    assert issubclass(pinstage.CudaUnavailableError, pinstage.PinstageError)
    assert issubclass(pinstage.CudaUnavailableError, RuntimeError)
    assert issubclass(pinstage.PinstageValueError, ValueError)
    assert issubclass(pinstage.PinstageTypeError, TypeError)
    assert issubclass(pinstage.StreamCaptureError, RuntimeError)


def test_mirror_and_bound_target_on_host():
    st = pinstage.PinnedStager("int64", 8, 2)
    d = np.full(6, 5, np.int64)
    m = pinstage.H2DMirror()
    assert st.copy_(d, [1, 2], pad_value=-1, mirror=m)
    assert not st.copy_(d, [1, 2], pad_value=-1, mirror=m)
    assert st.stats()["skipped_copies"] == 1
    other = np.zeros(6, np.int64)
    with pytest.raises(ValueError, match="mirrors another destination"):
        st.copy_(other, [1, 2], mirror=m)
    m.invalidate()
    assert st.copy_(other, [1, 2], mirror=m)
    t = st.target(d, pad_value=0, skip_unchanged=True)
    assert t.numel == 6 and t.skip_unchanged
    assert t.copy_([9])
    assert not t.copy_([9])
    d[:] = 77  # written some other way: invalidate
    t.invalidate()
    assert t.copy_([9])
    assert d.tolist() == [9, 0, 0, 0, 0, 0]
    # user-level mirror API
    m2 = pinstage.H2DMirror()
    assert not m2.matches(1, np.arange(3))
    m2.record(1, np.arange(3))
    assert m2.matches(1, np.arange(3))
    assert not m2.matches(1, np.arange(3, dtype=np.int32)), "dtype is part of the content"
    assert not m2.matches(b"k", np.arange(3))


def test_copy_d2h_numpy_fallback_and_dst():
    src = rand_values("float32", 1000, 1).reshape(10, 100)
    out = pinstage.copy_d2h(src)
    assert out.shape == src.shape and out.dtype == src.dtype and out.flags.writeable
    np.testing.assert_array_equal(out, src)
    assert out.ctypes.data != src.ctypes.data
    out[0, 0] = -1
    assert src[0, 0] != -1
    dst = np.full(4000, POISON, np.uint8)
    r = pinstage.copy_d2h(src, dst)
    assert r.base is dst or r.base.base is dst
    np.testing.assert_array_equal(r, src)
    same = np.full((10, 100), -1, np.float32)  # src's dtype and shape: the result is dst itself
    assert pinstage.copy_d2h(src, same) is same
    np.testing.assert_array_equal(same, src)
    for other in (np.full((100, 10), -1, np.float32), np.full((10, 100), -1, np.int32)):
        r = pinstage.copy_d2h(src, other)  # another shape or dtype: a view in src's
        assert r is not other and r.shape == src.shape and r.dtype == src.dtype
        np.testing.assert_array_equal(r, src)
    with pytest.raises(ValueError, match="dst holds 10 bytes"):
        pinstage.copy_d2h(src, np.zeros(10, np.uint8))
    with pytest.raises(TypeError, match="dst must be a numpy array"):
        pinstage.copy_d2h(src, [0] * 4000)
    p = pinstage.copy_d2h_async(src)
    assert p.done()
    np.testing.assert_array_equal(p.wait(timeout=1.0), src)
    z = pinstage.copy_d2h(np.zeros((0, 3), np.int16))
    assert z.shape == (0, 3)


@pytest.mark.parametrize("name", DTYPES)
def test_copy_d2h_every_dtype_from_numpy(name):
    if name == "bfloat16":
        pytest.skip("numpy cannot export bfloat16 through DLPack (covered on the GPU with torch)")
    src = rand_values(name, 257, 3)
    out = pinstage.copy_d2h(src)
    assert out.dtype == src.dtype
    np.testing.assert_array_equal(out.view(np.uint8), src.view(np.uint8))


def test_copy_d2h_from_jax_cpu():
    jnp = pytest.importorskip("jax.numpy")
    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) * 1.5 + 1
    out = pinstage.copy_d2h(x)
    np.testing.assert_array_equal(out, np.asarray(x))
    assert out.flags.writeable


def test_fake_producers():
    buf = np.arange(1, 5, dtype=np.int32)
    # legacy-only producer (no kwargs, no __dlpack_device__)
    out = pinstage.copy_d2h(CapsuleProducer(make_capsule(buf)))
    assert out.tolist() == [1, 2, 3, 4]

    class NoMaxVersion:  # numpy < 2.1 style: rejects max_version
        def __init__(self, a):
            self.a = a
            self.calls = []

        def __dlpack__(self, stream=None):
            self.calls.append(stream)
            return self.a.__dlpack__()

        def __dlpack_device__(self):
            return (1, 0)

    p = NoMaxVersion(buf)
    assert pinstage.copy_d2h(p).tolist() == [1, 2, 3, 4]
    assert p.calls == [None]

    class Versioned:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
            assert max_version is not None
            return self.a.__dlpack__(max_version=max_version)

        def __dlpack_device__(self):
            return (1, 0)

    if tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 1):
        assert pinstage.copy_d2h(Versioned(buf)).tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(dtype=(0, 32, 4)), TypeError, "lanes 4"),
        (dict(dtype=(3, 64, 1)), TypeError, "unsupported DLPack dtype"),
        (dict(dtype=(2, 8, 1)), TypeError, "unsupported DLPack dtype"),
        (dict(shape=(2, 2), strides=(1, 2)), ValueError, "not contiguous"),
        (dict(shape=(4,), strides=(-1,)), ValueError, "not contiguous"),
        (dict(shape=(-4,)), ValueError, "negative"),
        (dict(data=0), ValueError, "null"),
        (dict(device=(10, 0)), ValueError, "unsupported DLPack device type 10"),
        (dict(ndim=-1), ValueError, "ndim"),
    ],
)
def test_lying_producers_get_typed_errors(kwargs, exc, match):
    buf = np.arange(1, 5, dtype=np.int32)
    before = buf.copy()
    cap = make_capsule(buf, **kwargs)
    with pytest.raises(exc, match=match):
        pinstage.copy_d2h(CapsuleProducer(cap))
    st = pinstage.PinnedStager("int32", 8, 2)
    with pytest.raises((ValueError, TypeError)):
        st.copy_(CapsuleProducer(make_capsule(buf, **kwargs)), [9])
    np.testing.assert_array_equal(buf, before)


def test_producer_that_raises_or_returns_garbage():
    class Raises:
        def __dlpack__(self, **kw):
            raise RuntimeError("producer exploded")

    class Garbage:
        def __dlpack__(self, **kw):
            return 42

    class WrongDevice:
        def __init__(self):
            self.a = np.arange(4, dtype=np.int32)

        def __dlpack__(self, **kw):
            return self.a.__dlpack__()

        def __dlpack_device__(self):
            return (2, 0)  # claims CUDA, the capsule is CPU

    with pytest.raises(RuntimeError, match="producer exploded"):
        pinstage.copy_d2h(Raises())
    with pytest.raises(TypeError, match="did not return a DLPack capsule"):
        pinstage.copy_d2h(Garbage())
    with pytest.raises(ValueError, match="device changed during import"):
        pinstage.copy_d2h(WrongDevice())


def test_cuda_entries_without_driver_raise_clear_errors():
    if pinstage.cuda_available():
        pytest.skip("a driver is present")
    assert pinstage.device_count() == 0
    for fn in (
        lambda: pinstage.empty_pinned((4,), "int32"),
        lambda: pinstage.alloc_pinned_numpy(16, "int32", 4),
        lambda: pinstage.copy_d2h(CapsuleProducer(make_capsule(np.arange(4, dtype=np.int32), device=(2, 0)))),
        lambda: pinstage.PinnedStager("int32").copy_(
            CapsuleProducer(make_capsule(np.arange(4, dtype=np.int32), device=(2, 0))), [1]
        ),
    ):
        with pytest.raises(pinstage.CudaUnavailableError, match="CUDA is unavailable"):
            fn()


def test_alloc_pinned_numpy_validation():
    with pytest.raises(ValueError, match="smaller than prod"):
        pinstage.alloc_pinned_numpy(8, "int32", (3,))
    with pytest.raises(ValueError, match="negative"):
        pinstage.alloc_pinned_numpy(8, "int32", (-1,))


def test_threads_share_a_stager_on_host_destinations():
    """8 threads, 200 copies each, every copy into its own poisoned row: all rows checked."""
    st = pinstage.PinnedStager("int32", 16, 2)
    dsts = [np.full((200, 64), -77777, np.int32) for _ in range(8)]
    errors = []

    def work(k):
        try:
            for i in range(200):
                st.copy_(dsts[k][i], np.full(32, k * 1000 + i, np.int32), pad_value=-k - 1)
        except Exception as e:  # pragma: no cover
            errors.append(e)

    ts = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errors
    for k, d in enumerate(dsts):
        for i in range(200):
            assert (d[i, :32] == k * 1000 + i).all() and (d[i, 32:] == -k - 1).all(), (k, i)


def test_every_public_callable_has_a_docstring():
    import inspect

    for name in pinstage.__all__:
        obj = getattr(pinstage, name)
        if name.startswith("__") or inspect.isclass(obj) and issubclass(obj, BaseException):
            continue
        assert obj.__doc__ and len(obj.__doc__.strip()) > 20, name
        if inspect.isclass(obj):
            for meth, member in vars(obj).items():
                if not meth.startswith("_"):
                    assert member.__doc__ and member.__doc__.strip(), f"{name}.{meth}"
    for fn in (pinstage.copy_d2h, pinstage.alloc_pinned_numpy, pinstage.PinnedStager.copy_, pinstage.PendingCopy.wait):
        doc = fn.__doc__
        assert "Parameters:" in doc and "Raises:" in doc, fn.__name__
    assert "Example:" in pinstage.PinnedStager.__doc__ and "Raises:" in pinstage.PinnedStager.__doc__


def test_stub_matches_module():
    import inspect
    import pathlib

    stub = (pathlib.Path(pinstage.__file__).parent / "_native.pyi").read_text()
    native = pinstage._native
    public = {n for n in dir(native) if not n.startswith("_")}
    for name in public:
        assert f"def {name}(" in stub or f"class {name}(" in stub or f"class {name}:" in stub, name
    for cls in ("PinnedStager", "H2DMirror", "StagedTarget", "PendingCopy", "PinnedBlock"):
        for meth in (m for m in dir(getattr(native, cls)) if not m.startswith("_")):
            assert f"def {meth}(" in stub, f"{cls}.{meth} missing from the stub"
    assert set(pinstage.__all__) - {"__version__"} == public
    gc.collect()


def test_close_and_context_manager():
    with pinstage.PinnedStager("int32", 8, 2) as st:
        d = np.zeros(4, np.int32)
        st.copy_(d, [1, 2])
        assert not st.closed
    assert st.closed
    with pytest.raises(ValueError, match="closed"):
        st.copy_(d, [3])
    with pytest.raises(ValueError, match="closed"):
        st.stats()
    assert d.tolist() == [1, 2, 0, 0]
    st.close()  # idempotent


def test_pinned_bytes_is_zero_without_driver():
    if pinstage.cuda_available():
        pytest.skip("a driver is present")
    assert pinstage.pinned_bytes() == 0


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", DTYPES)
def test_copy_d2h_jax_cpu_matrix(name, size):
    jax = pytest.importorskip("jax")
    vals = rand_values(name, size, seed=size + 5)
    with jax.enable_x64(True):
        x = jax.device_put(jax.numpy.asarray(vals), jax.devices("cpu")[0])
        out = pinstage.copy_d2h(x)
    assert out.dtype == vals.dtype and out.shape == vals.shape and out.flags.writeable
    assert (out.view(np.uint8) == vals.view(np.uint8)).all()


def test_stream_arguments_are_parsed():
    st = pinstage.PinnedStager("int32", 8, 2)
    d = np.zeros(4, np.int32)

    class CudaStreamProtocol:
        def __cuda_stream__(self):
            return (0, 0)

    class TorchLike:
        cuda_stream = 0

    class CupyLike:
        ptr = 0

    class BadProtocol:
        def __cuda_stream__(self):
            return "nope"

    for i, s in enumerate([None, 0, CudaStreamProtocol(), TorchLike(), CupyLike()]):
        assert st.copy_(d, [i + 1], stream=s)  # host destination: the stream is parsed, unused
    assert d[0] == 5
    with pytest.raises(TypeError, match="__cuda_stream__"):
        st.copy_(d, [1], stream=BadProtocol())
    with pytest.raises(TypeError, match="stream must be"):
        st.copy_(d, [1], stream=1.5)
    for bad in (5, 4095, 0x7F00_0000_0001):  # null page, unaligned: never a stream
        with pytest.raises(ValueError, match="no CUDA stream"):
            st.copy_(d, [9], stream=bad)
        with pytest.raises(ValueError, match="no CUDA stream"):
            pinstage.copy_d2h(d, stream=bad)

    # Not a stream object, though it has `.ptr` (as a cupy Event or MemoryPointer): its handle is
    # checked as an int would be (this one lies at no memory: 128 KiB, below any mapping).
    class Event:
        ptr = 0x2_0000

    for call in (lambda: st.copy_(d, [9], stream=Event()), lambda: pinstage.copy_d2h(d, stream=Event())):
        with pytest.raises(ValueError, match="no CUDA stream"):
            call()
    assert d[0] == 5

    # Only stream objects of torch and cupy that own their stream are trusted unchecked; an
    # ExternalStream wraps a handle its caller owns, and any other object's handle is checked.
    def stream_class(module, name, via):
        ns = {"__module__": module}
        if via == "protocol":
            ns["__cuda_stream__"] = lambda self: (0, 0x2_0000)
        else:
            ns[via] = 0x2_0000
        return type(name, (), ns)

    for module, name in [("torch.cuda.streams", "ExternalStream"), ("cupy.cuda.stream", "ExternalStream"),
                         ("mylib", "Stream"), ("mylib", "MyStream")]:
        for via in ("protocol", "cuda_stream", "ptr"):
            with pytest.raises(ValueError, match="no CUDA stream"):
                st.copy_(d, [9], stream=stream_class(module, name, via)())
    for module in ("torch.cuda.streams", "cupy.cuda.stream"):
        for via in ("protocol", "cuda_stream", "ptr"):
            # Trusted (a host destination: parsed, unused).
            assert st.copy_(d, [6], stream=stream_class(module, "Stream", via)())
    assert d[0] == 6


def test_closed_stream_objects_raise():
    """Stream objects that say they are closed: cuda.core's Stream after close() refuses
    __cuda_stream__(); others give None. Each is a typed error, and nothing is written."""
    st = pinstage.PinnedStager("int32", 8, 2)
    d = np.full(4, 77, np.int32)

    class ClosedRaises:
        def __cuda_stream__(self):
            raise RuntimeError("this Stream has been closed")

    class ClosedNone:
        def __cuda_stream__(self):
            return (0, None)

    class TorchLikeClosed:
        cuda_stream = None

    class CupyLikeClosed:
        ptr = None

    cases = [
        (ClosedRaises(), "closed"),
        (ClosedNone(), "it is closed"),
        (TorchLikeClosed(), r"\.cuda_stream is None"),
        (CupyLikeClosed(), r"\.ptr is None"),
    ]
    for s, msg in cases:
        for call in (
            lambda: st.copy_(d, [1, 2], -1, stream=s),
            lambda: st.target(d, pad_value=-1).copy_([1, 2], stream=s),
            lambda: pinstage.copy_d2h(d, stream=s),
        ):
            with pytest.raises(pinstage.PinstageValueError, match=msg):
                call()
    assert (d == 77).all()


def test_dtype_arguments_from_every_framework():
    names = {
        np.int32: "int32",
        np.dtype("float16"): "float16",
        "uint8": "uint8",
        "torch.int64": "int64",
        bool: "bool",
    }
    jnp = pytest.importorskip("jax.numpy")
    names[jnp.int32] = "int32"
    names[jnp.bfloat16] = "bfloat16"
    names[jnp.complex64] = "complex64"
    for arg, want in names.items():
        assert pinstage.PinnedStager(arg, 4, 1).dtype == want, arg


def test_a_mirror_keeps_its_destination_alive_so_its_address_is_not_reused():
    import weakref

    st = pinstage.PinnedStager("int64", 8, 2)
    m = pinstage.H2DMirror()
    d1 = np.full(6, -1, np.int64)
    r = weakref.ref(d1)
    assert st.copy_(d1, [1, 2], pad_value=0, mirror=m)
    del d1
    gc.collect()
    assert r() is not None, "the bound destination was freed: a new array could take its address"
    d2 = np.full(6, -1, np.int64)
    with pytest.raises(ValueError, match="mirrors another destination"):
        st.copy_(d2, [1, 2], pad_value=0, mirror=m)
    m.invalidate()
    gc.collect()
    assert r() is None, "invalidate() let go of the destination"
    assert st.copy_(d2, [1, 2], pad_value=0, mirror=m)
    assert d2.tolist() == [1, 2, 0, 0, 0, 0]


def test_a_thread_copying_at_full_rate_does_not_hold_up_other_python_threads():
    """copy_ runs without the GIL, as torch's calls do: while one thread copies small arrays in
    a tight loop, another thread that sleeps 1 ms at a time mostly gets the GIL back at once,
    not after a switch interval (set to 500 ms here: holding the GIL makes EVERY sleep last
    that long; a loaded machine may delay a few). Every copy of the loop is checked."""
    import os
    import sys
    import time

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs: the sleeper must run while the copier copies")
    st = pinstage.PinnedStager(np.int32, 256, 4)
    dst = np.zeros(256, np.int32)
    stop = threading.Event()
    wrong, errors = [], []
    done = [0]
    vals = np.arange(1, 201, dtype=np.int32)

    def copier():
        k = 0
        try:
            while not stop.is_set():
                k += 1
                vals[0] = vals[199] = k  # in place: a fresh array per call would hide the bug
                dst.fill(-9)
                st.copy_(dst, vals, pad_value=-1)
                if dst[0] != k or dst[1] != 2 or dst[199] != k or dst[200] != -1 or dst[255] != -1:
                    wrong.append(k)
                done[0] = k
        except Exception as e:  # noqa: BLE001 (reported by the test below)
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    t = threading.Thread(target=copier)
    try:
        t.start()
        deadline = time.monotonic() + 30
        while done[0] < 10 and not errors and time.monotonic() < deadline:
            time.sleep(0.001)
        gaps = []
        last = time.perf_counter()
        for _ in range(20):
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    finally:
        stop.set()
        t.join(30)
        sys.setswitchinterval(old)
    assert not errors, f"copy_ raised in the copying thread: {errors[0]!r}"
    assert not wrong, f"copies {wrong[:5]} wrote the wrong values"
    assert done[0] > 20, "the copier did not run"
    quick = sum(g < 0.05 for g in gaps)
    assert quick >= 15, (
        f"only {quick} of 20 1-ms sleeps ended within 50 ms (longest {max(gaps) * 1e3:.0f} ms): "
        "copy_ held the GIL"
    )


def test_mirror_invalidate_while_another_thread_copies_a_large_array_does_not_deadlock():
    import threading

    st = pinstage.PinnedStager("uint8", 4 << 20, 2)
    m = pinstage.H2DMirror()
    d = np.zeros(4 << 20, np.uint8)
    vals = np.full(4 << 20, 7, np.uint8)
    stop = []

    def other():
        while not stop:
            m.invalidate()
            repr(m)

    t = threading.Thread(target=other, daemon=True)
    t.start()
    for i in range(50):
        vals[0] = i + 1
        st.copy_(d, vals, mirror=m)
    stop.append(1)
    t.join(10)
    assert not t.is_alive()
    assert d[0] == 50 and d[1] == 7


class _ArrayInterfaceOnly:
    def __init__(self, a):
        self.a = a
        self.__array_interface__ = a.__array_interface__


class _ArrayOnly:
    def __init__(self, a):
        self.a = a

    def __array__(self, dtype=None, copy=None):
        return self.a


@pytest.mark.parametrize(
    "make",
    [
        lambda a: range(1, 4),
        lambda a: memoryview(a),
        lambda a: _ArrayInterfaceOnly(a),
        lambda a: _ArrayOnly(a),
    ],
    ids=["range", "memoryview", "array_interface", "array"],
)
def test_every_kind_of_array_like_values_is_read(make):
    st = pinstage.PinnedStager("int32", numel=8, depth=2)
    d = np.full(4, -1, np.int32)
    st.copy_(d, make(np.arange(1, 4, dtype=np.int32)), pad_value=0)
    assert d.tolist() == [1, 2, 3, 0]


@pytest.mark.parametrize(
    "values",
    [b"\x01\x02", bytearray(b"\x01"), "12", {1: 2}, {1, 2}, iter([1, 2])],
    ids=["bytes", "bytearray", "str", "dict", "set", "iterator"],
)
def test_values_that_are_no_array_of_numbers_are_refused_untouched(values):
    st = pinstage.PinnedStager("int32", numel=8, depth=2)
    d = np.full(4, -1, np.int32)
    with pytest.raises(pinstage.PinstageTypeError, match="values must be a list, a tuple or an array"):
        st.copy_(d, values, pad_value=0)
    assert d.tolist() == [-1, -1, -1, -1]


_INTS = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]


@pytest.mark.parametrize("dst", _INTS)
@pytest.mark.parametrize("src", _INTS)
def test_integer_arrays_of_any_width_cast_exactly_or_name_the_value(src, dst):
    # An integer array of another width or signedness is cast element by element: every value
    # that fits arrives exact, and the first that does not is named with its index.
    s, t = np.iinfo(src), np.iinfo(dst)
    st = pinstage.PinnedStager(dst, numel=8, depth=2)
    fits = [v for v in (5, -3, 100, 2000, 70000, 2**31 + 7, -(2**40) - 1) if s.min <= v <= s.max and t.min <= v <= t.max]
    d = np.full(len(fits) + 1, 9, dst)
    st.copy_(d, np.array(fits, dtype=src), pad_value=1)
    assert d.tolist() == fits + [1]
    worst = [v for v in (int(s.min), int(s.max)) if not t.min <= v <= t.max]
    if worst:
        d = np.full(4, 9, dst)
        with pytest.raises(ValueError, match=rf"values do not fit {dst}: {worst[0]} at index 2 cannot"):
            st.copy_(d, np.array([1, 2, worst[0]], dtype=src))
        assert d.tolist() == [9] * 4


@pytest.mark.parametrize("src", [">i4", ">u2", ">i8"])
def test_integer_arrays_of_the_other_byte_order_are_read_in_theirs(src):
    st = pinstage.PinnedStager("int64", numel=8, depth=2)
    d = np.full(4, -9, np.int64)
    st.copy_(d, np.array([1, 300, 40000], dtype=src), pad_value=7)
    assert d.tolist() == [1, 300, 40000, 7]


@pytest.mark.parametrize("scalar", [5, 2.5, 1j], ids=["int", "float", "complex"])
def test_a_python_scalar_is_named_as_one(scalar):
    st = pinstage.PinnedStager("complex64", numel=8, depth=2)
    d = np.full(2, 3 + 4j, np.complex64)
    with pytest.raises(pinstage.PinstageTypeError, match=f"got a scalar of type {type(scalar).__name__}"):
        st.copy_(d, scalar)
    assert d.tolist() == [3 + 4j, 3 + 4j]


def test_zero_dimensional_values_are_refused_even_into_a_zero_dimensional_destination():
    st = pinstage.PinnedStager("int32", numel=8, depth=2)
    d = np.array(5, np.int32)
    with pytest.raises(ValueError, match=r"got values of shape \(\) for a destination of shape \(\)"):
        st.copy_(d, np.array(7, np.int32))
    assert d == 5
    st.copy_(d, [7])  # one value in a sequence is the way
    assert d == 7


def test_integer_arrays_of_zeros_and_ones_cast_to_bool_and_others_are_refused():
    st = pinstage.PinnedStager(bool, numel=8, depth=2)
    d = np.array([True, False, True, False])
    st.copy_(d, np.array([0, 1, 1], dtype=np.int64), pad_value=True)
    assert d.tolist() == [False, True, True, True]
    with pytest.raises(ValueError, match="do not fit bool"):
        st.copy_(d, np.array([1, 2], dtype=np.uint8))
    assert d.tolist() == [False, True, True, True]
