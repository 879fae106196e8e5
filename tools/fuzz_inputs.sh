#!/usr/bin/env bash
# tools/fuzz_inputs.py under AddressSanitizer: builds the CPU implementation with -fsanitize=address in a copy of
# the tree (WORK, default /tmp/flash_attn_asan; rebuilt incrementally) and runs the fuzzer there, so a read or
# write outside a tensor stops the run with ASan's report instead of passing silently.
# Usage: tools/fuzz_inputs.sh [fuzz_inputs.py arguments, e.g. --cases 4000 --seed 3]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${WORK:-/tmp/flash_attn_asan}"
mkdir -p "$WORK"
(cd "$ROOT" && git ls-files -z | xargs -0 tar -cf - | tar -xf - -C "$WORK")
cd "$WORK"
SAN="-fsanitize=address -fno-omit-frame-pointer -g"
FLASH_ATTN_SKIP_CUDA=1 CFLAGS="$SAN" LDFLAGS="-fsanitize=address" python3 setup.py build_ext --inplace > build.log 2>&1 \
  || { tail -20 build.log; exit 1; }
# Python itself is not instrumented: preload the ASan runtime, and libstdc++ so that ASan finds __cxa_throw (the
# ops report bad arguments by C++ exceptions). allocator_may_return_null: an allocation too large for the machine
# (probabilities asked for at a 2^31-row bound) must fail as torch's out-of-memory error, as it does without ASan.
ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:allocator_may_return_null=1}" \
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)" \
PYTHONPATH="$WORK" python3 tools/fuzz_inputs.py "$@"
