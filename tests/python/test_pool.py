"""PinnedPool (max_outstanding_bytes, outstanding_bytes, pooled_bytes, clear), alloc_pinned_numpy
and copy_d2h with pool=, empty_host, nvtx_range. Without a driver: the accounting, the pageable
fallbacks and the typed errors; on a GPU (`gpu`): pinned blocks, recycling, the budget."""

import gc

import os

import numpy as np
import pytest

import pinstage


def test_empty_host_works_everywhere():
    a = pinstage.empty_host((3, 4), "int32")
    assert a.shape == (3, 4) and a.dtype == np.int32 and a.flags.c_contiguous and a.flags.writeable
    a[:] = 7
    assert (a == 7).all()
    b = pinstage.empty_host(5)
    assert b.dtype == np.float64 and b.shape == (5,)
    pool = pinstage.PinnedPool(max_outstanding_bytes=0)
    c = pinstage.empty_host(16, "uint8", pool=pool)  # past the budget: pageable, never an error
    assert not pinstage.is_pinned(c) and c.shape == (16,)


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        (dict(max_outstanding_bytes=-1), pinstage.PinstageValueError),
        (dict(max_outstanding_bytes="1"), pinstage.PinstageTypeError),
        (dict(max_outstanding_bytes=1.5), pinstage.PinstageTypeError),
        (dict(device=-1), pinstage.PinstageValueError),
    ],
)
def test_pool_arguments(kwargs, exc):
    with pytest.raises(exc):
        pinstage.PinnedPool(**kwargs)


def test_pool_accounting_without_allocations():
    pool = pinstage.PinnedPool(max_outstanding_bytes=1 << 20)
    assert pool.max_outstanding_bytes == 1 << 20
    assert pool.outstanding_bytes == 0 and pool.pooled_bytes == 0
    pool.clear()
    assert pinstage.PinnedPool().max_outstanding_bytes is None
    assert "max_outstanding_bytes=1048576" in repr(pool)
    assert set(pool.stats()) >= {"hits", "misses", "pageable_fallbacks", "outstanding_bytes", "pooled_bytes"}


@pytest.mark.parametrize("bad", [3, "pool", object()])
def test_pool_argument_must_be_a_pool(bad):
    with pytest.raises(pinstage.PinstageTypeError, match="PinnedPool"):
        pinstage.empty_host(4, pool=bad)
    with pytest.raises(pinstage.PinstageTypeError, match="PinnedPool"):
        pinstage.copy_d2h(np.arange(4), pool=bad)


def test_copy_d2h_with_a_pool_without_a_driver_is_a_host_copy():
    pool = pinstage.PinnedPool()
    src = np.arange(10, dtype=np.int64)
    out = pinstage.copy_d2h(src, pool=pool)
    assert out.tolist() == list(range(10))
    out2 = pinstage.copy_d2h_async(src * 2, pool=pool).wait()
    assert out2.tolist() == [2 * i for i in range(10)]


def test_nvtx_range_is_a_context_manager():
    with pinstage.nvtx_range("outer"):
        with pinstage.nvtx_range("inner"):
            x = 1
    assert x == 1
    assert isinstance(pinstage.NvtxRange.available(), bool)
    with pytest.raises(pinstage.PinstageTypeError):
        pinstage.nvtx_range(3)
    with pytest.raises(ZeroDivisionError):
        with pinstage.nvtx_range("raises"):
            1 / 0


def test_alloc_pinned_numpy_with_a_pool_needs_a_driver():
    if pinstage.cuda_available():
        pytest.skip("a driver is present (the GPU tests cover the pinned path)")
    with pytest.raises(pinstage.CudaUnavailableError):
        pinstage.alloc_pinned_numpy(64, "int32", 16, pool=pinstage.PinnedPool())


@pytest.mark.gpu
def test_pool_recycles_blocks_and_counts_bytes(gpu):
    pool = pinstage.PinnedPool(max_outstanding_bytes=1 << 20)
    a = pinstage.alloc_pinned_numpy(4096, "float32", 1024, pool=pool)
    assert pinstage.is_pinned(a) and a.shape == (1024,)
    a[:] = np.arange(1024)
    assert pool.outstanding_bytes == 4096 and pool.pooled_bytes == 0
    addr = a.ctypes.data
    del a
    gc.collect()
    # outstanding_bytes: pinned bytes alive in the pool, handed out and cached (as the
    # reference module counts them).
    assert pool.outstanding_bytes == 4096 and pool.pooled_bytes == 4096
    assert pool.stats()["in_use_bytes"] == 0
    b = pinstage.alloc_pinned_numpy(4096, "int32", (32, 32), pool=pool)
    assert b.ctypes.data == addr, "the collected array's block serves the next request"
    assert pool.stats()["hits"] == 1 and pool.stats()["misses"] == 1
    del b
    gc.collect()
    pool.clear()
    assert pool.pooled_bytes == 0 and pool.outstanding_bytes == 0


@pytest.mark.gpu
def test_past_the_budget_alloc_raises_and_the_others_fall_back(gpu):
    torch = pytest.importorskip("torch")
    pool = pinstage.PinnedPool(max_outstanding_bytes=64 << 10)
    keep = [pinstage.alloc_pinned_numpy(32 << 10, "uint8", 32 << 10, pool=pool) for _ in range(2)]
    assert pool.outstanding_bytes == 64 << 10
    with pytest.raises(pinstage.PoolExhaustedError, match="max_outstanding_bytes = 65536") as e:
        pinstage.alloc_pinned_numpy(4096, "uint8", 4096, pool=pool)
    assert isinstance(e.value, RuntimeError)
    h = pinstage.empty_host(4096, "uint8", pool=pool)
    assert not pinstage.is_pinned(h)
    src = torch.arange(1000, dtype=torch.int32, device="cuda")
    out = pinstage.copy_d2h(src, pool=pool)
    assert not pinstage.is_pinned(out) and out.tolist() == list(range(1000))
    assert pool.outstanding_bytes == 64 << 10 and pool.stats()["pageable_fallbacks"] >= 2
    del keep
    gc.collect()
    # The two cached 32 KiB blocks fill the budget: one is freed to make room.
    assert pool.outstanding_bytes == 64 << 10 and pool.pooled_bytes == 64 << 10
    out = pinstage.copy_d2h(src, pool=pool)
    assert pinstage.is_pinned(out) and out.tolist() == list(range(1000))
    assert pool.outstanding_bytes == (32 << 10) + 4096 and pool.stats()["evictions"] == 1
    h = pinstage.empty_host(4096, "uint8", pool=pool)
    assert pinstage.is_pinned(h)


@pytest.mark.gpu
def test_pool_blocks_survive_many_cycles_without_growth(gpu):
    torch = pytest.importorskip("torch")
    pool = pinstage.PinnedPool()
    src = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
    base = pinstage.pinned_bytes()
    for k in range(200):
        src.add_(1)
        out = pinstage.copy_d2h(src, pool=pool)
        # Every element: the block reused from the last round held that round's values.
        np.testing.assert_array_equal(out, np.arange(1 << 16, dtype=np.float32) + (k + 1))
        del out
    assert pool.stats()["misses"] <= 2, pool.stats()
    assert pinstage.pinned_bytes() - base <= 2 * (1 << 18)
    pool.clear()


@pytest.mark.parametrize(
    "make, exc",
    [
        (lambda: [1, 2, 3], pinstage.PinstageTypeError),
        (lambda: np.array([None], dtype=object), pinstage.PinstageTypeError),
        (lambda: np.zeros((4, 4))[:, ::2], pinstage.PinstageValueError),
        (lambda: np.zeros(0), pinstage.PinstageValueError),
    ],
)
def test_pin_refuses_bad_arrays(make, exc):
    with pytest.raises(exc):
        pinstage.pin(make())


def test_pin_needs_a_driver():
    if pinstage.cuda_available():
        pytest.skip("a driver is present")
    with pytest.raises(pinstage.CudaUnavailableError):
        pinstage.pin(np.zeros(16))


@pytest.mark.gpu
def test_pin_in_place_copies_and_unpins(gpu):
    torch = pytest.importorskip("torch")
    a = np.arange(1 << 22, dtype=np.float32)  # 16 MiB, pageable
    assert not pinstage.is_pinned(a)
    base = pinstage.pinned_bytes()
    region = pinstage.pin(a)
    assert region.pinned and region.nbytes == a.nbytes and pinstage.is_pinned(a)
    assert pinstage.pinned_bytes() - base == a.nbytes
    dst = torch.full((1 << 22,), -1.0, device="cuda")
    pinstage.copy_h2d(dst, a)
    assert torch.equal(dst.cpu(), torch.from_numpy(a))
    back = np.full_like(a, -1)
    with pinstage.pin(back) as b:
        assert b is back and pinstage.is_pinned(back)
        pinstage.copy_d2h(dst * 2, b)
    assert not pinstage.is_pinned(back) and (back == a * 2).all()
    with pytest.raises(pinstage.PinstageValueError, match="page-locked"):
        pinstage.pin(a)  # already pinned
    region.unpin()
    region.unpin()  # idempotent
    assert not region.pinned and not pinstage.is_pinned(a)
    assert pinstage.pinned_bytes() == base
    ro = np.arange(4096, dtype=np.int64)
    ro.flags.writeable = False
    with pinstage.pin(ro):
        t = torch.empty(4096, dtype=torch.int64, device="cuda")
        pinstage.copy_h2d(t, ro)
        assert t.cpu().tolist() == ro.tolist()
    with pytest.raises(pinstage.PinstageValueError, match="page-locked"):
        pinstage.pin(pinstage.empty_pinned(1024))


@pytest.mark.gpu
def test_pin_unpin_cycles_do_not_leak(gpu):
    base = pinstage.pinned_bytes()
    arrays = [np.ones(4096 // 8) * k for k in range(4)]
    for k in range(10_000):
        r = pinstage.pin(arrays[k % 4])
        r.unpin()
    assert pinstage.pinned_bytes() == base
    assert not any(pinstage.is_pinned(a) for a in arrays)
    r = pinstage.pin(arrays[0])
    del r
    gc.collect()
    pinstage.empty_cache()  # the reaper unregisters it: waited for
    assert not pinstage.is_pinned(arrays[0]), "a collected region unpins"


@pytest.mark.gpu
def test_the_budget_bounds_cached_blocks_too(gpu):
    # Blocks of ever new sizes, each collected at once: the pool never holds more pinned bytes
    # than its budget, cached ones included.
    pool = pinstage.PinnedPool(max_outstanding_bytes=1 << 20)
    for k in range(1, 64):
        a = pinstage.alloc_pinned_numpy(k * 4096, "uint8", k * 4096, pool=pool)
        a[:] = k % 251
        assert (a == k % 251).all()
        del a
        gc.collect()
        assert pool.outstanding_bytes <= 1 << 20, (k, pool)
    assert pool.stats()["evictions"] > 0
    pool.clear()
    assert pool.outstanding_bytes == 0


@pytest.mark.gpu
def test_max_pooled_bytes_bounds_the_cache(gpu):
    pool = pinstage.PinnedPool(max_pooled_bytes=8192)
    assert pool.max_pooled_bytes == 8192
    arrays = [pinstage.alloc_pinned_numpy(4096, "uint8", 4096, pool=pool) for _ in range(4)]
    assert pool.outstanding_bytes == 4 * 4096 and pool.pooled_bytes == 0
    del arrays
    gc.collect()
    assert pool.pooled_bytes == 8192 and pool.outstanding_bytes == 8192


@pytest.mark.gpu
def test_the_reference_modules_pool_scenario(gpu):
    # The reference module's own test, as its users would run it against pinstage.
    pool = pinstage.PinnedPool()
    a = pinstage.alloc_pinned_numpy(1 << 20, np.uint8, (1 << 20,), pool=pool)
    ptr = a.ctypes.data
    assert pool.outstanding_bytes == 1 << 20
    assert pool.pooled_bytes == 0
    del a
    gc.collect()
    assert pool.pooled_bytes == 1 << 20
    b = pinstage.alloc_pinned_numpy(1 << 20, np.uint8, (1 << 20,), pool=pool)
    assert b.ctypes.data == ptr
    assert pool.pooled_bytes == 0
    del b
    gc.collect()
    pool.clear()
    assert pool.outstanding_bytes == 0
    small = pinstage.PinnedPool(max_outstanding_bytes=1 << 20)
    keep = pinstage.alloc_pinned_numpy(1 << 19, np.uint8, (1 << 19,), pool=small)
    with pytest.raises(RuntimeError, match="budget"):
        pinstage.alloc_pinned_numpy(1 << 20, np.uint8, (1 << 20,), pool=small)
    del keep


@pytest.mark.gpu
def test_alloc_pinned_numpy_without_a_pool_recycles_its_blocks(gpu):
    a = pinstage.alloc_pinned_numpy(1 << 16, "uint8", 1 << 16)
    addr = a.ctypes.data
    del a
    gc.collect()
    before = pinstage.pinned_bytes()
    b = pinstage.alloc_pinned_numpy(1 << 16, "int32", 1 << 14)
    assert pinstage.pinned_bytes() == before, "nothing new was pinned: the block was reused"
    assert b.ctypes.data == addr, "the collected array's block serves the next request"
    assert pinstage.is_pinned(b)


def test_limits_and_counts_take_numpy_integers():
    pool = pinstage.PinnedPool(np.int64(1 << 20), max_pooled_bytes=np.uint32(4096))
    assert pool.max_outstanding_bytes == 1 << 20 and pool.max_pooled_bytes == 4096
    with pytest.raises(pinstage.PinstageTypeError):
        pinstage.PinnedPool(np.True_)
    with pytest.raises(pinstage.PinstageTypeError):
        pinstage.PinnedPool(np.float64(4096))
    with pytest.raises(pinstage.PinstageValueError):
        pinstage.PinnedPool(max_pooled_bytes=-1)


def test_empty_host_takes_its_pool_positionally():
    pool = pinstage.PinnedPool()
    a = pinstage.empty_host((4, 4), np.bool_, pool)
    assert a.shape == (4, 4) and a.dtype == np.bool_


def test_nvtx_range_is_a_decorator_and_takes_message():
    calls = []

    @pinstage.nvtx_range("decorated")
    def f(x, *, y=0):
        """f's doc"""
        calls.append((x, y))
        return x + y

    assert f(1, y=2) == 3 and f(4) == 4 and calls == [(1, 2), (4, 0)]
    assert f.__name__ == "f" and f.__doc__ == "f's doc"
    with pinstage.nvtx_range(message="keyword"):
        pass
    with pytest.raises(pinstage.PinstageTypeError):
        pinstage.nvtx_range("x")(3)

    @pinstage.nvtx_range("raises")
    def g():
        raise KeyError("k")

    with pytest.raises(KeyError):
        g()


@pytest.mark.gpu
def test_alloc_pinned_numpy_arrays_never_take_the_results_budget(gpu):
    torch = pytest.importorskip("torch")
    budget = pinstage.pool_stats()["max_outstanding_bytes"]
    pinstage.set_pool_budget(1 << 20)
    try:
        keep = [pinstage.alloc_pinned_numpy(1 << 20, "uint8", 1 << 20) for _ in range(4)]
        assert all(pinstage.is_pinned(k) for k in keep)
        assert pinstage.pool_stats()["in_use_bytes"] == 0, "the arrays are not the results' pool's"
        src = torch.arange(1000, dtype=torch.int32, device="cuda")
        out = pinstage.copy_d2h(src)
        assert pinstage.is_pinned(out) and out.tolist() == list(range(1000))
        del keep
        with pytest.raises(pinstage.PoolExhaustedError, match="budget"):
            pinstage.alloc_pinned_numpy(4 << 20, "uint8", 4 << 20, pool=pinstage.PinnedPool(1 << 20))
    finally:
        pinstage.set_pool_budget(budget)


def test_pageable_fallbacks_are_counted_without_a_driver_too():
    if pinstage.cuda_available():
        pytest.skip("a driver is present (test_past_the_budget_alloc_raises_and_the_others_fall_back)")
    pool = pinstage.PinnedPool(max_outstanding_bytes=1 << 20)
    pinstage.empty_host(16, "uint8", pool)
    out = pinstage.copy_d2h(np.arange(5), pool=pool)
    assert out.tolist() == list(range(5))
    s = pool.stats()
    assert s["pageable_fallbacks"] == 2, s
    assert pool.outstanding_bytes == 0 and pool.pooled_bytes == 0


NVTX_STUB = r"""
#include <stdio.h>
#include <stdlib.h>
static int depth;
static void note(const char *what, const char *msg) {
    FILE *f = fopen(getenv("NVTX_LOG"), "a");
    if (f) { fprintf(f, "%s %s\n", what, msg); fclose(f); }
}
int nvtxRangePushA(const char *msg) { note("push", msg); return depth++; }
int nvtxRangePop(void) { note("pop", "-"); return --depth; }
"""


@pytest.mark.child_process
def test_nvtx_ranges_reach_the_nvtx_library(tmp_path):
    """With a recording stand-in for libnvToolsExt on the library path, every range is pushed
    with its message and popped, as a context manager, a decorator, and when the body raises."""
    import shutil
    import subprocess
    import sys

    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed to build the recording NVTX library"
    (tmp_path / "stub.c").write_text(NVTX_STUB)
    lib = tmp_path / "libnvToolsExt.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "stub.c")], check=True)
    log = tmp_path / "nvtx.log"
    code = """
import pinstage
assert pinstage.NvtxRange.available()
with pinstage.nvtx_range("outer"):
    with pinstage.nvtx_range("inner"):
        pass
@pinstage.nvtx_range("decorated")
def f():
    return 1
assert f() == 1 and f() == 1
try:
    with pinstage.nvtx_range("raises"):
        1 / 0
except ZeroDivisionError:
    pass
"""
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}", NVTX_LOG=str(log))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    assert log.read_text().split("\n")[:-1] == [
        "push outer", "push inner", "pop -", "pop -",
        "push decorated", "pop -", "push decorated", "pop -",
        "push raises", "pop -",
    ]

