// First kernel of the sm80+ backward: per (query row, q head) delta = rowsum(dO * O) - dlse (the softmax
// backward's row term, dlse entering like -D) into the fp32 workspace, and zeroes the row's dq accumulators (in the
// main kernel's layout, DqLayout). For the Hopper kernel (BwdParams::block_stats) it also writes LSE log2(e) and
// delta into the statistics blocks, padding included.
// Memory-bound: 8 threads per row, 16-byte loads when the rows allow them.
#pragma once

#include "flash_attn/bwd_workspace.h"
#include "flash_attn/common/math.h"
#include "sm80/bwd_common.h"

namespace flash::sm80::bwd {

// Threads per CTA of the row-wise kernels (this one and the dq conversion), independent of the main kernel's.
constexpr int kRowwiseThreads = 256;
constexpr int kRowThreads = 8;  // threads sharing one row (reduced with 3 shuffles)
constexpr int kRowwiseRows = kRowwiseThreads / kRowThreads;

// zero_dq: false where the main kernel stores dQ without the accumulator (sm90/bwd_direct_dq.h).
template <typename T>
__global__ void __launch_bounds__(kRowwiseThreads) bwd_preprocess_kernel(const BwdParams bp, DqLayout layout,
                                                                          bool zero_dq) {
  const FwdParams& p = bp.fwd;
  const int b = blockIdx.z;
  const int h = blockIdx.y;
  const SeqInfo si = seq_info(p.shape, b);
  const int row = blockIdx.x * kRowwiseRows + threadIdx.x / kRowThreads;
  const int part = threadIdx.x % kRowThreads;
  if (blockIdx.x * kRowwiseRows >= si.seqlen_q) return;
  const bool active = row < si.seqlen_q;
  const BwdWorkspace w = bwd_workspace(bp, layout);
  float* stats = w.stats == nullptr ? nullptr
                                    : w.stats + h * w.stats_head_stride +
                                          bwd_stats_block0(si.global_q_row0, b) * 2 * kBwdStatsRows;
  // The CTA of the sequence's last row pads its last statistics blocks (bwd_stats_padded_rows): rows past the end
  // see no key (LSE +inf, P = 0) and add nothing (D = 0).
  if (stats != nullptr && blockIdx.x == (si.seqlen_q - 1) / kRowwiseRows) {
    const int64_t padded = bwd_stats_padded_rows(si.seqlen_q);
    for (int64_t r = si.seqlen_q + threadIdx.x; r < padded; r += kRowwiseThreads) {
      float* block = stats + r / kBwdStatsRows * 2 * kBwdStatsRows;
      block[r % kBwdStatsRows] = INFINITY;
      block[kBwdStatsRows + r % kBwdStatsRows] = 0.f;
    }
  }
  const int64_t head_dim = p.shape.head_dim;

  float dot = 0.f;
  if (active) {
    const T* o = static_cast<const T*>(p.out) + b * p.out_strides.batch + (si.q_row0 + row) * p.out_strides.row +
                 h * p.out_strides.head;
    const T* d_o = static_cast<const T*>(bp.dout) + b * bp.dout_strides.batch +
                   (si.q_row0 + row) * bp.dout_strides.row + h * bp.dout_strides.head;
    constexpr int kWidth = kVectorBytes / sizeof(T);
    if (vector_rows(o, p.out_strides.row, head_dim) && vector_rows(d_o, bp.dout_strides.row, head_dim)) {
      for (int64_t c = part * kWidth; c < head_dim; c += kRowThreads * kWidth) {
        const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
        const uint4 dv = *reinterpret_cast<const uint4*>(d_o + c);
        const T* oe = reinterpret_cast<const T*>(&ov);
        const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
        for (int e = 0; e < kWidth; ++e) dot += to_float(oe[e]) * to_float(de[e]);
      }
    } else {
      for (int64_t c = part; c < head_dim; c += kRowThreads) dot += to_float(o[c]) * to_float(d_o[c]);
    }
  }
#pragma unroll
  for (int offset = kRowThreads / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  if (!active) return;

  const int64_t global_row = si.global_q_row0 + row;
  if (part == 0) {
    const int64_t lse_index = b * p.lse_batch_stride + h * p.lse_head_stride + si.q_row0 + row;
    if (bp.dlse != nullptr) dot -= static_cast<const float*>(bp.dlse)[lse_index];
    w.delta[h * w.delta_head_stride + global_row] = dot;
    if (stats != nullptr) {
      float* block = stats + row / kBwdStatsRows * 2 * kBwdStatsRows;
      block[row % kBwdStatsRows] = static_cast<const float*>(p.lse)[lse_index] * static_cast<float>(kLog2e);
      block[kBwdStatsRows + row % kBwdStatsRows] = dot;
    }
  }
  // Row r's dq_row_stride floats from r * dq_row_stride, whatever the layout (DqLayout): every row pair's floats are
  // its two rows' ranges. In row pairs, a sequence's last row that starts a pair zeroes the second row's range too:
  // no row may follow it (the last row of an odd total_q, or of the rows before cu_seqlens_q's end), and where one
  // does, it zeroes the same range (before the main kernel, so the double write is harmless).
  if (!zero_dq) return;
  const float4 zeros = make_float4(0.f, 0.f, 0.f, 0.f);
  const bool pair_tail = layout == DqLayout::kRowPairs && global_row % 2 == 0 && row + 1 == si.seqlen_q;
  const int64_t zeroed = pair_tail ? 2 : 1;
  for (int64_t split = 0; split < bp.dq_splits; ++split) {
    float* acc = w.dq_accum + split * w.dq_split_stride + h * w.dq_head_stride + global_row * w.dq_row_stride;
    for (int64_t c = part * 4; c < zeroed * w.dq_row_stride; c += kRowThreads * 4) {
      *reinterpret_cast<float4*>(acc + c) = zeros;
    }
  }
}

}  // namespace flash::sm80::bwd
