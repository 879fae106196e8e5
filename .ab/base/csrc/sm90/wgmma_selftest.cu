// The wgmma one-tile self test (wgmma_selftest.h): the SS or RS form at fp16 / bf16 on one tile, its fp32 registers
// returned as stored; test-only, tests/test_ptx_wrappers.py computes the expected registers.
#include "sm90/wgmma_selftest.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "flash_attn/ptx/warpgroup_sm90.h"
#include "flash_attn/ptx/wgmma_sm90_generated.h"

namespace flash::sm90::selftest {
namespace {

constexpr int kLineElems = 64;       // 16-bit elements per 128-byte swizzled line
constexpr int kChunkElems = 8;       // 16-byte chunk
constexpr int kChunksPerLine = 8;
[[maybe_unused]] constexpr int kK16LineBytes = 32;      // one k16 step along a K-major line
[[maybe_unused]] constexpr int kK16RowsBytes = 16 * 128;  // one k16 step of an MN-major operand: 16 lines
constexpr int kMinCodeArch = 90;

// Element (row, col < 64) of a [rows][64] tile stored with the 128-byte swizzle on a 1024-byte aligned base.
[[maybe_unused]] __device__ __forceinline__ int swizzled(int row, int col) {
  return row * kLineElems + (((col / kChunkElems) ^ (row % kChunksPerLine)) * kChunkElems) + col % kChunkElems;
}

template <typename T>
[[maybe_unused]] __device__ __forceinline__ uint32_t pack_two(T lo, T hi) {
  const uint16_t l = *reinterpret_cast<const uint16_t*>(&lo);
  const uint16_t h = *reinterpret_cast<const uint16_t*>(&hi);
  return static_cast<uint32_t>(l) | (static_cast<uint32_t>(h) << 16);
}

template <typename T, WgmmaForm kForm>
__global__ void wgmma_tile_kernel(const T* a, const T* b, float* d) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ __align__(1024) T a_tile[kWgmmaM * kWgmmaK];
  __shared__ __align__(1024) T b_tile[kWgmmaN * kWgmmaK];
  const int t = threadIdx.x;
  // Both operands row-major as given, one 64-element line per row: (M, K) or (N, K) lines for K-major operands, (K, M)
  // or (K, N) lines for MN-major ones.
  for (int i = t; i < kWgmmaM * kWgmmaK; i += ptx::kWarpgroupThreads) a_tile[swizzled(i / kLineElems, i % kLineElems)] = a[i];
  for (int i = t; i < kWgmmaN * kWgmmaK; i += ptx::kWarpgroupThreads) b_tile[swizzled(i / kLineElems, i % kLineElems)] = b[i];
  ptx::fence_proxy_async_shared();
  __syncthreads();

  float acc[kWgmmaN / 2];
  const int warp = t / 32, lane = t % 32;
  const int row0 = 16 * warp + lane / 4;
  if constexpr (kForm == WgmmaForm::kRegistersA) {
    uint32_t frag[kWgmmaK / 16][4];
    for (int kk = 0; kk < kWgmmaK / 16; ++kk) {
      const int col = 16 * kk + 2 * (lane % 4);
      const int rows[4] = {row0, row0 + 8, row0, row0 + 8};
      const int cols[4] = {col, col, col + 8, col + 8};
      for (int w = 0; w < 4; ++w) {
        frag[kk][w] = pack_two(a[rows[w] * kWgmmaK + cols[w]], a[rows[w] * kWgmmaK + cols[w] + 1]);
      }
    }
    const uint64_t b_desc = ptx::smem_descriptor(b_tile, kWgmmaK * ptx::kSwizzleRowBytes, ptx::kSwizzleAtomBytes);
    ptx::warpgroup_fence();
#pragma unroll
    for (int kk = 0; kk < kWgmmaK / 16; ++kk) {
      ptx::Wgmma<T, kWgmmaN>::rs(acc, frag[kk], ptx::advance_descriptor(b_desc, kk * kK16RowsBytes), kk > 0);
    }
  } else if constexpr (kForm == WgmmaForm::kSharedMnMajor) {
    // Lines of 64 M (a) or N (b) elements, one per k: the MN-major canonical layout, 16 lines per k16 step.
    const uint64_t a_desc = ptx::smem_descriptor(a_tile, kWgmmaK * ptx::kSwizzleRowBytes, ptx::kSwizzleAtomBytes);
    const uint64_t b_desc = ptx::smem_descriptor(b_tile, kWgmmaK * ptx::kSwizzleRowBytes, ptx::kSwizzleAtomBytes);
    ptx::warpgroup_fence();
#pragma unroll
    for (int kk = 0; kk < kWgmmaK / 16; ++kk) {
      ptx::Wgmma<T, kWgmmaN>::template ss<1, 1>(acc, ptx::advance_descriptor(a_desc, kk * kK16RowsBytes),
                                                ptx::advance_descriptor(b_desc, kk * kK16RowsBytes), kk > 0);
    }
  } else {
    const uint64_t a_desc = ptx::smem_descriptor(a_tile, ptx::kDescriptorUnitBytes, ptx::kSwizzleAtomBytes);
    const uint64_t b_desc = ptx::smem_descriptor(b_tile, ptx::kDescriptorUnitBytes, ptx::kSwizzleAtomBytes);
    ptx::warpgroup_fence();
#pragma unroll
    for (int kk = 0; kk < kWgmmaK / 16; ++kk) {
      ptx::Wgmma<T, kWgmmaN>::ss(acc, ptx::advance_descriptor(a_desc, kk * kK16LineBytes),
                                 ptx::advance_descriptor(b_desc, kk * kK16LineBytes), kk > 0);
    }
  }
  ptx::warpgroup_commit();
  ptx::warpgroup_wait<0>();
#pragma unroll
  for (int i = 0; i < kWgmmaN / 2; ++i) ptx::pin_register(acc[i]);
  // Register 4j + 2h + e: row row0 + 8h, column 8j + 2 (lane % 4) + e.
#pragma unroll
  for (int i = 0; i < kWgmmaN / 2; ++i) {
    const int j = i / 4, h = (i / 2) % 2, e = i % 2;
    d[(row0 + 8 * h) * kWgmmaN + 8 * j + 2 * (lane % 4) + e] = acc[i];
  }
#else
  (void)a, (void)b, (void)d;
  __trap();
#endif
}

template <typename T>
void launch(WgmmaForm form, const void* a, const void* b, float* d, cudaStream_t stream) {
  const T* ta = static_cast<const T*>(a);
  const T* tb = static_cast<const T*>(b);
  switch (form) {
    case WgmmaForm::kSharedKMajor:
      wgmma_tile_kernel<T, WgmmaForm::kSharedKMajor><<<1, ptx::kWarpgroupThreads, 0, stream>>>(ta, tb, d);
      break;
    case WgmmaForm::kRegistersA:
      wgmma_tile_kernel<T, WgmmaForm::kRegistersA><<<1, ptx::kWarpgroupThreads, 0, stream>>>(ta, tb, d);
      break;
    case WgmmaForm::kSharedMnMajor:
      wgmma_tile_kernel<T, WgmmaForm::kSharedMnMajor><<<1, ptx::kWarpgroupThreads, 0, stream>>>(ta, tb, d);
      break;
  }
}

}  // namespace

bool wgmma_tile(DType dtype, WgmmaForm form, const void* a, const void* b, float* d, int code_arch, void* stream) {
  if (code_arch < kMinCodeArch || (dtype != DType::kFloat16 && dtype != DType::kBFloat16)) return false;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == DType::kFloat16) {
    launch<__half>(form, a, b, d, s);
  } else {
    launch<__nv_bfloat16>(form, a, b, d, s);
  }
  return true;
}

}  // namespace flash::sm90::selftest
