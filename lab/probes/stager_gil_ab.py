"""When should a small PinnedStager copy release the GIL? Three builds in one run, on the H200.
The hold-50us build is commit 1c6631b (reverted in the next commits): run x had it fail the GIL test on the H200 (12 of 20
1-ms sleeps within 50 ms, longest 297 ms, under a 500 ms switch interval): a release of a few
microseconds every 50 us is not taken by a thread waiting for the GIL, whose wake-up comes after
the copier took it back (lab/NOTEBOOK.md). Build its wheel from 1c6631b to run this.

  hold-50us   the copy holds the GIL unless this thread last released it 50 us ago or more,
              and only if no slot wait is needed (1c6631b)
  release     the copy always releases the GIL (c73d108: bench_gpu run v had the bound target
              at 4.82 us against run p's 3.69 before, and 4 threads on one stager at 85k
              calls/s with 79k GIL hand-overs/s against run p's 252k and 187)
  held        the copy always holds the GIL but for a slot wait (the seeded copy_gil_held
              build: the code before 26c584b; run p's graph beside a copying thread +167%)

Rows, per build, one child process per build per round, 5 rounds (AB_ROUNDS) alternating the order:
  1 thread   us per call, median of 7 batches of 20,000 calls (bench_gpu's shape: 256 of 4096
             int32 into a torch CUDA tensor, pad -1, depth 16), bound target and copy_
  4 threads  calls/s of 4 threads, each with its own bound target on one stager, 20,000 calls
  gap        the longest of 20 1-ms sleeps of another thread while one thread copies in a
             loop (the default 5 ms switch interval): what a graph-launching thread waits
A cost probe, not a bench: every call's values differ (the call's index in the first element);
after each batch the destinations are synchronized and the last call's values and pad checked.

    python3 lab/probes/stager_gil_ab.py NAME=SITE ...     (PYTHONPATH directories)
"""

import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, statistics, threading, time
import numpy as np, torch, pinstage
n, total, calls = 256, 4096, 20000
out, bad = {}, []
st = pinstage.PinnedStager(torch.int32, 256)
def check(dst, k, what):
    torch.cuda.synchronize()
    h = dst.cpu().numpy()
    if h[0] != k or h[n - 1] != n or (h[n:] != -1).any():
        bad.append(what)
dst = torch.full((total,), -9, dtype=torch.int32, device="cuda")
target = st.target(dst, pad_value=-1)
vals = np.arange(1, n + 1, dtype=np.int32)
for name, fn in (("1 thread, bound target", lambda: target.copy_(vals)),
                 ("1 thread, copy_", lambda: st.copy_(dst, vals, -1))):
    per = []
    for b in range(8):
        dst.fill_(-9); torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(calls):
            vals[0] = b * calls + i + 1
            fn()
        if b:
            per.append((time.perf_counter() - t) / calls * 1e6)
        check(dst, b * calls + calls, name)
    out[name] = statistics.median(per)
# 4 threads, one stager, each its own destination and values
dsts = [torch.full((total,), -9, dtype=torch.int32, device="cuda") for _ in range(4)]
tgts = [st.target(d, pad_value=-1) for d in dsts]
vs = [np.arange(1, n + 1, dtype=np.int32) for _ in range(4)]
torch.cuda.synchronize()
go = threading.Barrier(5)
def work(k):
    go.wait()
    for i in range(calls):
        vs[k][0] = i + 1
        tgts[k].copy_(vs[k])
ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
for t in ts: t.start()
go.wait(); t0 = time.perf_counter()
for t in ts: t.join()
out["4 threads, calls/s (k)"] = 4 * calls / (time.perf_counter() - t0) / 1e3
for k in range(4):
    check(dsts[k], calls, "4 threads")
# Controls (the same in every build): what four threads pay when each call releases the GIL,
# with no pinstage in the call. torch `copy_` releases the GIL on every call (its bindings drop
# it around the dispatch); `time.sleep(0)` is a bare release and re-acquire (a syscall between).
def four(fn_of):
    fns = [fn_of(k) for k in range(4)]
    go4 = threading.Barrier(5)
    def w(k):
        go4.wait()
        for i in range(calls):
            fns[k](i)
    th = [threading.Thread(target=w, args=(k,)) for k in range(4)]
    for x in th: x.start()
    go4.wait(); t1 = time.perf_counter()
    for x in th: x.join()
    return 4 * calls / (time.perf_counter() - t1) / 1e3
srcs = [torch.arange(1, n + 1, dtype=torch.int32).pin_memory() for _ in range(4)]
tdst = [torch.full((n,), -9, dtype=torch.int32, device="cuda") for _ in range(4)]
def torch_copy(k):
    def f(i):
        tdst[k].copy_(srcs[k], non_blocking=True)
    return f
torch.cuda.synchronize()
out["control: 4 threads torch copy_ 1 KiB pinned, calls/s (k)"] = four(torch_copy)
torch.cuda.synchronize()
for k in range(4):
    if not torch.equal(tdst[k].cpu(), srcs[k]):
        bad.append("torch control")
out["control: 4 threads time.sleep(0), calls/s (k)"] = four(lambda k: (lambda i: time.sleep(0)))
t = time.perf_counter()
for i in range(calls):
    time.sleep(0)
out["control: 1 thread time.sleep(0), us"] = (time.perf_counter() - t) / calls * 1e6
# a sleeper beside a copying loop
stop = threading.Event(); done = [0]
def loop():
    while not stop.is_set():
        done[0] += 1
        vals[0] = done[0]
        target.copy_(vals)
t = threading.Thread(target=loop); t.start()
while done[0] < 100: time.sleep(0.001)
gaps, last = [], time.perf_counter()
for _ in range(20):
    time.sleep(0.001); now = time.perf_counter(); gaps.append(now - last); last = now
stop.set(); t.join()
check(dst, done[0], "gap loop")
out["gap beside a copy loop, ms (longest of 20 1-ms sleeps)"] = max(gaps) * 1e3
out["bad"] = bad
print(json.dumps(out))
"""


def main():
    sites = dict(a.split("=", 1) for a in sys.argv[1:])
    res = {k: {} for k in sites}
    rounds = int(os.environ.get("AB_ROUNDS", "5"))
    for rnd in range(rounds):
        order = list(sites.items())
        if rnd % 2:
            order.reverse()
        for label, site in order:
            r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                               env=dict(os.environ, PYTHONPATH=site), timeout=150)
            if r.returncode:
                print(label, "failed:", r.stderr[-2000:])
                sys.exit(1)
            d = json.loads(r.stdout.strip().splitlines()[-1])
            if d.pop("bad"):
                print(label, "round", rnd, "WRONG VALUES")
                sys.exit(1)
            for k, v in d.items():
                res[label].setdefault(k, []).append(v)
            print(f"round {rnd} {label}: " + ", ".join(f"{k} {v:.2f}" for k, v in d.items()),
                  flush=True)
    print(f"\nmedian of {rounds} rounds (min-max); every batch's last call checked, all passed")
    rows = list(next(iter(res.values())))
    for k in rows:
        print(f"  {k}")
        for label in sites:
            v = res[label][k]
            print(f"    {label:12s} {statistics.median(v):8.2f} ({min(v):.2f}-{max(v):.2f})")


main()
