#!/bin/bash
# The TMA-map failures of call 1: the same tests in this tree and in main's csrc (7a5ff43), then a repeat loop.
set -u
ROOT=$PWD
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export FLASH_ATTN_MASKS="none;causal;local" FLASH_ATTN_HEAD_DIMS="32;64;96;128" AB_WORK=/tmp/abw AB_ROUNDS=0
export AB_VARIANTS=". .ab/base" AB_TEST_FIRST=0 AB_TESTS_S=100
export AB_TESTS="tests/test_hopper_backward.py::test_seqlens tests/test_hopper_backward.py::test_head_dims tests/test_hopper_backward.py::test_gqa"
timeout 400 tools/ab_bench.sh 2>&1 | grep -E "build|tests |objects" | cut -c1-300
for v in new base; do (cd $AB_WORK/$v && PYTHONPATH=$PWD timeout 60 python3 $ROOT/.ab/diag.py 3 2>&1 | tail -8) ; done
