// ldmatrix (sm75+): warp-wide loads of 8x8 16-bit tiles from shared memory into mma fragments.
// x2.trans gives the B fragment of a 16 (k) x 8 (n) tile stored row-major by k, e.g. V[key][dim]:
// lanes 0-15 pass the addresses of rows k = 0..15 (each 16-byte aligned); lanes 16-31 are ignored.
#pragma once

#include <cstdint>

#include "flash_attn/ptx/mma_sm80.h"

namespace flash::ptx {

__device__ __forceinline__ MmaB ldmatrix_x2_trans(const void* row_address) {
  MmaB frag;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(row_address));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(frag.reg[0]), "=r"(frag.reg[1])
               : "r"(address));
#endif
  return frag;
}

}  // namespace flash::ptx
