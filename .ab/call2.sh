#!/bin/bash
# Call 2: memcheck of the cluster merge; the nocl variant (combine kernel) built at hd 128; kvcache A/B.
cd "$(dirname "$0")/.."
export AB_WORK=$PWD/build/abw
ls build/abw 2>&1 | head
(cd build/abw/new && timeout 200 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest -q -p no:cacheprovider \
  tests/test_kvcache.py -k "every_split_count" > $OUT/memcheck.log 2>&1
echo "memcheck rc=$? $(grep 'ERROR SUMMARY' $OUT/memcheck.log | sort | uniq -c) $(tail -1 $OUT/memcheck.log)")
FLASH_ATTN_HEAD_DIMS="128" FLASH_ATTN_DTYPES=bf16 FLASH_ATTN_DIRECTIONS=fwd AB_VARIANTS=". .ab/nocl" AB_REUSE=1 \
  AB_HEADDIMS=128 AB_SEQLENS=512 AB_ROUNDS=2 AB_KVCACHE=1 \
  AB_KVCACHE_ARGS="--shapes 1:8192,16:8192,8:32768,64:4096,1:131072 --num-splits 2,4,8" tools/ab_bench.sh 2>&1 | tail -60
