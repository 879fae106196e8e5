#!/bin/bash
# A/B of the backward switches on call 1's builds: main / fused dQ / fused dQ + D in the kernel, cuDNN beside.
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export FLASH_ATTN_MASKS="none;causal;local" FLASH_ATTN_HEAD_DIMS="32;64;96;128" AB_WORK=/tmp/abw AB_REUSE=1
export AB_ROUNDS=2 AB_CHECK_ROUNDS=0 AB_VARIANTS=". .ab/fused .ab/dk" AB_DIRECTION=bwd AB_IMPL=flash_attn
export AB_PEER=sdpa_cudnn AB_HEADDIMS=64,128 AB_SEQLENS=${SEQLENS:-512,1024,2048,4096,16384} AB_HEADS_K=${HEADS_K:-0,4}
export AB_ARG_SETS="${ARG_SETS:---doc-len 512}"
timeout 585 tools/ab_bench.sh 2>&1 | tail -90
