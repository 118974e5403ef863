#!/usr/bin/env bash
# A/B of the reaper's scheduling class on the freed-pinned-memory stall test (tests/gpu_stall.rs,
# `gpu_freed_pinned_memory_never_stalls_a_call`, which fails when a call made while pinned
# garbage is handed to the reaper takes >= 1 ms): the whole gpu_stall binary (its other tests run
# before it, as in scripts/gpu-run), interleaved: the normal build (the reaper in SCHED_BATCH; run o of 2026-12-05 ran SCHED_IDLE)
# and the lab variant `reaper_normal` (the reaper at the normal priority), ROUNDS rounds each.
# Needs `PINSTAGE_VARIANTS=reaper_normal scripts/gpu-build`. Prints each run's "the call:" line
# (the call's time, the test thread's context switches and CPU) and the counts of failures.
set -u
rounds=${1:-8}
a=.gpu/bin/test-gpu_stall b=.gpu/variants/reaper_normal/test-gpu_stall
[ -x "$a" ] && [ -x "$b" ] || { echo "missing $a or $b"; exit 2; }
declare -A failed=([class]=0 [normal]=0)
for r in $(seq "$rounds"); do
  for v in class normal; do
    bin=$a; [ $v = normal ] && bin=$b
    out=$("$bin" --include-ignored --test-threads=1 --nocapture 2>&1)
    rc=$?
    [ $rc -eq 0 ] || failed[$v]=$((failed[$v] + 1))
    echo "round $r $v rc=$rc: $(echo "$out" | grep -o 'the call: .*' | head -1)"
    echo "$out" | grep -E "^test .*FAILED|panicked" | head -3
  done
done
echo "failed runs of $rounds: reaper in its class ${failed[class]}, reaper at the normal priority ${failed[normal]}"
