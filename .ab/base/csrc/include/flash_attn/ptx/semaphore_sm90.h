// Counters in global memory that order work between CTAs (sm90+): an acquire load to wait on one, a release add to
// advance it, and the proxy fence between those generic-proxy accesses and the bulk reductions they order (the Hopper
// backward's ordered dQ, sm90/bwd_kernel.h).
#pragma once

namespace flash::ptx {

// The counter's value, with acquire semantics at GPU scope: what the thread that released it wrote before is visible.
__device__ __forceinline__ int ld_acquire_gpu(const int* counter) {
  int value = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(counter) : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
  return value;
}

// Adds `value` with release semantics at GPU scope: this thread's earlier writes are visible to whoever acquires it.
__device__ __forceinline__ void red_release_gpu_add(int* counter, int value) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(counter), "r"(value) : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// Orders this thread's generic-proxy global accesses (an acquire above) before its later async-proxy ones (bulk
// reductions), and completed async-proxy writes before a later release.
__device__ __forceinline__ void fence_proxy_async_global() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

}  // namespace flash::ptx
