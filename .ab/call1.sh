#!/bin/bash
# Build hd 32-128 (bf16, every mask) once, the three switch variants from the cache, then the new and changed tests.
set -u
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader | head -1
export FLASH_ATTN_MASKS="none;causal;local" FLASH_ATTN_HEAD_DIMS="32;64;96;128" AB_WORK=/tmp/abw AB_ROUNDS=0
export AB_VARIANTS=". .ab/fused .ab/dk .ab/tall" AB_TEST_FIRST=1 AB_TESTS_S=${TESTS_S:-330}
export AB_TESTS="tests/test_hopper_backward.py tests/test_ptx_wrappers.py tests/test_hopper_forward.py::test_tall_rows tests/test_hopper_forward.py::test_tall_rows_varlen tests/test_sm90_fwd_plan.py tests/test_sm90_block_ranges.py"
timeout 590 tools/ab_bench.sh 2>&1 | tail -40
cp $AB_WORK/new/.ab_built $OUT/ 2>/dev/null
tar xzf $OUT/ab_files.tgz -O tests_new.log > /tmp/tests_new.log 2>/dev/null
grep -E "^(FAILED|ERROR)" /tmp/tests_new.log | head -40
tail -2 /tmp/tests_new.log
