#!/bin/bash
# Call 3: the tree (key-warps decode tile) built wide, tests, memcheck + racecheck of the decode paths.
cd "$(dirname "$0")/.."
export AB_WORK=$PWD/build/abw
FLASH_ATTN_HEAD_DIMS="64;96;128;160;192;256" FLASH_ATTN_DTYPES=bf16 FLASH_ATTN_DIRECTIONS=fwd AB_VARIANTS="." AB_ROUNDS=0 \
  AB_TESTS="tests/test_kvcache.py tests/test_kvcache_paged.py tests/test_ptx_wrappers.py tests/test_fwd_pages_policy.py tests/test_cuda_forward.py tests/test_cuda_graph.py tests/test_cuda_index_values.py" \
  AB_TESTS_S=300 tools/ab_bench.sh 2>&1 | tail -12
cd build/abw/new
timeout 150 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest -q -p no:cacheprovider \
  tests/test_kvcache.py -k "one_and_four or every_split_count or split_merge" > $OUT/memcheck.log 2>&1
echo "memcheck rc=$? $(grep 'ERROR SUMMARY' $OUT/memcheck.log | sort | uniq -c | tr '\n' ' ') $(tail -1 $OUT/memcheck.log)"
timeout 150 compute-sanitizer --tool racecheck --print-limit 5 python3 -m pytest -q -p no:cacheprovider \
  tests/test_kvcache.py -k "one_and_four or (every_split_count and 128)" > $OUT/racecheck.log 2>&1
echo "racecheck rc=$? $(grep 'RACECHECK SUMMARY' $OUT/racecheck.log | sort | uniq -c | tr '\n' ' ') $(tail -1 $OUT/racecheck.log)"
timeout 100 compute-sanitizer --tool racecheck --print-limit 5 python3 -m pytest -q -p no:cacheprovider \
  tests/test_kvcache.py -k "decode_append_in_kernel and None" > $OUT/racecheck2.log 2>&1
echo "racecheck2 rc=$? $(grep 'RACECHECK SUMMARY' $OUT/racecheck2.log | sort | uniq -c | tr '\n' ' ') $(tail -1 $OUT/racecheck2.log)"
