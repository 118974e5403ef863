"""Step staging from Python: layouts, steps, commits, exports.

Without a GPU the stager works against host memory (slots, arena and fresh blocks are host
bytes), so the semantics are checked in CI; the `gpu` tests run the same paths on the H200 with
torch, cupy and JAX consumers, every field of every step checked against poisoned memory.
"""

import gc
import sys
import threading
import time
import weakref

import numpy as np
import pytest

import pinstage

ENGINE = {
    "input_ids": ("int32", 8192),
    "positions": ("int64", 8192),
    "slot_mapping": ("int64", 8192),
    "seq_lens": ("int32", 256),
    "query_start_loc": ("int32", 257),
    "block_table": ("int32", (256, 128)),
}


def engine_values(k, rng=None):
    """The engine step of the issue (256 tokens, 64 sequences), distinct per step, no zeros."""
    rng = rng or np.random.default_rng(k)
    return {
        "input_ids": rng.integers(1, 50_000, 256, dtype=np.int32),
        "positions": rng.integers(1, 1 << 40, 256, dtype=np.int64),
        "slot_mapping": rng.integers(1, 1 << 40, 256, dtype=np.int64),
        "seq_lens": rng.integers(1, 4096, 64, dtype=np.int32),
        "query_start_loc": np.cumsum(rng.integers(1, 8, 65, dtype=np.int32)).astype(np.int32),
        "block_table": rng.integers(1, 1 << 30, (64, 128), dtype=np.int32),
    }


def block_bytes(b):
    """A fresh block's bytes on the host: read back from the device (or the host block)."""
    return pinstage.copy_d2h(b) if b.device is not None else np.from_dlpack(b)


def check_arena(st, vals):
    for name, v in vals.items():
        got = st.read_field(name)
        assert np.array_equal(got[: len(v)], v), name


# ---------------------------------------------------------------- CPU (and GPU) semantics


def test_layout_describes_its_fields():
    layout = pinstage.StepLayout(ENGINE)
    assert layout.names == list(ENGINE)
    assert len(layout) == 6 and "block_table" in layout and "nope" not in layout
    offs = [f["offset"] for f in layout.fields]
    assert offs == sorted(offs) and all(o % 256 == 0 for o in offs)
    bt = layout.fields[-1]
    assert bt["shape"] == (256, 128) and bt["nbytes"] == 256 * 128 * 4 and bt["dtype"] == "int32"
    assert layout.nbytes % 256 == 0 and layout.nbytes >= bt["offset"] + bt["nbytes"]
    same = pinstage.StepLayout([(n, d, s) for n, (d, s) in ENGINE.items()])
    assert same.fields == layout.fields
    assert "block_table: int32[256, 128]" in repr(layout)


@pytest.mark.parametrize(
    "name",
    ["float", "double", "int", "long", "half", "single", "intc", "short", "byte", "ubyte",
     "uint", "complex", "f", "d", "i", "l", "b", "B", "e", "float32", "int64", "bool"],
)
def test_dtype_strings_mean_what_numpy_says(name):
    layout = pinstage.StepLayout({"a": (name, 4)})
    assert layout.fields[0]["dtype"] == np.dtype(name).name, name


def test_torch_dtype_strings_mean_what_torch_says():
    got = pinstage.StepLayout(
        {n: ("torch." + n, 4) for n in ["float", "int", "long", "half", "double"]}
    ).fields
    assert [f["dtype"] for f in got] == ["float32", "int32", "int64", "float16", "float64"]


@pytest.mark.parametrize(
    "fields, exc",
    [
        ({}, pinstage.PinstageValueError),
        ({"a": ("int32", 0)}, pinstage.PinstageValueError),
        ({"a": ("int32", (2, 2, 2))}, pinstage.PinstageValueError),
        ({"a": ("int32", -1)}, pinstage.PinstageValueError),
        ({"a": ("str", 4)}, pinstage.PinstageTypeError),
        ({"a": "int32"}, pinstage.PinstageTypeError),
        ({"": ("int32", 4)}, pinstage.PinstageValueError),
        ([("a", "int32", 4), ("a", "int8", 4)], pinstage.PinstageValueError),
        (42, pinstage.PinstageTypeError),
        ({1: ("int32", 4)}, pinstage.PinstageTypeError),
    ],
)
def test_bad_layouts(fields, exc):
    with pytest.raises(exc):
        pinstage.StepLayout(fields)


def test_skip_unchanged_names_must_exist():
    with pytest.raises(pinstage.UnknownFieldError, match="nope"):
        pinstage.StepLayout({"a": ("int32", 4)}, skip_unchanged=["nope"])


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        (dict(depth=0), pinstage.PinstageValueError),
        (dict(depth="2"), pinstage.PinstageTypeError),
        (dict(mode="nope"), pinstage.PinstageValueError),
        (dict(mode=3), pinstage.PinstageTypeError),
        (dict(max_gap=-1), pinstage.PinstageValueError),
        (dict(device=-1), pinstage.PinstageValueError),
    ],
)
def test_bad_stager_arguments(kwargs, exc):
    with pytest.raises(exc):
        pinstage.StepStager(pinstage.StepLayout(ENGINE), **kwargs)


def test_stager_needs_a_layout():
    with pytest.raises(pinstage.PinstageTypeError):
        pinstage.StepStager({"a": ("int32", 4)})


def test_steps_commit_every_field_every_step():
    st = pinstage.StepStager(pinstage.StepLayout(ENGINE), depth=3)
    for k in range(12):
        vals = engine_values(k)
        with st.step() as step:
            for name in ("input_ids", "positions", "seq_lens", "block_table"):
                step.put(name, vals[name])
            step.view("slot_mapping", rows=256)[:] = vals["slot_mapping"]
            step.view("query_start_loc", rows=65)[:] = vals["query_start_loc"]
        check_arena(st, vals)
    s = st.stats()
    assert s["steps"] == 12 and s["aborted"] == 0 and s["copies"] + s["batches"] >= 12


def test_stage_in_one_call_with_pads_and_rows():
    layout = pinstage.StepLayout({"ids": ("int32", 64), "table": ("int32", (8, 4))})
    st = pinstage.StepStager(layout, depth=2)
    # Poison every row first (and both slots): the pads below must be written, not found.
    for _ in range(2):
        st.stage({"ids": np.full(64, 99, np.int32), "table": np.full((8, 4), 98, np.int32)})
    st.stage(
        {"ids": [1, 2, 3], "table": np.array([[1, 2], [3, 4]], np.int32)},
        pad_value={"ids": -1, "table": -5},
        rows={"ids": 6, "table": 3},
    )
    assert st.read_field("ids")[:7].tolist() == [1, 2, 3, -1, -1, -1, 99]
    assert st.read_field("table")[:4].tolist() == [[1, 2, -5, -5], [3, 4, -5, -5], [-5, -5, -5, -5], [98] * 4]


@pytest.mark.parametrize("k", [3, 9, 40])
def test_stage_resolves_names_interned_or_built(k):
    """Literal (interned) names resolve by pointer, names built at run time through the
    name table; both reach the right field, and an unknown name is refused with the slot freed."""
    layout = pinstage.StepLayout({f"f{i}": ("int32", 8) for i in range(k)})
    st = pinstage.StepStager(layout, depth=1)
    for rnd in range(3):
        built = {"".join(["f", str(i)]): np.full(8, rnd * 100 + i, np.int32) for i in range(k)}
        st.stage(built)
        for i in range(k):
            assert st.read_field(f"f{i}").tolist() == [rnd * 100 + i] * 8
    literal = {"f0": np.arange(8, dtype=np.int32), "f2": np.arange(8, dtype=np.int32) + 5}
    st.stage(literal)
    assert st.read_field("f0").tolist() == list(range(8))
    assert st.read_field("f2").tolist() == list(range(5, 13))
    with pytest.raises(pinstage.UnknownFieldError, match="f99"):
        st.stage({"f99": np.zeros(8, np.int32)})
    with pytest.raises(pinstage.UnknownFieldError):
        st.stage({"".join(["f", "9", "9", "9"]): np.zeros(8, np.int32)})
    st.stage({"f1": np.ones(8, np.int32)})  # depth 1: the refusals released the slot
    assert st.read_field("f1").tolist() == [1] * 8


@pytest.mark.parametrize(
    "call, exc",
    [
        (lambda s: s.put("nope", [1]), pinstage.UnknownFieldError),
        (lambda s: s.put("ids", list(range(65))), pinstage.PinstageValueError),
        (lambda s: s.put("ids", [1 << 40]), pinstage.PinstageValueError),
        (lambda s: s.put("ids", [0.5]), pinstage.PinstageValueError),
        (lambda s: s.put("ids", "abc"), pinstage.PinstageTypeError),
        (lambda s: s.put("ids", [1], rows=5), pinstage.PinstageValueError),
        (lambda s: s.put("ids", [1], pad_value=0, rows=65), pinstage.PinstageValueError),
        (lambda s: s.put("ids", [1], pad_value=2**40), pinstage.PinstageValueError),
        (lambda s: s.put("table", [1, 2]), pinstage.PinstageValueError),
        (lambda s: s.put("table", np.ones((2, 5), np.int32), pad_value=0), pinstage.PinstageValueError),
        (lambda s: s.put("table", np.ones((2, 3), np.int32)), pinstage.PinstageValueError),
        (lambda s: s.view("ids", rows=65), pinstage.PinstageValueError),
        (lambda s: s.view("nope"), KeyError),
        (lambda s: s.field("ids"), (pinstage.PinstageValueError, pinstage.CudaUnavailableError)),
    ],
)
def test_bad_input_is_typed_writes_nothing_and_releases_the_slot(call, exc):
    layout = pinstage.StepLayout({"ids": ("int32", 64), "table": ("int32", (8, 4))})
    st = pinstage.StepStager(layout, depth=1)
    st.stage({"ids": [7, 8, 9]})
    with pytest.raises(exc):
        with st.step() as step:
            step.put("ids", [100, 200])
            call(step)
    # The failed step was released untouched: depth 1, so the next step gets its slot at once,
    # and the arena still holds the last committed values.
    assert st.stats()["aborted"] == 1
    assert st.read_field("ids")[:3].tolist() == [7, 8, 9]
    st.stage({"ids": [4]})
    assert st.read_field("ids")[:3].tolist() == [4, 8, 9]


def test_views_are_read_only_after_commit_and_abort():
    st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 64)}), depth=2)
    step = st.step()
    v = step.view("ids", rows=4)
    v[:] = [1, 2, 3, 4]
    step.commit()
    with pytest.raises(ValueError, match="read-only"):
        v[0] = 5
    with pytest.raises(ValueError):
        v.flags.writeable = True
    step = st.step()
    w = step.view("ids")
    step.abort()
    with pytest.raises(ValueError, match="read-only"):
        w[:] = 0
    assert st.read_field("ids")[:4].tolist() == [1, 2, 3, 4]


def test_step_state_errors():
    st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 64)}))
    step = st.step()
    step.put("ids", [1])
    assert step.commit() is None and step.committed
    for bad in (step.commit, lambda: step.put("ids", [2]), lambda: step.view("ids")):
        with pytest.raises(pinstage.StepStateError, match="already committed"):
            bad()
    step.abort()  # no-op on an ended step
    aborted = st.step()
    aborted.abort()
    with pytest.raises(pinstage.StepStateError, match="aborted"):
        aborted.commit()
    assert "committed" in repr(step) and "aborted" in repr(aborted)


def test_a_step_belongs_to_its_thread():
    st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 64)}), depth=1)
    step = st.step()
    errors = []

    def other():
        for call in (lambda: step.put("ids", [1]), step.commit, step.abort):
            try:
                call()
            except pinstage.StepStateError as e:
                errors.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 3 and all("thread" in e for e in errors)
    step.put("ids", [3])
    step.commit()
    assert st.read_field("ids")[0] == 3


def test_skip_unchanged_sends_nothing_for_unchanged_fields():
    layout = pinstage.StepLayout({"ids": ("int32", 64), "table": ("int32", (8, 4))}, skip_unchanged=["table"])
    st = pinstage.StepStager(layout)
    table = np.arange(1, 9, dtype=np.int32).reshape(2, 4)
    for k in range(5):
        st.stage({"table": table, "ids": [k + 1]})
    s = st.stats()
    assert s["skipped_fields"] == 4 and s["steps"] == 5
    assert np.array_equal(st.read_field("table")[:2], table)
    st.stage({"table": table + 1})
    assert np.array_equal(st.read_field("table")[:2], table + 1)
    st.stage({"table": table + 1})
    assert st.stats()["empty_steps"] == 1  # nothing changed, nothing written: nothing issued


def test_fresh_blocks_hold_their_step_and_unpack():
    layout = pinstage.StepLayout({"ids": ("int32", 16), "pos": ("int64", 16), "t": ("uint8", (2, 3))})
    st = pinstage.StepStager(layout, mode="fresh", depth=2)
    kept = []
    for k in range(10):
        b = st.stage({"ids": np.arange(16, dtype=np.int32) + k * 100, "pos": [k] * 16, "t": [[k, 1, 2], [3, 4, 5]]})
        assert b.shape == (layout.nbytes,) and b.dtype == "uint8"
        kept.append((k, b))
    for k, b in kept:  # every block, read back from where it lives
        f = layout.unpack(block_bytes(b))
        assert f["ids"].tolist() == list(range(k * 100, k * 100 + 16))
        assert f["pos"].tolist() == [k] * 16 and f["t"].tolist() == [[k, 1, 2], [3, 4, 5]]
    blocks = st.stats()["blocks"]
    assert blocks >= 10, f"stats() counts the fresh blocks made: {blocks} for 10 alive"
    del kept, b
    gc.collect()
    for k in range(10):
        st.stage({"ids": [k]})
    assert st.stats()["blocks"] == blocks, "released blocks are reused"


def test_open_steps_own_distinct_slots_and_say_which():
    """Each open step owns its own slot (0 to depth - 1), and `step.slot` says which: the steps
    open at once hold every slot once; after they end, a new step's slot is again in range."""
    st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 4)}), depth=3)
    steps = [st.step() for _ in range(3)]
    assert sorted(s.slot for s in steps) == [0, 1, 2]
    for k, s in enumerate(steps):
        s.put("ids", [k + 1] * 4)
        s.commit()
    assert st.read_field("ids").view(np.int32).tolist() == [3, 3, 3, 3]
    with st.step() as s:
        assert 0 <= s.slot < 3


def test_unpack_checks_its_input():
    layout = pinstage.StepLayout({"ids": ("int32", 16)})
    with pytest.raises(pinstage.PinstageValueError, match="nbytes"):
        layout.unpack(np.zeros(10, np.uint8))
    with pytest.raises(pinstage.PinstageValueError):
        layout.unpack(np.zeros(layout.nbytes // 4, np.int32))


def test_arena_exports_need_arena_mode():
    st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 16)}), mode="fresh")
    for bad in (lambda: st.field("ids"), st.arena, lambda: st.read_field("ids")):
        with pytest.raises(pinstage.PinstageValueError):
            bad()


def test_a_stager_reports_what_it_was_built_with():
    layout = pinstage.StepLayout({"ids": ("int32", 16)})
    st = pinstage.StepStager(layout, depth=3)
    assert (st.depth, st.device, st.cuda) == (3, 0, pinstage.cuda_available())
    assert f"depth=3, device=0, cuda={st.cuda})" in repr(st)


def test_device_exports_need_a_driver():
    st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 16), "t": ("int64", (2, 2))}))
    st.stage({"ids": [1, 2, 3], "t": [[5, 6], [7, 8]]})
    assert st.read_field("ids")[:3].tolist() == [1, 2, 3]  # host memory stands in for the arena
    if st.cuda:
        pytest.skip("a driver is present (the GPU tests import the arena)")
    for export in (lambda: st.field("ids"), st.arena):
        with pytest.raises(pinstage.CudaUnavailableError):
            export()


def test_a_framework_stream_object_is_read_once_others_every_time():
    """A torch/cupy stream object's handle is fixed for its life: the same object passed again
    is not asked again. Any other object is asked each time, and a new object always is."""
    calls = []

    def stream_type(module, handle):
        class Stream:
            def __cuda_stream__(self):
                calls.append(self)
                return (0, handle)

        Stream.__module__ = module
        return Stream

    layout = pinstage.StepLayout({"ids": ("int32", 4)})
    st = pinstage.StepStager(layout, depth=2)
    # Handle 0, the legacy default stream: valid with a driver too.
    torch_like = stream_type("torch.cuda.streams", 0)()
    for _ in range(3):
        st.stage({"ids": [1]}, stream=torch_like)
    assert len(calls) == 1
    other = stream_type("mylib", 0)()
    for _ in range(3):
        st.stage({"ids": [2]}, stream=other)
    assert len(calls) == 4
    # A new torch-like object is read, and a handle that cannot be a stream is refused even
    # right after a cached one.
    bad = stream_type("torch.cuda.streams", 3)()
    with pytest.raises(pinstage.PinstageValueError, match="no CUDA stream"):
        st.stage({"ids": [3]}, stream=bad)
    st.stage({"ids": [4]}, stream=torch_like)
    assert len(calls) == 5 and calls[-1] is bad
    assert st.read_field("ids")[:1].tolist() == [4]


def test_stage_finds_fields_by_name_in_any_order_and_spelling():
    names = [f"f{i}" for i in range(12)]
    layout = pinstage.StepLayout({n: ("int32", 4) for n in names})
    st = pinstage.StepStager(layout, depth=2)
    built = ["".join(["f", str(i)]) for i in range(12)]  # equal text, other objects
    for order in (built, built[::-1], built[5:] + built[:5]):
        st.stage({n: [int(n[1:]) + 100 * k for k in range(2)] for n in order})
        for n in names:
            assert st.read_field(n)[:2].tolist() == [int(n[1:]), int(n[1:]) + 100], (order, n)
    with pytest.raises(KeyError):
        st.stage({"f1": [1], "f13": [2]})


def test_bound_host_arena():
    layout = pinstage.StepLayout({"ids": ("int32", 16)})
    raw = np.zeros(layout.nbytes + 256, np.uint8)
    off = (-raw.ctypes.data) % 256
    arena = raw[off : off + layout.nbytes]
    st = pinstage.StepStager(layout, arena=arena)
    st.stage({"ids": [9, 8, 7]})
    assert arena[:12].view(np.int32).tolist() == [9, 8, 7]
    assert np.from_dlpack(st.field("ids"))[:3].tolist() == [9, 8, 7]  # a bound host arena exports
    for bad, match in (
        (arena[: layout.nbytes - 1], "the arena must hold the layout's"),
        (raw[off + 4 : off + 4 + layout.nbytes], "arena.*aligned"),
    ):
        with pytest.raises(pinstage.PinstageValueError, match=match):
            pinstage.StepStager(layout, arena=bad)
    ro = arena.copy()
    ro.flags.writeable = False
    with pytest.raises((pinstage.PinstageValueError, BufferError, ValueError)) as e:
        pinstage.StepStager(layout, arena=ro)
    assert "arena" in str(e.value) and "dst" not in str(e.value), e.value
    with pytest.raises(pinstage.PinstageValueError):
        pinstage.StepStager(layout, arena=arena, mode="fresh")


def test_a_bound_arena_outlives_its_stager_through_its_exports():
    """field() and arena() exports of a bound arena keep the caller's buffer alive: an import
    made before, or from an export taken before, the stager and the buffer were dropped reads
    the last step's values (it read freed memory, and crashed, before); once every export is
    gone the buffer is freed."""
    n = 1 << 20  # 4 MiB: numpy maps it, and unmaps it when freed
    layout = pinstage.StepLayout({"a": ("int32", n)})
    raw = np.zeros(layout.nbytes + 256, np.uint8)
    off = (-raw.ctypes.data) % 256
    st = pinstage.StepStager(layout, arena=raw[off : off + layout.nbytes])
    vals = np.arange(n, dtype=np.int32) * 3 + 1
    st.stage({"a": vals})
    field, whole = st.field("a"), st.arena()
    early = np.from_dlpack(st.field("a"))
    freed = weakref.ref(raw)
    del st, raw
    gc.collect()
    assert freed() is not None, "the exports no longer hold the buffer"
    junk = [np.full(n, -1, np.int32) for _ in range(8)]  # would take freed memory
    assert np.array_equal(early, vals)
    assert np.array_equal(np.from_dlpack(field), vals)
    assert np.array_equal(np.from_dlpack(whole)[: 4 * n].view(np.int32), vals)
    del junk, field, whole, early
    gc.collect()
    assert freed() is None, "the buffer outlived every export"


@pytest.mark.parametrize("how", ["thread", "executor"])
def test_a_step_left_open_by_an_exited_thread_frees_its_slot(how):
    """Only its own thread may end a step; one that thread left open (kept alive by a list
    here, by a Future's stored traceback there) held its slot for good, and every other
    thread's stage() waited forever. The thread's exit now aborts it."""
    st = pinstage.StepStager(pinstage.StepLayout({"a": ("int32", 8)}), depth=1)
    kept = []

    def work():
        s = st.step()
        s.put("a", [5])
        kept.append(s)
        if how == "executor":
            s.put("a", [1.5])  # raises: the Future's traceback holds the step

    if how == "thread":
        t = threading.Thread(target=work)
        t.start()
        t.join()
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(work)
        assert isinstance(fut.exception(), pinstage.PinstageValueError)
    done = threading.Event()

    def stage():
        st.stage({"a": [1, 2]})
        done.set()

    threading.Thread(target=stage, daemon=True).start()
    assert done.wait(10), "stage() still waits for the slot of a step whose thread exited"
    assert st.read_field("a")[:2].tolist() == [1, 2]
    s = kept[0]
    assert repr(s) == "Step(aborted: its thread exited)"
    s.abort()  # ended already: nothing to do, from any thread
    for call in (lambda: s.put("a", [1]), s.commit, lambda: s.view("a")):
        with pytest.raises(pinstage.StepStateError, match="thread that opened it exited"):
            call()
    assert st.stats()["aborted"] >= 1


def test_every_step_an_exited_thread_left_open_is_aborted():
    """Two steps left open by one thread (the second opened while the first is open): the
    thread's exit aborts both, so both slots are free again."""
    st = pinstage.StepStager(pinstage.StepLayout({"a": ("int32", 8)}), depth=2)
    kept = []

    def work():
        for v in (5, 6):
            s = st.step()
            s.put("a", [v])
            kept.append(s)

    t = threading.Thread(target=work)
    t.start()
    t.join()  # returns before the OS thread's exit, where its steps are aborted: poll
    deadline = time.monotonic() + 10
    while any(repr(s) == "Step(open)" for s in kept) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert [repr(s) for s in kept] == ["Step(aborted: its thread exited)"] * 2
    with st.step() as a, st.step() as b:  # both slots, from this thread, at once
        a.put("a", [1])
        b.put("a", [2])
    assert st.read_field("a")[:1].tolist() == [1]  # `a` commits last (contexts exit inner first)


def test_a_thread_that_ended_its_steps_waits_for_another_threads_slot():
    """Only a thread's OPEN steps count against it: one that opened and ended a step before
    waits for the slot another thread holds, instead of being told it holds every slot."""
    st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 4)}), depth=1)
    got, errors, go = [], [], threading.Event()

    def other():
        try:
            st.stage({"ids": [1, 1, 1, 1]})  # a step opened and ended on this thread
            go.wait(10)
            st.stage({"ids": [7, 7, 7, 7]})  # waits for the main thread's slot
            got.append(True)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=other, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while st.stats()["steps"] < 1 and not errors and time.monotonic() < deadline:
        time.sleep(0.001)
    held = st.step()
    go.set()
    time.sleep(0.2)
    assert not got and not errors, errors  # waiting, not refused
    held.put("ids", [2, 2, 2, 2])
    held.commit()
    t.join(10)
    assert got == [True] and not errors, errors
    assert st.read_field("ids").tolist() == [7, 7, 7, 7]


def test_many_threads_one_stager_every_step_checked():
    layout = pinstage.StepLayout({"a": ("int64", 512), "b": ("int32", 64)})
    st = pinstage.StepStager(layout, mode="fresh", depth=4)
    errors = []

    def worker(t):
        try:
            for k in range(200):
                v = np.arange(512, dtype=np.int64) + t * 1_000_000 + k * 1000
                with st.step() as step:
                    step.put("a", v)
                    step.view("b", rows=4)[:] = [t, k, 1, 2]
                f = layout.unpack(block_bytes(step.block))  # every step, on the device too
                assert np.array_equal(f["a"], v) and f["b"][:4].tolist() == [t, k, 1, 2], (t, k)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert st.stats()["steps"] == 1600


# ---------------------------------------------------------------- GPU


torch = None


def _torch():
    return pytest.importorskip("torch")


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["stage", "put", "views"])
@pytest.mark.parametrize("max_gap", [0, 65536, None])
def test_torch_arena_every_field_every_step(gpu, how, max_gap):
    torch = _torch()
    layout = pinstage.StepLayout(ENGINE)
    st = pinstage.StepStager(layout, depth=3, max_gap=max_gap)
    fields = {n: torch.from_dlpack(st.field(n)) for n in ENGINE}
    assert fields["block_table"].shape == (256, 128) and fields["positions"].dtype == torch.int64
    addr = {n: t.data_ptr() for n, t in fields.items()}
    s = torch.cuda.Stream()
    for k in range(40):
        vals = engine_values(k)
        with torch.cuda.stream(s):
            for t in fields.values():
                t.fill_(-77)  # poison every field before every step (on the commit's stream)
            if how == "stage":
                st.stage(vals, stream=s)
            else:
                with st.step(stream=s) as step:
                    for name, v in vals.items():
                        if how == "put":
                            step.put(name, v)
                        else:
                            step.view(name, rows=len(v))[:] = v
        s.synchronize()
        for name, v in vals.items():
            got = fields[name][: len(v)].cpu().numpy()
            assert np.array_equal(got, v), (k, name)
    assert {n: t.data_ptr() for n, t in fields.items()} == addr
    stats = st.stats()
    assert stats["steps"] == 40
    if max_gap == 0:
        assert stats["batches"] == 40 and stats["batch_entries"] == 240, stats
    elif max_gap is None:  # automatic: the engine step's gaps are below 64 KiB: one copy
        assert stats["copies"] == 40 and stats["batches"] == 0, stats
    else:
        assert stats["copies"] == 40 and stats["batches"] == 0, stats


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [1, 2, 16])
def test_slots_never_rewritten_while_their_copy_is_queued(gpu, depth):
    """The stream is stalled by a sleep kernel (the test's, not pinstage's) before the steps: each
    step's snapshot, taken on the stream right after its commit, must hold that step's values."""
    torch = _torch()
    layout = pinstage.StepLayout(ENGINE)
    st = pinstage.StepStager(layout, depth=depth)
    fields = {n: torch.from_dlpack(st.field(n)) for n in ENGINE}
    s = torch.cuda.Stream()
    steps = 3 * depth + 2
    snaps, want = [], []
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)
        for k in range(steps):
            vals = engine_values(1000 + k)
            st.stage(vals, stream=s)
            snaps.append({n: fields[n][: len(v)].clone() for n, v in vals.items()})
            want.append(vals)
    s.synchronize()
    for k, (snap, vals) in enumerate(zip(snaps, want)):
        for name, v in vals.items():
            assert np.array_equal(snap[name].cpu().numpy(), v), (depth, k, name)
    assert st.stats()["waits"] >= 1


@pytest.mark.gpu
def test_cuda_graph_replay_sees_each_steps_values(gpu):
    torch = _torch()
    layout = pinstage.StepLayout(ENGINE)
    st = pinstage.StepStager(layout, depth=4)
    f = {n: torch.from_dlpack(st.field(n)) for n in ENGINE}
    s = torch.cuda.Stream()
    out = torch.zeros(4, dtype=torch.int64, device="cuda")

    def work():
        out[0] = f["input_ids"][:256].to(torch.int64).sum()
        out[1] = f["positions"][:256].sum() + f["slot_mapping"][:256].sum()
        out[2] = f["seq_lens"][:64].to(torch.int64).sum() + f["query_start_loc"][:65].to(torch.int64).sum()
        out[3] = f["block_table"][:64].to(torch.int64).sum()

    st.stage(engine_values(0), stream=s)
    s.synchronize()
    with torch.cuda.stream(s):
        work()  # warm up
    s.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        work()
    for k in range(1, 60):
        vals = engine_values(k)
        with torch.cuda.stream(s):
            out.fill_(-1)
            st.stage(vals, stream=s)
            g.replay()
        s.synchronize()
        want = [
            int(vals["input_ids"].astype(np.int64).sum()),
            int(vals["positions"].sum() + vals["slot_mapping"].sum()),
            int(vals["seq_lens"].astype(np.int64).sum() + vals["query_start_loc"].astype(np.int64).sum()),
            int(vals["block_table"].astype(np.int64).sum()),
        ]
        assert out.cpu().tolist() == want, k


@pytest.mark.gpu
def test_cupy_reads_the_arena(gpu):
    cp = pytest.importorskip("cupy")
    layout = pinstage.StepLayout(ENGINE)
    st = pinstage.StepStager(layout)
    ids = cp.from_dlpack(st.field("input_ids"))
    bt = cp.from_dlpack(st.field("block_table"))
    s = cp.cuda.Stream(non_blocking=True)
    for k in range(10):
        vals = engine_values(k)
        with s:
            ids.fill(-5)
            bt.fill(-5)
            st.stage(vals, stream=s)
        s.synchronize()
        assert np.array_equal(cp.asnumpy(ids[:256]), vals["input_ids"])
        assert np.array_equal(cp.asnumpy(bt[:64]), vals["block_table"])


@pytest.mark.gpu
def test_jax_fresh_steps_keep_their_values(gpu):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    layout = pinstage.StepLayout(ENGINE)
    depth = 3
    st = pinstage.StepStager(layout, mode="fresh", depth=depth)

    @jax.jit
    def step_fn(packed):
        f = layout.unpack(packed)
        return (
            jnp.sum(f["input_ids"][:256].astype(jnp.int64)),
            jnp.sum(f["positions"][:256]),
            jnp.sum(f["block_table"][:64].astype(jnp.int64)),
        )

    held = []
    for k in range(4 * depth):
        vals = engine_values(k)
        packed = jax.dlpack.from_dlpack(st.stage(vals))
        got = [int(x) for x in step_fn(packed)]
        want = [
            int(vals["input_ids"].astype(np.int64).sum()),
            int(vals["positions"].sum()),
            int(vals["block_table"].astype(np.int64).sum()),
        ]
        assert got == want, k
        held.append((packed, vals))
    # Arrays from step N still hold step N's values after 3x depth later steps.
    for k, (packed, vals) in enumerate(held):
        f = layout.unpack(packed)
        for name, v in vals.items():
            assert np.array_equal(np.asarray(f[name][: len(v)]), v), (k, name)
    del held, packed
    gc.collect()


@pytest.mark.gpu
def test_zero_copy_kernels_read_the_slot(gpu):
    torch = _torch()
    layout = pinstage.StepLayout({"ids": ("int32", 1024), "w": ("float32", (64, 16))})
    st = pinstage.StepStager(layout, mode="zero_copy", depth=2)
    s = torch.cuda.Stream()
    results = []
    for k in range(50):
        ids = np.arange(1, 301, dtype=np.int32) * (k + 1)
        w = np.full((10, 16), k + 0.5, np.float32)
        with st.step(stream=s) as step:
            step.put("ids", ids)
            early = step.view("w", rows=10)
            early[:] = w
            t_ids = torch.from_dlpack(step.field("ids"))
            # The fields went to the device: views taken before turn read-only.
            assert not early.flags.writeable
            t_w = torch.from_dlpack(step.field("w"))
            assert t_ids.shape == (300,) and t_w.shape == (10, 16) and t_ids.is_cuda
            with pytest.raises(pinstage.StepStateError):
                step.put("ids", ids)
            with torch.cuda.stream(s):
                results.append((t_ids.to(torch.int64).sum(), t_w.sum(), k, int(ids.astype(np.int64).sum())))
    s.synchronize()
    for a, b, k, want in results:
        assert int(a) == want and float(b) == pytest.approx(160 * (k + 0.5)), k
    assert st.stats()["copies"] == 0 and st.stats()["batches"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["exception", "dropped"])
def test_an_aborted_zero_copy_step_is_not_rewritten_under_its_readers(gpu, how):
    """Kernels queued behind a stall read a zero-copy step's slot; the step then ends without a
    commit (an exception in its block, or dropped). The next step (depth 1: the same slot) must
    not write the slot before those readers ran: they see the aborted step's values."""
    torch = _torch()
    layout = pinstage.StepLayout({"ids": ("int64", 4096)})
    st = pinstage.StepStager(layout, mode="zero_copy", depth=1)
    s = torch.cuda.Stream()
    old = np.arange(7, 7 + 4096, dtype=np.int64)

    def read(dev):
        # Takes the device view, not the step: under compute-sanitizer a frame that outlived
        # its call held the step when the step was passed in here (run zzf).
        t = torch.from_dlpack(dev)
        with torch.cuda.stream(s):
            torch.cuda._sleep(100_000_000)
            return t.clone()

    if how == "exception":
        with pytest.raises(RuntimeError, match="planned"):
            with st.step(stream=s) as step:
                step.put("ids", old)
                seen = read(step.field("ids"))
                raise RuntimeError("planned")
    else:
        step = st.step(stream=s)
        step.put("ids", old)
        seen = read(step.field("ids"))
        held = [getattr(getattr(r, "f_code", None), "co_name", type(r).__name__) for r in gc.get_referrers(step)]
        refs = sys.getrefcount(step)
        del step
        gc.collect()
        # The step's drop is what releases its slot: it must have run here.
        assert st.stats()["aborted"] == 1, f"the dropped step is still alive: {refs} refs, held by {held}"
    new = np.full(4096, -3, dtype=np.int64)
    with st.step(stream=s) as step:
        step.put("ids", new)
    s.synchronize()
    assert np.array_equal(seen.cpu().numpy(), old)
    assert st.stats()["aborted"] == 1


@pytest.mark.gpu
def test_gpu_bound_arena_and_refusals(gpu):
    torch = _torch()
    layout = pinstage.StepLayout({"ids": ("int32", 64), "t": ("int64", (4, 4))})
    arena = torch.empty(layout.nbytes, dtype=torch.uint8, device="cuda")
    st = pinstage.StepStager(layout, arena=arena)
    st.stage({"ids": [1, 2, 3], "t": [[1, 2, 3, 4]]})
    torch.cuda.synchronize()
    assert arena[:12].view(torch.int32).tolist() == [1, 2, 3]
    assert torch.from_dlpack(st.field("ids")).data_ptr() == arena.data_ptr()
    with pytest.raises(pinstage.PinstageValueError, match="bytes"):
        pinstage.StepStager(layout, arena=arena[:-1])
    with pytest.raises(pinstage.PinstageValueError, match="aligned"):
        pinstage.StepStager(layout, arena=torch.empty(layout.nbytes + 8, dtype=torch.uint8, device="cuda")[8:])
    jax = pytest.importorskip("jax")
    with pytest.raises(pinstage.PinstageValueError, match="JAX"):
        pinstage.StepStager(layout, arena=jax.numpy.zeros(layout.nbytes, jax.numpy.uint8))


@pytest.mark.gpu
def test_capturing_stream_is_refused_and_releases_the_slot(gpu):
    torch = _torch()
    layout = pinstage.StepLayout({"ids": ("int32", 64)})
    st = pinstage.StepStager(layout, depth=1)
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    x = torch.zeros(1, device="cuda")
    with torch.cuda.graph(g, stream=s):
        x.add_(1)
        with pytest.raises(pinstage.StreamCaptureError):
            st.stage({"ids": [1]}, stream=s)
        step = st.step(stream=s)
        step.put("ids", [2])
        with pytest.raises(pinstage.StreamCaptureError):
            step.commit()
    # The failed commit released the slot and says so.
    assert step.committed is False and repr(step) == "Step(failed)"
    with pytest.raises(pinstage.StepStateError, match="failed"):
        step.commit()
    st.stage({"ids": [5]})
    torch.cuda.synchronize()
    assert st.read_field("ids")[0] == 5


@pytest.mark.gpu
def test_many_threads_fresh_blocks_checked_on_the_gpu(gpu):
    torch = _torch()
    layout = pinstage.StepLayout({"a": ("int64", 512), "b": ("int32", (4, 8))})
    st = pinstage.StepStager(layout, mode="fresh", depth=8)
    errors = []

    def worker(t):
        try:
            s = torch.cuda.Stream()
            kept = []
            for k in range(150):
                v = np.arange(512, dtype=np.int64) + t * 1_000_000 + k * 1000
                b = st.stage({"a": v, "b": np.full((4, 8), t * 1000 + k, np.int32)}, stream=s)
                kept.append((torch.from_dlpack(b), v, t * 1000 + k))
            for blk, v, tag in kept:
                f = layout.unpack(blk)
                assert np.array_equal(f["a"].cpu().numpy(), v), (t, tag)
                assert (f["b"].cpu().numpy() == tag).all(), (t, tag)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]


@pytest.mark.gpu
def test_fresh_blocks_do_not_leak(gpu):
    torch = _torch()
    layout = pinstage.StepLayout(ENGINE)
    st = pinstage.StepStager(layout, mode="fresh", depth=4)
    vals = engine_values(1)
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    for _ in range(3000):
        t = torch.from_dlpack(st.stage(vals))
        del t
    torch.cuda.synchronize()
    assert st.stats()["blocks"] <= 16, st.stats()
    assert torch.cuda.mem_get_info()[0] >= free0 - 64 * layout.nbytes


@pytest.mark.two_gpus
@pytest.mark.gpu
def test_two_gpus_each_with_its_own_arena(gpu):
    torch = _torch()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    layout = pinstage.StepLayout(ENGINE)
    sts = [pinstage.StepStager(layout, device=d) for d in range(2)]
    fields = [torch.from_dlpack(st.field("block_table")) for st in sts]
    assert [f.device.index for f in fields] == [0, 1]
    for k in range(20):
        vals = [engine_values(10 * k + d) for d in range(2)]
        for d, st in enumerate(sts):
            with torch.cuda.device(d):
                fields[d].fill_(-3)
                st.stage(vals[d], stream=torch.cuda.current_stream(d))
        for d in range(2):
            torch.cuda.synchronize(d)
            for name, v in vals[d].items():
                got = sts[d].read_field(name)[: len(v)]
                assert np.array_equal(got, v), (k, d, name)
            assert np.array_equal(fields[d][:64].cpu().numpy(), vals[d]["block_table"]), (k, d)
    t = torch.empty(layout.nbytes, dtype=torch.uint8, device="cuda:1")
    with pytest.raises(pinstage.PinstageValueError, match="device"):
        pinstage.StepStager(layout, device=0, arena=t)
    # Without device=, a bound arena names its device; with torch's current device 1, a new
    # stager lives there too.
    bound = pinstage.StepStager(layout, arena=t)
    vals = engine_values(99)
    with torch.cuda.device(1):
        bound.stage(vals, stream=torch.cuda.current_stream(1))
        torch.cuda.synchronize(1)
        assert np.array_equal(bound.read_field("input_ids")[: len(vals["input_ids"])], vals["input_ids"])
        here = pinstage.StepStager(layout)
        assert torch.from_dlpack(here.field("input_ids")).device.index == 1


def test_an_int_stream_pointing_at_no_memory_is_refused():
    """The driver would dereference it (a segfault on a GPU machine): refused before any use."""
    st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 16)}), depth=1)
    for bad in (2**40, 10**9, 2**63, 2**48 + 8):
        with pytest.raises(pinstage.PinstageValueError, match="stream"):
            st.stage({"ids": [1]}, stream=bad)
        with pytest.raises(pinstage.PinstageValueError, match="stream"):
            st.step(stream=bad)
    st.stage({"ids": [2]})  # nothing was held
    assert st.read_field("ids")[0] == 2


# --- Misuse that used to hang, panic or write through released slots (no GPU needed). Each
# runs in a child process with a timeout, so a hang fails the test instead of the suite.


def _child(code, timeout=60):
    import os
    import subprocess
    import sys
    import textwrap

    code = "import numpy as np, pinstage, threading\n" + textwrap.dedent(code)
    if os.environ.get("PINSTAGE_PYTEST_IN_PROCESS") == "1":
        return _in_process(code, timeout)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def _in_process(code, timeout):
    """`_child` under src/python/pytest.rs, whose build of the module lives in this process
    only: the code runs here on a thread, its prints captured; a hang fails the test (and that
    harness's own time limit ends the process)."""
    import contextlib
    import io

    out, errors = io.StringIO(), []

    def run():
        try:
            with contextlib.redirect_stdout(out):
                exec(code, {"__name__": "__child__"})
        except BaseException as e:  # noqa: BLE001 - reported below, as a child's rc would be
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still running after {timeout} s"
    assert not errors, repr(errors[0])
    return out.getvalue()


def test_a_step_beyond_the_depth_on_the_same_thread_is_refused_not_waited_for():
    out = _child(
        """
        st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 8)}), depth=2)
        a, b = st.step(), st.step()
        try:
            st.step()
        except pinstage.StepStateError as e:
            print("refused:", e)
        try:
            st.stage({"ids": [1]})
        except pinstage.StepStateError:
            print("stage refused")
        a.abort()
        with st.step() as c:          # a slot is free again
            c.put("ids", [4, 5], pad_value=0)
        b.commit()
        print(st.read_field("ids").view(np.int32).tolist())
        """
    )
    assert "refused: every slot" in out and "stage refused" in out
    assert "[4, 5, 0, 0, 0, 0, 0, 0]" in out


def test_a_step_waiting_for_another_threads_slot_gets_it():
    out = _child(
        """
        import time
        st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 4)}), depth=1)
        held = st.step()
        got = []
        def other():
            with st.step() as s:      # waits until the main thread commits
                s.put("ids", [7, 7, 7, 7])
            got.append(True)
        t = threading.Thread(target=other)
        t.start()
        time.sleep(0.2)
        print("early" if got else "waited")  # the only slot is held: it must not have one yet
        held.put("ids", [1, 1, 1, 1])
        held.commit()
        t.join(30)
        print("got" if got else "stuck", st.read_field("ids").view(np.int32).tolist())
        """
    )
    assert "waited" in out and "got [7, 7, 7, 7]" in out


def test_a_step_used_by_a_callback_of_its_own_call_is_refused():
    out = _child(
        """
        st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 4)}), depth=1)
        step = st.step()
        seen = []
        class E:
            def __index__(self):
                for f in (step.commit, lambda: step.committed, lambda: step.used_rows("ids")):
                    try:
                        f()
                    except pinstage.StepStateError as e:
                        seen.append("in use" in str(e))
                return 3
        try:
            step.put("ids", [E(), 1, 2, 3])
        except pinstage.PinstageError:
            pass
        print("repr", repr(step), seen)
        step.put("ids", [1, 2, 3, 4])
        step.commit()
        print(st.read_field("ids").view(np.int32).tolist())
        """
    )
    assert "[True, True, True]" in out and "[1, 2, 3, 4]" in out


def test_another_thread_reading_a_busy_step_does_not_deadlock():
    out = _child(
        """
        st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 8)}), depth=1)
        s = st.step()
        stop = []
        def reader():
            while not stop:
                try:
                    s.committed
                    repr(s)
                except pinstage.StepStateError:
                    pass
        t = threading.Thread(target=reader, daemon=True)
        t.start()
        for _ in range(5000):
            s.put("ids", [1.0, 2.0], pad_value=0)   # converted through numpy (Python code)
        stop.append(1)
        t.join(10)
        s.commit()
        print("done", st.read_field("ids").view(np.int32).tolist())
        """
    )
    assert "done [1, 2, 0, 0, 0, 0, 0, 0]" in out


def test_stage_with_a_dict_changed_by_a_value_raises_and_releases_the_slot():
    out = _child(
        """
        st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 8), "t": ("int32", 8)}), depth=1)
        fields = {}
        class V:
            def __array__(self, dtype=None, copy=None):
                fields["t"] = [1]
                return np.arange(3, dtype=np.int32)
        fields["ids"] = V()
        try:
            st.stage(fields)
        except pinstage.PinstageValueError as e:
            print("refused:", e)
        st.stage({"ids": [5, 6, 7, 8, 9, 10, 11, 12]})
        print(st.read_field("ids").view(np.int32).tolist())
        """
    )
    assert "refused: the dict changed size" in out
    assert "[5, 6, 7, 8, 9, 10, 11, 12]" in out


def test_views_turn_read_only_when_their_step_is_dropped():
    st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 8)}), depth=1)
    v = st.step().view("ids")  # the step is dropped at once: its slot is released
    gc.collect()
    assert not v.flags.writeable
    with pytest.raises(ValueError):
        v[:] = 99
    with st.step() as s:
        s.put("ids", [3] * 8)
    assert st.read_field("ids").view(np.int32).tolist() == [3] * 8


def test_stage_refuses_rows_and_pads_of_fields_it_does_not_write():
    st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 8), "pos": ("int64", 8)}), depth=1)
    with pytest.raises(pinstage.UnknownFieldError):
        st.stage({"ids": [1, 2]}, rows={"idz": 8}, pad_value={"ids": 0})
    with pytest.raises(pinstage.UnknownFieldError):
        st.stage({"ids": [1, 2]}, pad_value={"idz": 0})
    with pytest.raises(pinstage.PinstageValueError, match="does not write"):
        st.stage({"ids": [1, 2]}, rows={"pos": 8}, pad_value={"ids": 0})
    st.stage({"ids": [1, 2]}, rows={"ids": 4}, pad_value={"ids": -1})
    assert st.read_field("ids").view(np.int32)[:4].tolist() == [1, 2, -1, -1]


def test_stage_converts_values_of_another_dtype_and_refuses_another_width():
    # The exact-array fast path must not take arrays of another dtype (their bytes are not the
    # field's) or another row width.
    st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 8), "t": ("int64", (4, 2))}), depth=1)
    st.stage({"ids": np.array([7, 7, 7, 7], np.int32), "t": np.full((4, 2), 9, np.int64)})
    st.stage({"ids": np.array([1, -2, 3], np.int64), "t": np.array([[5, -6]], np.int32)})
    assert st.read_field("ids")[:4].tolist() == [1, -2, 3, 7]
    assert st.read_field("t")[:2].tolist() == [[5, -6], [9, 9]]
    with pytest.raises(pinstage.PinstageValueError, match="shape"):
        st.stage({"ids": np.array([[4], [5]], np.int32)})  # two axes for one, of the exact dtype
    assert st.read_field("ids")[:4].tolist() == [1, -2, 3, 7]
    for bad, why in ((np.zeros((2, 3), np.int64), "shape"), (np.zeros((2, 1), np.int64), "pad")):
        with pytest.raises(pinstage.PinstageValueError, match=why):
            st.stage({"t": bad})
    assert st.read_field("t")[:2].tolist() == [[5, -6], [9, 9]]
    # One axis for two: refused, but for no rows at all (an empty list writes none).
    for bad in ([1, 2], np.array([1, 2], np.int64)):
        with pytest.raises(pinstage.PinstageValueError, match="shape"):
            st.stage({"t": bad})
        with pytest.raises(pinstage.PinstageValueError, match="shape"):
            with st.step() as step:
                step.put("t", bad)
    st.stage({"t": []})
    assert st.read_field("t")[:2].tolist() == [[5, -6], [9, 9]]


def test_layouts_compare_hash_and_pickle():
    import copy
    import pickle

    a = pinstage.StepLayout({"ids": ("int32", 8), "t": ("int64", (4, 2))}, skip_unchanged=["t"])
    b = pickle.loads(pickle.dumps(a))
    assert a == b and hash(a) == hash(b) and copy.deepcopy(a) == a and {a: 1}[b] == 1
    assert b.fields == a.fields
    assert a != pinstage.StepLayout({"ids": ("int32", 8), "t": ("int64", (4, 2))})  # skip differs
    assert a != pinstage.StepLayout({"t": ("int64", (4, 2)), "ids": ("int32", 8)}, skip_unchanged=["t"])
    assert a != "layout"
    # Layouts that differ in one respect each hash apart (a constant hash would be legal but
    # would pile every layout kept in a dict or set into one bucket).
    others = [pinstage.StepLayout({"ids": ("int32", 8), "t": ("int64", (4, 2))}),
              pinstage.StepLayout({"ids": ("int32", 9), "t": ("int64", (4, 2))}, skip_unchanged=["t"]),
              pinstage.StepLayout({"ids": ("int64", 8), "t": ("int64", (4, 2))}, skip_unchanged=["t"]),
              pinstage.StepLayout({"id": ("int32", 8), "t": ("int64", (4, 2))}, skip_unchanged=["t"])]
    assert len({hash(x) for x in [a, *others]}) == 5
    st = pinstage.StepStager(b, depth=1)
    st.stage({"ids": [4, 5]})
    assert st.read_field("ids")[:2].tolist() == [4, 5]


def test_a_stage_reentered_from_a_values_conversion_is_refused_not_waited_for():
    st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 8)}), depth=1)
    inner = []

    class Reenters:
        def __array__(self, dtype=None, copy=None):
            try:
                st.stage({"ids": np.arange(8, dtype=np.int32)})
            except pinstage.StepStateError as e:
                inner.append(e)
            return np.arange(10, 18, dtype=np.int32)

    st.stage({"ids": Reenters()})
    assert len(inner) == 1, "the inner stage must be refused at once"
    assert st.read_field("ids").tolist() == list(range(10, 18))
    st.stage({"ids": np.arange(8, dtype=np.int32)})  # the slot was released
    assert st.read_field("ids").tolist() == list(range(8))


def test_unpack_refuses_what_is_not_a_packed_array_with_typed_errors():
    layout = pinstage.StepLayout({"ids": ("int32", 8), "w": ("float32", 4)})
    with pytest.raises(pinstage.PinstageTypeError):
        layout.unpack([1, 2, 3])
    strided = np.zeros(layout.nbytes * 2, np.uint8)[::2]
    with pytest.raises(pinstage.PinstageValueError):
        layout.unpack(strided)
    ok = layout.unpack(np.zeros(layout.nbytes, np.uint8))
    assert ok["ids"].dtype == np.int32 and ok["w"].shape == (4,)


def test_an_oversized_layout_is_a_value_error():
    with pytest.raises(pinstage.PinstageValueError):
        pinstage.StepLayout({"a": ("int64", 2**62)})


def test_zero_copy_steps_count_as_empty_only_when_nothing_was_written():
    st = pinstage.StepStager(pinstage.StepLayout({"ids": ("int32", 8)}), mode="zero_copy", depth=2)
    with st.step() as step:
        step.put("ids", [1])
    with st.step():
        pass
    s = st.stats()
    assert s["steps"] == 2 and s["empty_steps"] == 1, s


def test_zero_copy_steps_count_as_empty_step_by_step():
    # Every field written, some, none: only the last is empty (counted after each step).
    layout = pinstage.StepLayout({"ids": ("int32", 8), "pos": ("int64", 8)})
    st = pinstage.StepStager(layout, mode="zero_copy", depth=2)
    for written, empty in [({"ids": [1], "pos": [2]}, 0), ({"ids": [3]}, 0), ({}, 1)]:
        with st.step() as step:
            for name, values in written.items():
                step.put(name, values)
        assert st.stats()["empty_steps"] == empty, (written, st.stats())


@pytest.mark.parametrize("src_dtype", ["int8", "uint8", "int16", "uint16", "int64", "uint64", "uint32"])
@pytest.mark.parametrize("dst_dtype", ["int32", "uint8", "int64", "uint16"])
def test_integer_values_of_another_width_are_cast_exactly_or_refused(src_dtype, dst_dtype):
    st = pinstage.StepStager(pinstage.StepLayout({"f": (dst_dtype, 8)}), depth=1)
    src = np.dtype(src_dtype)
    lo = max(np.iinfo(src).min, np.iinfo(dst_dtype).min)
    hi = min(np.iinfo(src).max, np.iinfo(dst_dtype).max)
    ok = np.array([lo, hi, 0, 1, hi // 3, 7], dtype=src)
    st.stage({"f": ok})
    assert st.read_field("f")[:6].tolist() == ok.tolist()
    st.stage({"f": ok[::2]})  # not contiguous
    assert st.read_field("f")[:3].tolist() == ok[::2].tolist()
    before = st.read_field("f").tolist()
    for bad in (int(np.iinfo(dst_dtype).max) + 1, int(np.iinfo(dst_dtype).min) - 1):
        if np.iinfo(src).min <= bad <= np.iinfo(src).max:
            with pytest.raises(pinstage.PinstageValueError, match="fit"):
                st.stage({"f": np.array([1, bad], dtype=src)})
            assert st.read_field("f").tolist() == before, "nothing written"


def test_array_like_values_of_the_fields_dtype_go_in_unconverted():
    asked = []

    class Tensorish:  # as a torch CPU tensor: numpy.asarray gives its own memory
        def __init__(self, a):
            self.a = a

        def __array__(self, dtype=None, copy=None):
            asked.append(dtype)
            return self.a

    st = pinstage.StepStager(pinstage.StepLayout({"w": ("float32", (4, 3))}), depth=1)
    v = np.arange(6, dtype=np.float32).reshape(2, 3) + 0.5
    # Signaling NaNs with payloads: any conversion through Python floats or float64 would
    # quiet them (set bit 22), so equal bits prove the values went in as they were.
    v.view(np.uint32)[0, :2] = [0x7F800001, 0xFF800123]
    st.stage({"w": Tensorish(v)})
    assert st.read_field("w")[:2].view(np.uint32).tolist() == v.view(np.uint32).tolist()
    assert asked and all(d is None for d in asked), asked  # never asked for another dtype
