"""pinstage beside a CUDA graph captured on another thread (GPU).

torch captures graphs in global mode by default. While such a capture runs, the driver refuses
event and stream queries and waits on every other thread, and each refusal also invalidates the
capture. pinstage's queries and waits (a busy slot's event, a step's slot, a pending copy, a D2H
result) run with their thread's capture mode relaxed: the worker's copies go on and are checked,
and the capture ends intact. A build whose queries keep the thread's mode (the seeded bug
`capture_strict` in scripts/seeded.tsv, `scripts/gpu-run seeded`) fails this test.

The scenario runs in a child process, as an engine would: a fresh process whose capture nothing
else disturbs (in the suite, objects other tests left to the garbage collector could be freed
during the capture on either thread), and whose failure (an invalidated capture leaves CUDA
state that crashed a later test's JAX in run 2026-12-02 j) cannot take the suite down."""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import pinstage


@pytest.mark.gpu
def test_copies_on_another_thread_while_a_graph_is_captured_in_global_mode(gpu):
    pytest.importorskip("torch")
    pytest.importorskip("cuda.bindings.driver")
    r = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "child"],
        capture_output=True,
        text=True,
        timeout=180,
        env=os.environ.copy(),
    )
    assert r.returncode == 0 and "scenario passed" in r.stdout, (
        f"the child failed (rc={r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    )


def scenario():
    import torch
    from cuda.bindings import driver

    dev = torch.device("cuda", 0)
    n = 16384  # 64 KiB of int32 per copy: claims of a depth-2 ring find busy slots
    ws = torch.cuda.Stream()
    stager = pinstage.PinnedStager(torch.int32, numel=n, depth=2)
    dst = torch.full((n,), -1, dtype=torch.int32, device=dev)
    target = stager.target(dst)
    big = torch.arange(1 << 20, dtype=torch.float32, device=dev) * 3  # 4 MiB
    big_want = np.arange(1 << 20, dtype=np.float32) * 3
    big_out = pinstage.empty_pinned(1 << 20, np.float32)  # poisoned before every copy
    layout = pinstage.StepLayout({"ids": ("int32", 4096)})
    steps = pinstage.StepStager(layout, depth=2)
    ids = torch.from_dlpack(steps.field("ids"))
    torch.cuda.synchronize()

    errors, progress = [], [0]
    warm, stop = threading.Event(), threading.Event()
    last_ids = [None]
    capture_stream = [None]
    invalidated_after = []

    def capture_status():
        """The capture's status as the driver sees it (asking is allowed during a capture)."""
        cs = capture_stream[0]
        if cs is None:
            return "none"
        err, status = driver.cuStreamIsCapturing(driver.CUstream(cs.cuda_stream))
        return status.name if err == driver.CUresult.CUDA_SUCCESS else f"error {err}"

    def step(name, fn):
        """Runs one worker call; notes the first after which the capture was invalidated."""
        out = fn()
        if not invalidated_after and capture_status().endswith("INVALIDATED"):
            invalidated_after.append(name)
        return out

    def worker():
        try:
            with torch.cuda.stream(ws):
                k = 0
                while not stop.is_set():
                    k += 1
                    vals = (np.arange(n, dtype=np.int32) * 7 + k).astype(np.int32)
                    step("target.copy_", lambda: target.copy_(vals, stream=ws))
                    host = step("copy_d2h", lambda: pinstage.copy_d2h(dst, stream=ws))
                    if not np.array_equal(host, vals):
                        raise AssertionError(f"round {k}: the device copy came back wrong")
                    big_out.fill(-5.0)
                    got = step(
                        "copy_d2h_async().wait()",
                        lambda: pinstage.copy_d2h_async(big, big_out, stream=ws).wait(),
                    )
                    if not np.array_equal(big_out, big_want):
                        raise AssertionError(f"round {k}: the 4 MiB result is wrong")
                    step_vals = np.full(4096, k, dtype=np.int32)
                    step("StepStager.stage", lambda: steps.stage({"ids": step_vals}, stream=ws))
                    del host, got
                    last_ids[0] = step_vals
                    progress[0] = k
                    if k >= 5:  # the pools hold every block a round needs (no pinned allocation)
                        warm.set()
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            warm.set()

    th = threading.Thread(target=worker)
    th.start()
    capture_error = None
    try:
        assert warm.wait(30), "the worker did not finish its warm-up rounds"
        assert not errors, errors
        x = torch.ones(1 << 16, device=dev)
        g = torch.cuda.CUDAGraph()
        graph = torch.cuda.graph(g)  # capture_error_mode="global": torch's default
        capture_stream[0] = graph.capture_stream
        try:
            with graph:
                y = x * 3
                before = progress[0]
                t_end = time.monotonic() + 0.5
                while time.monotonic() < t_end and not errors:
                    time.sleep(0.005)  # the GIL goes to the worker
                during = progress[0] - before
        except Exception as e:
            capture_error = e
    finally:
        stop.set()
        th.join(60)
        capture_stream[0] = None
    assert not errors, f"the worker failed during the capture: {errors[0]!r}"
    assert capture_error is None, (
        f"the capture was invalidated (first seen after the worker's {invalidated_after or ['?']}): "
        f"{capture_error!r}"
    )
    assert during >= 5, f"only {during} worker rounds ran during the capture: nothing proven"
    x.fill_(2.0)
    g.replay()
    torch.cuda.synchronize()
    assert float(y.sum()) == 6.0 * x.numel(), "the captured graph does not replay x * 3"
    ws.synchronize()
    assert np.array_equal(ids.cpu().numpy(), last_ids[0]), "the last step did not land"
    print("scenario passed")


if __name__ == "__main__" and sys.argv[1:] == ["child"]:
    scenario()
