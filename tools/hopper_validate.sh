#!/usr/bin/env bash
# One device call for the Hopper kernels (csrc/sm90/) on the H200: builds the extension for sm_90a and, meanwhile, the
# torch-free forward check (tools/sm90_fwd_check.sh, run on the GPU while the extension compiles); then the wgmma self
# tests and tests/test_hopper_{forward,backward}.py (force mode), the whole suite through the Hopper kernels where they
# serve the call (FLASH_ATTN_HOPPER=1), and the standard table with flash_attn_hopper beside the default dispatch,
# cuDNN and FA2. Each stage has its own time limit; a short summary is printed last. At most 8 files land in $OUT.
# Usage: OUT=dir tools/hopper_validate.sh [build_s tests_s suite_s bench_s]   (SUITE_PORTABLE_S=n adds the suite with
# FLASH_ATTN_HOPPER=0 under that limit, SANITIZE_S=n the sanitizers' Hopper pass; BENCH_IMPLS, BENCH_DIRECTION,
# BENCH_HEADDIMS, BENCH_SEQLENS pick the table; SWEEP_S=n adds bench_attention.py
# --sweep with flash_attn_hopper and flash_attn_portable under that limit: every head-dim bucket, GQA, softcap /
# window / ALiBi, varlen (SWEEP_IMPLS: other impls); a second call within 30 s, on the still-warm machine, reuses every
# unchanged unit's object (the compile cache below), so CHECK=0 SWEEP_S=500 tools/hopper_validate.sh 300 0 0 0 runs the
# sweep after a short build)
set -uo pipefail
OUT="${OUT:-/tmp/hopper_validate}"; mkdir -p "$OUT"
LOGS="$(mktemp -d)"
# The build and the forward check run side by side (CHECK_S), then the rest. The full default build took 219, 235
# and 250+ s with 16 jobs on the H200 (forty-first, fifty-third, fifty-fourth sessions) and more than 300 s on an H100
# machine (fifty-fifth): 360. Every stage also ends by TOTAL_S seconds from the start (590: inside one 10-minute
# device call), so a long build shortens the later stages instead of the call's limit cutting off the summary.
BUILD_S="${1:-360}"; TESTS_S="${2:-120}"; SUITE_S="${3:-100}"; BENCH_S="${4:-80}"; CHECK_S="${CHECK_S:-220}"
TOTAL_S="${TOTAL_S:-590}"
kMinStageS=5  # a stage with less time left than this is skipped (timeout 0 would mean no limit at all)
export MAX_JOBS="${MAX_JOBS:-12}" PYTHONUNBUFFERED=1 FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS:-90}"
# Objects kept by content (tools/compile_cache.py): each device call gets a fresh copy of the tree, whose new file
# times make ninja recompile every unit (forty-first session: a second call on the warm machine built again, 241 s);
# through the cache a unit whose source, flags and includes are unchanged takes its object from the earlier call.
export COMPILE_CACHE_DIR="${COMPILE_CACHE_DIR:-/tmp/flash_attn_compile_cache}"
export COMPILE_CACHE_ROOT="${COMPILE_CACHE_ROOT:-$PWD}"

start=$(date +%s)
# stage_limit S: S, or what is left of TOTAL_S if that is less (0 once below kMinStageS).
stage_limit() {
  local left=$(( TOTAL_S - ($(date +%s) - start) ))
  (( left > $1 )) && left=$1
  (( left < kMinStageS )) && left=0
  echo "$left"
}
BUILD_S=$(stage_limit "$BUILD_S")
timeout "$BUILD_S" python3 -m pip install -v --no-build-isolation --no-deps -e . > "$LOGS/build.log" 2>&1 &
build_pid=$!
if [ "${CHECK:-1}" = 1 ]; then
  OUT="$LOGS/check" timeout "$CHECK_S" tools/sm90_fwd_check.sh "${CHECK_SCHEDULES:-serial overlap pingpong}" \
    > "$OUT/check.log" 2>&1
  # What the check's runs printed, also when its time limit cut the summary off.
  cat "$LOGS"/check/{correctness,speed,tiles}.log > "$OUT/check_runs.log" 2>/dev/null
fi
wait "$build_pid"; build_rc=$?
build_s=$(( $(date +%s) - start ))
[ "$build_rc" -ne 0 ] && { grep -E "error|Error" "$LOGS/build.log" | head -30 > "$OUT/build_errors.log"; }

tests_rc=skipped; suite_rc=skipped; sanitize_rc=skipped
if [ "$build_rc" -eq 0 ]; then
  TESTS_S=$(stage_limit "$TESTS_S")
  if [ "$TESTS_S" -gt 0 ]; then
    timeout "$TESTS_S" python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_ptx_wrappers.py \
      tests/test_hopper_forward.py tests/test_hopper_backward.py > "$OUT/tests_hopper.log" 2>&1
    tests_rc=$?
  fi
  SUITE_S=$(stage_limit "$SUITE_S")
  if [ "$SUITE_S" -gt 0 ]; then
    FLASH_ATTN_HOPPER=1 OMP_NUM_THREADS=2 timeout "$SUITE_S" python3 -m pytest -q -n 8 -p no:cacheprovider tests \
      > "$OUT/tests_suite_hopper.log" 2>&1
    suite_rc=$?
  fi
  # SANITIZE_S=n: tools/sanitize.sh's Hopper pass (memcheck, racecheck, synccheck on the sanitize subset) under that
  # limit.
  SANITIZE_S=$(stage_limit "${SANITIZE_S:-0}")
  if [ "$SANITIZE_S" -gt 0 ]; then
    SANITIZE_PORTABLE=0 timeout "$SANITIZE_S" tools/sanitize.sh > "$OUT/sanitize.log" 2>&1
    sanitize_rc=$?
  fi
  SUITE_PORTABLE_S=$(stage_limit "${SUITE_PORTABLE_S:-0}")
  if [ "$SUITE_PORTABLE_S" -gt 0 ]; then
    FLASH_ATTN_HOPPER=0 OMP_NUM_THREADS=2 timeout "$SUITE_PORTABLE_S" python3 -m pytest -q -n 8 -p no:cacheprovider \
      tests > "$OUT/tests_suite_portable.log" 2>&1
  fi
  BENCH_S=$(stage_limit "$BENCH_S")
  [ "$BENCH_S" -gt 0 ] && timeout "$BENCH_S" python3 benchmarks/bench_attention.py \
    --impls "${BENCH_IMPLS:-flash_attn,flash_attn_hopper,sdpa_cudnn,sdpa_flash}" --direction "${BENCH_DIRECTION:-both}" \
    --headdim "${BENCH_HEADDIMS:-128,64}" --seqlen "${BENCH_SEQLENS:-512,2048,16384}" --causal both \
    --rep-ms "${REP_MS:-50}" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  SWEEP_S=$(stage_limit "${SWEEP_S:-0}")
  [ "$SWEEP_S" -gt 0 ] && timeout "$SWEEP_S" python3 benchmarks/bench_attention.py --sweep \
    --impls "${SWEEP_IMPLS:-flash_attn,flash_attn_hopper,flash_attn_portable,sdpa_cudnn,sdpa_flash,flex}" --direction both --rep-ms "${REP_MS:-50}" \
    --out "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
fi

echo "== forward check (tools/sm90_fwd_check.sh)"; grep -E "correct runs|FAILED|nonfinite [1-9]" "$OUT/check.log" | head -12
echo "== hopper tests"; grep -E "^(FAILED|ERROR)" "$OUT/tests_hopper.log" 2>/dev/null | head -15; tail -1 "$OUT/tests_hopper.log" 2>/dev/null
echo "== suite with the Hopper path on (default)"; grep -E "^(FAILED|ERROR)" "$OUT/tests_suite_hopper.log" 2>/dev/null | head -15
tail -1 "$OUT/tests_suite_hopper.log" 2>/dev/null
if [ -f "$OUT/tests_suite_portable.log" ]; then
  echo "== suite with FLASH_ATTN_HOPPER=0"; grep -E "^(FAILED|ERROR)" "$OUT/tests_suite_portable.log" | head -15
  tail -1 "$OUT/tests_suite_portable.log"
fi
if [ -f "$OUT/sanitize.log" ]; then
  echo "== sanitizers (Hopper pass)"; grep -E "^== |ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/sanitize.log" | tail -12
  # Where a report came from (the log itself may not come back from the device machine).
  grep -E -A2 "Race reported|Invalid|Barrier error" "$OUT/sanitize.log" | cut -c1-220 | head -12
fi
echo "== bench (TFLOP/s fwd/bwd)"; grep -E "^ *(bf16|fp16)" "$OUT/bench.log" 2>/dev/null
[ -f "$OUT/sweep.log" ] && { echo "== sweep"; grep -E "^ *(bf16|fp16)" "$OUT/sweep.log"; }
echo "build ${build_s}s rc=$build_rc | hopper tests rc=$tests_rc | suite rc=$suite_rc | sanitize rc=$sanitize_rc"
