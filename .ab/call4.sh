#!/bin/bash
# Call 4: the tree (key-warps decode tile, rotate_rows per thread group) and nokw at hd 128; tests, racecheck, kvcache A/B.
cd "$(dirname "$0")/.."
export AB_WORK=$PWD/build/abw
FLASH_ATTN_HEAD_DIMS="128" FLASH_ATTN_DTYPES=bf16 FLASH_ATTN_DIRECTIONS=fwd AB_VARIANTS=". .ab/nokw" AB_ROUNDS=0 \
  AB_TEST_FIRST=1 AB_TESTS="tests/test_kvcache.py tests/test_kvcache_paged.py tests/test_rotary.py tests/test_cuda_graph.py tests/test_cuda_forward.py" \
  AB_TESTS_S=240 tools/ab_bench.sh 2>&1 | grep -v "^dir |" | tail -12
(cd build/abw/new && timeout 100 compute-sanitizer --tool racecheck --print-limit 5 python3 -m pytest -q -p no:cacheprovider \
  tests/test_kvcache.py -k "decode_append_in_kernel and None and 3" > $OUT/racecheck2.log 2>&1
echo "racecheck2 rc=$? $(grep 'RACECHECK SUMMARY' $OUT/racecheck2.log | sort | uniq -c | tr '\n' ' ') $(tail -1 $OUT/racecheck2.log)")
FLASH_ATTN_HEAD_DIMS="128" FLASH_ATTN_DTYPES=bf16 FLASH_ATTN_DIRECTIONS=fwd AB_VARIANTS=". .ab/nokw" AB_REUSE=1 \
  AB_HEADDIMS=128 AB_SEQLENS=512 AB_ROUNDS=2 AB_KVCACHE=1 \
  AB_KVCACHE_ARGS="--shapes 1:8192,16:8192,8:32768,64:4096,1:131072" tools/ab_bench.sh 2>&1 | grep -v "^fwd\|^dir" | tail -45
