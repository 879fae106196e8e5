// Thread-block clusters (sm90+): the CTA's rank in its cluster, the cluster-wide barrier, and loads from another
// CTA's shared memory (distributed shared memory). The split decode forward merges its splits' partial outputs this
// way (sm80/fwd_kernel.h combine_splits_in_cluster). Below sm90 each wrapper traps: no launcher asks for a cluster
// there.
#pragma once

#include <cstdint>

namespace flash::ptx {

// This CTA's rank in its cluster, 0 ... cluster size - 1 (x fastest, then y, then z).
__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t rank = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
  return rank;
}

// Every thread of every CTA of the cluster arrives, then waits for all of them: shared-memory writes before the
// barrier (release) are visible to every cluster CTA's reads after it (acquire). All threads of a warp call it
// together (the .aligned form).
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::
          : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// The shared::cluster address of `local` (a shared::cta address of this CTA) in the CTA of rank `rank`.
__device__ __forceinline__ uint32_t map_shared_to_rank(uint32_t local, uint32_t rank) {
  uint32_t remote = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
  return remote;
}

// A float from a shared::cluster address (map_shared_to_rank).
__device__ __forceinline__ float ld_shared_cluster_f32(uint32_t address) {
  float value = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(value) : "r"(address) : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
  return value;
}

// Four floats from a 16-byte aligned shared::cluster address.
__device__ __forceinline__ float4 ld_shared_cluster_v4_f32(uint32_t address) {
  float4 value = make_float4(0.f, 0.f, 0.f, 0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(value.x), "=f"(value.y), "=f"(value.z), "=f"(value.w)
               : "r"(address)
               : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
  return value;
}

}  // namespace flash::ptx
