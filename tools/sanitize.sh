#!/usr/bin/env bash
# Runs the representative CUDA test subset (pytest marker `sanitize`, tests/test_cuda_sanitize.py) under
# compute-sanitizer's memcheck (out-of-bounds / misaligned accesses) and racecheck (shared-memory hazards), then,
# where the GPU runs the Hopper kernels (sm_90a code), the same subset through them (FLASH_ATTN_HOPPER=1) under
# memcheck, racecheck and synccheck (named barriers, mbarriers); exits non-zero on the first tool that reports an
# error. Needs a GPU and a build with CUDA kernels.
# Usage: tools/sanitize.sh [extra pytest args]   (e.g. -k bwd). About 5 minutes on one H200 when every
# head-dim bucket is built in both directions. Each run names its tool in FLASH_ATTN_SANITIZE_TOOL, so a test can skip
# a case one tool cannot follow (tests/test_cuda_sanitize.py says which and why).
set -euo pipefail

cd "$(dirname "$0")/.."
SANITIZER="${COMPUTE_SANITIZER:-compute-sanitizer}"
if ! command -v "$SANITIZER" >/dev/null; then
  SANITIZER="${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer"
fi
# Without torch's caching allocator every tensor is its own cudaMalloc, so memcheck sees an access one element
# past a tensor instead of an access landing in a neighbouring tensor of the same pool block.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
PYTEST=(python3 -m pytest -q -p no:cacheprovider -m sanitize tests/test_cuda_sanitize.py "$@")

# SANITIZE_PORTABLE=0 runs the Hopper pass alone.
[ "${SANITIZE_PORTABLE:-1}" = 1 ] && for tool in memcheck racecheck; do
  echo "== compute-sanitizer --tool $tool (portable kernels)"
  FLASH_ATTN_SANITIZE_TOOL="$tool" FLASH_ATTN_HOPPER=0 "$SANITIZER" --tool "$tool" --error-exitcode 1 --print-limit 20 "${PYTEST[@]}"
done
hopper_code=$(python3 -c "import torch, flash_attn_C as C; print(int(C.loaded_code(0)[0] >= 90))" 2>/dev/null || echo 0)
if [ "$hopper_code" = 1 ]; then
  for tool in memcheck racecheck synccheck; do
    echo "== compute-sanitizer --tool $tool (Hopper kernels where they serve the call)"
    FLASH_ATTN_SANITIZE_TOOL="$tool" FLASH_ATTN_HOPPER=1 "$SANITIZER" --tool "$tool" --error-exitcode 1 --print-limit 20 "${PYTEST[@]}"
  done
fi
echo "== sanitizers clean"
