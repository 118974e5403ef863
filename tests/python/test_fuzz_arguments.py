"""Fuzzing the Python argument parser with hypothesis: every public call, each parameter in
turn replaced by a hostile value (None, bools, huge and negative ints, NaN, inf, strings, bytes,
nested lists, dicts, sets, generators, objects, numpy arrays of odd dtypes). A call either
works or raises a typed error that names what it refused; it never crashes the interpreter,
panics, or raises an untyped error (AttributeError, SystemError, pyo3's PanicException), and a
refused copy writes nothing. Runs everywhere (host destinations)."""

import math

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import pinstage  # noqa: E402


def _gen():
    yield 1


hostile = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63), 10**9]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.binary(max_size=6),
    st.lists(st.one_of(st.integers(-5, 5), st.floats(allow_nan=True), st.none()), max_size=4),
    st.lists(st.lists(st.integers(-3, 3), max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.frozensets(st.integers(), max_size=3),
    st.builds(_gen),
    st.builds(object),
    st.sampled_from(
        [
            np.array(["a", "b"], dtype=object),
            np.arange(3, dtype=">i4"),
            np.array(["abc"]),
            np.float64(math.nan),
            np.zeros((2, 2, 2), np.int32),
            np.zeros(0, np.int8),
        ]
    ),
)

ALLOWED = (pinstage.PinstageError, MemoryError)


def call_ok(fn, *names):
    try:
        fn()
    except ALLOWED:
        pass
    except (TypeError, ValueError, OverflowError) as e:
        # pyo3's own argument extraction (a str where a float goes): it names the argument.
        assert any(n in str(e) for n in names), f"{type(e).__name__} without the parameter: {e}"


SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(hostile, st.sampled_from(["dtype", "numel", "depth", "device"]))
def test_stager_constructor(value, param):
    kwargs = {"dtype": "int32", "numel": 8, "depth": 2, "device": None}
    kwargs[param] = value
    dtype = kwargs.pop("dtype")
    call_ok(lambda: pinstage.PinnedStager(dtype, **kwargs), param)


@SETTINGS
@given(hostile, st.sampled_from(["dst", "values", "pad_value", "mirror", "stream"]))
def test_stager_copy(value, param):
    st_ = pinstage.PinnedStager("int32", numel=8, depth=2)
    dst = np.full(8, 3, np.int32)
    args = {"dst": dst, "values": [1, 2], "pad_value": -1, "mirror": None, "stream": None}
    args[param] = value
    before = dst.copy()

    def run():
        st_.copy_(args["dst"], args["values"], args["pad_value"], args["mirror"], stream=args["stream"])

    try:
        run()
    except ALLOWED:
        np.testing.assert_array_equal(dst, before)  # a refused copy wrote nothing
        return
    except (TypeError, ValueError, OverflowError) as e:
        assert param in str(e), e
        np.testing.assert_array_equal(dst, before)


@SETTINGS
@given(hostile, st.sampled_from(["values", "stream"]))
def test_bound_target_copy(value, param):
    st_ = pinstage.PinnedStager("int64", numel=8, depth=2)
    dst = np.full(6, 3, np.int64)
    t = st_.target(dst, pad_value=0)
    args = {"values": [1], "stream": None}
    args[param] = value
    call_ok(lambda: t.copy_(args["values"], stream=args["stream"]), param)


@SETTINGS
@given(hostile, hostile)
def test_mirror(key, values):
    m = pinstage.H2DMirror()
    call_ok(lambda: m.record(key, values), "key", "values")
    call_ok(lambda: m.matches(key, values), "key", "values")


@SETTINGS
@given(hostile, st.sampled_from(["nbytes", "dtype", "shape", "device"]))
def test_pinned_array_constructors(value, param):
    args = {"nbytes": 64, "dtype": "int32", "shape": 4, "device": None}
    args[param] = value
    call_ok(lambda: pinstage.alloc_pinned_numpy(args["nbytes"], args["dtype"], args["shape"], device=args["device"]), param)
    if param != "nbytes":
        call_ok(lambda: pinstage.empty_pinned(args["shape"], args["dtype"], device=args["device"]), param)


@SETTINGS
@given(hostile, st.sampled_from(["src", "dst", "stream"]))
def test_copies(value, param):
    args = {"src": np.arange(4, dtype=np.int32), "dst": None, "stream": None}
    args[param] = value
    call_ok(lambda: pinstage.copy_d2h(args["src"], args["dst"], stream=args["stream"]), param)
    call_ok(lambda: pinstage.copy_d2h_async(args["src"], args["dst"], stream=args["stream"]).wait(), param)
    h2d = {"dst": np.zeros(4, np.int32), "src": np.arange(4, dtype=np.int32), "stream": None}
    h2d[param] = value
    call_ok(lambda: pinstage.copy_h2d(h2d["dst"], h2d["src"], stream=h2d["stream"]), param)


@SETTINGS
@given(hostile)
def test_module_functions(value):
    call_ok(lambda: pinstage.set_pool_budget(value), "nbytes")
    call_ok(lambda: pinstage.pool_stats(device=value), "device")
    call_ok(lambda: pinstage.is_pinned(value), "obj")
    p = pinstage.copy_d2h_async(np.arange(3))
    call_ok(lambda: p.wait(timeout=value), "timeout")
    pinstage.set_pool_budget(4 << 30)


STEP_LAYOUT = {"ids": ("int32", 16), "t": ("int64", (4, 3))}


@SETTINGS
@given(hostile, st.sampled_from(["fields", "skip_unchanged", "dtype", "shape"]))
def test_step_layout_constructor(value, param):
    fields = dict(STEP_LAYOUT)
    kwargs = {}
    if param == "fields":
        fields = value
    elif param == "skip_unchanged":
        kwargs["skip_unchanged"] = value
    elif param == "dtype":
        fields["ids"] = (value, 16)
    else:
        fields["ids"] = ("int32", value)
    call_ok(lambda: pinstage.StepLayout(fields, **kwargs), param, "fields", "skip_unchanged")


@SETTINGS
@given(hostile, st.sampled_from(["device", "depth", "mode", "arena", "max_gap", "batch"]))
def test_step_stager_constructor(value, param):
    layout = pinstage.StepLayout(STEP_LAYOUT)
    call_ok(lambda: pinstage.StepStager(layout, **{param: value}), param)


@SETTINGS
@given(hostile, st.sampled_from(["name", "values", "pad_value", "rows", "view_rows", "stream"]))
def test_step_calls_refuse_and_write_nothing(value, param):
    layout = pinstage.StepLayout(STEP_LAYOUT)
    stager = pinstage.StepStager(layout, depth=1)
    stager.stage({"ids": [5, 6, 7]})
    args = {"name": "ids", "values": [1, 2], "pad_value": 0, "rows": 4, "view_rows": 2, "stream": None}
    args[param] = value

    def run():
        with stager.step(stream=args["stream"]) as step:
            step.put(args["name"], args["values"], pad_value=args["pad_value"], rows=args["rows"])
            step.view(args["name"], rows=args["view_rows"])

    try:
        run()
    except (ALLOWED + (KeyError,)):
        # The step was released untouched: the arena still holds the last commit, and the slot
        # (depth 1) is free again.
        assert stager.read_field("ids")[:3].tolist() == [5, 6, 7]
        stager.stage({"ids": [5]})
        return
    except (TypeError, ValueError, OverflowError) as e:
        assert param.replace("view_", "") in str(e) or "name" in str(e), e
        assert stager.read_field("ids")[:3].tolist() == [5, 6, 7]


@SETTINGS
@given(hostile, st.sampled_from(["fields", "pad_value", "rows", "stream"]))
def test_step_stage_refuses_and_writes_nothing(value, param):
    layout = pinstage.StepLayout(STEP_LAYOUT)
    stager = pinstage.StepStager(layout, depth=1)
    stager.stage({"ids": [5, 6, 7]})
    kwargs = {"pad_value": None, "rows": None, "stream": None}
    fields = {"ids": [1]}
    if param == "fields":
        fields = value
    else:
        kwargs[param] = value
    try:
        stager.stage(fields, **kwargs)
    except (ALLOWED + (KeyError,)):
        assert stager.read_field("ids")[:3].tolist() == [5, 6, 7]
    except (TypeError, ValueError, OverflowError) as e:
        assert param in str(e) or "fields" in str(e), e
        assert stager.read_field("ids")[:3].tolist() == [5, 6, 7]
    stager.stage({"ids": [5]})  # the slot is free again


@SETTINGS
@given(hostile, st.sampled_from(["max_outstanding_bytes", "device"]))
def test_pinned_pool_constructor(value, param):
    call_ok(lambda: pinstage.PinnedPool(**{param: value}), param)


@SETTINGS
@given(hostile, st.sampled_from(["shape", "dtype", "pool", "device"]))
def test_empty_host(value, param):
    args = {"shape": 4, "dtype": "int32", "pool": None, "device": None}
    args[param] = value
    call_ok(lambda: pinstage.empty_host(args["shape"], args["dtype"], pool=args["pool"], device=args["device"]), param)


@SETTINGS
@given(hostile)
def test_nvtx_range(value):
    def run():
        with pinstage.nvtx_range(value):
            pass

    call_ok(run, "name")


@SETTINGS
@given(hostile, st.sampled_from(["array", "device"]))
def test_pin(value, param):
    args = {"array": np.zeros(8), "device": None}
    args[param] = value

    def run():
        pinstage.pin(args["array"], device=args["device"]).unpin()

    call_ok(run, param, "array")
