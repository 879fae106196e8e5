// Warpgroup-level Hopper primitives around wgmma_sm90_generated.h (sm_90a): shared-memory matrix descriptors for
// the 128-byte swizzle, the wgmma fence / commit / wait sequence, register reallocation between warpgroups
// (setmaxnreg), named barriers, a plain mbarrier arrive and the generic-to-async proxy fence. Every wrapper traps
// where it is reached in code compiled without the sm_90a features, so a wrong dispatch fails loudly.
#pragma once

#include <cstdint>

#include "flash_attn/ptx/fence_proxy_sm90.h"
#include "flash_attn/ptx/ldmatrix_sm80.h"

namespace flash::ptx {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr bool kHasWgmma = true;
#else
constexpr bool kHasWgmma = false;
#endif

constexpr int kWarpgroupThreads = 128;
constexpr uint32_t kSwizzleRowBytes = 128;      // one 128B-swizzled line: 64 16-bit elements
constexpr uint32_t kSwizzleAtomBytes = 1024;    // 8 lines: the swizzle pattern's period (and tile alignment)
constexpr uint32_t kDescriptorUnitBytes = 16;   // descriptor address and offset fields count 16-byte units
constexpr uint32_t kDescriptorFieldMask = 0x3FFF;
constexpr int kDescriptorLboShift = 16;
constexpr int kDescriptorSboShift = 32;
constexpr uint64_t kDescriptorSwizzle128B = uint64_t{1} << 62;
constexpr unsigned kFullWarpMask = 0xffffffffu;

// Whether warpgroup_index() reads the index from lane 0 of the warp: the compiler then knows the value is the same
// across the warp, so the shared-memory descriptors built from it stay in uniform registers (from threadIdx.x
// directly, each wgmma's descriptor is added up in vector registers and moved into uniform ones before the
// instruction). ptxas + cuobjdump (tools/sass_stats.py, thirtieth session): the hd 128 causal backward's step loop 1,097
// -> 937 instructions (R2UR 60 -> 4, IMAD 163 -> 94). Timed (thirty-first session, with the backward's step
// counters, bwd_cta.h BwdStepWalk; two calls): backward hd 64 / 128 / 256 +1-7 % at 512-2k keys, forward level.
constexpr bool kWarpgroupIndexFromShuffle = true;

// The calling thread's warpgroup; every lane of the warp must call it together (all do, before any branch).
__device__ __forceinline__ int warpgroup_index() {
  const int index = static_cast<int>(threadIdx.x / kWarpgroupThreads);
  return kWarpgroupIndexFromShuffle ? __shfl_sync(kFullWarpMask, index, 0) : index;
}

// The 64-bit wgmma descriptor of a 128B-swizzled operand at `smem` (its 1024-byte atom aligned, base offset 0):
// `leading_bytes` between 64-element blocks along the strided dimension of an MN-major operand (unused for
// K-major, pass kDescriptorUnitBytes), `stride_bytes` between 8-line groups (kSwizzleAtomBytes when dense).
__device__ __forceinline__ uint64_t smem_descriptor(const void* smem, uint32_t leading_bytes, uint32_t stride_bytes) {
  const uint32_t address = smem_address(smem);
  return static_cast<uint64_t>((address / kDescriptorUnitBytes) & kDescriptorFieldMask) |
         static_cast<uint64_t>((leading_bytes / kDescriptorUnitBytes) & kDescriptorFieldMask)
             << kDescriptorLboShift |
         static_cast<uint64_t>((stride_bytes / kDescriptorUnitBytes) & kDescriptorFieldMask)
             << kDescriptorSboShift |
         kDescriptorSwizzle128B;
}

// Moves a descriptor's start address by `bytes` (a multiple of 16), e.g. 32 per k16 step inside a K-major line.
__device__ __forceinline__ uint64_t advance_descriptor(uint64_t descriptor, uint32_t bytes) {
  return descriptor + bytes / kDescriptorUnitBytes;
}

// Orders this thread's register writes to accumulators or A fragments before the next wgmma reads them.
__device__ __forceinline__ void warpgroup_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

__device__ __forceinline__ void warpgroup_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// Waits until at most kPending committed wgmma groups of this warpgroup are still running.
template <int kPending>
__device__ __forceinline__ void warpgroup_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// Keeps the compiler from moving reads or writes of an accumulator register across the async region.
__device__ __forceinline__ void pin_register(float& value) { asm volatile("" : "+f"(value)::"memory"); }
__device__ __forceinline__ void pin_register(uint32_t& value) { asm volatile("" : "+r"(value)::"memory"); }

// Register reallocation: every warp of a warpgroup runs one of these with the same count (a multiple of 8 in
// [24, 256]); needs __launch_bounds__ with one block per SM.
template <int kRegisters>
__device__ __forceinline__ void release_registers() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}
template <int kRegisters>
__device__ __forceinline__ void claim_registers() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// Named barriers (ids 1..15; 0 is __syncthreads): `threads` a multiple of 32 counts every arriving and syncing thread.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// One arrival (no transaction bytes) on a shared-memory mbarrier: a consumer releasing a pipeline slot.
__device__ __forceinline__ void mbarrier_arrive(uint64_t* barrier) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(barrier)) : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

}  // namespace flash::ptx
