#!/usr/bin/env bash
# One-shot GPU validation on the H200 machine: build (knobs from the environment), the whole test suite on CUDA,
# then the BENCHMARKS.md forward/backward and decode runs, each stage under its own time limit so a slow stage
# still leaves the others' logs. Usage: OUT=dir tools/gpu_validate.sh [build_s tests_s bench_s] (bench_s per head
# dim, 0 skips the benchmarks; SANITIZE_S=n also runs tools/sanitize.sh under that limit; BENCH_SEQLENS narrows).
# The results JSONs record `git rev-parse HEAD`; the device machine's copy of .git can be older than the tree it
# gets, so pass FLASH_ATTN_COMMIT=<the local HEAD> in the device command when the JSONs are to be committed.
# INSTALL_MODE=regular installs as the README does (`pip install .`, tests run from the checkout against the installed
# extension) instead of the editable install; FLASH_ATTN_CUDA_ARCHS unset builds for the visible GPU (setup.py).
set -uo pipefail
OUT="${OUT:-/tmp/gpu_validate}"; mkdir -p "$OUT"
# Bench logs stay beside, not in, $OUT: the device tool returns at most 8 files.
LOGS="$(mktemp -d)"
BUILD_S="${1:-200}"; TESTS_S="${2:-170}"; BENCH_S="${3:-150}"; REP_MS="${REP_MS:-100}"
# BENCH_IMPLS narrows the peers for a quicker iteration run (the committed results use the default).
BENCH_IMPLS="${BENCH_IMPLS:-flash_attn,sdpa_flash,sdpa_cudnn,sdpa_efficient}"
BENCH_SEQLENS="${BENCH_SEQLENS:-512,1024,2048,4096,8192,16384}"  # BENCHMARKS.md's six lengths
export MAX_JOBS="${MAX_JOBS:-16}" PYTHONUNBUFFERED=1
INSTALL_ARGS=(-e .)
[ "${INSTALL_MODE:-editable}" = regular ] && INSTALL_ARGS=(.)

start=$(date +%s)
timeout "$BUILD_S" python3 -m pip install -v --no-build-isolation --no-deps "${INSTALL_ARGS[@]}" > "$OUT/build.log" 2>&1
build_rc=$?
build_s=$(( $(date +%s) - start ))
if [ "$build_rc" -ne 0 ]; then grep -E "error|Error" "$OUT/build.log" | head -30; echo "BUILD FAILED rc=$build_rc after ${build_s}s"; exit 1; fi

start=$(date +%s)
OMP_NUM_THREADS=2 timeout "$TESTS_S" python3 -m pytest -q -n 8 -p no:cacheprovider --durations=15 tests > "$OUT/tests.log" 2>&1
tests_rc=$?
tests_s=$(( $(date +%s) - start ))

sanitize_rc=skipped
if [ "${SANITIZE_S:-0}" -gt 0 ]; then
  timeout "$SANITIZE_S" tools/sanitize.sh > "$OUT/sanitize.log" 2>&1
  sanitize_rc=$?
fi

start=$(date +%s)
[ "$BENCH_S" -gt 0 ] && for hd in 128 64 256; do
  timeout "$BENCH_S" python3 benchmarks/bench_attention.py --impls "$BENCH_IMPLS" \
    --direction both --headdim "$hd" --seqlen "$BENCH_SEQLENS" --causal both --rep-ms "$REP_MS" --out "$OUT/bench_hd$hd.json" \
    > "$LOGS/bench_hd$hd.log" 2>&1
done
[ "$BENCH_S" -gt 0 ] && timeout 30 python3 benchmarks/bench_attention.py --decode --rep-ms "$REP_MS" --impls "${BENCH_IMPLS%,sdpa_efficient}" \
  --out "$OUT/decode.json" > "$LOGS/decode.log" 2>&1
bench_s=$(( $(date +%s) - start ))

grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -40
tail -3 "$OUT/tests.log"
for f in "$LOGS"/bench_hd*.log "$LOGS/decode.log"; do [ -f "$f" ] && grep -E "^ *(bf16|fp16)" "$f"; done
[ "$sanitize_rc" != skipped ] && grep -E "^(== |=+ (ERROR|RACECHECK) SUMMARY)|passed|failed" "$OUT/sanitize.log" | tail -8
echo "build ${build_s}s rc=$build_rc | tests ${tests_s}s rc=$tests_rc | sanitize rc=$sanitize_rc | bench ${bench_s}s"
