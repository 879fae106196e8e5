// Split-KV combine kernel of the sm80+ forward: merges the per-split fp32 partial outputs and lses that
// fwd_kernel wrote (FwdParams::split_out / split_lse) into the call's output and lse. One CTA per (batch, head,
// query row).
#pragma once

#include <cmath>
#include <cstdint>

#include "flash_attn/params.h"
#include "flash_attn/common/seqlen.h"
#include "flash_attn/ptx/griddep_sm90.h"
#include "sm80/fwd_tile_config.h"
#include "sm80/kernel_common.h"

namespace flash::sm80 {

// Warp 0 turns the split lses into weights: each lane loads its splits' lses once (lanes over splits, so the loads
// overlap; a serial loop over 64 splits cost ~100 us of dependent L2 round trips). Each thread owns one float4 column
// chunk of the row for a strided subset of the splits (kCombineThreads / (head_dim / 4) subsets, 8 at head dim 128)
// and issues its first kCombinePrefetch partial-output loads before the weights exist: they do not depend on them,
// so the lse round trips and the first output round trip overlap. At 1 x 8k (64 splits) the kernel took 4.1 us per
// call when the lses were read three times and the outputs only after the weights (torch profiler, warm L2). The
// subsets' partial sums meet in shared memory.
constexpr int kCombineThreads = 256;
constexpr int kCombineVec = 4;          // floats per column chunk (one 16-byte load)
constexpr int kCombinePrefetch = 8;     // loads per thread issued before the weights (8 x float4: 32 registers)
constexpr int kCombineLoadsInFlight = 4;
constexpr int kCombineLseSlots = (kMaxKeySplits + kWarpSize - 1) / kWarpSize;  // split lses per lane of warp 0

// o += w * x, per component.
__device__ __forceinline__ void add_weighted(float4& o, float w, const float4& x) {
  o.x += w * x.x;
  o.y += w * x.y;
  o.z += w * x.z;
  o.w += w * x.w;
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kCombineThreads) fwd_combine_kernel(const FwdParams p) {
  constexpr int kChunks = kHeadDim / kCombineVec;
  constexpr int kGroups = kCombineThreads / kChunks;  // threads past kGroups * kChunks sit out the sum
  static_assert(kHeadDim % kCombineVec == 0 && kGroups >= 1, "combine layout");
  __shared__ float weight[kMaxKeySplits];
  __shared__ float row_lse;
  __shared__ float4 partial[kGroups][kChunks];

  const int64_t rows_total = p.shape.batch * p.shape.nheads_q * p.shape.seqlen_q;
  const int64_t flat = blockIdx.x;
  const int row = static_cast<int>(flat % p.shape.seqlen_q);
  const int h = static_cast<int>((flat / p.shape.seqlen_q) % p.shape.nheads_q);
  const int b = static_cast<int>(flat / (p.shape.seqlen_q * p.shape.nheads_q));
  int64_t q_row0 = 0;
  if (p.shape.cu_seqlens_q != nullptr) {
    const SequenceRows q_rows = varlen_rows(p.shape.cu_seqlens_q, b, p.shape.total_q, p.shape.seqlen_q);
    q_row0 = q_rows.row0;
    if (row >= q_rows.length) return;
  }
  // Everything below reads what the split kernel wrote (launched as its dependent on sm90, see fwd_launch.h).
  ptx::wait_for_primary_grid();
  const int splits = p.num_splits;

  // split_out rows are kHeadDim (the bucket) floats wide and 16-byte aligned; columns past head_dim hold zeros.
  const int chunk = threadIdx.x % kChunks;
  const int group = threadIdx.x / kChunks;
  const float4* src = reinterpret_cast<const float4*>(p.split_out) + flat * kChunks + chunk;
  const int64_t split_step = rows_total * kChunks;
  const int group_splits = group < kGroups ? splits : 0;
  float4 first[kCombinePrefetch];
#pragma unroll
  for (int j = 0; j < kCombinePrefetch; ++j) {
    const int s = min(group + j * kGroups, group_splits - 1);  // past the end: a valid row, weighted 0 below
    first[j] = s >= 0 ? src[s * split_step] : make_float4(0.f, 0.f, 0.f, 0.f);
  }

  if (threadIdx.x < kWarpSize) {
    const int lane = threadIdx.x;
    float lses[kCombineLseSlots];
    float max_lse = -INFINITY;
#pragma unroll
    for (int i = 0; i < kCombineLseSlots; ++i) {
      const int s = lane + i * kWarpSize;
      lses[i] = s < splits ? p.split_lse[s * rows_total + flat] : -INFINITY;
      max_lse = fmaxf(max_lse, lses[i]);
    }
    for (int mask = kWarpSize / 2; mask > 0; mask /= 2) {
      max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, mask));
    }
    float total = 0.f;
    if (max_lse != -INFINITY) {
#pragma unroll
      for (int i = 0; i < kCombineLseSlots; ++i) total += expf(lses[i] - max_lse);
    }
    for (int mask = kWarpSize / 2; mask > 0; mask /= 2) total += __shfl_xor_sync(0xffffffffu, total, mask);
    const bool empty = total == 0.f;
    const float lse = empty ? INFINITY : max_lse + logf(total);
#pragma unroll
    for (int i = 0; i < kCombineLseSlots; ++i) {
      const int s = lane + i * kWarpSize;
      if (s < splits) weight[s] = empty ? 0.f : expf(lses[i] - lse);
    }
    if (lane == 0) row_lse = lse;
  }
  __syncthreads();

  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int j = 0; j < kCombinePrefetch; ++j) {
    const int s = group + j * kGroups;
    add_weighted(o, s < group_splits ? weight[s] : 0.f, first[j]);
  }
  // Loads of a batch are written to be issued before any is used (a plain unrolled loop, or predicated loads,
  // let the compiler reuse one register quad: one or two in flight; this form gives three to four, sm_90 SASS).
  for (int s0 = group + kCombinePrefetch * kGroups; s0 < group_splits; s0 += kCombineLoadsInFlight * kGroups) {
    float4 x[kCombineLoadsInFlight];
#pragma unroll
    for (int j = 0; j < kCombineLoadsInFlight; ++j) {
      const int s = min(s0 + j * kGroups, group_splits - 1);
      x[j] = src[s * split_step];
    }
#pragma unroll
    for (int j = 0; j < kCombineLoadsInFlight; ++j) {
      const int s = s0 + j * kGroups;
      add_weighted(o, s < group_splits ? weight[s] : 0.f, x[j]);
    }
  }
  if (group < kGroups) partial[group][chunk] = o;
  __syncthreads();
  if (group != 0) return;
#pragma unroll
  for (int g = 1; g < kGroups; ++g) {
    const float4 x = partial[g][chunk];
    o.x += x.x;
    o.y += x.y;
    o.z += x.z;
    o.w += x.w;
  }
  // head_dim is a multiple of 8 (the API pads), so a chunk is wholly inside or outside the row.
  const int col = chunk * kCombineVec;
  T* out = static_cast<T*>(p.out) + b * p.out_strides.batch + (q_row0 + row) * p.out_strides.row +
           h * p.out_strides.head;
  if (col < p.shape.head_dim) {
    *reinterpret_cast<uint2*>(out + col) = make_uint2(pack_float2<T>(o.x, o.y), pack_float2<T>(o.z, o.w));
  }
  if (threadIdx.x == 0) {
    float* lse_out = static_cast<float*>(p.lse) + b * p.lse_batch_stride + h * p.lse_head_stride + q_row0;
    lse_out[row] = row_lse;
  }
}

}  // namespace flash::sm80
