"""pinstage beside a CUDA graph captured on another thread (GPU).

torch captures graphs in global mode by default. While such a capture runs, the driver refuses
event and stream queries and waits on every other thread, and each refusal also invalidates the
capture. pinstage's queries and waits (a busy slot's event, a step's slot, a pending copy, a D2H
result) run with their thread's capture mode relaxed: the worker's copies go on and are checked,
and the capture ends intact. A build whose queries keep the thread's mode (the seeded bug
`capture_strict`, `scripts/gpu-run broken-capture`) fails this test."""

import threading
import time

import numpy as np
import pytest

import pinstage


@pytest.mark.gpu
def test_copies_on_another_thread_while_a_graph_is_captured_in_global_mode(gpu):
    torch = pytest.importorskip("torch")
    dev = torch.device("cuda", 0)
    n = 16384  # 64 KiB of int32 per copy: claims of a depth-2 ring find busy slots
    ws = torch.cuda.Stream()
    stager = pinstage.PinnedStager(torch.int32, numel=n, depth=2)
    dst = torch.full((n,), -1, dtype=torch.int32, device=dev)
    target = stager.target(dst)
    big = torch.arange(1 << 20, dtype=torch.float32, device=dev) * 3  # 4 MiB
    big_want = np.arange(1 << 20, dtype=np.float32) * 3
    layout = pinstage.StepLayout({"ids": ("int32", 4096)})
    steps = pinstage.StepStager(layout, depth=2)
    ids = torch.from_dlpack(steps.field("ids"))
    torch.cuda.synchronize()

    errors, progress = [], [0]
    warm, stop = threading.Event(), threading.Event()
    last_ids = [None]

    def worker():
        try:
            with torch.cuda.stream(ws):
                k = 0
                while not stop.is_set():
                    k += 1
                    vals = (np.arange(n, dtype=np.int32) * 7 + k).astype(np.int32)
                    target.copy_(vals, stream=ws)
                    host = pinstage.copy_d2h(dst, stream=ws)
                    if not np.array_equal(host, vals):
                        raise AssertionError(f"round {k}: the device copy came back wrong")
                    got = pinstage.copy_d2h_async(big, stream=ws).wait()
                    if not np.array_equal(got, big_want):
                        raise AssertionError(f"round {k}: the 4 MiB result is wrong")
                    step_vals = np.full(4096, k, dtype=np.int32)
                    steps.stage({"ids": step_vals}, stream=ws)
                    last_ids[0] = step_vals
                    progress[0] = k
                    warm.set()
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            warm.set()

    th = threading.Thread(target=worker)
    th.start()
    try:
        assert warm.wait(30), "the worker did not finish a round"
        assert not errors, errors
        x = torch.ones(1 << 16, device=dev)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):  # capture_error_mode="global": torch's default
            y = x * 3
            before = progress[0]
            t_end = time.monotonic() + 0.5
            while time.monotonic() < t_end and not errors:
                time.sleep(0.005)  # the GIL goes to the worker
            during = progress[0] - before
    finally:
        stop.set()
        th.join(60)
    assert not errors, f"the worker failed during the capture: {errors[0]!r}"
    assert during >= 5, f"only {during} worker rounds ran during the capture: nothing proven"
    x.fill_(2.0)
    g.replay()
    torch.cuda.synchronize()
    assert float(y.sum()) == 6.0 * x.numel(), "the captured graph does not replay x * 3"
    ws.synchronize()
    assert np.array_equal(ids.cpu().numpy(), last_ids[0]), "the last step did not land"
