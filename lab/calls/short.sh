#!/usr/bin/env bash
# One short device call for the block mover: the block tests, both directions at once in the
# background under every staging mode (bench_blocks --pair-modes at PAIR_SIZES KiB, default
# 16,32), then either the copy-engine and host-memory controls of a staged pair (engines_pair,
# host_pair) or, with FULL=1, the full bench_blocks.py; run from the repo root on the device with
# .gpu-pack.tar.xz carried. Everything lands in $OUT/all.tar.xz; tails to stdout.
# BUDGET (s, default 500): a step starts only while it fits.
set -u
tar -xJf .gpu-pack.tar.xz
export PINSTAGE_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G"
S=$SECONDS; BUDGET=${BUDGET:-500}
R() { echo "=== $1 at $((SECONDS-S))s"; }
left() { echo $((BUDGET-(SECONDS-S))); }
fits() { [ "$(left)" -gt "$1" ]; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/wheels/*.whl
R tests
timeout 60 .gpu/bin/test-gpu_blocks --include-ignored --test-threads=4 > $OUT/rust.txt 2>&1; echo rc=$?; tail -3 $OUT/rust.txt
R pairs
PYTHONPATH=/tmp/site timeout 240 python3 benches/bench_blocks.py --only-background --sizes ${PAIR_SIZES:-16,32} --rounds 3 --pair-modes > $OUT/pairs.txt 2>&1; echo rc=$?; grep -A40 "^== summary" $OUT/pairs.txt | grep -E "both-bg|checks" || tail -20 $OUT/pairs.txt
if [ "${FULL:-0}" = 1 ]; then
  if fits 120; then R full
    PYTHONPATH=/tmp/site timeout $(($(left)-10)) python3 benches/bench_blocks.py --out $OUT > $OUT/full.txt 2>&1; echo rc=$?; tail -45 $OUT/full.txt; fi
else
  if fits 150; then R engines
    PINSTAGE_C_ARGS_engines_pair="16 64" PINSTAGE_DEADLINE=140 OUT=$OUT/r timeout 140 bash scripts/gpu-run c-engines_pair > $OUT/engines.txt 2>&1
    grep -v "^binary" $OUT/engines.txt | tail -18; fi
  if fits 100; then R host_pair
    PINSTAGE_C_ARGS_host_pair="16 64" PINSTAGE_DEADLINE=$(($(left)-15)) OUT=$OUT/r timeout $(($(left)-10)) bash scripts/gpu-run c-host_pair > $OUT/host_pair.txt 2>&1
    grep -v "^binary" $OUT/host_pair.txt | tail -24; fi
fi
R end
cd $OUT && tar -cJf /tmp/all.tar.xz . && mv /tmp/all.tar.xz $OUT/ && ls
