// First kernel of the sm80+ backward: per (query row, q head) delta = rowsum(dO * O) - dlse (the softmax
// backward's row term, dlse entering like -D) into the fp32 workspace, and zeroes the row's dq accumulators (in the
// main kernel's layout, DqLayout). For the Hopper kernel (BwdParams::block_stats) it also writes LSE log2(e) and
// delta into the statistics blocks, padding included.
// Memory-bound: 8 threads per row, 16-byte loads when the rows allow them; one where the Hopper kernel sums D itself.
#pragma once

#include "flash_attn/bwd_workspace.h"
#include "flash_attn/common/math.h"
#include "sm80/bwd_common.h"

namespace flash::sm80::bwd {

// Threads per CTA of the row-wise kernels (this one and the dq conversion), independent of the main kernel's.
constexpr int kRowwiseThreads = 256;
constexpr int kRowThreads = 8;  // threads sharing one row (reduced with 3 shuffles)
constexpr int kRowwiseRows = kRowwiseThreads / kRowThreads;

// What the preprocess does for dQ besides D and the statistics blocks:
//   kZero: zeroes the row's dq accumulators, which the main kernel adds into (the portable kernels, most Hopper calls);
//   kNone: nothing (the Hopper direct dQ stores dq itself, sm90/bwd_direct_dq.h);
//   kFused: the Hopper fused dQ (sm90/bwd_tile_config.h bwd_fuses_dq), whose first adder of a query block stores its
//           tile instead of adding it: zeroes only the rows of each sequence's last, partial box of `box_rows` rows
//           (the first adder adds into those, since a store of the whole box would overwrite the next sequence's
//           rows), and writes dq = 0 in the rows that see no key: no key block walks a query block of only such rows,
//           so no adder writes them (tests/cpp/sm90_block_ranges_check.cpp).
enum class DqPrep { kZero, kNone, kFused };

// Threads sharing a row of the preprocess: kRowThreads where it sums the row's dO . O, one where the Hopper kernel does
// (kDeltaInKernel: the row's LSE and dlse are all it reads, and 8 threads a row launched 8x the CTAs for nothing).
template <bool kDeltaInKernel>
constexpr int preprocess_row_threads() {
  return kDeltaInKernel ? 1 : kRowThreads;
}
template <bool kDeltaInKernel>
constexpr int preprocess_rows() {
  return kRowwiseThreads / preprocess_row_threads<kDeltaInKernel>();
}

// dq = 0 in one row, by the kThreads threads sharing it (part: this thread's index among them).
template <typename T, int kThreads>
__device__ __forceinline__ void zero_dq_row(const BwdParams& bp, int b, int64_t q_row, int h, int part) {
  T* dq = static_cast<T*>(bp.dq) + b * bp.dq_strides.batch + q_row * bp.dq_strides.row + h * bp.dq_strides.head;
  const int64_t head_dim = bp.fwd.shape.head_dim;
  constexpr int kWidth = kVectorBytes / sizeof(T);
  if (vector_rows(dq, bp.dq_strides.row, head_dim)) {
    for (int64_t c = part * kWidth; c < head_dim; c += kThreads * kWidth) {
      *reinterpret_cast<uint4*>(dq + c) = make_uint4(0, 0, 0, 0);
    }
  } else {
    for (int64_t c = part; c < head_dim; c += kThreads) dq[c] = from_float<T>(0.f);
  }
}

// kDeltaInKernel: the Hopper kernel sums rowsum(dO * O) itself (sm90/bwd_step_delta.h); delta and the statistics
// blocks' D then get -dlse (or 0) only, O and dO are not read, and a thread takes a row. Grid: (ceil(max_seqlen_q /
// preprocess_rows), heads, batch).
template <typename T, bool kDeltaInKernel = false>
__global__ void __launch_bounds__(kRowwiseThreads) bwd_preprocess_kernel(const BwdParams bp, DqLayout layout,
                                                                          DqPrep prep, int box_rows) {
  constexpr int kThreads = preprocess_row_threads<kDeltaInKernel>();
  constexpr int kRows = preprocess_rows<kDeltaInKernel>();
  const FwdParams& p = bp.fwd;
  const int b = blockIdx.z;
  const int h = blockIdx.y;
  const SeqInfo si = seq_info(p.shape, b);
  const int row = blockIdx.x * kRows + threadIdx.x / kThreads;
  const int part = threadIdx.x % kThreads;
  if (blockIdx.x * kRows >= si.seqlen_q) return;
  const bool active = row < si.seqlen_q;
  const BwdWorkspace w = bwd_workspace(bp, layout);
  float* stats = w.stats == nullptr ? nullptr
                                    : w.stats + h * w.stats_head_stride +
                                          bwd_stats_block0(si.global_q_row0, b) * 2 * kBwdStatsRows;
  // The CTA of the sequence's last row pads its last statistics blocks (bwd_stats_padded_rows): rows past the end
  // see no key (LSE +inf, P = 0) and add nothing (D = 0).
  if (stats != nullptr && blockIdx.x == (si.seqlen_q - 1) / kRows) {
    const int64_t padded = bwd_stats_padded_rows(si.seqlen_q);
    for (int64_t r = si.seqlen_q + threadIdx.x; r < padded; r += kRowwiseThreads) {
      float* block = stats + r / kBwdStatsRows * 2 * kBwdStatsRows;
      block[r % kBwdStatsRows] = INFINITY;
      block[kBwdStatsRows + r % kBwdStatsRows] = 0.f;
    }
  }
  const int64_t head_dim = p.shape.head_dim;

  float dot = 0.f;
  if (active && !kDeltaInKernel) {
    const T* o = static_cast<const T*>(p.out) + b * p.out_strides.batch + (si.q_row0 + row) * p.out_strides.row +
                 h * p.out_strides.head;
    const T* d_o = static_cast<const T*>(bp.dout) + b * bp.dout_strides.batch +
                   (si.q_row0 + row) * bp.dout_strides.row + h * bp.dout_strides.head;
    constexpr int kWidth = kVectorBytes / sizeof(T);
    if (vector_rows(o, p.out_strides.row, head_dim) && vector_rows(d_o, bp.dout_strides.row, head_dim)) {
      for (int64_t c = part * kWidth; c < head_dim; c += kThreads * kWidth) {
        const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
        const uint4 dv = *reinterpret_cast<const uint4*>(d_o + c);
        const T* oe = reinterpret_cast<const T*>(&ov);
        const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
        for (int e = 0; e < kWidth; ++e) dot += to_float(oe[e]) * to_float(de[e]);
      }
    } else {
      for (int64_t c = part; c < head_dim; c += kThreads) dot += to_float(o[c]) * to_float(d_o[c]);
    }
  }
#pragma unroll
  for (int offset = kThreads / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
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
  if (prep == DqPrep::kNone) return;
  if (prep == DqPrep::kFused) {
    // The main kernel's key count (seqused_k included) and diagonal, as its walks see them (sm90/kernel_common.h).
    const int64_t keys = p.shape.cu_seqlens_q == nullptr ? used_keys(p.shape, b, si.seqlen_k) : si.seqlen_k;
    const KeyRange seen = visible_keys(p.mask, row, diagonal_offset(p.mask, si.seqlen_q, keys), keys);
    if (seen.end <= seen.begin) zero_dq_row<T, kThreads>(bp, b, si.q_row0 + row, h, part);
    if (row < si.seqlen_q / box_rows * box_rows) return;
  }
  const float4 zeros = make_float4(0.f, 0.f, 0.f, 0.f);
  const bool pair_tail = layout == DqLayout::kRowPairs && global_row % 2 == 0 && row + 1 == si.seqlen_q;
  const int64_t zeroed = pair_tail ? 2 : 1;
  for (int64_t split = 0; split < bp.dq_splits; ++split) {
    float* acc = w.dq_accum + split * w.dq_split_stride + h * w.dq_head_stride + global_row * w.dq_row_stride;
    for (int64_t c = part * 4; c < zeroed * w.dq_row_stride; c += kThreads * 4) {
      *reinterpret_cast<float4*>(acc + c) = zeros;
    }
  }
}

}  // namespace flash::sm80::bwd
