// Scratch memory of the CUDA backward: its size (for the API layer, which allocates it) and its layout (for
// the kernels). Two fp32 arrays: delta = rowsum(dO * O) - dlse per (q head, row), and dq_accum, dq_splits
// accumulators of dQ per (q head, row, head-dim column). Header-only and torch-free.
#pragma once

#include <cstdint>

#include "flash_attn/common/host_device.h"
#include "flash_attn/params.h"

namespace flash {

// dq_accum rows are padded to a multiple of this (the head-dim bucket step), so every kernel instantiation of
// a bucket reads rows of exactly its bucket width.
constexpr int64_t kBwdHeadDimQuantum = 32;
// Deterministic mode gives each CTA its own dq accumulator; this many CTAs per SM (over batch x kv heads x
// splits) keep the GPU busy without multiplying the scratch further.
constexpr int64_t kBwdSplitCtasPerSm = 2;
// Splits are capped at one per this many keys. Where a kernel's key blocks (32 to 128 keys by tile,
// sm80/bwd_common.h) are fewer than the splits, the launcher runs one CTA per key block and the spare
// accumulators stay zero; smaller key blocks only mean more blocks per split.
constexpr int64_t kBwdKeysPerSplit = 64;
constexpr int64_t kBwdAlignFloats = 4;  // 16 bytes

// dq_accum columns are interleaved in groups of kDqSlotGroup: column 2t + j of the group is kept in slot 4t + j
// and column 8 + 2t + j in slot 4t + 2 + j (t < 4, j < 2), the order in which lane t of an mma.m16n8k16 holds
// them across two n8 tiles, so the main kernel adds them with one 16-byte reduction (sm80/bwd_kernel.h).
constexpr int kDqSlotGroup = 16;
FLASH_HOST_DEVICE constexpr int dq_slot(int column_in_group) {
  return column_in_group < 8 ? 2 * column_in_group - column_in_group % 2
                             : 2 * (column_in_group - 8) - column_in_group % 2 + 2;
}

FLASH_HOST_DEVICE int64_t bwd_padded_head_dim(int64_t head_dim) {
  return (head_dim + kBwdHeadDimQuantum - 1) / kBwdHeadDimQuantum * kBwdHeadDimQuantum;
}

// How many dq accumulators a call uses on a GPU with num_sms SMs: 1 unless deterministic.
inline int64_t bwd_dq_splits(const BwdParams& params, int num_sms) {
  if (!params.deterministic) return 1;
  const AttentionShape& s = params.fwd.shape;
  const int64_t ctas = s.batch * s.nheads_k > 0 ? s.batch * s.nheads_k : 1;
  int64_t splits = (kBwdSplitCtasPerSm * num_sms + ctas - 1) / ctas;
  const int64_t key_blocks = (s.seqlen_k + kBwdKeysPerSplit - 1) / kBwdKeysPerSplit;
  if (splits > key_blocks) splits = key_blocks;
  return splits < 1 ? 1 : splits;
}

struct BwdWorkspace {
  float* delta;     // [nheads_q][delta_row_stride]
  float* dq_accum;  // [dq_splits][nheads_q][total_q][dq_row_stride], columns interleaved (dq_slot)
  int64_t delta_head_stride;
  int64_t dq_row_stride;
  int64_t dq_head_stride;
  int64_t dq_split_stride;
};

// The layout for params (total_q, dq_splits, head dim, heads); pointers into params.workspace (may be null
// when only the size is wanted).
FLASH_HOST_DEVICE BwdWorkspace bwd_workspace(const BwdParams& params) {
  const AttentionShape& s = params.fwd.shape;
  BwdWorkspace w{};
  w.delta_head_stride = (params.total_q + kBwdAlignFloats - 1) / kBwdAlignFloats * kBwdAlignFloats;
  w.dq_row_stride = bwd_padded_head_dim(s.head_dim);
  w.dq_head_stride = params.total_q * w.dq_row_stride;
  w.dq_split_stride = s.nheads_q * w.dq_head_stride;
  float* base = static_cast<float*>(params.workspace);
  w.delta = base;
  w.dq_accum = base == nullptr ? nullptr : base + s.nheads_q * w.delta_head_stride;
  return w;
}

inline int64_t bwd_workspace_bytes(const BwdParams& params) {
  const BwdWorkspace w = bwd_workspace(params);
  const int64_t floats = params.fwd.shape.nheads_q * w.delta_head_stride + params.dq_splits * w.dq_split_stride;
  return floats * static_cast<int64_t>(sizeof(float));
}

}  // namespace flash
