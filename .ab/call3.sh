#!/bin/bash
# Descending order for fused dQ, the deterministic backward with fused dQ, and the hd 96 forward's tall rows.
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export FLASH_ATTN_MASKS="none;causal;local" FLASH_ATTN_HEAD_DIMS="32;64;96;128" AB_WORK=/tmp/abw AB_REUSE=1
export AB_ROUNDS=2 AB_CHECK_ROUNDS=0 AB_IMPL=flash_attn AB_PEER=sdpa_cudnn
(OUT=$OUT/b AB_VARIANTS=". .ab/fused .ab/desc" AB_DIRECTION=bwd AB_HEADDIMS=64,128 AB_SEQLENS=512,1024,2048 \
  AB_BENCH_ARGS="--deterministic" timeout 280 tools/ab_bench.sh 2>&1 | tail -30)
(OUT=$OUT/f AB_VARIANTS=". .ab/tall" AB_DIRECTION=fwd AB_HEADDIMS=96 AB_HIDDEN=6720 \
  AB_SEQLENS=2048,4096,8192,16384 AB_HEADS_K=0,14 timeout 280 tools/ab_bench.sh 2>&1 | tail -30)
