"""A toy paged KV cache whose blocks are evicted to pinned host memory and reloaded (torch).

Each of 8 layers keeps K and V in one device tensor `[2, num_blocks, block_size, heads,
head_dim]` with too few blocks for every sequence; host memory holds 4x as many. Every step some
sequences run: a sequence whose blocks were evicted is loaded back (`mover.load`, on the model's
stream), the "model" appends one block of new K/V per layer, and its "attention" reads every
block of the sequence through the block table. To make room, the least recently used idle
sequences are offloaded (`mover.offload`, on a side stream that waits for the model's writes;
the model's stream waits for the offload before it overwrites the freed blocks). Every step
reads every running sequence's blocks in every layer and compares them with the values written
(distinct per sequence, position, layer and K/V), so a block lost, misplaced or overwritten
anywhere in the cycle fails the example. With no GPU it runs on host memory.

python examples/kv_offload.py [--steps 60]
"""

import argparse
import collections

import numpy as np
import torch

import pinstage

LAYERS, DEV_BLOCKS, HOST_BLOCKS, BLOCK, HEADS, DIM = 8, 48, 192, 16, 4, 32
SEQS, RUNNING, MAX_BLOCKS = 24, 6, 6


def token_values(seq, pos):
    """The K/V values of tokens `pos` (an array) of `seq` in every layer: small integers,
    exact in float16 and in float32 sums. Shape [LAYERS, 2, len(pos)]."""
    layer = np.arange(LAYERS)[:, None, None]
    kv = np.arange(2)[None, :, None]
    return ((seq * 7 + pos[None, None, :] * 3 + layer * 11 + kv * 5) % 61).astype(np.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    shape = (2, DEV_BLOCKS, BLOCK, HEADS, DIM)
    kv = [torch.zeros(shape, dtype=torch.float16, device=dev) for _ in range(LAYERS)]
    host = [pinstage.empty_host((2, HOST_BLOCKS, BLOCK, HEADS, DIM), np.float16) for _ in range(LAYERS)]
    mover = pinstage.BlockMover(kv, host, block_dim=1)
    model = torch.cuda.current_stream() if cuda else None
    side = torch.cuda.Stream() if cuda else None

    free_dev = list(range(DEV_BLOCKS))
    free_host = list(range(HOST_BLOCKS))
    on_dev = {}  # seq -> its device block ids, in order
    on_host = {}  # seq -> its host block ids
    length = collections.Counter()  # seq -> tokens written
    seq_gen = collections.Counter()  # seq -> how many times it restarted (new values)
    lru = collections.OrderedDict()  # resident sequences, least recently used first
    rng = np.random.default_rng(0)
    moved = {"offloaded": 0, "loaded": 0}
    pending_offload = None

    def evict(need):
        """Offload idle resident sequences until `need` device blocks are free."""
        nonlocal pending_offload
        while len(free_dev) < need:
            seq = next(s for s in lru if s not in running)
            lru.pop(seq)
            ids = on_dev.pop(seq)
            hids = [free_host.pop() for _ in ids]
            on_host[seq] = hids
            free_dev.extend(ids)
            if cuda:
                side.wait_stream(model)  # after the model wrote these blocks
            p = mover.offload(ids, hids, stream=side)
            if cuda:
                p.stream_wait(model)  # the model overwrites the freed blocks only after this
            moved["offloaded"] += len(ids)
            pending_offload = p

    for step in range(args.steps):
        running = set(rng.choice(SEQS, RUNNING, replace=False).tolist())
        for seq in sorted(running):
            if length[seq] >= MAX_BLOCKS * BLOCK:  # finished: a new sequence takes its place
                free_dev.extend(on_dev.pop(seq, []))
                free_host.extend(on_host.pop(seq, []))
                lru.pop(seq, None)
                length[seq] = 0
                seq_gen[seq] += 1
            blocks_now = length[seq] // BLOCK
            need = blocks_now + 1 - len(on_dev.get(seq, []))
            if seq in on_host:
                need = blocks_now + 1
            evict(need)
            if seq in on_host:  # reload on the model's stream, before the model reads it
                hids = on_host.pop(seq)
                ids = [free_dev.pop() for _ in hids]
                mover.load(hids, ids, stream=model)
                free_host.extend(hids)
                on_dev[seq] = ids
                moved["loaded"] += len(ids)
            # the model appends one block of K/V per layer
            block = free_dev.pop()
            on_dev.setdefault(seq, []).append(block)
            pos = np.arange(length[seq], length[seq] + BLOCK)
            vals = torch.from_numpy(token_values(seq + SEQS * seq_gen[seq], pos)).to(dev, torch.float16)
            for layer in range(LAYERS):
                kv[layer][:, block] = vals[layer][:, :, None, None]
            length[seq] += BLOCK
            lru.pop(seq, None)
            lru[seq] = True
        # "attention": every running sequence reads all its blocks through its block table;
        # each layer's K and V, every token of every block, must hold the values written.
        for seq in sorted(running):
            table = torch.tensor(on_dev[seq], device=dev)
            nb = length[seq] // BLOCK
            vals = token_values(seq + SEQS * seq_gen[seq], np.arange(length[seq]))
            want = torch.from_numpy(vals.reshape(LAYERS, 2, nb, BLOCK)).to(dev, torch.float16)
            for layer in range(LAYERS):
                got = kv[layer].index_select(1, table)  # [2, nb, BLOCK, HEADS, DIM]
                if not torch.equal(got, want[layer][:, :, :, None, None].expand_as(got)):
                    raise SystemExit(f"step {step}: sequence {seq}, layer {layer}: wrong KV")
    if pending_offload is not None:
        pending_offload.wait()
    print(f"{args.steps} steps on {dev}: {moved['offloaded']} blocks offloaded, {moved['loaded']} "
          f"loaded back, every running sequence's KV checked every step")


if __name__ == "__main__":
    main()
