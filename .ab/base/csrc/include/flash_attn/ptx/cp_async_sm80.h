// cp.async (sm80+): asynchronous 16-byte global -> shared copies that bypass registers, grouped with
// commit_group and awaited with wait_group<N> (N = groups allowed to stay in flight). The zero-fill form
// writes 16 zero bytes instead of reading when `valid` is false, so ragged tile edges need no branch.
#pragma once

#include <cstdint>

namespace flash::ptx {

constexpr int kCpAsyncBytes = 16;

// .cg caches in L2 only: K/V tiles are read once per CTA, so L1 would only evict useful lines.
__device__ __forceinline__ void cp_async_16(void* smem, const void* global, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? kCpAsyncBytes : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global), "r"(src_bytes));
#endif
}

// One 4-byte element (e.g. an fp32 row statistic); .ca is the only cache mode with sizes below 16 bytes.
// `valid` false writes a zero without reading.
constexpr int kCpAsyncWordBytes = 4;
__device__ __forceinline__ void cp_async_4(void* smem, const void* global, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? kCpAsyncWordBytes : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(address), "l"(global), "r"(src_bytes));
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int kGroupsInFlight>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kGroupsInFlight));
#endif
}

}  // namespace flash::ptx
