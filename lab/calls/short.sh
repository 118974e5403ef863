#!/usr/bin/env bash
# One short device call for the block mover and the floor: the copy-engine and host-memory
# controls of a staged pair (engines_pair, host_pair), the block tests, the graph check; run from
# the repo root on the device with .gpu-pack.tar.xz carried. Everything lands in $OUT/all.tar.xz; the tails go to stdout.
# BUDGET (s, default 440) bounds the optional parts at the end.
set -u
tar -xJf .gpu-pack.tar.xz
export PINSTAGE_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G"; git log -1 --format=%h 2>/dev/null
S=$SECONDS; BUDGET=${BUDGET:-440}
R() { echo "=== $1 at $((SECONDS-S))s"; }
left() { echo $((BUDGET-(SECONDS-S))); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/wheels/*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-nt .gpu/variants/load_nt/*.whl 2>/dev/null
R engines
PINSTAGE_C_ARGS_engines_pair="16 64" PINSTAGE_DEADLINE=150 OUT=$OUT/r timeout 150 bash scripts/gpu-run c-engines_pair > $OUT/engines.txt 2>&1
grep -v "^binary" $OUT/engines.txt | tail -30
R host_pair
PINSTAGE_C_ARGS_host_pair="16 64" PINSTAGE_DEADLINE=120 OUT=$OUT/r timeout 120 bash scripts/gpu-run c-host_pair > $OUT/host_pair.txt 2>&1
grep -v "^binary" $OUT/host_pair.txt | tail -24
R tests
timeout 50 .gpu/bin/test-gpu_blocks --include-ignored --test-threads=4 > $OUT/rust.txt 2>&1; echo rc=$?; tail -3 $OUT/rust.txt
R graph
PYTHONPATH=/tmp/site timeout 90 python3 benches/bench_blocks.py --only-graph --rounds 8 --graph-kib 32 > $OUT/graph.txt 2>&1; echo rc=$?; tail -22 $OUT/graph.txt
if [[ $G == *H200* ]] && [ "$(left)" -gt 90 ]; then
  R trace
  TUNINGS=0,1 COLD=1 SIZES_MIB=64 OUT=$OUT/r timeout 80 bash scripts/gpu-run probe-probe_h2d_trace > $OUT/trace.txt 2>&1; tail -30 $OUT/trace.txt
fi
if [[ $G == *H100* ]] && [ "$(left)" -gt 100 ]; then
  R load_nt
  for k in 1 2; do for v in site site-nt; do
    [ "$(left)" -gt 40 ] || break 2
    echo "--- $v round $k"
    PYTHONPATH=/tmp/$v timeout 45 python3 benches/bench_blocks.py --only-background --sizes 16,64 --staging always --rounds 3 > $OUT/nt-$v-$k.txt 2>&1; echo rc=$?; tail -12 $OUT/nt-$v-$k.txt
  done; done
fi
R end
cd $OUT && tar -cJf /tmp/all.tar.xz . && mv /tmp/all.tar.xz $OUT/ && ls
