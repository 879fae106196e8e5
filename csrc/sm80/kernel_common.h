// Pieces every sm80+ kernel shares: element types, fp32 <-> 16-bit conversions, the mma tile constants, the
// padded shared-memory row layout, and the cp.async tile loader. Device code only; no torch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "flash_attn/params.h"
#include "flash_attn/ptx/cp_async_sm80.h"
#include "flash_attn/ptx/mma_sm80.h"

namespace flash::sm80 {

template <DType kDType>
struct Element;
template <>
struct Element<DType::kFloat16> {
  using type = __half;
};
template <>
struct Element<DType::kBFloat16> {
  using type = __nv_bfloat16;
};

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Two floats -> one packed register (low = a), rounded to nearest: one cvt instruction for the pair.
template <typename T>
__device__ __forceinline__ uint32_t pack_float2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack_float2<__half>(float a, float b) {
  const __half2 pair = __floats2half2_rn(a, b);
  return reinterpret_cast<const uint32_t&>(pair);
}
template <>
__device__ __forceinline__ uint32_t pack_float2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(a, b);
  return reinterpret_cast<const uint32_t&>(pair);
}

constexpr int kWarpSize = 32;
constexpr int kMmaM = 16;
constexpr int kMmaN = 8;
constexpr int kMmaK = 16;
// Shared-memory rows are padded by 8 elements (16 bytes): the 8 rows one ldmatrix phase reads then start in
// 8 different 4-bank groups, so fragment loads and 16-byte cp.async stores are conflict-free.
constexpr int kSmemRowPad = 8;
// Elements per 16-byte cp.async chunk.
constexpr int kChunkElems = 8;

__device__ __forceinline__ float read_bias(const void* base, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::kFloat16: return __half2float(static_cast<const __half*>(base)[index]);
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[index]);
    case DType::kFloat32: return static_cast<const float*>(base)[index];
    case DType::kFloat64: return static_cast<float>(static_cast<const double*>(base)[index]);
  }
  return 0.f;
}

// Issues cp.async for a kRows x kHeadDim tile (row stride kHeadDim + kSmemRowPad in shared memory). Rows at or
// beyond rows_valid and columns at or beyond head_dim are zero-filled. Requires head_dim % 8 == 0, a row stride
// that is a multiple of 8 and a 16-byte-aligned gmem (the API guarantees all three for CUDA calls).
template <int kRows, int kHeadDim, int kThreads, typename T>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, int64_t row_stride, int rows_valid,
                                                int head_dim, int tid) {
  constexpr int kChunksPerRow = kHeadDim / kChunkElems;
  constexpr int kStride = kHeadDim + kSmemRowPad;
  if constexpr (kThreads % kChunksPerRow == 0) {
    // Each thread keeps one column chunk and walks rows with a fixed pointer step: two live 64-bit values
    // instead of one per iteration (the hoisted per-iteration offsets cost ~30 registers and spilled).
    constexpr int kRowsPerIter = kThreads / kChunksPerRow;
    const int col = (tid % kChunksPerRow) * kChunkElems;
    const int row0 = tid / kChunksPerRow;
    const bool col_valid = col < head_dim;
    const T* src = gmem + row0 * row_stride + col;
    const int64_t step = kRowsPerIter * row_stride;
#pragma unroll
    for (int i = 0; i < kRows / kRowsPerIter; ++i) {
      const bool valid = col_valid && row0 + i * kRowsPerIter < rows_valid;
      ptx::cp_async_16(smem + (row0 + i * kRowsPerIter) * kStride + col, valid ? src : gmem, valid);
      src += step;
    }
  } else {
    constexpr int kChunks = kRows * kChunksPerRow;
    constexpr int kIters = (kChunks + kThreads - 1) / kThreads;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int c = tid + i * kThreads;
      if (kChunks % kThreads == 0 || c < kChunks) {
        const int row = c / kChunksPerRow;
        const int col = (c % kChunksPerRow) * kChunkElems;
        const bool valid = row < rows_valid && col < head_dim;
        const T* src = valid ? gmem + row * row_stride + col : gmem;
        ptx::cp_async_16(smem + row * kStride + col, src, valid);
      }
    }
  }
}

}  // namespace flash::sm80
