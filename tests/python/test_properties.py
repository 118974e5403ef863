"""Property tests (hypothesis): the stager against numpy's own assignment, for random dtypes,
shapes, values, pads, mirrors and destinations. Host destinations everywhere; CUDA destinations
(torch) on a GPU."""

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

import pinstage  # noqa: E402

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]
POISON = 0xA5


@st.composite
def case(draw):
    """A destination shape, values that numpy can assign as dst[:n] = values, and maybe a pad."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    rows = draw(st.integers(0, 40))
    tail = draw(st.lists(st.integers(1, 5), min_size=0, max_size=2))
    dst_shape = (rows, *tail)
    n = draw(st.integers(0, rows))
    values = draw(
        hnp.arrays(dtype, (n, *tail), elements=hnp.from_dtype(dtype, allow_nan=False, allow_infinity=False))
    )
    if not tail and draw(st.booleans()):
        values = values.tolist()  # a Python list takes the sequence path
    pad = draw(st.none() | hnp.from_dtype(dtype, allow_nan=False, allow_infinity=False))
    return dtype, dst_shape, values, pad


def expected(dtype, dst_shape, values, pad, before):
    out = before.copy()
    v = np.asarray(values, dtype=dtype).reshape((-1, *dst_shape[1:]))
    out[: len(v)] = v
    if pad is not None:
        out[len(v):] = pad
    return out


def poisoned(dtype, shape):
    raw = np.full(int(np.prod(shape)) * dtype.itemsize + 16, POISON, np.uint8)
    return raw, raw[: int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case(), st.booleans())
def test_host_destinations_match_numpy_assignment(c, with_mirror):
    dtype, dst_shape, values, pad = c
    stager = pinstage.PinnedStager(dtype, numel=16, depth=2)
    raw, dst = poisoned(dtype, dst_shape)
    before = dst.copy()
    mirror = pinstage.H2DMirror() if with_mirror else None
    wrote = stager.copy_(dst, values, pad_value=pad, mirror=mirror)
    want = expected(dtype, dst_shape, values, pad, before)
    assert dst.tobytes() == want.tobytes()
    assert (raw[dst.nbytes:] == POISON).all(), "bytes past the destination were touched"
    n = len(np.asarray(values).reshape((-1, *dst_shape[1:])))
    assert wrote == (n > 0 or (pad is not None and dst.size > 0))
    if with_mirror and wrote:
        dst[...] = before  # rewritten behind the mirror's back: the mirror still says "held"
        assert not stager.copy_(dst, values, pad_value=pad, mirror=mirror)
        mirror.invalidate()
        assert stager.copy_(dst, values, pad_value=pad, mirror=mirror)
        assert dst.tobytes() == want.tobytes()


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(DTYPES), st.integers(1, 30), st.data())
def test_values_that_do_not_fit_are_refused_and_nothing_is_written(name, n, data):
    dtype = np.dtype(name)
    if dtype.kind not in "iub":
        return
    info = np.iinfo(dtype) if dtype.kind != "b" else None
    lo, hi = (0, 1) if info is None else (int(info.min), int(info.max))
    bad = data.draw(st.integers(hi + 1, hi + 2**70) | st.integers(lo - 2**70, lo - 1))
    values = [lo] * (n - 1) + [bad]
    stager = pinstage.PinnedStager(dtype, numel=8, depth=2)
    raw, dst = poisoned(dtype, (n,))
    with pytest.raises(ValueError, match="fit"):
        stager.copy_(dst, values, pad_value=None)
    assert (raw == POISON).all()


@pytest.mark.gpu
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case())
def test_cuda_destinations_match_numpy_assignment(gpu, c):
    torch = pytest.importorskip("torch")
    dtype, dst_shape, values, pad = c
    stager = pinstage.PinnedStager(dtype, numel=16, depth=2)
    raw_host, host = poisoned(dtype, dst_shape)
    raw = torch.from_numpy(raw_host).cuda()
    before = host.copy()
    dst = raw[: host.nbytes].view(getattr(torch, dtype.name)).reshape(dst_shape)
    stager.copy_(dst, values, pad_value=pad)
    torch.cuda.synchronize()
    got = raw.cpu().numpy()
    want = expected(dtype, dst_shape, values, pad, before)
    assert got[: host.nbytes].tobytes() == want.tobytes()
    assert (got[host.nbytes:] == POISON).all()
