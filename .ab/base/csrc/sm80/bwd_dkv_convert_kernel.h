// bwd_convert_dkv_kernel<T>: the last pass of a backward whose KV heads' query heads were split over CTAs
// (BwdParams::head_splits > 1, the Hopper and the portable main kernels): the workspace's fp32 dK and dV accumulators,
// which every split added into, to dk and dv in the call's dtype and strides. One thread per pair of columns,
// grid-stride; launch_dkv_convert zeroes the accumulators before the main kernel and launches the pass after it.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "flash_attn/bwd_workspace.h"
#include "flash_attn/params.h"
#include "sm80/kernel_common.h"

namespace flash::sm80::bwd {

constexpr int kDkvConvertThreads = 256;
constexpr int64_t kDkvConvertMaxBlocks = 4096;

template <typename T>
__global__ void __launch_bounds__(kDkvConvertThreads) bwd_convert_dkv_kernel(const BwdParams bp) {
  const BwdWorkspace w = bwd_workspace(bp, DqLayout::kRows);
  const AttentionShape& s = bp.fwd.shape;
  const bool varlen = s.cu_seqlens_k != nullptr;
  const int64_t pairs = s.head_dim / 2;  // head_dim is a multiple of 8 here (kernel_inputs.h pads it)
  const int64_t total = s.total_k * s.nheads_k * pairs;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t col = 2 * (i % pairs);
    const int64_t row_head = i / pairs;  // key row * nheads_k + KV head
    const int64_t head = row_head % s.nheads_k;
    const int64_t row = row_head / s.nheads_k;
    // Varlen rows are the packed rows; dense ones are batch entry * seqlen_k + key.
    const int64_t batch = varlen ? 0 : row / s.seqlen_k;
    const int64_t key = varlen ? row : row % s.seqlen_k;
    const float2 dk = *reinterpret_cast<const float2*>(w.dk_accum + row_head * w.dkv_row_stride + col);
    const float2 dv = *reinterpret_cast<const float2*>(w.dv_accum + row_head * w.dkv_row_stride + col);
    T* dk_out = static_cast<T*>(bp.dk) + batch * bp.dk_strides.batch + key * bp.dk_strides.row +
                head * bp.dk_strides.head + col;
    T* dv_out = static_cast<T*>(bp.dv) + batch * bp.dv_strides.batch + key * bp.dv_strides.row +
                head * bp.dv_strides.head + col;
    *reinterpret_cast<uint32_t*>(dk_out) = pack_float2<T>(dk.x, dk.y);
    *reinterpret_cast<uint32_t*>(dv_out) = pack_float2<T>(dv.x, dv.y);
  }
}

// Zeroes the split dK / dV accumulators (before the main kernel adds into them). Stream-ordered, graph-safe.
inline void zero_dkv_accumulators(const BwdParams& params, cudaStream_t stream) {
  const BwdWorkspace w = bwd_workspace(params, DqLayout::kRows);
  (void)cudaMemsetAsync(w.dk_accum, 0, 2 * w.dkv_floats * sizeof(float), stream);
}

// The conversion pass after the main kernel.
template <typename T>
void launch_dkv_convert(const BwdParams& params, cudaStream_t stream) {
  const AttentionShape& shape = params.fwd.shape;
  const int64_t pairs = shape.total_k * shape.nheads_k * (shape.head_dim / 2);
  const int64_t blocks = std::min<int64_t>((pairs + kDkvConvertThreads - 1) / kDkvConvertThreads, kDkvConvertMaxBlocks);
  if (blocks > 0) bwd_convert_dkv_kernel<T><<<static_cast<unsigned>(blocks), kDkvConvertThreads, 0, stream>>>(params);
}

}  // namespace flash::sm80::bwd
