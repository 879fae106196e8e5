#!/usr/bin/env bash
# A/B speed comparison in one GPU call, robust to the few-percent drift between runs on a shared H200: each variant
# is a copy of the working tree with the files of one overlay directory copied over it (AB_VARIANTS, e.g.
# ".ab/base .ab/x": .ab/base/csrc/sm80/fwd_kernel.h replaces csrc/sm80/fwd_kernel.h; "." is the tree as is). All
# variants build in parallel, then AB_ROUNDS rounds benchmark every variant in turn (FA2 = sdpa_flash alongside each),
# and tools/ab_summary.py prints each variant's best and median TFLOP/s per shape over the rounds.
# Usage: OUT=dir AB_VARIANTS=". .ab/base" [AB_DIRECTION=fwd AB_HEADDIMS=64,128,256 AB_SEQLENS=... AB_ROUNDS=3
#        AB_TESTS="tests/x.py" (run on every variant; AB_TEST_FIRST=1: the first only) AB_WORK=dir (where the variant trees go;
#        AB_REUSE=1: variants an earlier call built there are not rebuilt, so one device call can time several features)
#        AB_IMPL=flash_attn AB_PEER=sdpa_flash (bench_attention.py impls)
#        AB_DECODE=1 (also the decode shapes of BENCHMARKS.md, TB/s) AB_KVCACHE=1 (also benchmarks/bench_kvcache.py
#        --graph, summarised by tools/ab_kvcache_summary.py; AB_KVCACHE_ARGS="--shapes 1:8192": its arguments)
#        AB_BENCH_ARGS="..." (more bench_attention.py arguments, e.g. --deterministic) AB_HIDDEN=n (nheads = n / head
#        dim; 2048 by default, so head dims that do not divide it, e.g. 96, need one: AB_HIDDEN=3072) AB_HEADS_K="1,0"
#        (KV head counts, each timed in turn; 0 = MHA, the default) AB_ARG_SETS="--feature softcap;--doc-len 512"
#        (beyond the table: each ;-separated set of bench_attention.py arguments timed after the plain run, in the same
#        rounds and order; SDPA peers refuse the features, so those rows compare the variants with each other)
#        AB_CHECK_ROUNDS=1 (rounds that check every call against the fp32 reference; later ones only time)
#        AB_JOBS=16 (compile jobs) AB_COMPILE_CACHE=0 (no shared object cache, every variant built at once)]
#        An overlay's file AB_ENV (lines NAME=value) is exported for its tests and benchmark runs: a run-time switch
#        (e.g. FLASH_ATTN_BWD_FUSED_DQ=1) is then a variant whose build is all cache hits.
#        tools/ab_bench.sh   (build knobs FLASH_ATTN_* and REP_MS from the environment)
set -uo pipefail
# FLASH_ATTN_MASKS="none;causal" compiles a third fewer kernels: the benchmark runs the calls whose mask kind is built
# (bench_attention.py kernels_built_for), and so do the Hopper tests (per-kind skips); the portable tests ask
# flash_attn.is_supported, which wants every kind, and skip everything on such a build. Every round runs causal and
# non-causal calls, and a window needs the local kind.
if [ -n "${FLASH_ATTN_MASKS:-}" ]; then
  for kind in none causal; do
    if ! [[ ";$FLASH_ATTN_MASKS;" == *";$kind;"* ]]; then
      echo "ab_bench.sh: FLASH_ATTN_MASKS='$FLASH_ATTN_MASKS' lacks '$kind', which every round runs; add it" >&2
      exit 2
    fi
  done
  if [[ "${AB_ARG_SETS:-}" == *window* ]] && ! [[ ";$FLASH_ATTN_MASKS;" == *";local;"* ]]; then
    echo "ab_bench.sh: AB_ARG_SETS runs a window, which needs 'local' in FLASH_ATTN_MASKS" >&2
    exit 2
  fi
  echo "ab_bench.sh: FLASH_ATTN_MASKS='$FLASH_ATTN_MASKS': tests that ask flash_attn.is_supported skip" >&2
fi
# Every call needs a forward kernel (a backward call runs one first), so a build without the fwd direction supports
# nothing: the hd 96 A/B of the ninth session benchmarked and tested nothing with FLASH_ATTN_DIRECTIONS=bwd.
if [ -n "${FLASH_ATTN_DIRECTIONS:-}" ] && ! [[ "$FLASH_ATTN_DIRECTIONS" == *fwd* ]]; then
  echo "ab_bench.sh: FLASH_ATTN_DIRECTIONS='$FLASH_ATTN_DIRECTIONS' builds no forward, so no call is supported; add fwd" >&2
  exit 2
fi
OUT="${OUT:-/tmp/ab}"; mkdir -p "$OUT"
# What each variant runs and the peer beside the first: e.g. AB_IMPL=flash_attn_hopper AB_PEER=sdpa_cudnn for a
# Hopper kernel that dispatch does not take by default.
IMPL="${AB_IMPL:-flash_attn}"; PEER="${AB_PEER:-sdpa_flash}"
ROOT="$PWD"; WORK="${AB_WORK:-$(mktemp -d)}"
VARIANTS=(${AB_VARIANTS:-.}); NV=${#VARIANTS[@]}
export FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS:-90}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export FLASH_ATTN_DTYPES="${FLASH_ATTN_DTYPES:-bf16}" FLASH_ATTN_HEAD_DIMS="${FLASH_ATTN_HEAD_DIMS:-64;128;256}"
DIRECTION="${AB_DIRECTION:-fwd}"; HEADDIMS="${AB_HEADDIMS:-64,128,256}"; SEQLENS="${AB_SEQLENS:-512,2048,8192,16384}"
REP_MS="${REP_MS:-30}"; ROUNDS="${AB_ROUNDS:-3}"; TESTS="${AB_TESTS:-}"; AB_HEADS_K="${AB_HEADS_K:-0}"

name_of() { [ "$1" = "." ] && echo new || basename "$1"; }
# Run in a variant's tree: exports its AB_ENV settings, if it has any.
variant_env() { if [ -f AB_ENV ]; then set -a; . ./AB_ENV; set +a; fi; }
start=$(date +%s)
# The variants share an object cache (tools/compile_cache.py, for nvcc and, through tools/cxx_cache.sh, the C++
# compiler of the compile rules): the first to build compiles alone with every job, then the others in parallel, each
# compiling only the units its overlay changed (a csrc/sm90 overlay reuses the portable kernels' and the 18
# torch-header C++ files'). In the forty-fifth session three trees of 8 head dims built side by side, 5 jobs each,
# took 413 s. On a 2-core machine (hd 64 forward build) a tree with one sm90 header changed reused 10 of its 12 CUDA
# objects.
# AB_COMPILE_CACHE=0: every variant at once, without the cache.
CACHE="$WORK/.compile_cache"; JOBS=${AB_JOBS:-16}
build_variant() {  # $1: variant, $2: jobs
  local name dir; name=$(name_of "$1"); dir="$WORK/$name"
  # setup.py routes the compiles through tools/compile_cache.py when COMPILE_CACHE_DIR is set. An overlay's
  # AB_HEADDIMS file (bucket head dims, e.g. "96" or "160,192") narrows its build to those buckets too: each generated
  # unit declares only its own kernel (tools/gen_kernels.py), so the narrowed build compiles what its overlay changed
  # there and reuses the rest of the first variant's objects.
  (cd "$dir" && export MAX_JOBS="$2" && if [ "${AB_COMPILE_CACHE:-1}" = 1 ]; then
     export COMPILE_CACHE_DIR="$CACHE" COMPILE_CACHE_ROOT="$dir"; fi &&
   if [ -f AB_HEADDIMS ]; then export FLASH_ATTN_HEAD_DIMS="$(tr ',' ';' < AB_HEADDIMS | tr -d '[:space:]')"; fi &&
   { python3 setup.py build_ext --inplace > "$OUT/build_$name.log" 2>&1 && touch .ab_built; } ||
   echo "BUILD $name FAILED")
}
pending=()
for v in "${VARIANTS[@]}"; do
  name=$(name_of "$v"); dir="$WORK/$name"
  # AB_REUSE=1: a variant that an earlier ab_bench.sh call in the same AB_WORK built is benchmarked as it is.
  if [ "${AB_REUSE:-0}" = 1 ] && [ -f "$dir/.ab_built" ]; then continue; fi
  mkdir -p "$dir"
  tar -C "$ROOT" --exclude=./build --exclude=./.git --exclude=./.ab -cf - . | tar -C "$dir" -xf -
  if [ "$v" != "." ]; then (cd "$ROOT/$v" && find . -type f) | while read -r f; do cp "$ROOT/$v/$f" "$dir/$f"; done; fi
  pending+=("$v")
done
if [ "${AB_COMPILE_CACHE:-1}" = 1 ] && [ ${#pending[@]} -gt 1 ]; then
  build_variant "${pending[0]}" "$JOBS"
  echo "first build (${pending[0]}): $(( $(date +%s) - start ))s with $JOBS jobs"
  pending=("${pending[@]:1}")
fi
for v in "${pending[@]}"; do
  build_variant "$v" $(( JOBS / ${#pending[@]} > 0 ? JOBS / ${#pending[@]} : 1 )) &
done
wait
reused=$(cat "$OUT"/build_*.log 2>/dev/null | grep -c "compile_cache: hit")
echo "builds: $(( $(date +%s) - start ))s; objects reused: $reused"
grep -l "BUILD\|error:" "$OUT"/build_*.log 2>/dev/null | head

if [ -n "$TESTS" ]; then  # correctness of every variant (of the first only with AB_TEST_FIRST=1)
  tested=("${VARIANTS[@]}"); [ "${AB_TEST_FIRST:-0}" = 1 ] && tested=("${VARIANTS[0]}")
  for v in "${tested[@]}"; do
    name=$(name_of "$v")
    # Every run in a variant's tree imports that tree (PYTHONPATH): an editable install on the machine
    # (tools/hopper_validate.sh's pip install -e, earlier in the same warm call) otherwise serves every variant its
    # build, as in the forty-fourth session, where every variant ran the tree's hd 96 build and supported nothing.
    (cd "$WORK/$name" && export PYTHONPATH="$PWD" && variant_env &&
      timeout "${AB_TESTS_S:-150}" python3 -m pytest -q -n 8 -p no:cacheprovider $TESTS > "$OUT/tests_$name.log" 2>&1)
    echo "tests $name: $(grep -E "^(FAILED|ERROR)" "$OUT/tests_$name.log" | head -5) $(tail -1 "$OUT/tests_$name.log")"
    # The failures' first assertion lines here: the device returns only 8 files, and the test logs may not be among them.
    grep -E "^E  " "$OUT/tests_$name.log" | head -8
  done
fi

# Every variant's process times the peer after each shape, as the first's did alone until the twenty-seventh session:
# then the first variant of identical hd 256 kernels ran 8 % faster at 2k keys and 4 % slower at 8k than the second
# (docs/perf_log.md). Even rounds also run the variants in reverse order, so neither position favours one variant.
for r in $(seq "$ROUNDS"); do
  order=("${!VARIANTS[@]}")
  if [ $((r % 2)) = 0 ]; then order=(); for ((j = NV - 1; j >= 0; j--)); do order+=("$j"); done; fi
  for i in "${order[@]}"; do
    name=$(name_of "${VARIANTS[$i]}")
    impls="$IMPL,$PEER"
    # An overlay may narrow its head dims with a file AB_HEADDIMS (e.g. a tile change that only hd 256 takes); its
    # build has only those buckets (build_variant).
    hds="$HEADDIMS"; [ -f "$WORK/$name/AB_HEADDIMS" ] && hds=$(cat "$WORK/$name/AB_HEADDIMS")
    # The variant's runs of this round in one process (tools/bench_runs.py: one start-up of torch, CUDA and the
    # extension), a log and JSON file each.
    runs="$OUT/.runs_r${r}_$name"; : > "$runs"
    # Rounds after the first AB_CHECK_ROUNDS (default 1) skip the fp32 reference: the first checked every variant on
    # every shape, and a backward run spent most of its time outside the timed loops (forty-sixth session: 18 shapes
    # at 16k tokens, 35 s a run, ~7 s of it timed).
    check=""; [ "$r" -gt "${AB_CHECK_ROUNDS:-1}" ] && check="--no-check"
    for hk in ${AB_HEADS_K//,/ }; do  # 0: as many KV heads as query heads
      # Set 0 is the plain run; sets 1... are AB_ARG_SETS in turn (files r<round>_<variant>_hk<n>_s<set>).
      IFS=';' read -r -a arg_sets <<< ";${AB_ARG_SETS:-}"
      for s in "${!arg_sets[@]}"; do
        [ "$s" -gt 0 ] && [ -z "${arg_sets[$s]// /}" ] && continue
        tag="hk$hk"; [ "$s" -gt 0 ] && tag="hk${hk}_s$s"
        printf '%s\t%s\n' "$OUT/r${r}_${name}_$tag.log" "--impls $impls --direction $DIRECTION --headdim $hds \
--seqlen $SEQLENS --causal both --rep-ms $REP_MS ${AB_HIDDEN:+--hidden $AB_HIDDEN} --heads-k $hk ${AB_BENCH_ARGS:-} \
${arg_sets[$s]} $check --out $OUT/r${r}_${name}_$tag.json" >> "$runs"
      done
    done
    (cd "$WORK/$name" && export PYTHONPATH="$PWD" && variant_env && python3 tools/bench_runs.py "$runs") ||
      echo "bench $name round $r: a run failed (its log says which)"
    rm -f "$runs"
    if [ "${AB_KVCACHE:-0}" = 1 ]; then
      (cd "$WORK/$name" && export PYTHONPATH="$PWD" &&
        python3 benchmarks/bench_kvcache.py --graph --rep-ms "$REP_MS" ${AB_KVCACHE_ARGS:-} \
        --out "$OUT/kv${r}_${name}.json" > "$OUT/kv${r}_${name}.log" 2>&1) || echo "kvcache $name round $r failed"
    fi
    if [ "${AB_DECODE:-0}" = 1 ]; then
      (cd "$WORK/$name" && export PYTHONPATH="$PWD" &&
        python3 benchmarks/bench_attention.py --impls "$impls" --decode --rep-ms "$REP_MS" \
        --out "$OUT/r${r}_${name}_decode.json" > "$OUT/r${r}_${name}_decode.log" 2>&1) || echo "decode $name round $r failed"
    fi
  done
done
python3 "$ROOT/tools/ab_summary.py" --peer "$PEER" "$OUT" $(for v in "${VARIANTS[@]}"; do name_of "$v"; done) \
  | tee "$OUT/summary.txt"
if [ "${AB_KVCACHE:-0}" = 1 ]; then
  python3 "$ROOT/tools/ab_kvcache_summary.py" "$OUT" $(for v in "${VARIANTS[@]}"; do name_of "$v"; done) \
    | tee -a "$OUT/summary.txt"
fi
# The device machine returns a few files of $OUT: the rounds and logs travel as one archive beside the summary.
(cd "$OUT" && tar czf ab_files.tgz --remove-files r[0-9]*_* kv[0-9]*_* build_*.log tests_*.log 2>/dev/null)
