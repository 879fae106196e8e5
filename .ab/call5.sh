#!/bin/bash
# Call 5: the tree (key-warps tile for unsplit calls of 67-132 CTAs) at hd 64/128/192 + nokw at hd 128: tests, racecheck, kvcache A/B.
cd "$(dirname "$0")/.."
export AB_WORK=$PWD/build/abw
FLASH_ATTN_HEAD_DIMS="64;128;192" FLASH_ATTN_DTYPES=bf16 FLASH_ATTN_DIRECTIONS=fwd AB_VARIANTS=". .ab/nokw" AB_ROUNDS=0 \
  AB_TEST_FIRST=1 AB_TESTS="tests/test_kvcache.py tests/test_kvcache_paged.py tests/test_cuda_graph.py tests/test_fwd_pages_policy.py" \
  AB_TESTS_S=240 tools/ab_bench.sh 2>&1 | grep -v "^dir |" | tail -12
(cd build/abw/new && timeout 120 compute-sanitizer --tool racecheck --print-limit 5 python3 -m pytest -q -p no:cacheprovider \
  tests/test_kvcache.py -k "(decode_append_in_kernel and wave and None and half) or (one_and_four and 20)" > $OUT/racecheck.log 2>&1
echo "racecheck rc=$? $(grep 'RACECHECK SUMMARY' $OUT/racecheck.log | sort | uniq -c | tr '\n' ' ') $(tail -1 $OUT/racecheck.log)")
FLASH_ATTN_HEAD_DIMS="64;128;192" FLASH_ATTN_DTYPES=bf16 FLASH_ATTN_DIRECTIONS=fwd AB_VARIANTS=". .ab/nokw" AB_REUSE=1 \
  AB_HEADDIMS=128 AB_SEQLENS=512 AB_ROUNDS=2 AB_KVCACHE=1 tools/ab_bench.sh 2>&1 | grep -v "^fwd\|^dir" | tail -45
