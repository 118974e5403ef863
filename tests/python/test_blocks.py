"""BlockMover: KV-cache blocks between device tensors and pinned host tensors.

Every block of every tensor is checked after every move: values distinct per tensor, part, block
and move; destinations poisoned with a value no source holds; blocks not moved still poisoned.
Host arrays on both sides (no driver needed) exercise the ids, layouts and runs; the GPU tests
move torch tensors both ways, on the current and on other streams, at once in both directions.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pinstage
from conftest import CapsuleProducer, make_capsule

POISON = -0x5A5A5A5B  # int32; values are >= 0


def values(shape, t, m):
    """Distinct non-negative int32 values for tensor t of move m."""
    base = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    return ((base * 2654435761 + t * 1000003 + m * 7919) & 0x7FFFFFFF).astype(np.int32)


def expected(dst_before, src, src_ids, dst_ids, block_dim):
    """dst_before with block src_ids[i] of src copied into block dst_ids[i] (every part)."""
    want = dst_before.copy()
    for s, d in zip(src_ids, dst_ids):
        idx_s = (slice(None),) * block_dim + (s,)
        idx_d = (slice(None),) * block_dim + (d,)
        want[idx_d] = src[idx_s]
    return want


LAYOUTS = {
    # name: (shape given blocks, block_dim)
    "kv_first": (lambda nb: (2, nb, 4, 6), 1),
    "blocks_first": (lambda nb: (nb, 2, 4, 6), 0),
    "cross_layer": (lambda nb: (nb, 3, 2, 5), 0),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_host_mover_moves_every_block_and_nothing_else(layout):
    shape, dim = LAYOUTS[layout]
    dev = [values(shape(24), t, 0) for t in range(3)]
    host = [np.full(shape(16), POISON, np.int32) for _ in range(3)]
    mover = pinstage.BlockMover(dev, host, block_dim=dim)
    assert (mover.num_tensors, mover.device_blocks, mover.host_blocks) == (3, 24, 16)
    assert mover.block_bytes == sum(x[(slice(None),) * dim + (0,)].nbytes for x in dev)
    src_ids, dst_ids = [5, 6, 7, 20, 0, 1], [9, 10, 11, 2, 15, 3]
    before = [h.copy() for h in host]
    assert mover.offload(src_ids, dst_ids).wait() is None
    for t in range(3):
        np.testing.assert_array_equal(host[t], expected(before[t], dev[t], src_ids, dst_ids, dim))
    # And back into poisoned device tensors, ids as numpy arrays of two integer dtypes.
    for t in range(3):
        host[t][...] = values(shape(16), t, 1)
        dev[t][...] = POISON
    before = [d.copy() for d in dev]
    mover.load(np.array(dst_ids, np.uint16), np.array(src_ids, np.int64)).wait()
    for t in range(3):
        np.testing.assert_array_equal(dev[t], expected(before[t], host[t], dst_ids, src_ids, dim))
    p = mover.plan("offload", src_ids, dst_ids)
    # 5,6,7 -> 9,10,11 is one run; 0 -> 15, 1 -> 3 and 20 -> 2 are three more.
    assert p["runs"] == 4 and p["blocks"] == 6
    parts = 2 if layout == "kv_first" else 1
    assert p["copies"] == 4 * parts * 3
    assert p["bytes"] == 6 * mover.block_bytes


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    n_dev=st.integers(1, 40),
    n_host=st.integers(1, 40),
    layout=st.sampled_from(sorted(LAYOUTS)),
)
def test_host_mover_matches_a_loop_of_block_copies(data, n_dev, n_host, layout):
    shape, dim = LAYOUTS[layout]
    k = data.draw(st.integers(0, min(n_dev, n_host)))
    dst_ids = data.draw(st.permutations(range(n_host)))[:k]
    src_ids = data.draw(st.lists(st.integers(0, n_dev - 1), min_size=k, max_size=k))
    dev = [values(shape(n_dev), t, 3) for t in range(2)]
    host = [np.full(shape(n_host), POISON, np.int32) for _ in range(2)]
    before = [h.copy() for h in host]
    pinstage.BlockMover(dev, host, block_dim=dim).offload(src_ids, dst_ids).wait()
    for t in range(2):
        np.testing.assert_array_equal(host[t], expected(before[t], dev[t], src_ids, dst_ids, dim))


class _Index:
    """An id through __index__ (as numpy integers and other int-likes give theirs)."""

    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v


class _IntSub(int):
    """An int subclass: not a plain int, read through __index__."""


_ITEMS = st.one_of(
    st.integers(0, 23),
    st.integers(-(2**70), 2**70),
    st.sampled_from([True, False, 1.0, "3", None, 2**63 - 1, 2**63, -(2**63), -1]),
    st.integers(0, 23).map(np.int64),
    st.integers(0, 23).map(np.uint8),
    st.integers(0, 23).map(_Index),
    st.integers(0, 23).map(_IntSub),
    st.just(np.bool_(True)),
)


def _outcome(f):
    try:
        return ("ok", f())
    except Exception as e:  # noqa: BLE001 - the outcome IS the exception's type and text
        return (type(e).__name__, str(e))


@settings(max_examples=300, deadline=None)
@given(src=st.lists(_ITEMS, max_size=12), data=st.data())
def test_list_ids_read_as_any_sequence_of_the_same_items(src, data):
    """A list is read by index with plain ints taken straight from their objects; a tuple of
    the same items goes through the general path. Every list gives the tuple's outcome: the
    same plan, or the same error type and message (negative, too large, bool, float, str)."""
    dst = data.draw(st.permutations(range(16)))[: len(src)]
    dev = [values((2, 24, 3), 0, 0)]
    host = [np.full((2, 16, 3), POISON, np.int32)]
    mover = pinstage.BlockMover(dev, host, block_dim=1)
    as_list = _outcome(lambda: mover.plan("offload", list(src), list(dst)))
    as_tuple = _outcome(lambda: mover.plan("offload", tuple(src), tuple(dst)))
    assert as_list == as_tuple
    if as_list[0] == "ok" and src:
        mover.offload(list(src), list(dst)).wait()
        for s_, d_ in zip(src, dst):
            np.testing.assert_array_equal(host[0][:, d_], dev[0][:, int(s_)])


def test_a_list_changed_by_an_item_while_read_is_read_safely():
    """An item's __index__ that empties the list being read: no crash, no stale read; the ids
    read are the ones that were there when each was read."""
    ids = [0, 1, 2, 3]

    class Clears:
        def __index__(self):
            ids.clear()
            return 5

    ids.insert(1, Clears())
    dev = [values((2, 24, 3), 0, 0)]
    host = [np.full((2, 16, 3), POISON, np.int32)]
    mover = pinstage.BlockMover(dev, host, block_dim=1)
    # Read: 0, then 5 (the list is emptied): two source ids against two destinations.
    p = mover.plan("offload", ids, [7, 8])
    assert p["blocks"] == 2


class _DLPackOnly:
    """A host array known to pinstage only through DLPack (as a CPU torch tensor is)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_ids_from_any_dlpack_host_array():
    """Ids from a producer that is not numpy: read through DLPack when 1-D and in host memory;
    two dimensions refused before anything is written."""
    dev = [values((2, 24, 3), 0, 0)]
    host = [np.full((2, 16, 3), POISON, np.int32)]
    mover = pinstage.BlockMover(dev, host, block_dim=1)
    src = _DLPackOnly(np.array([5, 6, 20], np.int32))
    dst = _DLPackOnly(np.array([9, 10, 2], np.int64))
    mover.offload(src, dst).wait()
    want = expected(np.full((2, 16, 3), POISON, np.int32), dev[0], [5, 6, 20], [9, 10, 2], 1)
    np.testing.assert_array_equal(host[0], want)
    host[0][...] = POISON
    with pytest.raises(pinstage.PinstageValueError, match="device_ids must be a 1-D integer array"):
        mover.offload(_DLPackOnly(np.array([[5, 6]], np.int64)), [1, 2])
    assert (host[0] == POISON).all()


def test_empty_ids_whose_data_pointer_is_null():
    """An empty id array may carry a null data pointer (torch exports one for zero-size
    tensors): read as no ids, every integer width, nothing moved."""
    dev = [values((2, 24, 3), 0, 0)]
    host = [np.full((2, 16, 3), POISON, np.int32)]
    mover = pinstage.BlockMover(dev, host, block_dim=1)
    for bits in (64, 32):
        for code in (0, 1):  # int, uint
            def empty():  # a capsule is consumed once
                buf = np.zeros(1, np.int64)
                cap = make_capsule(buf, dtype=(code, bits, 1), shape=(0,), data=0)
                return CapsuleProducer(cap, device=(1, 0))

            assert mover.plan("offload", empty(), [])["blocks"] == 0
            assert mover.offload(empty(), []).wait() is None
    assert (host[0] == POISON).all()


@pytest.mark.parametrize(
    "src, dst, exc, match",
    [
        ([1, 2], [3, 3], pinstage.PinstageValueError, "host_ids.*3 twice"),
        ([24], [0], pinstage.PinstageValueError, "device_ids.*24"),
        ([0], [16], pinstage.PinstageValueError, "host_ids.*16"),
        ([0, 1], [0], pinstage.PinstageValueError, "2 source and 1 destination"),
        ([-1], [0], pinstage.PinstageValueError, "device_ids holds -1"),
        (np.array([3, -2, 5], np.int64), [0, 1, 2], pinstage.PinstageValueError, "device_ids holds -2"),
        # Two negatives, and an even OR: the sign of every id is read, not of their XOR or sum.
        (np.array([-2, 4, -6], np.int64), [0, 1, 2], pinstage.PinstageValueError, "device_ids holds -2"),
        (np.array([3, 2**63], np.uint64), [0, 1], pinstage.PinstageValueError, "device_ids.*9223372036854775808"),
        (np.array([3, 23, 24], np.int64), [0, 1, 2], pinstage.PinstageValueError, "device_ids.*24 .the tensor"),
        ([0, 1, 2], np.array([15, 16, 3], np.int64), pinstage.PinstageValueError, "host_ids.*16 .the tensor"),
        ([1.0], [0], pinstage.PinstageTypeError, "device_ids must hold ints"),
        (np.array([1.0]), [0], pinstage.PinstageTypeError, "integers"),
        (np.array([[1]]), [0], pinstage.PinstageValueError, "1-D"),
        ("ab", [0, 1], pinstage.PinstageTypeError, "ints"),
        (3, [0], pinstage.PinstageTypeError, "list of ints"),
    ],
)
def test_bad_ids_are_refused_and_nothing_is_written(src, dst, exc, match):
    dev = [values((2, 24, 3), 0, 0)]
    host = [np.full((2, 16, 3), POISON, np.int32)]
    mover = pinstage.BlockMover(dev, host, block_dim=1)
    with pytest.raises(exc, match=match):
        mover.offload(src, dst)
    with pytest.raises(exc, match=match):
        mover.plan("offload", src, dst)
    assert (host[0] == POISON).all()


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_ids_from_every_integer_dtype_aligned_or_not(dtype, aligned):
    dev = [values((2, 24, 3), 0, 0)]
    host = [np.full((2, 16, 3), POISON, np.int32)]
    mover = pinstage.BlockMover(dev, host, block_dim=1)
    want_src, want_dst = [3, 4, 20], [15, 0, 7]
    ids = []
    for v in (want_src, want_dst):
        a = np.array(v, dtype=dtype)
        if not aligned and a.itemsize > 1:  # the same values one byte off their alignment
            raw = np.zeros(a.nbytes + 1, np.uint8)
            a = np.ndarray(len(v), dtype=dtype, buffer=raw, offset=1)
            a[:] = v
        ids.append(a)
    assert mover.plan("offload", ids[0], ids[1])["blocks"] == 3
    mover.offload(ids[0], ids[1]).wait()
    want = expected(np.full((2, 16, 3), POISON, np.int32), dev[0], want_src, want_dst, 1)
    np.testing.assert_array_equal(host[0], want)


@pytest.mark.parametrize(
    "view",
    [
        lambda a: np.repeat(a, 2)[::2],  # every other element
        lambda a: a[::-1].copy()[::-1],  # reversed twice: a negative stride
        lambda a: np.stack([a, a + 100]).T[:, 0],  # a column: a stride of two elements
        lambda a: np.frombuffer(a.astype(np.int16).tobytes(), np.int16),  # read-only
    ],
    ids=["every_other", "negative_stride", "column", "read_only"],
)
def test_ids_from_numpy_views_are_read_with_their_strides(view):
    dev = [values((2, 24, 3), 0, 0)]
    host = [np.full((2, 16, 3), POISON, np.int32)]
    mover = pinstage.BlockMover(dev, host, block_dim=1)
    want_src, want_dst = [3, 4, 20, 9], [15, 0, 7, 8]
    src, dst = (view(np.array(v, np.int64)) for v in (want_src, want_dst))
    assert list(src) == want_src and list(dst) == want_dst
    assert mover.plan("offload", src, dst)["runs"] == 4
    mover.offload(src, dst).wait()
    want = expected(np.full((2, 16, 3), POISON, np.int32), dev[0], want_src, want_dst, 1)
    np.testing.assert_array_equal(host[0], want)


def test_bad_tensors_are_refused():
    dev = [np.zeros((2, 8, 4), np.int32)]
    with pytest.raises(pinstage.PinstageValueError, match="one host tensor per device tensor"):
        pinstage.BlockMover(dev, [])
    with pytest.raises(pinstage.PinstageValueError, match="block_dim"):
        pinstage.BlockMover(dev, [np.zeros((2, 8, 4), np.int32)], block_dim=3)
    bad_dims = ((-1, pinstage.PinstageValueError), (True, pinstage.PinstageTypeError),
                (1.0, pinstage.PinstageTypeError))
    for bad, exc in bad_dims:
        with pytest.raises(exc, match="block_dim must be an int"):
            pinstage.BlockMover(dev, [np.zeros((2, 8, 4), np.int32)], block_dim=bad)
    assert pinstage.BlockMover(dev, [np.zeros((2, 8, 4), np.int32)], block_dim=np.int64(1)).host_blocks == 8
    with pytest.raises(pinstage.PinstageValueError, match="pair 0"):
        pinstage.BlockMover(dev, [np.zeros((2, 8, 5), np.int32)], block_dim=1)
    with pytest.raises(pinstage.PinstageTypeError):
        pinstage.BlockMover(dev, [np.zeros((2, 8, 4), np.float32)], block_dim=1)
    with pytest.raises(pinstage.PinstageValueError, match="contiguous"):
        pinstage.BlockMover(dev, [np.zeros((2, 8, 8), np.int32)[:, :, ::2]], block_dim=1)
    with pytest.raises(pinstage.PinstageValueError, match="direction"):
        pinstage.BlockMover(dev, [np.zeros((2, 8, 4), np.int32)], block_dim=1).plan("up", [0], [0])
    ro = np.zeros((2, 8, 4), np.int32)
    ro.flags.writeable = False
    mover = pinstage.BlockMover(dev, [ro], block_dim=1)
    with pytest.raises(pinstage.PinstageValueError, match="read-only"):
        mover.offload([0], [0])
    mover.load([0], [1]).wait()  # reading a read-only host tensor is fine


# --------------------------------------------------------------------------------------- GPU


def with_run(ids, run, pool, k):
    """`k` distinct ids: `run` first, then ids of `pool` not in it."""
    run = run[: min(len(run), k)]
    rest = [x for x in pool if x not in set(run.tolist())]
    return np.array(run.tolist() + rest[: k - len(run)], dtype=ids.dtype)


def torch_side(torch, shape, n, t0, m, device):
    return [torch.from_numpy(values(shape, t0 + t, m)).to(device) for t in range(n)]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("stream_kind", ["current", "side", "int"])
@pytest.mark.parametrize("host_kind", ["empty_pinned", "torch_pinned"])
@pytest.mark.parametrize("pooled", [False, True], ids=["apart", "pooled"])
def test_torch_every_block_of_every_move(gpu, layout, stream_kind, host_kind, pooled):
    """pooled: each side's tensors are slices of one allocation (as engines allocate a KV
    pool), so small moves go as 2D copies across all tensors ("strided")."""
    torch = pytest.importorskip("torch")
    shape, dim = LAYOUTS[layout]
    L, NB, NH = 4, 40, 32
    dev = torch_side(torch, shape(NB), L, 0, 0, "cuda")
    if pooled:
        dev = list(torch.stack(dev).unbind(0))
    if host_kind == "empty_pinned":
        if pooled:
            pool = pinstage.empty_pinned((L,) + shape(NH), "int32")
            host_np = [pool[t] for t in range(L)]
        else:
            host_np = [pinstage.empty_pinned(shape(NH), "int32") for _ in range(L)]
        host = host_np
    else:
        if pooled:
            host = list(torch.empty((L,) + shape(NH), dtype=torch.int32).pin_memory().unbind(0))
        else:
            host = [torch.empty(shape(NH), dtype=torch.int32).pin_memory() for _ in range(L)]
        host_np = [h.numpy() for h in host]
    mover = pinstage.BlockMover(dev, host, block_dim=dim)
    side = torch.cuda.Stream()
    stream = {"current": None, "side": side, "int": side.cuda_stream}[stream_kind]
    rng = np.random.default_rng(7)
    for m in range(8):
        k = [1, 5, 32, 17, 9, 32, 2, 24][m]
        src_ids = rng.permutation(NB)[:k]
        dst_ids = rng.permutation(NH)[:k]
        if m % 2:  # a run of 4 blocks adjacent on both sides, then distinct others
            src_ids = with_run(src_ids, np.arange(10, 14), rng.permutation(NB), k)
            dst_ids = with_run(dst_ids, np.arange(3, 7), rng.permutation(NH), k)
        for t in range(L):
            dev[t].copy_(torch.from_numpy(values(shape(NB), t, m)))
            host_np[t][...] = POISON
        torch.cuda.synchronize()
        src = [d.cpu().numpy() for d in dev]
        with torch.cuda.stream(side) if stream_kind != "current" else torch.cuda.stream(torch.cuda.current_stream()):
            p = mover.offload(torch.from_numpy(src_ids), dst_ids.tolist(), stream=stream)
        p.wait()
        for t in range(L):
            want = expected(np.full(shape(NH), POISON, np.int32), src[t], src_ids, dst_ids, dim)
            np.testing.assert_array_equal(host_np[t], want, err_msg=f"offload {m} tensor {t}")
        # Back: new host values into poisoned device tensors.
        for t in range(L):
            host_np[t][...] = values(shape(NH), 10 + t, m)
            dev[t].fill_(POISON)
        torch.cuda.synchronize()
        p = mover.load(dst_ids, src_ids, stream=stream)
        p.wait()
        for t in range(L):
            want = expected(np.full(shape(NB), POISON, np.int32), host_np[t], dst_ids, src_ids, dim)
            np.testing.assert_array_equal(dev[t].cpu().numpy(), want, err_msg=f"load {m} tensor {t}")
    plan = mover.plan("load", [1, 2], [3, 4])
    assert plan["strategy"] == ("strided" if pooled else "batched") and plan["runs"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("background", [False, True], ids=["caller", "background"])
def test_torch_large_moves_are_timed_both_ways_then_take_the_faster(gpu, background):
    """A pooled mover whose moves 2D copies and a batch can both carry: its first four moves of
    8 MiB of a kind are timed, the two ways in turn; then plan() says which was faster and every
    move takes it. Every move checked."""
    torch = pytest.importorskip("torch")
    L, NB, W = 8, 96, 4096  # blocks of 16 KiB int32; 64 ids carry 8 MiB
    dev_all = torch.zeros((L, NB, W), dtype=torch.int32, device="cuda")
    host_all = pinstage.empty_pinned((L, NB, W), "int32")
    # The timings of unstaged ways: moves in the background go as moves on this thread do.
    mover = pinstage.BlockMover(list(dev_all.unbind(0)), [host_all[t] for t in range(L)], staging="never")
    rng = np.random.default_rng(3)
    seen = []
    for m in range(8):
        d_ids, h_ids = rng.permutation(NB)[:64], rng.permutation(NB)[:64]
        plan = mover.plan("load", h_ids, d_ids)
        assert plan["bytes"] == 8 << 20
        seen.append((plan["strategy"], plan["choice"], plan.get("measured_gbps")))
        host_all[...] = rng.integers(0, 2**31 - 1, size=host_all.shape, dtype=np.int32)
        dev_all.fill_(POISON)
        mover.load(h_ids, d_ids, background=background).wait()
        got = dev_all.cpu().numpy()
        want = np.full(got.shape, POISON, np.int32)
        want[:, d_ids] = host_all[:, h_ids]
        np.testing.assert_array_equal(got, want, err_msg=f"load {m}")
    assert [c for _, c, _ in seen[:4]] == ["timing"] * 4, seen
    ways = [w for w, _, _ in seen[:4]]
    assert ways[0] != ways[1] and ways[:2] == ways[2:], seen
    for way, choice, gbps in seen[4:]:
        assert choice == "measured" and gbps["strided"] > 0 and gbps["batched"] > 0, seen
        # 512 copies: a batch from one thread only, nothing more to time.
        assert "batched_one_thread" not in gbps, seen
        # The batch takes the class only when it beats the 2D copies by 5% (BATCH_MARGIN).
        assert way == ("batched" if gbps["batched"] > 1.05 * gbps["strided"] else "strided"), seen
    assert mover.plan("load", [1, 2], [3, 4])["choice"] == "table"


@pytest.mark.gpu
def test_torch_offload_and_load_at_once_on_two_streams_every_round_checked(gpu):
    torch = pytest.importorskip("torch")
    L, NB, shape = 8, 64, (2, 64, 16, 64)  # 8 KiB per block part (int32)
    hot = torch_side(torch, shape, L, 0, 0, "cuda")
    cold = [torch.full(shape, POISON, dtype=torch.int32, device="cuda") for _ in range(L)]
    host_out = [pinstage.empty_pinned(shape, "int32") for _ in range(L)]
    host_in = [pinstage.empty_pinned(shape, "int32") for _ in range(L)]
    out_m = pinstage.BlockMover(hot, host_out, block_dim=1)
    in_m = pinstage.BlockMover(cold, host_in, block_dim=1)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    rng = np.random.default_rng(3)
    for r in range(20):
        a, b = rng.permutation(NB)[:48], rng.permutation(NB)[:48]
        for t in range(L):
            hot[t].copy_(torch.from_numpy(values(shape, t, r)))
            cold[t].fill_(POISON)
            host_out[t][...] = POISON
            host_in[t][...] = values(shape, 50 + t, r)
        torch.cuda.synchronize()
        src = [h.cpu().numpy() for h in hot]
        p1 = out_m.offload(a, b, stream=s1)
        p2 = in_m.load(b, a, stream=s2)
        p1.wait()
        p2.wait()
        for t in range(L):
            np.testing.assert_array_equal(
                host_out[t], expected(np.full(shape, POISON, np.int32), src[t], a, b, 1), err_msg=f"round {r}"
            )
            np.testing.assert_array_equal(
                cold[t].cpu().numpy(), expected(np.full(shape, POISON, np.int32), host_in[t], b, a, 1), err_msg=f"round {r}"
            )


@pytest.mark.gpu
def test_torch_stream_order_and_event(gpu):
    """A move on the current stream runs after the work queued before it and before the work
    queued after it; done() is False while a kernel ahead of it still runs."""
    torch = pytest.importorskip("torch")
    dev = [torch.zeros((1, 16, 1024), dtype=torch.int32, device="cuda")]
    host = [pinstage.empty_pinned((1, 16, 1024), "int32")]
    host[0][...] = POISON
    mover = pinstage.BlockMover(dev, host, block_dim=1)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the move
    dev[0][:, 3].fill_(1234)  # queued before the move: the move must see it
    p = mover.offload([3], [5])
    assert not p.done()
    dev[0][:, 3].fill_(99)  # queued after: the move must not see it
    p.wait()
    assert p.done()
    assert (host[0][:, 5] == 1234).all() and (host[0][:, 4] == POISON).all()


def poisoned_kv(torch, pooled=False, **kw):
    """4 poisoned CUDA tensors [2, 64, 32, 64] int32 (8 KiB per block part), pinned host
    tensors of that shape, and a mover over them (block_dim 1; `kw` to the mover). pooled: each
    side's tensors are views of one allocation."""
    L, NB, shape = 4, 64, (2, 64, 32, 64)
    if pooled:
        dev = list(torch.full((L,) + shape, POISON, dtype=torch.int32, device="cuda").unbind(0))
        pool = pinstage.empty_pinned((L,) + shape, "int32")
        host = [pool[t] for t in range(L)]
    else:
        dev = [torch.full(shape, POISON, dtype=torch.int32, device="cuda") for _ in range(L)]
        host = [pinstage.empty_pinned(shape, "int32") for _ in range(L)]
    return L, NB, shape, dev, host, pinstage.BlockMover(dev, host, block_dim=1, **kw)


@pytest.mark.gpu
def test_torch_stream_order_load_then_use_without_a_wait(gpu):
    """The engine's pattern: load blocks, then use them on the same stream at once (no wait):
    every use sees the load, and an offload queued after a kernel that rewrites the blocks sees
    the kernel's values; every round checked, the GPU kept busy ahead of each move."""
    torch = pytest.importorskip("torch")
    L, NB, shape, dev, host, mover = poisoned_kv(torch)
    rng = np.random.default_rng(11)
    for r in range(10):
        a, b = rng.permutation(NB)[:40], rng.permutation(NB)[:40]
        for t in range(L):
            host[t][...] = values(shape, 20 + t, r)
            dev[t].fill_(POISON)
        idx = torch.from_numpy(b).cuda()  # before the sleep: .cuda() synchronizes the stream
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)  # GPU work ahead of the move
        mover.load(a, b)  # the handle dropped: it lingers, nothing waits on the host
        used = [d[:, idx].clone() for d in dev]  # same stream, no wait
        for d in dev:
            d[:, idx] += 1  # rewritten after the load
        p = mover.offload(b, a)  # back into the host blocks it came from
        p.wait()
        for t in range(L):
            want = values(shape, 20 + t, r)[:, a]
            np.testing.assert_array_equal(used[t].cpu().numpy(), want, err_msg=f"round {r} tensor {t}")
            np.testing.assert_array_equal(host[t][:, a], want + 1, err_msg=f"round {r} tensor {t}")


def offload_checked(torch, mover, dev, host, layout, ids, m):
    """Device tensors filled with move m's values, host tensors poisoned, one offload in the
    background waited for; every host block checked (moved ones, and the poison elsewhere)."""
    (shape, dim), (src_ids, dst_ids) = layout, ids
    nb, nh = dev[0].shape[dim], host[0].shape[dim]
    for t in range(len(dev)):
        dev[t].copy_(torch.from_numpy(values(shape(nb), t, m)))
        host[t][...] = POISON
    src = [d.cpu().numpy() for d in dev]
    mover.offload(src_ids, dst_ids, background=True).wait()
    for t in range(len(dev)):
        want = expected(np.full(shape(nh), POISON, np.int32), src[t], src_ids, dst_ids, dim)
        np.testing.assert_array_equal(host[t], want, err_msg=f"offload {m} tensor {t}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("pooled", [False, True], ids=["apart", "pooled"])
def test_torch_background_moves_every_block(gpu, layout, pooled):
    """Moves issued by the mover's threads (background=True): every block of every move lands,
    nothing else is written; waited for with wait() (offload) and joined on the stream with
    stream_wait() then read there (load)."""
    torch = pytest.importorskip("torch")
    shape, dim = LAYOUTS[layout]
    L, NB, NH = 4, 40, 32
    dev = torch_side(torch, shape(NB), L, 0, 0, "cuda")
    if pooled:
        dev = list(torch.stack(dev).unbind(0))
        pool = pinstage.empty_pinned((L,) + shape(NH), "int32")
        host = [pool[t] for t in range(L)]
    else:
        host = [pinstage.empty_pinned(shape(NH), "int32") for _ in range(L)]
    mover = pinstage.BlockMover(dev, host, block_dim=dim)
    rng = np.random.default_rng(17)
    for m in range(6):
        k = [1, 5, 32, 17, 9, 24][m]
        src_ids, dst_ids = rng.permutation(NB)[:k], rng.permutation(NH)[:k]
        offload_checked(torch, mover, dev, host, (shape, dim), (src_ids, dst_ids), m)
        for t in range(L):
            host[t][...] = values(shape(NH), 10 + t, m)
            dev[t].fill_(POISON)
        p = mover.load(dst_ids, src_ids, background=True)
        p.stream_wait(torch.cuda.current_stream())
        got = [d.cpu().numpy() for d in dev]  # read on the stream that joined the load
        for t in range(L):
            want = expected(np.full(shape(NB), POISON, np.int32), host[t], dst_ids, src_ids, dim)
            np.testing.assert_array_equal(got[t], want, err_msg=f"load {m} tensor {t}")
        p.wait()


STAGED = dict(staging="always", staging_chunk=65536)


@pytest.mark.gpu
@pytest.mark.parametrize("staged", [False, True], ids=["unstaged", "staged"])
def test_torch_background_order_fork_and_join(gpu, staged):
    """A move in the background runs after the work queued on the stream before the call (a
    fork: GPU work kept ahead, and the values it must see written behind it), and work queued
    after stream_wait() runs after the move (it must not see that work); done() is False
    while the work ahead still runs. Every round checked. staged: through 64 KiB staging
    chunks (a move of 40 chunks: the ring of four wraps ten times)."""
    torch = pytest.importorskip("torch")
    L, NB, shape, dev, host, mover = poisoned_kv(torch, **(dict(pooled=True, **STAGED) if staged else {}))
    if staged:
        assert mover.plan("offload", list(range(40)), list(range(40)), background=True)["strategy"] == "staged"
    rng = np.random.default_rng(23)
    for r in range(8):
        a, b = rng.permutation(NB)[:40], rng.permutation(NB)[:40]
        for t in range(L):
            host[t][...] = POISON
        new = [torch.from_numpy(values(shape, 30 + t, r)).cuda() for t in range(L)]
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # GPU work ahead of the move
        for t in range(L):
            dev[t].copy_(new[t])  # queued before the move: it must see these values
        p = mover.offload(a, b, background=True)
        assert not p.done(), f"round {r}: done while the work ahead of it still runs"
        p.stream_wait(torch.cuda.current_stream())
        for d in dev:
            d.fill_(POISON)  # queued after the join: the move must not see it
        p.wait()
        for t in range(L):
            want = values(shape, 30 + t, r)[:, a]
            np.testing.assert_array_equal(host[t][:, b], want, err_msg=f"round {r} tensor {t}")
        rest = np.setdiff1d(np.arange(NB), b)
        assert (np.stack([h[:, rest] for h in host]) == POISON).all(), f"round {r}: written outside"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_torch_staged_moves_every_block(gpu, layout):
    """Moves in the background through staging (staging="always", 64 KiB chunks: moves of up
    to 30 chunks, so the ring of four wraps within a move and across moves): every
    block of every move lands, nothing else is written; the load read on a stream joined with
    stream_wait(); offload and load at once in the last rounds."""
    torch = pytest.importorskip("torch")
    base, dim = LAYOUTS[layout]
    shape = lambda nb: base(nb) + (64,)  # noqa: E731  (parts of 6-8 KiB)
    L, NB, NH = 4, 48, 40
    dev = list(torch.stack(torch_side(torch, shape(NB), L, 0, 0, "cuda")).unbind(0))
    pool = pinstage.empty_pinned((L,) + shape(NH), "int32")
    host = [pool[t] for t in range(L)]
    mover = pinstage.BlockMover(dev, host, block_dim=dim, **STAGED)
    assert mover.staging_bytes == 0
    rng = np.random.default_rng(29)
    for m in range(6):
        k = [1, 7, 40, 17, 33, 24][m]
        src_ids, dst_ids = rng.permutation(NB)[:k], rng.permutation(NH)[:k]
        if m % 2:
            src_ids = with_run(src_ids, np.arange(10, 16), rng.permutation(NB), k)
            dst_ids = with_run(dst_ids, np.arange(3, 9), rng.permutation(NH), k)
        plan = mover.plan("offload", src_ids, dst_ids, background=True)
        assert plan["strategy"] == "staged" and "always" in plan["reason"], plan
        assert mover.plan("offload", src_ids, dst_ids)["strategy"] != "staged"
        offload_checked(torch, mover, dev, host, (shape, dim), (src_ids, dst_ids), m)
        # Back: new host values into poisoned device blocks; the last rounds offload other
        # blocks at the same time.
        for t in range(L):
            host[t][...] = values(shape(NH), 10 + t, m)
            dev[t].fill_(POISON)
        torch.cuda.synchronize()
        p = mover.load(dst_ids, src_ids, background=True)
        if m >= 4:
            # Poisoned device blocks the load leaves alone into host blocks it does not read
            # (which hold values until then).
            spare = np.setdiff1d(np.arange(NB), src_ids)[:6]
            hspare = np.setdiff1d(np.arange(NH), dst_ids)[:6]
            mover.offload(spare, hspare, background=True).wait()
            at = expected_index(dim, hspare)
            assert all((h[at] == POISON).all() for h in host), f"offload during load {m}"
        p.stream_wait(torch.cuda.current_stream())
        got = [d.cpu().numpy() for d in dev]
        for t in range(L):
            before = values(shape(NH), 10 + t, m)
            want = expected(np.full(shape(NB), POISON, np.int32), before, dst_ids, src_ids, dim)
            np.testing.assert_array_equal(got[t], want, err_msg=f"load {m} tensor {t}")
        p.wait()
        # The staged path ran: each direction holds its ring (4 chunks of 64 KiB each side).
        assert mover.staging_bytes == 2 * 2 * 4 * 65536


def expected_index(dim, ids):
    return (slice(None),) * dim + (ids,)


@pytest.mark.gpu
def test_torch_staging_auto_takes_large_moves_of_small_blocks(gpu):
    """staging="auto": a move in the background of 8 MiB or more in copies under 128 KiB is
    staged (and lands, every block checked); a small move, a move of large copies and any move
    on the caller's thread are not; staging="never" never; bad values are refused."""
    torch = pytest.importorskip("torch")
    L, NB = 8, 96
    shape = (2, NB, 16, 128)  # int32: 8 KiB per part; a block across the tensors 128 KiB
    dev = list(torch.stack(torch_side(torch, shape, L, 0, 3, "cuda")).unbind(0))
    pool = pinstage.empty_pinned((L,) + shape, "int32")
    host = [pool[t] for t in range(L)]
    mover = pinstage.BlockMover(dev, host, block_dim=1)
    rng = np.random.default_rng(31)
    a, b = rng.permutation(NB)[:80], rng.permutation(NB)[:80]  # 10 MiB
    assert mover.plan("offload", a, b, background=True)["strategy"] == "staged"
    assert mover.plan("load", a, b, background=True)["strategy"] == "staged"
    assert mover.plan("offload", a[:8], b[:8], background=True)["strategy"] != "staged"
    assert mover.plan("offload", a, b)["strategy"] != "staged"
    run = np.arange(80)  # one run: copies of 640 KiB
    assert mover.plan("offload", run, run, background=True)["strategy"] != "staged"
    for n, staged in ((8, True), (16, False)):  # runs of n blocks: copies of 64 / 128 KiB
        ids = (np.arange(80) % n) + (np.arange(80) // n) * (n + 1)
        dst = ids.reshape(-1, n)[::-1].ravel().copy()  # the runs in reverse order
        got = mover.plan("load", ids, dst, background=True)
        assert (got["strategy"] == "staged") == staged, (n, got)
    for h in host:
        h[...] = POISON
    src = [d.cpu().numpy() for d in dev]
    mover.offload(a, b, background=True).wait()
    for t in range(L):
        want = expected(np.full(shape, POISON, np.int32), src[t], a, b, 1)
        np.testing.assert_array_equal(host[t], want, err_msg=f"tensor {t}")
    assert mover.staging_bytes == (2 * 4) << 24  # the offload's ring: 4 x 16 MiB each side
    never = pinstage.BlockMover(dev, host, block_dim=1, staging="never")
    assert never.plan("offload", a, b, background=True)["strategy"] != "staged"
    never.offload(a, b, background=True).wait()
    assert never.staging_bytes == 0
    with pytest.raises(pinstage.PinstageValueError, match="staging"):
        pinstage.BlockMover(dev, host, block_dim=1, staging="sometimes")
    for bad in (4096, (1 << 30) + 1):
        with pytest.raises(pinstage.PinstageValueError, match="staging_chunk"):
            pinstage.BlockMover(dev, host, block_dim=1, staging_chunk=bad)


@pytest.mark.gpu
def test_torch_staging_auto_stages_one_direction_at_a_time(gpu):
    """staging="auto": an offload and a load in the background that overlap (both held behind
    GPU work) go one staged, one not (two staged at once move about what one moves): one ring
    made; both land, every block checked."""
    torch = pytest.importorskip("torch")
    L, NB, half = 8, 192, 96
    shape = (2, NB, 16, 128)  # int32: 8 KiB per part; a block across the tensors 128 KiB
    dev = list(torch.stack(torch_side(torch, shape, L, 0, 5, "cuda")).unbind(0))
    pool = pinstage.empty_pinned((L,) + shape, "int32")
    host = [pool[t] for t in range(L)]
    for t in range(L):
        host[t][...] = values(shape, 40 + t, 6)
        host[t][:, :half] = POISON  # the offload's destinations
        dev[t][:, half:] = POISON  # the load's destinations
    mover = pinstage.BlockMover(dev, host, block_dim=1)
    rng = np.random.default_rng(37)
    # 80 blocks each way (10 MiB): the offload within the first half, the load the second.
    a, b = rng.permutation(half)[:80], rng.permutation(half)[:80]
    c, d = half + rng.permutation(half)[:80], half + rng.permutation(half)[:80]
    dev_before = [x.cpu().numpy() for x in dev]
    host_before = [h.copy() for h in host]
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # both moves wait for it: they overlap
    p = mover.offload(a, b, background=True)
    q = mover.load(c, d, background=True)
    p.wait()
    q.wait()
    torch.cuda.synchronize()
    for t in range(L):
        np.testing.assert_array_equal(
            host[t], expected(host_before[t], dev_before[t], a, b, 1), err_msg=f"host {t}")
        np.testing.assert_array_equal(
            dev[t].cpu().numpy(), expected(dev_before[t], host_before[t], c, d, 1),
            err_msg=f"device {t}")
    assert mover.staging_bytes == (2 * 4) << 24  # one direction's ring: 4 x 16 MiB each side


@pytest.mark.gpu
def test_gpu_refusals_issue_nothing(gpu):
    torch = pytest.importorskip("torch")
    dev = [torch.full((2, 8, 64), 7, dtype=torch.int32, device="cuda")]
    pageable = [np.full((2, 8, 64), POISON, np.int32)]
    with pytest.raises(pinstage.PinstageValueError, match="pageable"):
        pinstage.BlockMover(dev, pageable, block_dim=1)
    with pytest.raises(pinstage.PinstageValueError, match="device memory"):
        pinstage.BlockMover(dev, dev, block_dim=1)
    host = [pinstage.empty_pinned((2, 8, 64), "int32")]
    host[0][...] = POISON
    mover = pinstage.BlockMover(dev, host, block_dim=1)
    for src, dst in [([1, 2], [3, 3]), ([8], [0]), ([0, 1], [0]), ([0, 9], [1, 2])]:
        with pytest.raises(pinstage.PinstageValueError) as caller:
            mover.offload(src, dst)
        # In the background the ids are checked on the caller's thread too: the same error.
        with pytest.raises(pinstage.PinstageValueError) as background:
            mover.offload(src, dst, background=True)
        assert str(background.value) == str(caller.value)
    ro = pinstage.empty_pinned((2, 8, 64), "int32")
    ro[...] = POISON
    ro.flags.writeable = False
    ro_mover = pinstage.BlockMover(dev, [ro], block_dim=1)
    for background in (False, True):
        with pytest.raises(pinstage.PinstageValueError, match="read-only"):
            ro_mover.offload([0], [0], background=background)
    torch.cuda.synchronize()
    assert (host[0] == POISON).all() and (ro == POISON).all() and pageable[0].flags.writeable
    jax = pytest.importorskip("jax")
    ja = jax.device_put(np.zeros((2, 8, 64), np.int32))
    with pytest.raises(pinstage.PinstageValueError, match="JAX"):
        pinstage.BlockMover([ja], host, block_dim=1)


@pytest.mark.gpu
@pytest.mark.parametrize("background", [False, True], ids=["caller", "background"])
def test_dropped_pending_move_keeps_tensors_alive(gpu, background):
    """Every reference dropped while the move is queued: the pinned host tensor must stay
    allocated until the move completed. torch's pinned cache hands a freed block to the next
    allocation of its size at once, so were it freed, the new tensor would be the old block
    and the queued move would write into it."""
    torch = pytest.importorskip("torch")
    import gc

    shape = (2, 32, 4096)
    dev = [torch.arange(2 * 32 * 4096, dtype=torch.int32, device="cuda").reshape(shape)]
    host = [torch.empty(shape, dtype=torch.int32, pin_memory=True)]
    host[0].fill_(POISON)
    old = host[0].data_ptr()
    mover = pinstage.BlockMover(dev, host, block_dim=1)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work ahead of the move
    mover.offload(list(range(32)), list(range(32)), background=background)  # dropped at once
    del mover, dev, host
    gc.collect()
    fresh = torch.empty(shape, dtype=torch.int32, pin_memory=True)
    fresh.fill_(POISON)
    torch.cuda.synchronize()
    assert fresh.data_ptr() != old, "the moved-into block was freed while its move was queued"
    assert (fresh.numpy() == POISON).all()
    # Control: with nothing in flight, the cache does hand a freed block back at once (this
    # one, or the old block if it was let go meanwhile).
    a = torch.empty(shape, dtype=torch.int32, pin_memory=True)
    ptr = a.data_ptr()
    del a
    assert torch.empty(shape, dtype=torch.int32, pin_memory=True).data_ptr() in (ptr, old)


@pytest.mark.gpu
@pytest.mark.parametrize("background", [False, True], ids=["caller", "background"])
def test_moves_on_more_streams_than_remembered_follow_each_streams_work(gpu, background):
    """Each thread remembers the last few stream objects it passed (handle and device): with
    more streams than that, passed in turn, every move must still be ordered after the work
    queued on ITS stream (a wrong handle would copy before the delayed fill)."""
    torch = pytest.importorskip("torch")
    streams = [torch.cuda.Stream() for _ in range(6)]
    dev = [torch.full((2, 16, 256), POISON, dtype=torch.int32, device="cuda")]
    host = [pinstage.empty_pinned((2, 16, 256), "int32")]
    mover = pinstage.BlockMover(dev, host, block_dim=1)
    torch.cuda.synchronize()  # the poisoning done before any side stream's fill
    for r in range(3):
        for i, s in enumerate(streams):
            host[0][...] = POISON
            v = 1000 * r + i + 1
            with torch.cuda.stream(s):
                torch.cuda._sleep(5_000_000)  # GPU work ahead of the fill, on s only
                dev[0][:, i].fill_(v)
            mover.offload([i], [i], stream=s, background=background).wait()
            assert (host[0][:, i] == v).all(), f"round {r} stream {i}"
            assert (np.delete(host[0], i, axis=1) == POISON).all()


@pytest.mark.gpu
@pytest.mark.two_gpus
@pytest.mark.parametrize("background", [False, True], ids=["caller", "background"])
def test_a_stream_of_another_device_is_refused_after_one_of_its_own(gpu, background):
    """Each thread remembers the stream objects it passed and their devices: a stream of the
    other GPU must still be refused (every time), and the remembered one still accepted."""
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.fail("needs two GPUs (run with -m 'not two_gpus' on one GPU)")
    dev = [torch.full((2, 8, 64), 7, dtype=torch.int32, device="cuda:0")]
    host = [pinstage.empty_pinned((2, 8, 64), "int32")]
    host[0][...] = POISON
    mover = pinstage.BlockMover(dev, host, block_dim=1)
    own, other = torch.cuda.Stream(device=0), torch.cuda.Stream(device=1)
    for _ in range(2):
        mover.offload([1], [2], stream=own, background=background).wait()
        for s in (other, other.cuda_stream):
            with pytest.raises(pinstage.PinstageValueError, match="another device"):
                mover.offload([3], [4], stream=s, background=background)
    torch.cuda.synchronize()
    assert (host[0][:, 2] == 7).all() and (host[0][:, 4] == POISON).all()
