"""What does releasing the GIL around a small PinnedStager copy cost on the H200's host? (run 3
of 2026-12-03, sixth session: bench_gpu's bound target 4.82 us, copy_ 5.60, against run p's 3.69 /
4.38 before copy_ released the GIL; run-to-run noise of that row is ~0.7 us, so only an A/B in one
run can say.)

A: the wheel as built (the copy runs with the GIL released). B: the seeded `copy_gil_held` wheel
(the copy as before 26c584b: the GIL held but for a busy slot's wait). Each round runs one child
process per wheel, alternating, 5 rounds; a child times 7 batches of 20,000 calls per row
(bench_gpu's shape: 256 of 4096 int32 into a torch CUDA tensor, pad -1, depth 16) and reports the
median batch's us per call (a cost probe, not a bench: every call's values differ, the call's
index in the first element, and after each batch the destination is synchronized and the last
call's first element, value tail and pad checked). Printed: the median of the round medians (min-max) per wheel and row, B - A.

    python3 lab/probes/stager_gil_ab.py SITE_A SITE_B     (PYTHONPATH directories)
"""

import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, statistics, time
import numpy as np, torch, pinstage
n, total, calls = 256, 4096, 20000
dst = torch.full((total,), -9, dtype=torch.int32, device="cuda")
st = pinstage.PinnedStager(torch.int32, 256)
target = st.target(dst, pad_value=-1)
vals = np.arange(1, n + 1, dtype=np.int32)
out, bad = {}, 0
def check(k):
    global bad
    torch.cuda.synchronize()
    h = dst.cpu().numpy()
    if h[0] != k or h[n - 1] != n or (h[n:] != -1).any():
        bad += 1
rows = {
    "bound target": lambda: target.copy_(vals),
    "copy_(dst, v, pad)": lambda: st.copy_(dst, vals, -1),
    "copy_(numpy dst)": None,
}
host = np.zeros(total, np.int32)
for name, fn in rows.items():
    per = []
    for b in range(8):
        dst.fill_(-9); host.fill(-9); torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(calls):
            vals[0] = b * calls + i + 1
            if fn is None:
                st.copy_(host, vals, -1)
            else:
                fn()
        dt = (time.perf_counter() - t) / calls * 1e6
        if b:
            per.append(dt)
        k = b * calls + calls
        if fn is None:
            if host[0] != k or host[n - 1] != n or (host[n:] != -1).any():
                bad += 1
        else:
            check(k)
    out[name] = statistics.median(per)
out["bad"] = bad
print(json.dumps(out))
"""


def main():
    sites = {"A (GIL released)": sys.argv[1], "B (GIL held, seeded copy_gil_held)": sys.argv[2]}
    res = {k: {} for k in sites}
    for rnd in range(5):
        for label, site in (sites.items() if rnd % 2 == 0 else reversed(sites.items())):
            r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                               env=dict(os.environ, PYTHONPATH=site), timeout=120)
            if r.returncode:
                print(label, "failed:", r.stderr[-2000:])
                sys.exit(1)
            d = json.loads(r.stdout.strip().splitlines()[-1])
            if d.pop("bad"):
                print(label, "round", rnd, "WRONG VALUES")
                sys.exit(1)
            for k, v in d.items():
                res[label].setdefault(k, []).append(v)
            print(f"round {rnd} {label}: " + ", ".join(f"{k} {v:.2f}" for k, v in d.items()), flush=True)
    print("\nhost us per call, median of 5 round medians (min-max); every batch checked")
    a, b = list(sites)
    for k in res[a]:
        ma, mb = statistics.median(res[a][k]), statistics.median(res[b][k])
        print(f"  {k:22s} A {ma:5.2f} ({min(res[a][k]):.2f}-{max(res[a][k]):.2f})   "
              f"B {mb:5.2f} ({min(res[b][k]):.2f}-{max(res[b][k]):.2f})   A - B {ma - mb:+.2f}")


main()
