"""The public surface: docs/API.md names every public name; every 0.2 spelling still works for
one minor version and warns with the spelling to write instead; every public callable says what
it raises."""

import pathlib
import re
import warnings

import numpy as np
import pytest

import pinstage

API_MD = pathlib.Path(__file__).parents[2] / "docs" / "API.md"


def test_every_public_name_is_in_the_api_reference_and_nothing_else_is_public():
    text = API_MD.read_text()
    documented = {w for span in re.findall(r"`([^`]+)`", text) for w in re.findall(r"\w+", span)}
    public = {n for n in dir(pinstage) if not n.startswith("_")} - {"_native"}
    exported = set(pinstage.__all__) - {"__version__"}
    assert public - {"StepTensor"} >= exported
    assert not (exported - documented), f"not in docs/API.md: {sorted(exported - documented)}"
    # The package shows only what it exports (no helper modules at its root).
    assert public == exported, sorted(public ^ exported)


def test_every_public_callable_has_a_docstring_and_functions_say_what_they_raise():
    never_raise = {"cuda_available", "device_count", "driver_info", "empty_cache", "pinned_bytes"}
    as_other = {"copy_d2h_async": "copy_d2h", "empty_pinned": "alloc_pinned_numpy"}
    for name in pinstage.__all__:
        obj = getattr(pinstage, name)
        if name == "__version__":
            continue
        doc = obj.__doc__ or ""
        assert doc.strip(), name
        if callable(obj) and not isinstance(obj, type) and name not in never_raise:
            assert "Raises:" in doc or as_other.get(name, "@") in doc, name


P = int(np.full(1, 0xA5A5A5A5, np.uint32).view(np.int32)[0])  # the arena's poison, as int32


def _warns(new):
    return pytest.warns(DeprecationWarning, match=re.escape(new))


def _stager():
    layout = pinstage.StepLayout({"ids": ("int32", 8)})
    raw = np.full(layout.nbytes + 256, 0xA5, np.uint8)
    off = (-raw.ctypes.data) % 256
    return pinstage.StepStager(layout, depth=2, arena=raw[off : off + layout.nbytes])


def test_copy_h2d_handle_still_answers_with_a_warning():
    dst = np.full(4, -1, np.int32)
    with _warns("copy_h2d_async(dst, src)"):
        assert pinstage.copy_h2d(dst, np.arange(4, dtype=np.int32) + 3).wait() is dst
    assert dst.tolist() == [3, 4, 5, 6]
    with _warns("copy_h2d_async(dst, src)"):
        assert pinstage.copy_h2d(dst, np.arange(4, dtype=np.int32)).done()
    assert dst.tolist() == [0, 1, 2, 3]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pinstage.copy_h2d_async(dst, np.arange(4, dtype=np.int32) + 9).wait() is dst
    assert dst.tolist() == [9, 10, 11, 12]


def test_step_tensor_is_device_array_with_a_warning():
    with _warns("pinstage.DeviceArray"):
        assert pinstage.StepTensor is pinstage.DeviceArray
    with pytest.raises(AttributeError, match="no_such_name"):
        pinstage.no_such_name  # noqa: B018


def test_device_array_ready_and_synchronize_warn():
    st = _stager()
    st.stage({"ids": [1, 2]})
    arr = st.field("ids")
    with _warns("done()"):
        assert arr.ready()
    with _warns("wait()"):
        arr.synchronize()
    assert arr.done() and arr.wait() is arr
    assert np.from_dlpack(arr)[:3].tolist() == [1, 2, P]


def test_stage_pad_values_warns_and_pads():
    st = _stager()
    with _warns("stage(pad_value=...)"):
        st.stage({"ids": [1, 2]}, pad_values={"ids": 7}, rows={"ids": 4})
    assert st.read_field("ids")[:5].tolist() == [1, 2, 7, 7, P]
    with pytest.raises(TypeError, match="pad_value"):
        st.stage({"ids": [1]}, pad_value={"ids": 1}, pad_values={"ids": 1})


def test_positional_options_warn_and_mean_the_same():
    st = _stager()
    with st.step() as step, _warns("put(name, values, pad_value=pad, rows=rows)"):
        step.put("ids", [4], 9, 3)
    assert st.read_field("ids")[:4].tolist() == [4, 9, 9, P]
    with st.step() as step:
        with _warns("view(name, rows=rows)"):
            step.view("ids", 2)[:] = [6, 5]
    assert st.read_field("ids")[:4].tolist() == [6, 5, 9, P]
    with st.step() as step, _warns("Step.field(name)"):
        with pytest.raises((pinstage.PinstageValueError, pinstage.CudaUnavailableError)):
            step.device("ids")  # arena mode: only zero-copy steps hand out their fields
    ps = pinstage.PinnedStager("int32", numel=8, depth=2)
    d = np.full(4, -1, np.int32)
    with _warns("target(dst, pad_value=pad)"):
        t = ps.target(d, 8)
    t.copy_([1])
    assert d.tolist() == [1, 8, 8, 8]


def test_positional_options_fewer_too_many_or_twice():
    st = _stager()
    with st.step() as step, _warns("put(name, values, pad_value=pad, rows=rows)"):
        step.put("ids", [4], 9)  # fewer than every option: the pad only
    assert st.read_field("ids")[:2].tolist() == [4, P]
    with st.step() as step, _warns("put(name, values, pad_value=pad, rows=rows)"):
        step.put("ids", [5], 8, pad_value=None, rows=2)  # a keyword left None is not given
    assert st.read_field("ids")[:3].tolist() == [5, 8, P]
    with st.step() as step:
        with pytest.raises(pinstage.PinstageTypeError, match="at most 2 argument"):
            step.put("ids", [4], 9, 3, 1)
        with pytest.raises(pinstage.PinstageTypeError, match="pad_value was given both"):
            step.put("ids", [4], 9, pad_value=9)
        step.put("ids", [1])


def test_step_layout_positional_skip_unchanged_warns():
    with _warns("StepLayout(fields, skip_unchanged=names)"):
        a = pinstage.StepLayout({"ids": ("int32", 8)}, ["ids"])
    assert a == pinstage.StepLayout({"ids": ("int32", 8)}, skip_unchanged=["ids"])
    assert a == pinstage.StepLayout({"ids": ("int32", 8)}, skip_unchanged=True)


def test_pool_stats_positional_device_and_old_keys_warn():
    with _warns("pool_stats(device=device)"):
        s = pinstage.pool_stats(0)
    with _warns("device_pool_stats(device=device)"):
        d = pinstage.device_pool_stats(0)
    with _warns("['pooled_bytes']"):
        assert s["cached_bytes"] == s["pooled_bytes"]
    with _warns("['max_outstanding_bytes']"):
        assert s["budget_bytes"] == s["max_outstanding_bytes"]
    with _warns("['in_use_arrays']"):
        assert d["live_arrays"] == d["in_use_arrays"]
    with _warns("['in_use_bytes']"):
        assert d["live_bytes"] == d["in_use_bytes"]
    with _warns("['outstanding_bytes']"):
        assert d["reserved_bytes"] == d["outstanding_bytes"]
    ps = pinstage.PinnedStager("int32", numel=8, depth=2)
    with _warns("['skipped_copies']"):
        assert ps.stats()["skipped"] == ps.stats()["skipped_copies"] == 0
    with pytest.raises(KeyError):
        s["no_such_key"]
    # The new keys are the dict's keys: iterating, comparing and printing show no old name.
    assert "cached_bytes" not in s and "cached_bytes" not in repr(s)


def test_nvtx_range_available_warns():
    with _warns("NvtxRange.available()"):
        assert pinstage.nvtx_range.available() == pinstage.NvtxRange.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pinstage.nvtx_range("api") as r:
            assert isinstance(r, pinstage.NvtxRange)


def test_new_spellings_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st = _stager()
        st.stage({"ids": [1]}, pad_value={"ids": 2}, rows={"ids": 2})
        with st.step() as step:
            step.put("ids", [3], pad_value=4, rows=2)
            step.view("ids", rows=3)[2] = 5
        assert st.read_field("ids")[:4].tolist() == [3, 4, 5, P]
        pinstage.pool_stats(device=0)["pooled_bytes"]
        pinstage.device_pool_stats(device=0)["outstanding_bytes"]
        pinstage.StepLayout({"ids": ("int32", 8)}, skip_unchanged="ids")
        pinstage.PinnedStager("int32", numel=8, depth=2).target(np.zeros(4, np.int32), pad_value=0)


def _aligned_arena_stager():
    layout = pinstage.StepLayout({"a": ("int32", 4)})
    raw = np.zeros(layout.nbytes + 256, np.uint8)
    off = (-raw.ctypes.data) % 256
    st = pinstage.StepStager(layout, arena=raw[off : off + layout.nbytes])
    st.stage({"a": [1]})
    return st


@pytest.mark.parametrize(
    "call,exc,words",
    [
        (lambda: pinstage.PinnedStager("int32", numel=0), pinstage.PinstageValueError, r"numel must be an int from 1 to \d+; got 0"),
        (lambda: pinstage.PinnedStager("int32", numel=True), pinstage.PinstageTypeError, r"numel must be an int from 1 to \d+; got bool"),
        (
            lambda: pinstage.StepLayout({"ok": ("int8", 4), "huge": ("int64", (1 << 40, 1 << 20))}),
            pinstage.PinstageValueError,
            r"shape must be fields that fit one arena .*; got \[1099511627776, 1048576\] \(field \"huge\"",
        ),
        (lambda: pinstage.StepLayout({"a": ("U10", 4)}), pinstage.PinstageTypeError, r"dtype must be bool, .*; got 'U10'"),
        (lambda: pinstage.empty_host((1,) * 65, "int8"), pinstage.PinstageValueError, r"shape must have at most 64 dimensions.*; got 65"),
        (
            lambda: pinstage.StepStager(pinstage.StepLayout({"a": ("int32", 4)})).slot_field(0, "a"),
            pinstage.PinstageValueError,
            r"mode must be 'zero_copy' .*field\(name\).*; got 'arena'",
        ),
        (
            lambda: pinstage.StepStager(pinstage.StepLayout({"a": ("int32", 4)})).stage({"a": [1]}, pad_value={"a": "x"}, rows={"a": 2}),
            pinstage.PinstageTypeError,
            r"pad_value must be one number that fits int32; got 'x'",
        ),
        (lambda: pinstage.StepLayout({"a": ("int32", 4)}, skip_unchanged={"a": 1}), pinstage.PinstageTypeError, r"skip_unchanged must be .*; got dict"),
        (lambda: pinstage.StepLayout({"a": ("int32", 4)}, skip_unchanged=["a", "a"]), pinstage.PinstageValueError, r"skip_unchanged must name each field once; got"),
        (lambda: _aligned_arena_stager().field("a").__dlpack__(max_version="x"), pinstage.PinstageTypeError, r"max_version must be a tuple .*; got 'x'"),
        (lambda: _aligned_arena_stager().field("a").__dlpack__(dl_device=(1,)), pinstage.PinstageTypeError, r"dl_device must be a tuple .*; got \(1,\)"),
        (lambda: _aligned_arena_stager().field("a").__dlpack__(copy="yes"), pinstage.PinstageTypeError, r"copy must be True, False or None; got str"),
    ],
)
def test_bad_arguments_get_one_message_pattern(call, exc, words):
    """'X must be ...; got ...' naming the argument, in the class the docstring names."""
    with pytest.raises(exc, match=words):
        call()


def test_pool_stats_report_the_limits_given_with_or_without_a_driver():
    p = pinstage.PinnedPool(1 << 20, max_pooled_bytes=4096)
    assert (p.stats()["max_outstanding_bytes"], p.stats()["max_pooled_bytes"]) == (1 << 20, 4096)
    q = pinstage.PinnedPool()
    assert (q.stats()["max_outstanding_bytes"], q.stats()["max_pooled_bytes"]) == (None, None)
    assert pinstage.pool_stats()["max_pooled_bytes"] is None
