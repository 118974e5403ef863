"""An inference engine's step loop fed by pinstage step staging (torch).

The step inputs (token ids, positions, slot mapping, sequence lengths, query start offsets, a
block table) live in ONE device arena that pinstage owns; torch imports each field once, so a
CUDA graph captured once reads them at stable addresses. Every step the planner writes the new
values into the step's pinned slot and the commit sends them with one driver call, on the
graph's stream, before the replay. The graph's result is checked against numpy every step.
Without a GPU the same loop runs against host memory and numpy stands in for the graph.

python examples/engine_step.py [--steps 200]
"""

import argparse
import time

import numpy as np

import pinstage

LAYOUT = pinstage.StepLayout(
    {
        "input_ids": ("int32", 8192),
        "positions": ("int64", 8192),
        "slot_mapping": ("int64", 8192),
        "seq_lens": ("int32", 256),
        "query_start_loc": ("int32", 257),
        "block_table": ("int32", (256, 128)),
    }
)
TOKENS, SEQS = 256, 64


def plan(rng):
    """Step N+1's inputs, as a scheduler would plan them."""
    lens = rng.integers(1, 8, SEQS).astype(np.int32)
    return {
        "input_ids": rng.integers(1, 50_000, TOKENS).astype(np.int32),
        "positions": rng.integers(0, 4096, TOKENS).astype(np.int64),
        "slot_mapping": rng.integers(0, 1 << 20, TOKENS).astype(np.int64),
        "seq_lens": lens,
        "query_start_loc": np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
        "block_table": rng.integers(0, 1 << 16, (SEQS, 128)).astype(np.int32),
    }


def expected(v):
    """What the 'model' computes from the step inputs."""
    return [
        int(v["input_ids"].astype(np.int64).sum() + v["positions"].sum()),
        int(v["slot_mapping"].sum()),
        int(v["seq_lens"].astype(np.int64).sum() + v["query_start_loc"][-1]),
        int(v["block_table"].astype(np.int64).sum()),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    st = pinstage.StepStager(LAYOUT, depth=4)
    try:
        import torch

        gpu = torch.cuda.is_available() and st.cuda
    except ImportError:
        gpu = False
    if not gpu:
        for k in range(args.steps):
            v = plan(rng)
            with st.step() as step:
                for name, x in v.items():
                    step.put(name, x)
            got = {n: st.read_field(n)[: len(x)] for n, x in v.items()}
            assert expected(got) == expected(v), k
        print(f"no GPU: {args.steps} steps staged into host memory and checked")
        return

    f = {n: torch.from_dlpack(st.field(n)) for n in LAYOUT.names}  # imported once
    out = torch.zeros(4, dtype=torch.int64, device="cuda")
    s = torch.cuda.Stream()

    def model():
        out[0] = f["input_ids"][:TOKENS].sum(dtype=torch.int64) + f["positions"][:TOKENS].sum()
        out[1] = f["slot_mapping"][:TOKENS].sum()
        out[2] = f["seq_lens"][:SEQS].sum(dtype=torch.int64) + f["query_start_loc"][SEQS].to(torch.int64)
        out[3] = f["block_table"][:SEQS].sum(dtype=torch.int64)

    st.stage(plan(rng), stream=s)
    with torch.cuda.stream(s):
        model()  # warm-up before capture
    s.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        model()

    host_us = []
    for k in range(args.steps):
        v = plan(rng)
        t0 = time.perf_counter()
        with st.step(stream=s) as step:  # commit on the graph's stream, before the replay
            for name, x in v.items():
                step.put(name, x)
        host_us.append((time.perf_counter() - t0) * 1e6)
        with torch.cuda.stream(s):
            graph.replay()
        s.synchronize()
        assert out.tolist() == expected(v), f"step {k}: the graph saw other values"
    stats = st.stats()
    print(
        f"{args.steps} steps: graph replay saw every step's values; staging {np.median(host_us):.1f} us "
        f"per step (median, host), {stats['copies']} copies + {stats['batches']} batches for "
        f"{stats['steps']} steps"
    )


if __name__ == "__main__":
    main()
