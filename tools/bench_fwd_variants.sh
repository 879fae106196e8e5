#!/usr/bin/env bash
# One GPU call for the forward v4 experiment (docs/perf_log.md): in-place build of the default tile table, the
# CUDA forward tests, the forward and decode benchmarks, then rebuilds with each alternative of the tile table
# (csrc/sm80/fwd_tile_config.h: kWideTile for head dims > 128, kStagesUpTo128 for <= 128, kWideMinKeys) and
# benchmarks the shapes each one affects. Edits fwd_tile_config.h in place: run it on a staged copy, never on a checkout.
# Usage: OUT=dir tools/bench_fwd_variants.sh
set -uo pipefail
OUT="${OUT:-/tmp/fwd_variants}"; mkdir -p "$OUT"
export MAX_JOBS="${MAX_JOBS:-16}" FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS:-90}" FLASH_ATTN_DTYPES=bf16,fp16 FLASH_ATTN_DIRECTIONS=fwd
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
TILES=csrc/sm80/fwd_tile_config.h
REP_MS="${REP_MS:-40}"

build() {  # $1: log name
  local start=$(date +%s)
  # Everything that reads the tile table recompiles (ninja may not track the header through nvcc).
  for f in csrc/kernels/generated/fwd_*.cu csrc/dispatch/fwd_plan.cpp csrc/api/fwd_cuda_plan.cpp; do
    [ -e "$f" ] && touch "$f"
  done
  if ! python3 setup.py build_ext --inplace > "$OUT/$1.log" 2>&1; then
    grep -E "error" "$OUT/$1.log" | head -20; echo "BUILD $1 FAILED"; exit 1
  fi
  echo "build $1: $(( $(date +%s) - start ))s"
}
bench() {  # $1: head dims, $2: seqlens
  python3 benchmarks/bench_attention.py --impls flash_attn,sdpa_flash --direction fwd --headdim "$1" \
    --seqlen "$2" --causal both --rep-ms "$REP_MS" 2>&1 | grep -E "^ *(bf16|fp16)"
}

build default
timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_cuda_forward.py tests/test_forward.py \
  tests/test_cuda_probs.py > "$OUT/tests.log" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30; tail -2 "$OUT/tests.log"
echo "== default (kWideTile k128x64Warps8Ring, kStagesUpTo128 2)"
bench 64,128,256 512,2048,8192
python3 benchmarks/bench_attention.py --decode --impls flash_attn,sdpa_flash --rep-ms "$REP_MS" 2>&1 |
  grep -E "^ *(bf16|fp16)"

sed -i 's/^constexpr WideTile kWideTile = .*/constexpr WideTile kWideTile = WideTile::k128x64Warps8;/' "$TILES"
build wide_one_stage
echo "== kWideTile k128x64Warps8 (one stage)"
bench 256 2048,8192

sed -i 's/^constexpr WideTile kWideTile = .*/constexpr WideTile kWideTile = WideTile::k64x64Warps4;/' "$TILES"
sed -i 's/^constexpr int kStagesUpTo128 = .*/constexpr int kStagesUpTo128 = 1;/' "$TILES"
build v3_tiles
echo "== kWideTile k64x64Warps4, kStagesUpTo128 1 (the v3 tiles and pipeline)"
bench 64,128,256 512,2048,8192

sed -i 's/^constexpr WideTile kWideTile = .*/constexpr WideTile kWideTile = WideTile::k128x64Warps8Ring;/' "$TILES"
sed -i 's/^constexpr int kStagesUpTo128 = .*/constexpr int kStagesUpTo128 = 2;/' "$TILES"
sed -i 's/^constexpr long long kWideMinKeys = .*/constexpr long long kWideMinKeys = 0;/' "$TILES"
build wide_at_512
echo "== default, kWideMinKeys 0 (the wide ring tile at 512 keys too)"
bench 256 512
