// Which blocks the Hopper kernels visit under a mask (common/mask.h's rule), host/device so that
// tests/test_sm90_block_ranges.py can check them against brute force on CPU: the key blocks a tile of query rows sees
// and those it sees whole (no mask needed), the query blocks that see a block of keys, and whether a (query block, key
// block) pair needs the per-element mask, and that mask's 32-bit ranges local to a block. visible_keys' begin and end
// never decrease with the row, so a tile's first and last rows bound every row in between.
#pragma once

#include <cstdint>

#include "flash_attn/common/host_device.h"
#include "flash_attn/common/mask.h"
#include "flash_attn/params.h"

namespace flash::sm90 {

struct KeyBlocks {
  int n_min;    // key blocks [n_min, n_max) hold every key some row of the tile sees
  int n_max;
  int full_lo;  // key blocks [full_lo, full_hi) are seen whole by every row of the tile (may be empty)
  int full_hi;
};

// Rows [row_first, row_first + block_m) of a sequence (those below seqlen_q, at least one), keys in blocks of block_n.
FLASH_HOST_DEVICE KeyBlocks key_blocks_of_rows(const MaskParams& mask, int64_t row_first, int block_m,
                                               int64_t seqlen_q, int64_t seqlen_k, int64_t offset, int block_n) {
  const int64_t row_last = (row_first + block_m < seqlen_q ? row_first + block_m : seqlen_q) - 1;
  const KeyRange first_keys = visible_keys(mask, row_first, offset, seqlen_k);
  const KeyRange last_keys = visible_keys(mask, row_last, offset, seqlen_k);
  const int64_t key_begin = first_keys.begin > 0 ? first_keys.begin : 0;
  const int64_t key_end = last_keys.end < seqlen_k ? last_keys.end : seqlen_k;
  KeyBlocks blocks;
  blocks.n_min = static_cast<int>(key_begin / block_n);
  blocks.n_max = key_end > key_begin ? static_cast<int>((key_end + block_n - 1) / block_n) : blocks.n_min;
  const int64_t full_begin = last_keys.begin > 0 ? last_keys.begin : 0;
  const int64_t full_end = first_keys.end < seqlen_k ? first_keys.end : seqlen_k;
  blocks.full_lo = static_cast<int>((full_begin + block_n - 1) / block_n);
  blocks.full_hi = full_end > 0 ? static_cast<int>(full_end / block_n) : 0;
  return blocks;
}

struct QueryRows {
  int64_t begin;  // rows [begin, end) hold every row that sees some key of the block
  int64_t end;
};

// The query rows that see any key of [key0, key1) (window or causal; all of [0, seqlen_q) without a mask).
FLASH_HOST_DEVICE QueryRows rows_seeing_keys(const MaskParams& mask, int64_t key0, int64_t key1, int64_t offset,
                                             int64_t seqlen_q) {
  QueryRows rows{0, seqlen_q};
  if (mask.window_right != kUnboundedWindow) {
    const int64_t lo = key0 - offset - mask.window_right;  // end(q) = q + offset + right + 1 > key0
    rows.begin = lo > 0 ? lo : 0;
  }
  if (mask.window_left != kUnboundedWindow) {
    const int64_t hi = key1 - offset + mask.window_left;  // begin(q) = q + offset - left <= key1 - 1
    rows.end = hi < seqlen_q ? hi : seqlen_q;
  }
  return rows;
}

// The query rows that see key `key`: none past seqlen_k, so (query, key) is visible exactly when the query lies in
// them (the backward's per-element mask of one key row).
FLASH_HOST_DEVICE QueryRows rows_seeing_key(const MaskParams& mask, int64_t key, int64_t offset, int64_t seqlen_q,
                                            int64_t seqlen_k) {
  if (key >= seqlen_k) return QueryRows{0, 0};
  return rows_seeing_keys(mask, key, key + 1, offset, seqlen_q);
}

// [lo, hi): the columns of a block's `width` columns, counted from column0, that lie in [begin, end), clamped to [0,
// width] so that they fit 32-bit registers. A thread's per-element mask is then two 32-bit compares of each
// element's compile-time column offset, instead of 64-bit compares of its absolute column (two ISETP each).
struct LocalRange {
  int lo;
  int hi;
};
FLASH_HOST_DEVICE LocalRange local_range(int64_t begin, int64_t end, int64_t column0, int width) {
  const int64_t lo = begin - column0;
  const int64_t hi = end - column0;
  return LocalRange{static_cast<int>(lo < 0 ? 0 : (lo > width ? width : lo)),
                    static_cast<int>(hi < 0 ? 0 : (hi > width ? width : hi))};
}
FLASH_HOST_DEVICE bool in_local_range(const LocalRange& range, int column) {
  return column >= range.lo && column < range.hi;
}

// One key block's backward work: its keys, the query blocks that see them, and the (query head, query block) steps.
struct BwdBlock {
  int64_t key0;
  bool has_keys;  // false: a varlen sequence shorter than this block
  int m_min;
  int m_count;
  int steps;
  int rotation;  // each head's walk starts at query block m_min + rotation and wraps (0 unless rotated)
};

// Key block n_block of a sequence of seq_blocks key blocks, walked for `heads` query heads (head-major steps). rotates:
// without a mask every key block sees every query block, and key block n (the (seq_blocks - 1 - n)-th to add into a
// query block in the ordered dQ's order, sm90/bwd_ordered_dq.h) starts that far along, spread over the query blocks,
// so the key blocks reach a query block a few steps apart in the order they add into it.
FLASH_HOST_DEVICE BwdBlock plan_key_block(const MaskParams& mask, int n_block, int block_m, int block_n,
                                          int64_t seqlen_q, int64_t seqlen_k, int64_t offset, int heads, int seq_blocks,
                                          bool rotates) {
  BwdBlock block{static_cast<int64_t>(n_block) * block_n, false, 0, 0, 0, 0};
  block.has_keys = block.key0 < seqlen_k;
  if (!block.has_keys) return block;
  const int64_t key1 = block.key0 + block_n < seqlen_k ? block.key0 + block_n : seqlen_k;
  const QueryRows rows = rows_seeing_keys(mask, block.key0, key1, offset, seqlen_q);
  block.m_min = static_cast<int>(rows.begin / block_m);
  const int m_max = rows.end > rows.begin ? static_cast<int>((rows.end + block_m - 1) / block_m) : block.m_min;
  block.m_count = m_max - block.m_min;
  block.steps = heads * block.m_count;  // (query head, query block) pairs
  if (rotates && block.m_count > 0) {
    const int64_t position = seq_blocks - 1 - n_block;
    block.rotation = static_cast<int>(position * block.m_count / seq_blocks % block.m_count);
  }
  return block;
}

// The query block of step i of a block (its query head: i / m_count of the walked heads).
FLASH_HOST_DEVICE int step_query_block(const BwdBlock& block, int i) {
  int local = i % block.m_count + block.rotation;
  if (local >= block.m_count) local -= block.m_count;
  return block.m_min + local;
}

// Whether key block n_other (planned as `other`) adds into query block m_block of walked head head_index before key
// block n_block does at its step `step`, in the ordered dQ's order: arrival order, those that reach it at an earlier
// step or at the same step with a higher index; otherwise every higher key block that sees it.
FLASH_HOST_DEVICE bool dq_adds_before(const BwdBlock& other, int n_other, int n_block, int head_index, int m_block,
                                      int step, bool arrival_order) {
  const int local = m_block - other.m_min;
  if (n_other == n_block || local < 0 || local >= other.m_count) return false;
  if (!arrival_order) return n_other > n_block;
  int walked = local - other.rotation;
  if (walked < 0) walked += other.m_count;
  const int other_step = head_index * other.m_count + walked;
  return other_step < step || (other_step == step && n_other > n_block);
}

// Whether some (query, key) pair of query rows [q0, q0 + block_m) and keys [key0, key0 + block_n) is out of range or
// masked: the backward's per-step test.
FLASH_HOST_DEVICE bool block_pair_needs_mask(const MaskParams& mask, bool masked_kind, int64_t q0, int block_m,
                                             int64_t key0, int block_n, int64_t seqlen_q, int64_t seqlen_k,
                                             int64_t offset) {
  if (q0 + block_m > seqlen_q || key0 + block_n > seqlen_k) return true;
  if (!masked_kind) return false;
  const KeyRange first = visible_keys(mask, q0, offset, seqlen_k);
  const KeyRange last = visible_keys(mask, q0 + block_m - 1, offset, seqlen_k);
  return last.begin > key0 || first.end < key0 + block_n;
}

}  // namespace flash::sm90
