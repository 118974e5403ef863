"""A copy and its wait, side by side with torch's best idiom, in one run.

Host microseconds from issuing one copy to the return of its wait (the copy alone on its
stream, the destination poisoned before every copy outside the timing, every copy's result
checked after it outside the timing): pinstage `copy_h2d(dst, pinned).wait()`,
`copy_d2h_async(x, pinned).wait()` and `copy_d2h(x, pinned)` against torch `dst.copy_(src,
non_blocking=True)` + `stream.synchronize()`, both directions, from and into pinned memory. Each
figure is the median over `--runs` runs of the median call of the run; min and max over runs
beside it; the ratio pinstage - torch in microseconds (the goal: at most +2 µs).

    python3 benches/bench_waits.py [--runs 5] [--calls 200] [--out DIR]
"""

import argparse
import json
import os
import statistics
import time

import numpy as np

import pinstage

SIZES = [64 << 10, 1 << 20, 16 << 20]
POISON = -0x5A5A5A5B


def per_call(prepare, op, check, calls):
    """Median host µs of `op(k)` over `calls` calls; `prepare(k)` before and `check(k)` after
    each call, outside the timing."""
    ts = []
    for k in range(calls):
        prepare(k)
        t0 = time.perf_counter_ns()
        op(k)
        ts.append(time.perf_counter_ns() - t0)
        check(k)
    return statistics.median(ts) / 1e3


def implementations(torch, s, nbytes, failed):
    """{name: (prepare, op, check)} for one size. Call k copies `base + k` (distinct per call,
    never the poison); the destination is poisoned in `prepare`, every result checked."""
    n = nbytes // 4
    base = np.arange(n, dtype=np.int32)
    host = pinstage.empty_pinned(n, np.int32)
    host_t = torch.from_numpy(host)
    dev = torch.empty(n, dtype=torch.int32, device="cuda")
    src = torch.empty(n, dtype=torch.int32, device="cuda")
    ramp = torch.from_numpy(base).cuda()

    def h2d_prepare(k):
        host[:] = base + k
        dev.fill_(POISON)
        torch.cuda.synchronize()

    def d2h_prepare(k):
        torch.add(ramp, k, out=src)
        host.fill(POISON)
        torch.cuda.synchronize()

    def check(label, got_of):
        def c(k):
            got = got_of()
            if not np.array_equal(got, base + k):
                failed.append(f"{label} {nbytes >> 10} KiB: call {k}")
        return c

    def torch_h2d(k):
        dev.copy_(host_t, non_blocking=True)
        s.synchronize()

    def torch_d2h(k):
        host_t.copy_(src, non_blocking=True)
        s.synchronize()

    def on(stream, fn):
        def op(k):
            with torch.cuda.stream(stream):
                fn(k)
        return op

    dev_got = lambda: dev.cpu().numpy()  # noqa: E731
    return {
        "h2d torch copy_ + synchronize": (h2d_prepare, on(s, torch_h2d), check("h2d torch", dev_got)),
        "h2d pinstage copy_h2d().wait()": (
            h2d_prepare, lambda k: pinstage.copy_h2d(dev, host, stream=s).wait(), check("h2d pinstage", dev_got)),
        "d2h torch copy_ + synchronize": (d2h_prepare, on(s, torch_d2h), check("d2h torch", lambda: host)),
        "d2h pinstage copy_d2h_async().wait()": (
            d2h_prepare, lambda k: pinstage.copy_d2h_async(src, host, stream=s).wait(),
            check("d2h pinstage async", lambda: host)),
        "d2h pinstage copy_d2h()": (
            d2h_prepare, lambda k: pinstage.copy_d2h(src, host, stream=s), check("d2h pinstage", lambda: host)),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    s = torch.cuda.Stream()
    rows, failed = {}, []
    for nbytes in SIZES:
        calls = args.calls if nbytes < (16 << 20) else max(20, args.calls // 4)
        impls = implementations(torch, s, nbytes, failed)
        for prepare, op, check in impls.values():  # warm-up
            per_call(prepare, op, check, 10)
        res = {name: [] for name in impls}
        for _ in range(args.runs):
            for name, (prepare, op, check) in impls.items():  # interleaved: drift hits all alike
                res[name].append(per_call(prepare, op, check, calls))
        rows[nbytes] = {name: (statistics.median(v), min(v), max(v)) for name, v in res.items()}
    head = "copy + wait, host µs: median of run medians (min-max)"
    print(f"\n{head:44s}" + "".join(f"{b >> 10:>20d} KiB" for b in SIZES))
    for name in rows[SIZES[0]]:
        print(f"{name:44s}" + "".join(
            f"{rows[b][name][0]:>11.1f} ({rows[b][name][1]:.1f}-{rows[b][name][2]:.1f})" for b in SIZES))
    for d, ours in (("h2d", ["h2d pinstage copy_h2d().wait()"]),
                    ("d2h", ["d2h pinstage copy_d2h_async().wait()", "d2h pinstage copy_d2h()"])):
        for o in ours:
            diffs = [rows[b][o][0] - rows[b][f"{d} torch copy_ + synchronize"][0] for b in SIZES]
            verdict = "met" if all(x <= 2.0 for x in diffs) else "NOT met"
            print(f"{o[4:] + ' - torch (<= +2)':44s}" + "".join(f"{x:>+21.1f} " for x in diffs) + f"  {verdict}")
    print(f"checked: every call of every implementation, {args.runs} runs; {len(failed)} failed"
          + (f": {failed[:5]}" if failed else ""))
    if args.out:
        with open(os.path.join(args.out, "bench_waits.json"), "w") as f:
            json.dump({"rows": {str(k): v for k, v in rows.items()}, "failed": failed}, f, indent=1)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
