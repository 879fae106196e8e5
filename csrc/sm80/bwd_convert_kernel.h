// Last kernel of the sm80+ backward: dq = softmax_scale * (sum of the fp32 dq accumulators, in split order)
// cast to fp16/bf16, read in the layout the main kernel wrote (DqLayout). The fixed summation order keeps
// deterministic mode bitwise reproducible.
#pragma once

#include "flash_attn/bwd_workspace.h"
#include "sm80/bwd_common.h"
#include "sm80/bwd_preprocess_kernel.h"

namespace flash::sm80::bwd {

template <typename T>
__global__ void __launch_bounds__(kRowwiseThreads) bwd_convert_dq_kernel(const BwdParams bp, DqLayout layout) {
  const FwdParams& p = bp.fwd;
  const int b = blockIdx.z;
  const int h = blockIdx.y;
  const SeqInfo si = seq_info(p.shape, b);
  const int row = blockIdx.x * kRowwiseRows + threadIdx.x / kRowThreads;
  const int part = threadIdx.x % kRowThreads;
  if (row >= si.seqlen_q) return;
  const int64_t head_dim = p.shape.head_dim;
  const float scale = static_cast<float>(p.softmax_scale);
  const BwdWorkspace w = bwd_workspace(bp, layout);
  const float* acc = w.dq_accum + h * w.dq_head_stride;
  const int64_t global_row = si.global_q_row0 + row;
  T* dq = static_cast<T*>(bp.dq) + b * bp.dq_strides.batch + (si.q_row0 + row) * bp.dq_strides.row +
          h * bp.dq_strides.head;
  constexpr int kWidth = kVectorBytes / sizeof(T);
  constexpr int kGroup = kDqSlotGroup;
  static_assert(kGroup % kWidth == 0 && kBwdHeadDimQuantum % kGroup == 0, "dq slot groups tile the row");
  const bool vector = vector_rows(dq, bp.dq_strides.row, head_dim);
  // One interleaved slot group (16 columns) per thread and pass: the row stride is a multiple of it.
  for (int64_t c = part * kGroup; c < head_dim; c += kRowThreads * kGroup) {
    float slots[kGroup];
#pragma unroll
    for (int e = 0; e < kGroup; ++e) slots[e] = 0.f;
    for (int64_t split = 0; split < bp.dq_splits; ++split) {
      const int64_t offset = split * w.dq_split_stride + dq_offset(layout, global_row, c, w.dq_row_stride);
      const float4* src = reinterpret_cast<const float4*>(acc + offset);
#pragma unroll
      for (int v = 0; v < kGroup / 4; ++v) {
        const float4 x = src[v];
        slots[4 * v] += x.x, slots[4 * v + 1] += x.y, slots[4 * v + 2] += x.z, slots[4 * v + 3] += x.w;
      }
    }
    float sum[kGroup];
#pragma unroll
    for (int e = 0; e < kGroup; ++e) sum[e] = slots[dq_slot(e)] * scale;
    if (vector) {
#pragma unroll
      for (int part8 = 0; part8 < kGroup / kWidth; ++part8) {
        if (c + part8 * kWidth >= head_dim) break;
        uint4 packed;
        uint32_t* words = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
        for (int e = 0; e < kWidth / 2; ++e) {
          words[e] = pack_float2<T>(sum[part8 * kWidth + 2 * e], sum[part8 * kWidth + 2 * e + 1]);
        }
        *reinterpret_cast<uint4*>(dq + c + part8 * kWidth) = packed;
      }
    } else {
#pragma unroll
      for (int e = 0; e < kGroup; ++e) {
        if (c + e < head_dim) dq[c + e] = from_float<T>(sum[e]);
      }
    }
  }
}

}  // namespace flash::sm80::bwd
