"""A copy and its wait against torch's `copy_` + `stream.synchronize()`, back to back, both ways.

What is timed: host nanoseconds (perf_counter_ns) around ONE call, for calls issued back to back
(the next call starts right after the previous one returned; between them only the loop's own
bookkeeping, the same for every variant), all on one dedicated torch stream `s`:

  h2d  torch     dst.copy_(pinned, non_blocking=True); s.synchronize()
  h2d  pinstage  copy_h2d(dst, pinned_np, stream=s)                (completes)
  h2d  pinstage  copy_h2d_async(dst, pinned_np, stream=s).wait()
  h2d  control   copy_h2d_async(dst, pinned_np, stream=s); s.synchronize()   (enqueue vs wait)
  d2h  torch     pinned.copy_(src, non_blocking=True); s.synchronize()
  d2h  pinstage  copy_d2h(src, pinned_np, stream=s)                (waits)
  d2h  pinstage  copy_d2h_async(src, pinned_np, stream=s).wait()
  d2h  control   copy_d2h_async(src, pinned_np, stream=s); s.synchronize()

Buffers: per size a ring of B distinct destinations and B distinct sources (B = calls per batch,
>= 16); call k of a batch copies source k into destination k. Sources hold nonzero bytes in
1..163 that differ per ring slot (never the poison 0xA5). torch and pinstage use the SAME pinned
memory (torch pinned tensors; pinstage gets their numpy views). Before every batch all B
destinations are poisoned (h2d: a device fill; d2h: a DMA from a device poison block), outside
the timing; after it, EVERY call's destination is compared with its source on the device
(torch.equal), outside the timing. A round runs `--batches` batches of every variant, the
variants' order shuffled per batch (seeded) so drift and the trace of the one before hit all
alike; a round's figure is the median call; the printed figure the median over `--rounds`
rounds, (min-max) over rounds. Goal: pinstage <= torch + 2 us at 64 KiB, 1 MiB and 16 MiB, both
directions.

    python3 benches/bench_waits.py [--rounds 7] [--batches N] [--out DIR]

Exit status 1 when any check failed (or a call raised); the summary table is printed last.
"""

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time

import numpy as np

import pinstage

SIZES = (64 << 10, 1 << 20, 16 << 20)
POISON = 0xA5
GOAL_US = 2.0


def label(nbytes):
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def ring_shape(nbytes, batches_arg):
    """(calls per batch = ring size, batches per round): 64 x 16 up to 1 MiB, 16 x 8 at 16 MiB
    (about 6 ms of copies per batch at 16 MiB)."""
    if nbytes >= 16 << 20:
        return 16, batches_arg or 8
    return 64, batches_arg or 16


class Ring:
    """B distinct sources and B destinations of `n` bytes, per direction, and their operands
    made once (row views), so the timed loop only indexes lists."""

    def __init__(self, torch, n, B, salt):
        i = torch.arange(n, device="cuda", dtype=torch.int32)
        self.exp = torch.empty((B, n), dtype=torch.uint8, device="cuda")
        for k in range(B):  # row k: ((7 i + 31 k + salt) mod 163) + 1, distinct rows for B < 163
            self.exp[k] = ((i * 7 + (31 * k + salt)) % 163 + 1).to(torch.uint8)
        del i
        self.dst_dev = torch.empty((B, n), dtype=torch.uint8, device="cuda")
        self.src_pin = torch.empty((B, n), dtype=torch.uint8, pin_memory=True)
        self.src_pin.copy_(self.exp)
        self.dst_pin = torch.empty((B, n), dtype=torch.uint8, pin_memory=True)
        self.poison_dev = torch.full((B, n), POISON, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        # h2d: (device dst, pinned src as torch, pinned src as numpy)
        self.h2d_dst = list(self.dst_dev.unbind(0))
        self.h2d_src_t = list(self.src_pin.unbind(0))
        self.h2d_src_np = list(self.src_pin.numpy())
        # d2h: (device src, pinned dst as torch, pinned dst as numpy)
        self.d2h_src = list(self.exp.unbind(0))
        self.d2h_dst_t = list(self.dst_pin.unbind(0))
        self.d2h_dst_np = list(self.dst_pin.numpy())
        self.pinned_seen = bool(pinstage.is_pinned(self.h2d_src_np[0])) and bool(
            pinstage.is_pinned(self.d2h_dst_np[-1]))

    def poison(self, torch, direction):
        if direction == "h2d":
            self.dst_dev.fill_(POISON)
        else:
            self.dst_pin.copy_(self.poison_dev, non_blocking=True)
        torch.cuda.synchronize()

    def bad_calls(self, torch, direction):
        """Indices of the calls whose destination differs from their source (all checked)."""
        got = self.dst_dev if direction == "h2d" else self.dst_pin.to("cuda")
        if torch.equal(got, self.exp):
            return []
        return (got != self.exp).any(dim=1).nonzero().flatten().tolist()


def variants(torch, s):
    """[(direction, name, op, operand lists)]: op(a, b) is one call; `a`, `b` the k-th operands."""
    sync = s.synchronize
    h2d_async, d2h_async = pinstage.copy_h2d_async, pinstage.copy_d2h_async
    copy_h2d, copy_d2h = pinstage.copy_h2d, pinstage.copy_d2h

    def t_h2d(dst, src):
        dst.copy_(src, non_blocking=True)
        sync()

    def t_d2h(src, dst):
        dst.copy_(src, non_blocking=True)
        sync()

    def ctl_h2d(dst, src):
        p = h2d_async(dst, src, stream=s)
        sync()
        return p  # dropped after the batch, outside the timing

    def ctl_d2h(src, dst):
        p = d2h_async(src, dst, stream=s)
        sync()
        return p

    return [
        ("h2d", "torch copy_ + s.synchronize()", t_h2d, ("h2d_dst", "h2d_src_t")),
        ("h2d", "copy_h2d()", lambda d, x: copy_h2d(d, x, stream=s), ("h2d_dst", "h2d_src_np")),
        ("h2d", "copy_h2d_async().wait()", lambda d, x: h2d_async(d, x, stream=s).wait(),
         ("h2d_dst", "h2d_src_np")),
        ("h2d", "ctl: copy_h2d_async(); s.synchronize()", ctl_h2d, ("h2d_dst", "h2d_src_np")),
        ("d2h", "torch copy_ + s.synchronize()", t_d2h, ("d2h_src", "d2h_dst_t")),
        ("d2h", "copy_d2h()", lambda x, d: copy_d2h(x, d, stream=s), ("d2h_src", "d2h_dst_np")),
        ("d2h", "copy_d2h_async().wait()", lambda x, d: d2h_async(x, d, stream=s).wait(),
         ("d2h_src", "d2h_dst_np")),
        ("d2h", "ctl: copy_d2h_async(); s.synchronize()", ctl_d2h, ("d2h_src", "d2h_dst_np")),
    ]


def run_batch(op, a_rows, b_rows, out_ns):
    """B calls back to back, call k on (a_rows[k], b_rows[k]); appends each call's ns."""
    pc = time.perf_counter_ns
    keep = [None] * len(a_rows)
    for k in range(len(a_rows)):
        a, b = a_rows[k], b_rows[k]
        t0 = pc()
        r = op(a, b)
        t1 = pc()
        keep[k] = r
        out_ns.append(t1 - t0)
    return keep


def bench_size(torch, s, nbytes, args, failed):
    B, batches = ring_shape(nbytes, args.batches)
    ring = Ring(torch, nbytes, B, salt=nbytes % 157)
    vs = variants(torch, s)
    names = [f"{d} {n}" for d, n, _, _ in vs]
    dead = set()
    rounds = {name: [] for name in names}

    def one_batch(idx, ns, where):
        d, name, op, (a_attr, b_attr) = vs[idx]
        key = names[idx]
        ring.poison(torch, d)
        try:
            keep = run_batch(op, getattr(ring, a_attr), getattr(ring, b_attr), ns)
            torch.cuda.synchronize()
            del keep
        except Exception as e:  # noqa: BLE001 (a raising call is a failed check, reported)
            failed.append(f"{key} {label(nbytes)} {where}: raised {type(e).__name__}: {e}")
            dead.add(idx)
            torch.cuda.synchronize()
            return
        bad = ring.bad_calls(torch, d)
        if bad:
            failed.append(f"{key} {label(nbytes)} {where}: calls {bad[:8]} wrong ({len(bad)}/{B})")

    with torch.cuda.stream(s):
        for idx in range(len(vs)):  # warm-up: one checked batch each, untimed
            one_batch(idx, [], "warm-up")
        gc.collect()
        gc.disable()
        shuffle = random.Random(nbytes)
        try:
            for r in range(args.rounds):
                ns = {idx: [] for idx in range(len(vs))}
                for b in range(batches):
                    order = list(range(len(vs)))
                    shuffle.shuffle(order)
                    for idx in order:
                        if idx not in dead:
                            one_batch(idx, ns[idx], f"round {r} batch {b}")
                for idx, v in ns.items():
                    if v and idx not in dead:
                        rounds[names[idx]].append(statistics.median(v) / 1e3)
                gc.collect()
        finally:
            gc.enable()
    row = {}
    for name, v in rounds.items():
        row[name] = {"median_us": statistics.median(v) if v else None, "min_us": min(v, default=None),
                     "max_us": max(v, default=None), "rounds_us": v}
    for d in ("h2d", "d2h"):
        ref = rounds[f"{d} torch copy_ + s.synchronize()"]
        for name in names:
            if name.startswith(d) and "torch" not in name and rounds[name] and ref:
                paired = [a - b for a, b in zip(rounds[name], ref)]
                row[name]["minus_torch_us"] = row[name]["median_us"] - statistics.median(ref)
                row[name]["minus_torch_paired_us"] = paired
    info = {"calls_per_batch": B, "batches_per_round": batches, "pinned_seen_by_pinstage": ring.pinned_seen}
    del ring
    torch.cuda.empty_cache()
    return row, info


def fmt_cell(c):
    if c.get("median_us") is None:
        return f"{'--':>24s}"
    return f"{c['median_us']:>8.1f} ({c['min_us']:.1f}-{c['max_us']:.1f})".rjust(24)


def summary(rows, infos, failed, args):
    out = []
    head = f"host us per call, back to back; median of {args.rounds} round medians (min-max)"
    out.append("\n=== bench_waits summary: " + head)
    out.append(f"{'':42s}" + "".join(f"{label(b):>24s}" for b in SIZES))
    names = list(rows[SIZES[0]])
    for name in names:
        out.append(f"{name:42s}" + "".join(fmt_cell(rows[b][name]) for b in SIZES))
    out.append(f"pinstage - torch, us (difference of medians; [min,max] of per-round pairs); "
               f"goal <= +{GOAL_US:.0f}")
    verdicts = []
    for name in names:
        if "torch" in name or "ctl:" in name:
            continue
        cells = []
        for b in SIZES:
            c = rows[b][name]
            if "minus_torch_us" not in c:
                cells.append(f"{'--':>24s}")
                verdicts.append((name, b, False))
                continue
            ok = c["minus_torch_us"] <= GOAL_US
            verdicts.append((name, b, ok))
            p = c["minus_torch_paired_us"]
            cells.append(f"{c['minus_torch_us']:+7.1f} [{min(p):+.1f},{max(p):+.1f}] "
                         f"{'PASS' if ok else 'MISS'}".rjust(24))
        out.append(f"{name:42s}" + "".join(cells))
    for name in names:  # what the wait costs over torch's synchronize, and what the enqueue does
        if name.startswith(("h2d ctl", "d2h ctl")):
            d = name[:3]
            w = f"{d} {'copy_h2d' if d == 'h2d' else 'copy_d2h'}_async().wait()"
            cells = []
            for b in SIZES:
                c, a, t = rows[b][name], rows[b][w], rows[b][f"{d} torch copy_ + s.synchronize()"]
                if None in (c["median_us"], a["median_us"], t["median_us"]):
                    cells.append(f"{'--':>24s}")
                else:
                    cells.append(f"enq {c['median_us'] - t['median_us']:+.1f} wait "
                                 f"{a['median_us'] - c['median_us']:+.1f}".rjust(24))
            out.append(f"{d + ' ctl-torch (enqueue), async-ctl (wait)':42s}" + "".join(cells))
    misses = [f"{n} @ {label(b)}" for n, b, ok in verdicts if not ok]
    out.append("goal (<= torch + 2 us, 64 KiB/1 MiB/16 MiB, both directions): "
               + ("MET" if not misses else f"NOT MET: {', '.join(misses)}"))
    for b in SIZES:
        i = infos[b]
        out.append(f"{label(b)}: {i['calls_per_batch']} calls x {i['batches_per_round']} batches x "
                   f"{args.rounds} rounds per variant; pinned seen by pinstage: {i['pinned_seen_by_pinstage']}")
    out.append(f"checked: every call's destination (poisoned 0x{POISON:X} before each batch); "
               f"{len(failed)} failures" + (": " + "; ".join(failed[:4]) if failed else ""))
    print("\n".join(out), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", type=int, default=0, help="batches per round (0: by size)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    t_start = time.time()
    torch.cuda.init()
    print("device:", torch.cuda.get_device_name(0), "| pinstage", pinstage.__version__, "| torch",
          torch.__version__, "| python", sys.version.split()[0], flush=True)
    s = torch.cuda.Stream()
    rows, infos, failed = {}, {}, []
    for nbytes in SIZES:
        t0 = time.time()
        rows[nbytes], infos[nbytes] = bench_size(torch, s, nbytes, args, failed)
        print(f"  {label(nbytes)} done in {time.time() - t0:.1f} s", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_waits.json"), "w") as f:
            json.dump({"rows": {str(k): v for k, v in rows.items()}, "info": {str(k): v for k, v in infos.items()},
                       "rounds": args.rounds, "failed": failed, "seconds": time.time() - t_start}, f, indent=1)
    summary(rows, infos, failed, args)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
