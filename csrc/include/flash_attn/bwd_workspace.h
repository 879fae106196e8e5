// Scratch memory of the CUDA backward: its size (for the API layer, which allocates it) and its layout (for
// the kernels). fp32 arrays: delta = rowsum(dO * O) - dlse per (q head, row); dq_accum, dq_splits accumulators of
// dQ per (q head, row, head-dim column); for the Hopper kernel, split dK / dV accumulators and the statistics in
// query blocks. Header-only and torch-free.
#pragma once

#include <cstdint>

#include "flash_attn/common/host_device.h"
#include "flash_attn/common/mask.h"
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

// How the main kernel lays out dq_accum rows (the kernel's choice, sm80/bwd_common.h bwd_dq_layout; the dq conversion
// follows it). kRows: row r at r * dq_row_stride, a 2D tensor for the bulk tensor reductions of the kernels that stage
// dQ. kRowPairs: rows 2k and 2k + 1 share 2 * dq_row_stride floats, one slot group after the other, each group as 32
// floats (row 2k's 16 slots, then row 2k + 1's), so the 16-byte reductions of a warp over 8 consecutive rows of one
// slot group fill four whole 128-byte lines instead of eight halves. Both layouts step 8 rows by 8 * dq_row_stride.
enum class DqLayout { kRows, kRowPairs };
FLASH_HOST_DEVICE constexpr int64_t dq_group_step(DqLayout layout) {
  return layout == DqLayout::kRows ? kDqSlotGroup : 2 * kDqSlotGroup;
}
// Offset of (row, physical column: slot group * kDqSlotGroup + slot) within a head's accumulator rows.
FLASH_HOST_DEVICE constexpr int64_t dq_offset(DqLayout layout, int64_t row, int64_t column, int64_t row_stride) {
  return layout == DqLayout::kRows
             ? row * row_stride + column
             : (row / 2) * 2 * row_stride + (row % 2) * kDqSlotGroup + (column / kDqSlotGroup) * dq_group_step(layout) +
                   column % kDqSlotGroup;
}

// BwdParams::block_stats: per q head, blocks of kBwdStatsRows LSE values (log2 units) then the same rows' D, so one
// 512-byte bulk copy brings a 64-row query block's statistics, and two adjacent blocks a 128-row one's. Sequence b's
// rows start at block bwd_stats_block0 (the workspace row plus kBwdStatsSequenceRows per earlier sequence, rounded
// down to a multiple of kBwdStatsSequenceRows), so no two sequences share a block and a sequence's 128-row query
// blocks are whole block pairs; rows past a sequence's end, up to its next multiple of kBwdStatsSequenceRows, hold
// LSE +inf (P = 0) and D = 0.
constexpr int64_t kBwdStatsRows = 64;
constexpr int64_t kBwdStatsSequenceRows = 128;  // the longest query block a backward kernel reads (bwd_tile_config)
constexpr int64_t kBwdStatsBlocksPerSequenceUnit = kBwdStatsSequenceRows / kBwdStatsRows;
FLASH_HOST_DEVICE constexpr int64_t bwd_stats_block0(int64_t global_q_row0, int64_t batch_index) {
  return (global_q_row0 + kBwdStatsSequenceRows * batch_index) / kBwdStatsSequenceRows *
         kBwdStatsBlocksPerSequenceUnit;
}
// A sequence's rows with statistics: its length rounded up to kBwdStatsSequenceRows (the rest padded as above).
FLASH_HOST_DEVICE constexpr int64_t bwd_stats_padded_rows(int64_t seqlen_q) {
  return (seqlen_q + kBwdStatsSequenceRows - 1) / kBwdStatsSequenceRows * kBwdStatsSequenceRows;
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

constexpr bool kBwdSplitsHeads = true;
constexpr int64_t kBwdHeadSplitKeysPerCta = 128;  // the portable plain tiles' key block up to hd 128 (bwd_common.h)

// The masked calls' target in CTAs per SM (bwd_head_splits). From kBwdHeadSplitLongKeys keys a causal CTA of a
// 128-key block walks enough query blocks that twice the CTAs pay: H100, bf16, hd 128, 16k tokens, 32 query heads,
// causal, TFLOP/s at 4 -> 8 per SM (FA2's varlen kernels on K / V repeated to the query heads; sixty-second session
// A/B, 2-3 rounds): 32/8 at 2k / 4k / 16k 235 / 251-259 / 322-327 -> 246 / 281-286 / 332-343 (FA2 231 / 274 / 316),
// 32/4 245 / 275 / 331 -> 252 / 292 / 336, 32/1 level; hd 64 64/8 at 2k / 4k 228 / 255 -> 235 / 269. At 1k the same
// split lost 2-4 % on 32/8 (202 -> 193-197), so shorter keys keep 4, and so do (sixty-third session, 2k / 4k, 8 ->
// 4 per SM) windows (hd 64 64/8 causal window 171 / 216 -> 179 / 221, non-causal level) and the head dims past
// kBwdHeadSplitLongKeysMaxHeadDim, whose smaller key blocks already give twice the CTAs this count assumes (hd 256
// 16/8 causal 193 / 219 -> 204 / 239, windows 181 / 217 -> 204 / 240, causal 141 / 183 -> 173 / 203).
constexpr int64_t kBwdHeadSplitCtasPerSm = 4;
constexpr int64_t kBwdHeadSplitCtasPerSmLongKeys = 8;
constexpr int64_t kBwdHeadSplitLongKeys = 2048;
constexpr int64_t kBwdHeadSplitLongKeysMaxHeadDim = 128;
constexpr int64_t bwd_head_split_ctas_per_sm(int64_t seqlen_k, int64_t head_dim, MaskKind mask) {
  const bool long_causal =
      mask == MaskKind::kCausal && seqlen_k >= kBwdHeadSplitLongKeys && head_dim <= kBwdHeadSplitLongKeysMaxHeadDim;
  return long_causal ? kBwdHeadSplitCtasPerSmLongKeys : kBwdHeadSplitCtasPerSm;
}

// How many CTAs per key block share a KV head's query heads in the portable backward (BwdParams::head_splits; the
// Hopper backward has its own rule, dispatch/sm90_policy.h). A CTA sums dK and dV of its key block over every query
// head of its group, so MQA / GQA grids are small, and causal masks give the first key blocks the most work. Masked
// calls split until the grid has bwd_head_split_ctas_per_sm CTAs per SM (the longest blocks first, the rest fill in
// behind them); unmasked ones only while the split grid still fits in one wave, since a second wave costs more than
// the idle SMs of a nearly full one. The splits add into fp32 accumulators (2 x total_k x nheads_k x the padded head
// dim, bounded by the small grid) and a conversion follows. Deterministic calls keep one CTA per group (the
// additions' order would vary). H200, bf16, hd 128, 4 x 4k, 32 query heads, TFLOP/s without / with the split at 4 CTAs
// per SM, FA2 in brackets (twenty-second session A/B): causal 32/1 158 / 296 (261), 32/4 243 / 268 (258); 32/1
// non-causal split in two 328 / 314 (292), hence the one-wave rule (128 CTAs on 132 SMs: no split).
inline int64_t bwd_head_splits(const BwdParams& params, int num_sms) {
  const AttentionShape& s = params.fwd.shape;
  if (!kBwdSplitsHeads || params.deterministic || s.nheads_k < 1 || s.nheads_q % s.nheads_k != 0) return 1;
  const int64_t group = s.nheads_q / s.nheads_k;
  const MaskKind mask = mask_kind(params.fwd.mask);
  const bool masked = mask != MaskKind::kNone;
  const int64_t ctas = (s.seqlen_k + kBwdHeadSplitKeysPerCta - 1) / kBwdHeadSplitKeysPerCta * s.nheads_k * s.batch;
  const int64_t masked_target = bwd_head_split_ctas_per_sm(s.seqlen_k, s.head_dim, mask) * num_sms;
  int64_t splits = 1;
  while (splits < group) {
    int64_t next = splits + 1;
    while (group % next != 0) ++next;
    const bool enough = masked ? ctas * splits >= masked_target : ctas * next > num_sms;
    if (enough) break;
    splits = next;
  }
  return splits;
}

struct BwdWorkspace {
  float* delta;     // [nheads_q][delta_row_stride]
  // [dq_splits][nheads_q][dq_head_rows][dq_row_stride], columns interleaved (dq_slot), rows as DqLayout says
  float* dq_accum;
  int64_t delta_head_stride;
  int64_t dq_row_stride;
  int64_t dq_head_rows;  // total_q; with kRowPairs rounded up to whole pairs
  int64_t dq_head_stride;
  int64_t dq_split_stride;
  // With head_splits > 1: dK then dV accumulators, [total_k][nheads_k][dkv_row_stride] each (the head dim rounded up
  // like dq's rows), plain columns; null otherwise.
  float* dk_accum;
  float* dv_accum;
  int64_t dkv_row_stride;
  int64_t dkv_floats;  // of each
  // With block_stats: [nheads_q][stats_head_stride] (blocks of 2 x kBwdStatsRows floats); null otherwise.
  float* stats;
  int64_t stats_head_stride;
  // With block_stats: one counter per statistics block, [nheads_q][semaphore_head_stride], zeroed before the main
  // kernel: how many key blocks have added into that query block's dQ rows (the Hopper backward's ordered dQ,
  // deterministic or fused: sm90/bwd_tile_config.h bwd_orders_dq, bwd_fuses_dq); null otherwise.
  int* dq_semaphores;
  int64_t semaphore_head_stride;
};

// The layout for params (total_q, dq_splits, head dim, heads) and the main kernel's dq layout; pointers into
// params.workspace (may be null when only the size is wanted).
FLASH_HOST_DEVICE BwdWorkspace bwd_workspace(const BwdParams& params, DqLayout layout) {
  const AttentionShape& s = params.fwd.shape;
  BwdWorkspace w{};
  w.delta_head_stride = (params.total_q + kBwdAlignFloats - 1) / kBwdAlignFloats * kBwdAlignFloats;
  w.dq_row_stride = bwd_padded_head_dim(s.head_dim);
  w.dq_head_rows = layout == DqLayout::kRowPairs ? (params.total_q + 1) / 2 * 2 : params.total_q;
  w.dq_head_stride = w.dq_head_rows * w.dq_row_stride;
  w.dq_split_stride = s.nheads_q * w.dq_head_stride;
  w.dkv_row_stride = w.dq_row_stride;
  w.dkv_floats = params.head_splits > 1 ? s.total_k * s.nheads_k * w.dkv_row_stride : 0;
  float* base = static_cast<float*>(params.workspace);
  w.delta = base;
  w.dq_accum = base == nullptr ? nullptr : base + s.nheads_q * w.delta_head_stride;
  // The regions after the dq accumulators start where the longer (kRowPairs) layout's end, so the kernels and the
  // conversion passes find them at the same place whichever dq layout each was given.
  const int64_t pair_split_stride = s.nheads_q * ((params.total_q + 1) / 2 * 2) * w.dq_row_stride;
  float* dkv = w.dq_accum == nullptr ? nullptr : w.dq_accum + params.dq_splits * pair_split_stride;
  w.dk_accum = w.dkv_floats > 0 ? dkv : nullptr;
  w.dv_accum = w.dkv_floats > 0 && dkv != nullptr ? dkv + w.dkv_floats : nullptr;
  // With U = kBwdStatsSequenceRows and B = kBwdStatsBlocksPerSequenceUnit, a sequence's last block,
  // bwd_stats_block0(row0, b) + B ceil(length / U) - 1, is at most B (total_q / U + b + 1) - 1, below
  // B (ceil(total_q / U) + batch + 1) for any rows inside total_q (varlen rows are clamped to it).
  const int64_t stats_blocks =
      kBwdStatsBlocksPerSequenceUnit * ((params.total_q + kBwdStatsSequenceRows - 1) / kBwdStatsSequenceRows + s.batch + 1);
  w.stats_head_stride = params.block_stats ? stats_blocks * 2 * kBwdStatsRows : 0;
  w.stats = params.block_stats && dkv != nullptr ? dkv + 2 * w.dkv_floats : nullptr;
  w.semaphore_head_stride = params.block_stats ? stats_blocks : 0;
  w.dq_semaphores = w.semaphore_head_stride > 0 && w.stats != nullptr
                        ? reinterpret_cast<int*>(w.stats + s.nheads_q * w.stats_head_stride)
                        : nullptr;
  return w;
}

// Enough for either dq layout (kRowPairs has the longer heads).
inline int64_t bwd_workspace_bytes(const BwdParams& params) {
  const BwdWorkspace w = bwd_workspace(params, DqLayout::kRowPairs);
  static_assert(sizeof(int) == sizeof(float), "a semaphore takes one float's place");
  const int64_t floats =
      params.fwd.shape.nheads_q * (w.delta_head_stride + w.stats_head_stride + w.semaphore_head_stride) +
      params.dq_splits * w.dq_split_stride + 2 * w.dkv_floats;
  return floats * static_cast<int64_t>(sizeof(float));
}

}  // namespace flash
