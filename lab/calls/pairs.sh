#!/usr/bin/env bash
# One device call after a change to the pair rule: the block tests, both directions at once in
# the background under every staging mode at 4-64 KiB (bench_blocks --pair-modes), then the full
# bench_blocks.py while it fits; run from the repo root on the device with .gpu-pack.tar.xz
# carried. Everything lands in $OUT/all.tar.xz; tails to stdout. BUDGET (s, default 500).
set -u
tar -xJf .gpu-pack.tar.xz
export PINSTAGE_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$G"
S=$SECONDS; BUDGET=${BUDGET:-500}
R() { echo "=== $1 at $((SECONDS-S))s"; }
left() { echo $((BUDGET-(SECONDS-S))); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/wheels/*.whl
R tests
timeout 60 .gpu/bin/test-gpu_blocks --include-ignored --test-threads=4 > $OUT/rust.txt 2>&1; echo rc=$?; tail -3 $OUT/rust.txt
R pairs
PYTHONPATH=/tmp/site timeout 240 python3 benches/bench_blocks.py --only-background --sizes ${PAIR_SIZES:-4,8,16,32,64} --rounds 3 --pair-modes > $OUT/pairs.txt 2>&1; echo rc=$?; grep -A40 "^== summary" $OUT/pairs.txt | grep -E "both-bg|checks" || tail -20 $OUT/pairs.txt
if [ "$(left)" -gt 120 ]; then R full
  PYTHONPATH=/tmp/site timeout $(($(left)-10)) python3 benches/bench_blocks.py --out $OUT > $OUT/full.txt 2>&1; echo rc=$?; tail -45 $OUT/full.txt; fi
R end
cd $OUT && tar -cJf /tmp/all.tar.xz . && mv /tmp/all.tar.xz $OUT/ && ls
