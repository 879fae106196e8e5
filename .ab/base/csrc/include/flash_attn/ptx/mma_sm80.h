// mma.sync.m16n8k16 (fp16/bf16 inputs, fp32 accumulators) for sm80+, and the register layouts it uses.
// Lane l of a warp, with g = l / 4 and t = l % 4, holds: A (16x16, row-major) a0 = (g, 2t..2t+1),
// a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..); B (16x8, k x n) b0 = (k 2t..2t+1, n g),
// b1 = (k 2t+8.., n g); C (16x8) c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1). Pairs are packed in 32 bits.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flash::ptx {

struct MmaA {
  uint32_t reg[4];
};
struct MmaB {
  uint32_t reg[2];
};
struct MmaC {
  float reg[4] = {0.f, 0.f, 0.f, 0.f};
};

// c += a * b on bf16 inputs.
__device__ __forceinline__ void mma_m16n8k16(MmaC& c, const MmaA& a, const MmaB& b, __nv_bfloat16) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c.reg[0]), "+f"(c.reg[1]), "+f"(c.reg[2]), "+f"(c.reg[3])
      : "r"(a.reg[0]), "r"(a.reg[1]), "r"(a.reg[2]), "r"(a.reg[3]), "r"(b.reg[0]), "r"(b.reg[1]));
#endif
}

// c += a * b on fp16 inputs.
__device__ __forceinline__ void mma_m16n8k16(MmaC& c, const MmaA& a, const MmaB& b, __half) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c.reg[0]), "+f"(c.reg[1]), "+f"(c.reg[2]), "+f"(c.reg[3])
      : "r"(a.reg[0]), "r"(a.reg[1]), "r"(a.reg[2]), "r"(a.reg[3]), "r"(b.reg[0]), "r"(b.reg[1]));
#endif
}

// Two 16-bit values packed low-first into one 32-bit register, as the fragments hold them.
template <typename T>
__device__ __forceinline__ uint32_t pack2(T low, T high) {
  const uint16_t lo = reinterpret_cast<const uint16_t&>(low);
  const uint16_t hi = reinterpret_cast<const uint16_t&>(high);
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

}  // namespace flash::ptx
