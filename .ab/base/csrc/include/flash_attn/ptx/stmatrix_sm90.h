// stmatrix (sm90+): the store counterpart of ldmatrix_x4, four 8x8 16-bit tiles from mma accumulator
// fragments to shared memory with one instruction. Lanes 8i..8i+7 give the 16-byte-aligned row addresses of
// matrix i; every lane supplies {row lane/4, cols 2(lane%4), +1} of matrix i in reg[i] (the layout of a packed
// mma C fragment half, see mma_sm80.h).
#pragma once

#include <cstdint>

#include "flash_attn/ptx/ldmatrix_sm80.h"

namespace flash::ptx {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kHasStmatrix = true;
#else
constexpr bool kHasStmatrix = false;
#endif

// Callers branch on kHasStmatrix at compile time; reached below sm90 it traps rather than store nothing.
__device__ __forceinline__ void stmatrix_x4(void* row_address, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_address(row_address)),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
#elif defined(__CUDA_ARCH__)
  (void)row_address, (void)r0, (void)r1, (void)r2, (void)r3;
  __trap();
#endif
}

}  // namespace flash::ptx
