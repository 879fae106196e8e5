// Bulk tensor reduction (sm90+): the TMA unit adds a 2D box of fp32 from shared memory into global memory, as
// described by a tensor map (CUtensorMap, 128 bytes, made on the host; flash_attn/tensor_map_sm90.h). One thread issues a
// box; the bulk-group waits tell when the unit has read the box (shared memory reusable) or finished it.
#pragma once

#include <cstdint>

#include "flash_attn/ptx/fence_proxy_sm90.h"
#include "flash_attn/ptx/ldmatrix_sm80.h"

namespace flash::ptx {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kHasBulkReduce = true;
#else
constexpr bool kHasBulkReduce = false;
#endif

// global[row .. row + box rows, col .. col + box cols] += the box at `box` (dense rows of the map's box width,
// 128-byte aligned). `tensor_map`: generic address of a CUtensorMap in kernel-parameter (__grid_constant__),
// constant or global memory. Rows and columns past the map's extent are skipped. Callers branch on kHasBulkReduce
// at compile time; reached below sm90 it traps rather than add nothing.
__device__ __forceinline__ void bulk_reduce_add_2d(const void* tensor_map, const float* box, int col, int row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(tensor_map)),
      "r"(smem_address(box)), "r"(col), "r"(row)
      : "memory");
#elif defined(__CUDA_ARCH__)
  (void)tensor_map, (void)box, (void)col, (void)row;
  __trap();
#endif
}

// Closes the bulk group of this thread's reductions issued since the last commit.
__device__ __forceinline__ void bulk_commit_group() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most kPending of this thread's committed bulk groups still read their shared-memory source.
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Waits until at most kPending of this thread's committed bulk groups are unfinished (their global writes done).
template <int kPending>
__device__ __forceinline__ void bulk_wait_group() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

}  // namespace flash::ptx
