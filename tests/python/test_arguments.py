"""Every public call with hostile arguments: each refusal is a typed error that names the
parameter, leaves the destination as it was, and never aborts the interpreter. Also the
assignment rule, immutable producers and mirror keys. Runs everywhere (no GPU needed)."""

import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import pinstage

HUGE = 10**30


def stager(dtype="int32", **kw):
    return pinstage.PinnedStager(dtype, **kw)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(dtype=None), TypeError, "dtype=None"),
        (dict(dtype=object()), TypeError, "dtype must be bool"),
        (dict(dtype="object"), TypeError, "dtype must be bool"),
        (dict(numel=-1), ValueError, "numel must be an int from .*; got -1"),
        (dict(numel=0), ValueError, "numel must be an int from .*; got 0"),
        (dict(numel=HUGE), ValueError, "numel must be an int from .*; got "),
        (dict(numel=3.0), TypeError, "numel must be an int"),
        (dict(numel="3"), TypeError, "numel must be an int"),
        (dict(numel=True), TypeError, "numel must be an int"),
        (dict(numel=float("nan")), TypeError, "numel must be an int"),
        (dict(depth=-3), ValueError, "depth must be an int from .*; got -3"),
        (dict(depth=0), ValueError, "depth must be an int from .*; got 0"),
        (dict(depth=10**9), ValueError, "depth must be an int from .*; got 1000000000"),
        (dict(depth=HUGE), ValueError, "depth must be an int from .*; got "),
        (dict(depth=[1]), TypeError, "depth must be an int"),
        (dict(device=-1), ValueError, "device=-1"),
        (dict(device="gpu7"), ValueError, "cuda:N"),
        (dict(device=True), TypeError, "device must be"),
        (dict(device=3.5), TypeError, "device must be"),
    ],
)
def test_stager_constructor_refusals_name_the_parameter(kwargs, exc, match):
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", "int32")
    before = pinstage.pinned_bytes()
    with pytest.raises(exc, match=match) as info:
        pinstage.PinnedStager(dtype, **kwargs)
    assert isinstance(info.value, pinstage.PinstageError), type(info.value)
    assert pinstage.pinned_bytes() == before, "nothing allocated"


def test_device_beyond_the_driver_is_refused():
    # With a driver: no such device (a ValueError); without one, every device but 0 needs CUDA.
    n = pinstage.device_count()
    want = ValueError if pinstage.cuda_available() else pinstage.CudaUnavailableError
    with pytest.raises(want, match="device"):
        pinstage.PinnedStager("int32", device=n + 4)
    with pytest.raises(want, match="device"):
        pinstage.PinnedStager("int32", device=np.int64(n + 4))


class _Device:
    """A stand-in for torch.device (type, index) or cupy.cuda.Device (id)."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)

    def __repr__(self):
        return f"_Device({self.__dict__})"


@pytest.mark.parametrize(
    "device",
    ["cuda", "cuda:0", 0, np.int64(0), _Device(type="cuda", index=0), _Device(type="cuda", index=None),
     _Device(id=0)],
    ids=["cuda", "cuda:0", "int", "numpy", "torch-like", "torch-like-current", "cupy-like"],
)
def test_every_spelling_of_device_0_names_it(device):
    # Without a driver only device 0 can be named; each spelling must reach it (a spelling
    # misread as another device would need CUDA and raise).
    if pinstage.device_count() > 1:
        pytest.skip("with several devices the current one may not be 0")
    assert pinstage.PinnedStager("int32", numel=4, depth=2, device=device).device == 0


@pytest.mark.parametrize(
    "device, exc, match",
    [
        (_Device(type="cpu", index=0), pinstage.PinstageTypeError, "got a cpu device"),
        (_Device(type="cuda", index=True), pinstage.PinstageTypeError, "device must be"),
        (_Device(id=False), pinstage.PinstageTypeError, "device must be"),
        ("cuda:x", pinstage.PinstageValueError, "cuda:N"),
    ],
    ids=["cpu-device", "bool-index", "bool-id", "bad-suffix"],
)
def test_device_objects_that_are_no_cuda_device_are_refused(device, exc, match):
    with pytest.raises(exc, match=match):
        pinstage.PinnedStager("int32", numel=4, depth=2, device=device)


def test_huge_depth_does_not_abort_the_interpreter():
    # Used to abort with "memory allocation of 128000000000 bytes failed": run it in a child
    # (here under src/python/pytest.rs, whose build only this process has: an abort ends that
    # harness, a failure all the same).
    if os.environ.get("PINSTAGE_PYTEST_IN_PROCESS") == "1":
        with pytest.raises(ValueError, match="depth must be an int from 1 to 65536; got 1000000000"):
            pinstage.PinnedStager(np.int32, depth=10**9)
        return
    code = (
        "import pinstage, numpy as np\n"
        "try:\n"
        "    pinstage.PinnedStager(np.int32, depth=10**9)\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "refused: depth must be an int from 1 to 65536; got 1000000000" in r.stdout


def _gen():
    yield 1


@pytest.mark.parametrize(
    "values,exc,match",
    [
        (_gen(), TypeError, "got a generator"),
        ({1: 2}, TypeError, "got a dict"),
        ({1, 2}, TypeError, "got a set"),
        ("123", TypeError, "got a str"),
        (b"\x01", TypeError, "got a bytes"),
        (None, TypeError, "got a NoneType"),
        (5, TypeError, "scalar of type int"),
        ([[1, 2], [3]], TypeError, "rectangular"),
        ([[1, 2], [3, 4]], ValueError, "destination's shape past its first axis"),
        ([math.nan], ValueError, "do not fit int32"),
        ([math.inf], ValueError, "do not fit int32"),
        (np.array([1.5]), ValueError, "do not fit int32"),
        (np.array(["a"], dtype=object), TypeError, "numpy kind 'O'"),
        ([2**40], ValueError, "does not fit int32"),
        (np.arange(9, dtype=np.int32), ValueError, "must fit the destination's 8 elements; got 9 values"),
    ],
)
def test_copy_values_refusals_leave_dst_untouched(values, exc, match):
    st = stager(numel=8, depth=2)
    d = np.full(8, 3, np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's cast warnings must not reach the caller
        with pytest.raises(exc, match=match) as info:
            st.copy_(d, values, pad_value=-1)
    assert isinstance(info.value, pinstage.PinstageError), type(info.value)
    assert (d == 3).all()


@pytest.mark.parametrize(
    "dst,exc,match",
    [
        (np.full(4, 3, dtype=">i4"), TypeError, "cannot be shared through DLPack"),
        (np.array([1, 2], dtype=object), TypeError, "cannot be shared through DLPack|dtype"),
        (None, TypeError, "expected a DLPack producer"),
        ([1, 2, 3], TypeError, "expected a DLPack producer"),
        (np.full(8, 3, np.int32)[::2], ValueError, "not contiguous"),
    ],
)
def test_copy_destination_refusals(dst, exc, match):
    st = stager(numel=8, depth=2)
    before = None if dst is None or isinstance(dst, list) else dst.copy()
    with pytest.raises(exc, match=match) as info:
        st.copy_(dst, [1])
    assert isinstance(info.value, pinstage.PinstageError), type(info.value)
    if before is not None:
        np.testing.assert_array_equal(dst, before)


def test_big_endian_values_are_converted():
    st = stager(numel=8, depth=2)
    d = np.full(4, 3, np.int32)
    assert st.copy_(d, np.array([1, -2], dtype=">i4"), pad_value=9)
    assert d.tolist() == [1, -2, 9, 9]


@pytest.mark.parametrize(
    "values,dst_shape,ok",
    [
        (np.arange(6, dtype=np.int32), (6,), True),
        (np.arange(6, dtype=np.int32).reshape(2, 3), (6,), False),
        (np.arange(6, dtype=np.int32).reshape(2, 3), (4, 3), True),
        (np.arange(6, dtype=np.int32).reshape(3, 2), (4, 3), False),
        (np.arange(3, dtype=np.int32), (4, 3), False),
        ([[1, 2, 3]], (4, 3), True),
        (np.arange(24, dtype=np.int32).reshape(2, 3, 4), (2, 3, 4), True),
        (np.arange(24, dtype=np.int32).reshape(2, 3, 4), (2, 4, 3), False),
    ],
)
def test_assignment_rule_dst_leading_slice(values, dst_shape, ok):
    """`dst[:n] = values`: values of dst's shape past the first axis, or 1-D into 1-D (numpy would
    broadcast 1-D values over the rows of a 2-D dst; pinstage refuses that, a flat copy would
    fill the rows in order instead)."""
    st = stager(numel=64, depth=2)
    d = np.full(dst_shape, -7, np.int32)
    v = np.asarray(values, dtype=np.int32)
    if ok:
        expect = d.copy()
        expect[: v.shape[0]] = v
        assert st.copy_(d, values)
        np.testing.assert_array_equal(d, expect)
        t = st.target(d)
        d[...] = -7
        assert t.copy_(values)
        np.testing.assert_array_equal(d, expect)
    else:
        with pytest.raises(ValueError, match="destination's shape past its first axis"):
            st.copy_(d, values)
        with pytest.raises(ValueError, match="destination's shape past its first axis"):
            st.target(d).copy_(values)
        assert (d == -7).all()


def test_read_only_destinations_are_refused():
    st = stager(numel=8, depth=2)
    ro = np.arange(4, dtype=np.int32)
    ro.flags.writeable = False
    for fn in (lambda: st.copy_(ro, [1]), lambda: st.target(ro)):
        with pytest.raises((ValueError, TypeError), match="read"):
            fn()
    assert ro.tolist() == [0, 1, 2, 3]


def test_jax_arrays_are_never_written():
    jnp = pytest.importorskip("jax.numpy")
    x = jnp.arange(8, dtype=jnp.int32)
    st = stager(numel=8, depth=2)
    for fn in (lambda: st.copy_(x, [9, 9]), lambda: st.target(x)):
        with pytest.raises(ValueError, match="JAX arrays are immutable"):
            fn()
    assert np.asarray(x).tolist() == list(range(8))


@pytest.mark.parametrize("pad", [[5, 6], [], np.zeros(3, np.int32)], ids=["two", "none", "array"])
def test_a_pad_that_is_not_one_element_is_refused_where_it_is_given(pad):
    st = pinstage.PinnedStager("int32", numel=8, depth=2)
    dst = np.full(8, 7, np.int32)
    with pytest.raises(pinstage.PinstageValueError, match="the pad must be one"):
        st.target(dst, pad_value=pad)
    with pytest.raises(pinstage.PinstageValueError, match="the pad must be one"):
        st.copy_(dst, [1], pad_value=pad)
    layout = pinstage.StepLayout({"ids": ("int32", 8)})
    steps = pinstage.StepStager(layout, depth=2)
    with pytest.raises(pinstage.PinstageValueError, match="the pad must be one"):
        steps.stage({"ids": [1]}, pad_value={"ids": pad}, rows={"ids": 4})
    assert dst.tolist() == [7] * 8
    st.target(dst, pad_value=[9]).copy_([1])  # one value in a list is one element
    assert dst.tolist() == [1] + [9] * 7


def test_bound_target_copies_every_time_unless_asked_to_skip():
    st = stager(numel=8, depth=2)
    d = np.full(4, 5, np.int32)
    t = st.target(d, pad_value=0)
    assert not t.skip_unchanged
    assert t.copy_([1])
    d[:] = 77  # another writer changes dst
    assert t.copy_([1]), "no mirror by default: the copy is issued again"
    assert d.tolist() == [1, 0, 0, 0]
    s = st.target(d, pad_value=0, skip_unchanged=True)
    assert s.copy_([2]) and not s.copy_([2])
    assert st.stats()["skipped_copies"] == 1


@pytest.mark.parametrize(
    "key,same,other",
    [
        ((4096, -1), (4096, -1), (4096, 0)),
        ((4096, None), (4096, None), (4095, None)),
        (frozenset({1, 2}), frozenset({2, 1}), frozenset({1})),
        (1, 1.0, 2),
        ("k", "k", b"k"),
        (b"k", b"k", "k"),
    ],
)
def test_mirror_keys_are_any_hashable_compared_by_equality(key, same, other):
    m = pinstage.H2DMirror()
    v = np.arange(3, dtype=np.int32)
    assert not m.matches(key, v)
    m.record(key, v)
    assert m.matches(same, v)
    assert not m.matches(other, v)
    assert not m.matches(same, v.astype(np.int64)), "dtype is part of the content"
    m.invalidate()
    assert not m.matches(key, v)


def test_mirror_refuses_unhashable_keys():
    m = pinstage.H2DMirror()
    with pytest.raises(TypeError, match="hashable"):
        m.record([1, 2], np.arange(2))
    with pytest.raises(TypeError, match="hashable"):
        m.matches({}, np.arange(2))


@pytest.mark.parametrize(
    "values",
    [{"a": 1}, None, [object()], (i for i in range(3)), [10**30], np.array([1, 2], dtype=object)],
    ids=["dict", "None", "objects", "generator", "wide-int", "object-array"],
)
def test_mirror_refuses_values_numpy_holds_as_objects(values):
    """Their bytes would be addresses: equal values would differ and, an address reused,
    different ones would match."""
    m = pinstage.H2DMirror()
    with pytest.raises(pinstage.PinstageTypeError, match="Python objects"):
        m.record("k", values)
    with pytest.raises(pinstage.PinstageTypeError, match="Python objects"):
        m.matches("k", values)
    m.record("k", np.arange(3, dtype=np.int32))
    assert m.matches("k", [0, 1, 2]) is False, "a list of ints is int64 here: another dtype"
    assert m.matches("k", np.arange(3, dtype=np.int32))


def test_a_name_that_is_not_valid_utf8_is_an_unknown_field():
    st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 16)}), depth=2)
    bad = "\ud800"
    for call in (
        lambda: st.stage({bad: [1]}),
        lambda: st.read_field(bad),
        lambda: st.field(bad),
        lambda: st.stage({"ids": [1]}, rows={bad: 1}),
    ):
        with pytest.raises(pinstage.UnknownFieldError):
            call()
    with st.step() as step:
        for call in (lambda: step.put(bad, [1]), lambda: step.view(bad), lambda: step.used_rows(bad)):
            with pytest.raises(KeyError):
                call()
        step.put("ids", [4])
    assert st.read_field("ids")[:1].tolist() == [4]


@pytest.mark.parametrize(
    "fn,exc,match",
    [
        (lambda: pinstage.alloc_pinned_numpy(-1, "int32", 4), ValueError, "nbytes must be an int from .*; got -1"),
        (lambda: pinstage.alloc_pinned_numpy(HUGE, "int32", 4), ValueError, "nbytes must be an int from .*; got "),
        (lambda: pinstage.alloc_pinned_numpy(16, None, 4), TypeError, "dtype=None"),
        (lambda: pinstage.alloc_pinned_numpy(16, "int32", (-1,)), ValueError, "negative"),
        (lambda: pinstage.alloc_pinned_numpy(16, "int32", "x"), TypeError, "shape must be"),
        (lambda: pinstage.alloc_pinned_numpy(16, "int32", 4, device=-1), ValueError, "device=-1"),
        (lambda: pinstage.empty_pinned(-1), ValueError, "negative"),
        (lambda: pinstage.empty_pinned((2**40, 2**40), "int64"), ValueError, "shape must (hold|fit)"),
        (lambda: pinstage.set_pool_budget(-1), ValueError, "nbytes must be an int from .*; got -1"),
        (lambda: pinstage.set_pool_budget(None), TypeError, "nbytes must be an int"),
        (lambda: pinstage.set_pool_budget("1"), TypeError, "nbytes must be an int"),
        (lambda: pinstage.pool_stats(device=-1), ValueError, "device=-1"),
        (lambda: pinstage.copy_d2h(None), TypeError, "expected a DLPack producer"),
        (lambda: pinstage.copy_d2h(np.arange(4), dst=[0] * 4), TypeError, "dst must be a numpy array"),
        (lambda: pinstage.copy_d2h(np.arange(4), dst=np.zeros(1)), ValueError, "dst holds 8 bytes"),
        (lambda: pinstage.copy_d2h(np.arange(4), stream=-5), ValueError, "stream=-5"),
        (lambda: pinstage.copy_d2h(np.arange(4), stream=3), ValueError, "no CUDA stream"),
        (lambda: pinstage.is_pinned("x"), TypeError, "numpy array or an address"),
    ],
)
def test_module_functions_refuse_bad_arguments(fn, exc, match):
    before = pinstage.pinned_bytes()
    with pytest.raises(exc, match=match):
        fn()
    assert pinstage.pinned_bytes() == before


@pytest.mark.parametrize("timeout", [-1.0, math.nan, math.inf])
def test_pending_copy_wait_refuses_bad_timeouts(timeout):
    p = pinstage.copy_d2h_async(np.arange(4, dtype=np.int32))
    with pytest.raises(ValueError, match="timeout must be"):
        p.wait(timeout=timeout)
    assert p.wait().tolist() == [0, 1, 2, 3]


def test_pool_calls_work_without_a_driver():
    """pool_stats, set_pool_budget, empty_cache and pinned_bytes answer with or without a driver."""
    pinstage.set_pool_budget(1 << 20)
    s = pinstage.pool_stats()
    assert set(s) == {
        "hits",
        "misses",
        "pageable_fallbacks",
        "evictions",
        "in_use_bytes",
        "outstanding_bytes",
        "pooled_bytes",
        "peak_bytes",
        "max_outstanding_bytes",
        "max_pooled_bytes",
    }
    assert s["max_outstanding_bytes"] == 1 << 20
    if not pinstage.cuda_available():
        assert all(v == 0 for k, v in s.items() if not k.startswith("max_"))
        assert s["max_pooled_bytes"] is None
    pinstage.empty_cache()
    pinstage.set_pool_budget(4 << 30)
    assert pinstage.pool_stats()["max_outstanding_bytes"] == 4 << 30


@pytest.mark.parametrize(
    "dst",
    [
        lambda: np.array([None, None], dtype=object),
        lambda: np.zeros(2, dtype=[("a", object), ("b", np.int64)]),
    ],
)
def test_copy_d2h_never_writes_raw_bytes_over_python_objects(dst):
    """An object array's bytes are pointers: a raw copy into it would corrupt the interpreter
    (the argument fuzzer found this: a later print of the array segfaulted)."""
    d = dst()
    before = d.copy()
    with pytest.raises(pinstage.PinstageTypeError, match="Python objects"):
        pinstage.copy_d2h(np.arange(4, dtype=np.int32), d)
    assert repr(d) == repr(before)


@pytest.mark.parametrize("spelling", ["<f4", "=f4", "f4", "float32", np.float32, np.dtype("=f4")])
def test_dtype_type_strings_read_as_numpy_reads_them(spelling):
    a = pinstage.empty_host(3, spelling)
    assert a.dtype == np.float32
    assert pinstage.empty_host(2, "|u1").dtype == np.uint8
    assert pinstage.empty_host(2, "|b1").dtype == np.bool_


@pytest.mark.parametrize("spelling", [">f4", np.dtype(">f4"), np.dtype(">i8")])
def test_non_native_byte_orders_are_refused_not_reinterpreted(spelling):
    with pytest.raises(pinstage.PinstageTypeError, match="byte order"):
        pinstage.empty_host(3, spelling)


def test_bfloat16_numpy_arrays_go_both_ways_on_the_host():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    h = pinstage.empty_host(5, "bfloat16")
    assert h.dtype == ml_dtypes.bfloat16
    h[:] = [1.5, -2, 3, 0.25, 8]
    dst = np.full(5, 7, ml_dtypes.bfloat16)
    pinstage.copy_h2d(dst, h)
    assert dst.astype(np.float32).tolist() == [1.5, -2, 3, 0.25, 8]
    out = pinstage.copy_d2h(h)
    assert out.dtype == ml_dtypes.bfloat16 and out.astype(np.float32).tolist() == [1.5, -2, 3, 0.25, 8]
    with pytest.raises(pinstage.PinstageTypeError):
        pinstage.copy_h2d(np.zeros(5, np.uint16), h)  # same bytes, another dtype: refused
    ro = h.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        pinstage.copy_h2d(ro, h)  # a read-only bfloat16 destination


def test_counts_take_numpy_integers_but_not_bools_or_floats():
    st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 16)}), depth=np.int64(2))
    step = st.step()
    step.put("ids", [1], pad_value=3, rows=np.int64(2))
    step.view("ids", rows=np.int32(2))
    step.commit()
    assert st.read_field("ids")[:2].tolist() == [1, 3]
    for bad in (np.True_, np.float64(2.0), 2.0):
        with pytest.raises(pinstage.PinstageTypeError):
            pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 16)}), depth=bad)
    a = pinstage.empty_host(np.int64(3), "int8")
    assert a.shape == (3,)


def test_an_index_that_raises_other_than_type_error_propagates():
    """A count's __index__ raising TypeError is "not an integer" (a typed error); anything else
    it raises (Ctrl-C, MemoryError, its own error) reaches the caller as it was raised."""

    class Interrupted:
        def __index__(self):
            raise KeyboardInterrupt

    class Broken:
        def __index__(self):
            raise ZeroDivisionError("the object's own error")

    class NotAnInt:
        def __index__(self):
            raise TypeError("no")

    with pytest.raises(KeyboardInterrupt):
        pinstage.PinnedStager("int32", numel=Interrupted())
    with pytest.raises(ZeroDivisionError, match="own error"):
        pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 16)}), depth=Broken())
    with pytest.raises(pinstage.PinstageTypeError, match="numel"):
        pinstage.PinnedStager("int32", numel=NotAnInt())


@pytest.mark.parametrize(
    "values",
    [
        np.zeros(3, dtype=[("a", "i4"), ("b", "i4")]),
        np.ones(3, dtype=[("a", "i4")]),
        np.zeros(3, "V4"),
        np.ones(3, dtype=np.dtype((np.record, [("a", "i4")]))),
    ],
    ids=["structured", "one-field", "void", "record"],
)
def test_structured_and_void_values_are_typed_errors_with_nothing_written(values):
    st = pinstage.PinnedStager("int32", numel=8, depth=2)
    dst = np.full(8, 7, np.int32)
    with pytest.raises(pinstage.PinstageTypeError, match="structured or void"):
        st.copy_(dst, values, pad_value=0)
    with pytest.raises(pinstage.PinstageTypeError, match="structured or void"):
        st.copy_(dst, [1], pad_value=np.zeros(1, "V4")[0])
    steps = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 8)}), depth=2)
    with pytest.raises(pinstage.PinstageTypeError, match="structured or void"):
        steps.stage({"ids": values})
    assert dst.tolist() == [7] * 8


def test_shapes_take_ints_and_numpy_integers_never_bools_or_bytes():
    bad_shapes = (True, (True, 3), b"\x04", bytearray(b"\x04"), "4", (2, 2.0), None, {3, 2}, {2: 0},
                  (d for d in (2, 3)))
    for bad in bad_shapes:
        with pytest.raises(pinstage.PinstageTypeError, match="shape must be"):
            pinstage.empty_host(bad, "int8")
        with pytest.raises(pinstage.PinstageTypeError, match="shape must be"):
            pinstage.StepLayout({"a": ("int8", bad)})
    with pytest.raises(pinstage.PinstageValueError, match="out of range"):
        pinstage.empty_host(2**63, "int8")
    assert pinstage.empty_host((np.int64(2), 3), "int8").shape == (2, 3)
    assert pinstage.empty_host(np.array([2, 3]), "int8").shape == (2, 3)
    assert pinstage.StepLayout({"a": ("int8", (np.uint8(2), 3))}).fields[0]["shape"] == (2, 3)
    with pytest.raises(pinstage.PinstageTypeError, match="address"):
        pinstage.is_pinned(True)
    assert pinstage.is_pinned(np.int64(4096)) is False


def test_a_numpy_integer_is_a_stream_handle():
    st = pinstage.PinnedStager("int32", numel=8, depth=2)
    dst = np.full(8, 7, np.int32)
    st.copy_(dst, [1, 2], stream=np.int64(0))
    assert dst[:2].tolist() == [1, 2]
    with pytest.raises(pinstage.PinstageValueError, match="0 to 2\\*\\*64 - 1"):
        st.copy_(dst, [1], stream=np.int64(-1))


def test_reprs_spell_booleans_and_modes_as_python_does():
    st = pinstage.StepStager(pinstage.StepLayout({"a": ("int8", 4)}), mode="zero_copy" if pinstage.cuda_available() else "arena")
    assert "cuda=True" in repr(st) or "cuda=False" in repr(st), repr(st)
    assert "mode='" in repr(st), repr(st)
    p = pinstage.copy_d2h_async(np.arange(4))
    p.wait()
    assert repr(p) == "PendingCopy(done=True)"
    with pytest.raises(pinstage.PinstageValueError, match=r"mode must be .zero_copy. .* field\(name\)"):
        pinstage.StepStager(pinstage.StepLayout({"a": ("int8", 4)})).slot_field(0, "a")


def test_a_producer_whose_device_and_capsule_disagree_is_a_typed_error():
    class Liar:  # says CUDA device 0, exports a CPU capsule
        def __init__(self):
            self.a = np.zeros(3)

        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, **kwargs):
            return self.a.__dlpack__()

    dst = np.full(3, 7.0)
    with pytest.raises((pinstage.PinstageValueError, pinstage.CudaUnavailableError)):
        pinstage.copy_h2d(dst, Liar())
    assert dst.tolist() == [7.0, 7.0, 7.0]
