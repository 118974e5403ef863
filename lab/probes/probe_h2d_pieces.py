"""Probe: what the copy engine loses when one host-to-device copy from pinned memory is cut
into pieces, as the pageable path's bounce slots cut it. torch only (no pinstage): 64 MiB and
256 MiB from pinned memory as one copy, as pieces of 4 MiB / 1 MiB back to back, with an event
recorded after every piece (the bounce slots' events), from 12 separate pinned 4 MiB buffers in
turn (the slots themselves), and alternating between two streams. Each timed call starts with
the GPU idle and ends synchronised; the destination is poisoned first and checked after; median
of `REPS`.

Usage: python3 lab/probes/probe_h2d_pieces.py
"""

import pathlib
import sys

import statistics

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benches"))
import h2d_timing  # noqa: E402  (benches/h2d_timing.py)

REPS = 9


def timed(fn, dst, ref):
    fn()
    fn()
    return statistics.median(h2d_timing.timed_into(torch, fn, dst, ref, REPS))


s0 = torch.cuda.current_stream()
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
for nb in (64 << 20, 256 << 20):
    n = nb // 4
    src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32).pin_memory()
    ref = src.cuda()
    dst = torch.empty_like(ref)
    base = timed(lambda: dst.copy_(src, non_blocking=True), dst, ref)
    print(f"== {nb >> 20} MiB from pinned memory: one copy {base * 1e6:.0f} us ({nb / base / 1e9:.2f} GB/s)", flush=True)
    for piece in (4 << 20, 1 << 20):
        k = piece // 4
        parts = [(i, min(i + k, n)) for i in range(0, n, k)]
        events = [torch.cuda.Event() for _ in parts]
        slots = [torch.empty(k, dtype=torch.int32).pin_memory() for _ in range(12)]

        def plain():
            for a, b in parts:
                dst[a:b].copy_(src[a:b], non_blocking=True)

        def with_events():
            for (a, b), ev in zip(parts, events):
                dst[a:b].copy_(src[a:b], non_blocking=True)
                ev.record()

        def from_slots():
            # The slots were filled once, outside the timing (only the copy engine's side is
            # measured); slot j % 12 serves piece j once that slot's last copy completed.
            for j, ((a, b), ev) in enumerate(zip(parts, events)):
                if j >= 12:
                    events[j - 12].synchronize()
                dst[a:b].copy_(slots[j % 12][: b - a], non_blocking=True)
                ev.record()

        def two_streams():
            ev0 = torch.cuda.Event()
            ev0.record(s0)
            s1.wait_event(ev0)
            s2.wait_event(ev0)
            for j, (a, b) in enumerate(parts):
                s = s1 if j % 2 == 0 else s2
                with torch.cuda.stream(s):
                    dst[a:b].copy_(src[a:b], non_blocking=True)
                    events[j].record(s)
            s0.wait_stream(s1)
            s0.wait_stream(s2)

        row = []
        for name, fn in (("back to back", plain), ("an event after each", with_events), ("two streams, events", two_streams)):
            t = timed(fn, dst, ref)
            row.append(f"{name} {t * 1e6:.0f} us ({base / t:.3f})")
        # From the slots (random values; piece j lands slot j % 12's, so the reference is
        # made of the slots' values in that order).
        for sl in slots:
            sl.copy_(torch.randint(-(2**31), 2**31 - 1, (k,), dtype=torch.int32))
        ref_slots = torch.cat([slots[j % 12][: b - a] for j, (a, b) in enumerate(parts)]).cuda()
        t = timed(from_slots, dst, ref_slots)
        row.append(f"from 12 pinned slots in turn, events {t * 1e6:.0f} us ({base / t:.3f})")
        del ref_slots
        print(f"  {piece >> 20} MiB pieces ({len(parts)}): " + "; ".join(row), flush=True)
    del src
