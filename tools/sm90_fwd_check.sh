#!/usr/bin/env bash
# The Hopper forward's first look on the H200 without building the extension: builds tools/sm90_fwd_check.cu once per
# head dim in parallel, checks every head dim x mask x schedule on odd sizes (GQA, seqlen_q != seqlen_k both ways,
# head dims below their bucket, fp16), then times the standard table (BENCHMARKS.md shapes) per schedule and the
# other tiles at 16k. Each run has its own time limit, so a hang shows as TIMEOUT and the rest still runs.
# Usage: OUT=dir tools/sm90_fwd_check.sh [schedules]   (CHECK_SPEED=0 skips the standard table, CHECK_TILES=1 adds the
# persistent form and the other tiles: about 3 more minutes; CHECK_CORRECT=0 skips the odd-size checks, leaving the
# checks the 512 and 2k timing runs make on their own outputs)
set -uo pipefail
OUT="${OUT:-/tmp/sm90_fwd_check}"; mkdir -p "$OUT"
SCHEDULES="${1:-serial overlap pingpong}"
for hd in 64 128 192 256; do
  nvcc -O3 -std=c++20 --use_fast_math --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Icsrc \
    -Icsrc/include -DFLASH_WITH_CUDA -DFLASH_CHECK_HEAD_DIM=$hd tools/sm90_fwd_check.cu \
    csrc/dispatch/device_attributes.cpp csrc/dispatch/loaded_code_arch.cu -o "$OUT/check_hd$hd" \
    > "$OUT/build_hd$hd.log" 2>&1 &
done
wait
for hd in 64 128 192 256; do [ -x "$OUT/check_hd$hd" ] || { tail -20 "$OUT/build_hd$hd.log"; exit 1; }; done
bucket() { if [ "$1" -le 64 ]; then echo 64; elif [ "$1" -le 128 ]; then echo 128; elif [ "$1" -le 192 ]; then echo 192; else echo 256; fi; }
run() { timeout 20 "$OUT/check_hd$(bucket "$1")" "$@" || echo "FAILED or TIMEOUT (rc $?): $*"; }
[ "${CHECK_CORRECT:-1}" = 1 ] && for schedule in $SCHEDULES; do
  for hd in 64 104 128 192 232 256; do
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
# The persistent form (several tiles per CTA: many heads, small batch) with the overlapped schedules.
[ "${CHECK_CORRECT:-1}" = 1 ] && for schedule in overlap pingpong; do
  for hd in 64 128 192 256; do
    for mask in none causal; do
      run "$hd" "$mask" 3 40 8 300 517 2 bf16 "$schedule" 0 0 1
      run "$hd" "$mask" 2 40 40 517 300 2 bf16 "$schedule" 0 0 1
    done
  done
done >> "$OUT/correctness.log" 2>&1
[ "${CHECK_SPEED:-1}" = 1 ] && for schedule in $SCHEDULES; do
  for hd in 64 128 256; do
    for s in 512 2048 8192 16384; do
      for mask in none causal; do run "$hd" "$mask" $((16384 / s)) $((2048 / hd)) $((2048 / hd)) "$s" "$s" 20 bf16 \
        "$schedule"; done
    done
  done
done > "$OUT/speed.log" 2>&1
# The FMA-pipe exponentials against MUFU alone at hd 64 and 128, then the persistent form against one tile per CTA
# where it should matter most (512 and 2k), then the other tiles
# (tools/sm90_fwd_check.cu add_head_dim) at 16k and 2k, overlapped schedules.
[ "${CHECK_TILES:-0}" = 1 ] && for hd in 64 128; do
  for s in 2048 16384; do
    for mask in none causal; do
      for poly in 4 2; do run "$hd" "$mask" $((16384 / s)) $((2048 / hd)) $((2048 / hd)) "$s" "$s" 20 bf16 pingpong \
        0 0 0 "$poly"; done
    done
  done
done > "$OUT/tiles.log" 2>&1
[ "${CHECK_TILES:-0}" = 1 ] && for schedule in overlap pingpong; do
  for hd in 64 128 256; do
    for s in 512 2048; do
      for mask in none causal; do run "$hd" "$mask" $((16384 / s)) $((2048 / hd)) $((2048 / hd)) "$s" "$s" 20 bf16 \
        "$schedule" 0 0 1; done
    done
  done
done >> "$OUT/tiles.log" 2>&1
[ "${CHECK_TILES:-0}" = 1 ] && for schedule in overlap pingpong; do
  for tile in "64 192 2" "64 128 4" "128 176 2" "128 128 3" "192 96 2" "192 64 3" "256 64 2" "256 48 3"; do
    set -- $tile
    for s in 2048 16384; do
      for mask in none causal; do run "$1" "$mask" $((16384 / s)) $((2048 / $1)) $((2048 / $1)) "$s" "$s" 20 bf16 \
        "$schedule" "$2" "$3"; done
    done
  done
done >> "$OUT/tiles.log" 2>&1
grep -c "nonfinite 0" "$OUT/correctness.log" | sed 's/^/correct runs: /'
grep -E "FAILED|nonfinite [1-9]" "$OUT/correctness.log" | head -20
cat "$OUT/speed.log" "$OUT/tiles.log" 2>/dev/null | sed -E 's/ max\|dO\|.*\| / /'
