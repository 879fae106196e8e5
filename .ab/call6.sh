#!/bin/bash
# Call 6 (issue 20): a third ordered-dQ writer (.ab/w3) against the tree, hd 64 bf16, deterministic backward.
cd "$(dirname "$0")/.."
export AB_WORK=$PWD/build/abw6
FLASH_ATTN_HEAD_DIMS="64" FLASH_ATTN_DTYPES=bf16 FLASH_ATTN_DIRECTIONS="fwd;bwd" AB_VARIANTS=". .ab/w3" AB_ROUNDS=0 \
  AB_TESTS="tests/test_determinism.py" AB_TESTS_S=120 timeout 330 tools/ab_bench.sh 2>&1 | grep -v "^dir |" | tail -8
FLASH_ATTN_HEAD_DIMS="64" FLASH_ATTN_DTYPES=bf16 FLASH_ATTN_DIRECTIONS="fwd;bwd" AB_VARIANTS=". .ab/w3" AB_REUSE=1 \
  AB_IMPL=flash_attn AB_PEER=sdpa_cudnn AB_BENCH_ARGS=--deterministic AB_DIRECTION=bwd AB_HEADDIMS=64 \
  AB_SEQLENS=2048,16384 AB_ROUNDS=2 REP_MS=20 timeout 200 tools/ab_bench.sh 2>&1 | tail -8
