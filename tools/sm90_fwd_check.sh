#!/usr/bin/env bash
# The Hopper forward's first look on the H200 without building the extension: builds tools/sm90_fwd_check.cu, checks
# every head dim x mask x schedule on odd sizes (GQA, seqlen_q != seqlen_k both ways, head dims below their bucket,
# fp16), then times the standard table (BENCHMARKS.md shapes) per schedule. Each run has its own time limit, so a
# hang shows as TIMEOUT and the rest still runs. Usage: OUT=dir tools/sm90_fwd_check.sh [schedules]
set -uo pipefail
OUT="${OUT:-/tmp/sm90_fwd_check}"; mkdir -p "$OUT"
SCHEDULES="${1:-serial overlap pingpong}"
BIN="$OUT/sm90_fwd_check"
nvcc -O3 -std=c++20 --use_fast_math --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Icsrc \
  -Icsrc/include tools/sm90_fwd_check.cu -o "$BIN" > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
run() { timeout 20 "$BIN" "$@" || echo "FAILED or TIMEOUT (rc $?): $*"; }
for schedule in $SCHEDULES; do
  for hd in 64 100 128 192 232 256; do
    for mask in none causal local; do
      run "$hd" "$mask" 2 3 3 300 517 2 bf16 "$schedule"
      run "$hd" "$mask" 2 3 3 517 300 2 bf16 "$schedule"
    done
  done
  run 128 none 2 8 2 333 333 2 bf16 "$schedule"
  run 128 causal 1 4 1 129 127 2 bf16 "$schedule"
  run 128 none 2 3 3 300 517 2 fp16 "$schedule"
  run 128 causal 2 3 3 1 1 2 bf16 "$schedule"
done > "$OUT/correctness.log" 2>&1
for schedule in $SCHEDULES; do
  for hd in 64 128 256; do
    for s in 512 2048 8192 16384; do
      for mask in none causal; do run "$hd" "$mask" $((16384 / s)) $((2048 / hd)) $((2048 / hd)) "$s" "$s" 20 bf16 \
        "$schedule"; done
    done
  done | sed "s/^/$schedule /"
done > "$OUT/speed.log" 2>&1
grep -c "nonfinite 0" "$OUT/correctness.log" | sed 's/^/correct runs: /'
grep -E "FAILED|nonfinite [1-9]" "$OUT/correctness.log" | head -20
cat "$OUT/speed.log"
