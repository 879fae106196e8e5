// Vector reductions to global memory (sm90+): four (or two) consecutive fp32 values added with one relaxed,
// gpu-scope `red`, the four also under a predicate. A predicated instruction instead of `if (ok)
// atomicAdd(float4*)`: the branch form put a BSSY/BSYNC pair around every reduction and a reconvergence before the
// next shuffle.
#pragma once

#include <cstdint>

namespace flash::ptx {

// dst: 16-byte aligned global address. No "memory" clobber: callers never read what they reduce into
// within the same kernel phase, and the clobber would pin shared-memory loads around it.
__device__ __forceinline__ void red_add_v4_f32(float* dst, float x, float y, float z, float w, bool pred) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  setp.ne.b32 p, %5, 0;\n"
      "  @p red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n"
      "}\n" ::"l"(dst),
      "f"(x), "f"(y), "f"(z), "f"(w), "r"(static_cast<int>(pred)));
#endif
}

// The same without a predicate, for callers that know every row exists: the predicated form compiles to a
// branch (BSSY/BSYNC) around each reduction.
__device__ __forceinline__ void red_add_v4_f32(float* dst, float x, float y, float z, float w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(x), "f"(y), "f"(z), "f"(w));
#endif
}

// Two consecutive fp32 values (dst: 8-byte aligned global address), no predicate.
__device__ __forceinline__ void red_add_v2_f32(float* dst, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(x), "f"(y));
#endif
}

}  // namespace flash::ptx
