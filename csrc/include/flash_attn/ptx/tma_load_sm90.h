// TMA tile loads (sm90+): one thread asks the tensor-memory-accelerator to copy a box of a tensor map (CUtensorMap,
// made on the host; flash_attn/tensor_map_sm90.h) into shared memory, and the copy signals a shared-memory mbarrier with
// the bytes it wrote. Waiters poll the barrier's phase parity. No registers or load/store-unit slots per element: in
// the hd 256 forward the cp.async loads of K and V cost ~8 % of the kernel (docs/perf_log.md, twelfth session).
#pragma once

#include <cstdint>

#include "flash_attn/ptx/ldmatrix_sm80.h"

namespace flash::ptx {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kHasTmaLoad = true;
#else
constexpr bool kHasTmaLoad = false;
#endif

// Readies a barrier that completes a phase after `arrivals` arrivals and the bytes they announced. One thread runs
// it, then fence_barrier_init() and a CTA barrier before any use.
__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, uint32_t arrivals) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(barrier)), "r"(arrivals) : "memory");
#endif
}

// Makes initialised barriers visible to the TMA unit (the async proxy).
__device__ __forceinline__ void fence_barrier_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// Arrives on the barrier and announces `bytes` that copies will still deliver to the current phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* barrier, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(barrier)), "r"(bytes)
               : "memory");
#endif
}

// Waits until the barrier's phase with parity `parity` (0 for the first phase, then alternating) has completed;
// the completing copies' shared-memory writes are then visible to this thread.
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* barrier, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n"
      "}\n" ::"r"(smem_address(barrier)),
      "r"(parity)
      : "memory");
#endif
}

// Fetches a tensor map (generic address of a CUtensorMap in kernel-parameter (__grid_constant__), constant or global
// memory) into the TMA unit's descriptor cache ahead of its first copy, whose latency would otherwise include that
// fetch; CUTLASS and FlashAttention-3 issue it from the producer at kernel start. A hint: results do not depend on it.
__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tensor_map)) : "memory");
#else
  (void)tensor_map;
#endif
}

// Copies the box of the 4D tensor map at coordinates (c0 innermost .. c3) into shared memory at `box` (1024-byte
// aligned for the 128-byte swizzle) and counts its bytes on `barrier`; elements outside the map's extent are
// written as zeros and counted too. `tensor_map`: generic address of a CUtensorMap in kernel-parameter
// (__grid_constant__), constant or global memory. Callers branch on kHasTmaLoad; reached below sm90 it traps.
__device__ __forceinline__ void tma_load_4d(void* box, const void* tensor_map, uint64_t* barrier, int c0, int c1,
                                            int c2, int c3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, "
      "%6}], [%2];\n" ::"r"(smem_address(box)),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(smem_address(barrier)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
#elif defined(__CUDA_ARCH__)
  (void)box, (void)tensor_map, (void)barrier, (void)c0, (void)c1, (void)c2, (void)c3;
  __trap();
#endif
}

// The same for a 2D map (c0 the inner coordinate), into a dense box of the map's box width (128-byte aligned
// without a swizzle): the Hopper backward's fused dQ loads a query block's fp32 dQ sum back this way.
__device__ __forceinline__ void tma_load_2d(void* box, const void* tensor_map, uint64_t* barrier, int c0, int c1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], "
      "[%2];\n" ::"r"(smem_address(box)),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(smem_address(barrier)), "r"(c0), "r"(c1)
      : "memory");
#elif defined(__CUDA_ARCH__)
  (void)box, (void)tensor_map, (void)barrier, (void)c0, (void)c1;
  __trap();
#endif
}

// Copies `bytes` contiguous bytes of global memory at `source` into shared memory at `destination` and counts them
// on `barrier` (both addresses and the size multiples of 16 bytes). Reached below sm90 it traps.
__device__ __forceinline__ void bulk_load(void* destination, const void* source, uint32_t bytes, uint64_t* barrier) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_address(destination)),
      "l"(reinterpret_cast<uint64_t>(source)), "r"(bytes), "r"(smem_address(barrier))
      : "memory");
#elif defined(__CUDA_ARCH__)
  (void)destination, (void)source, (void)bytes, (void)barrier;
  __trap();
#endif
}

}  // namespace flash::ptx
