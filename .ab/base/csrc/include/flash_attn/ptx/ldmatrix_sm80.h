// ldmatrix (sm75+): warp-wide loads of 8x8 16-bit tiles from shared memory straight into mma fragments.
// Lanes 8i..8i+7 give the 16-byte-aligned row addresses of matrix i; every lane receives {row lane/4,
// cols 2(lane%4), +1} of each matrix (.trans: of its transpose). See mma_sm80.h for the fragment layouts.
#pragma once

#include <cstdint>

#include "flash_attn/ptx/mma_sm80.h"

namespace flash::ptx {

__device__ __forceinline__ uint32_t smem_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// Two matrices, transposed: the B fragment of a 16 (k) x 8 (n) tile stored row-major by k, e.g. V[key][dim].
// Lanes 0-15 pass rows k = 0..15; lanes 16-31 are ignored.
__device__ __forceinline__ MmaB ldmatrix_x2_trans(const void* row_address) {
  MmaB frag{};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(frag.reg[0]), "=r"(frag.reg[1])
               : "r"(smem_address(row_address)));
#endif
  return frag;
}

// Four matrices into four registers, in matrix order.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&reg)[4], const void* row_address) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(reg[0]), "=r"(reg[1]), "=r"(reg[2]), "=r"(reg[3])
               : "r"(smem_address(row_address)));
#endif
}

// Four matrices, each transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&reg)[4], const void* row_address) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(reg[0]), "=r"(reg[1]), "=r"(reg[2]), "=r"(reg[3])
               : "r"(smem_address(row_address)));
#endif
}

}  // namespace flash::ptx
