#!/bin/bash
# Call 1: the tree built wide (hd 64/96/128/256 bf16 fwd), kvcache + wrapper tests, sanitizer on the cluster merge.
cd "$(dirname "$0")/.."
export AB_WORK=$PWD/build/abw
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
FLASH_ATTN_HEAD_DIMS="64;96;128;256" FLASH_ATTN_DTYPES=bf16 FLASH_ATTN_DIRECTIONS=fwd AB_VARIANTS="." AB_ROUNDS=0 \
  AB_TESTS="tests/test_kvcache.py tests/test_kvcache_paged.py tests/test_ptx_wrappers.py tests/test_fwd_pages_policy.py" \
  AB_TESTS_S=300 tools/ab_bench.sh 2>&1 | tail -20
cd build/abw/new
timeout 150 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_kvcache.py -k "every_split_count or num_splits_honoured" > $OUT/memcheck.log 2>&1
echo "memcheck rc=$? $(grep -c 'Invalid\|ERROR SUMMARY: [1-9]' $OUT/memcheck.log) $(tail -1 $OUT/memcheck.log)"
timeout 120 compute-sanitizer --tool racecheck --print-limit 5 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_kvcache.py -k "every_split_count and 128" > $OUT/racecheck.log 2>&1
echo "racecheck rc=$? $(grep -c 'hazard\|ERROR SUMMARY: [1-9]' $OUT/racecheck.log) $(tail -1 $OUT/racecheck.log)"
grep "ERROR SUMMARY" $OUT/memcheck.log $OUT/racecheck.log | sort | uniq -c | head
