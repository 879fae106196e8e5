// Bulk tensor stores (sm90+): the TMA unit copies a 2D box of fp32 from shared memory into global memory, as described
// by a tensor map, overwriting what is there (the Hopper backward's fused dQ: a query block's first adder stores its
// tile instead of adding it into a zeroed accumulator). Completion goes through the bulk groups of bulk_reduce_sm90.h.
#pragma once

#include <cstdint>

#include "flash_attn/ptx/bulk_reduce_sm90.h"

namespace flash::ptx {

// global[row .. row + box rows, col .. col + box cols] = the box at `box` (dense rows of the map's box width, 128-byte
// aligned). Rows and columns past the map's extent are not written. Reached below sm90 it traps.
__device__ __forceinline__ void bulk_store_2d(const void* tensor_map, const float* box, int col, int row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(tensor_map)),
               "r"(smem_address(box)), "r"(col), "r"(row)
               : "memory");
#elif defined(__CUDA_ARCH__)
  (void)tensor_map, (void)box, (void)col, (void)row;
  __trap();
#endif
}

}  // namespace flash::ptx
