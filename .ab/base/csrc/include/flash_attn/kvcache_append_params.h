// The host<->kernel contract of flash_attn_with_kvcache's append (torch.ops.flash_attn.kvcache_append_): the new
// rows k, v (batch, new_rows, nheads_k, head_dim) written in place into a cache at each sequence's length, k (and q,
// into q_out, when given) rotated by the rotary tables when given, and the attention's key counts returned. Built by
// csrc/api/kvcache_append_api.cpp; read by csrc/cpu/kvcache_append_cpu.cpp and csrc/sm80/kvcache_append_kernel.cu.
#pragma once

#include <cstdint>

#include "flash_attn/params.h"

namespace flash {

// An optional int32 or int64 (batch,) or (batch, n) index tensor.
struct IndexArg {
  const void* data = nullptr;  // null: not given
  bool int64 = false;
  int64_t row_stride = 0;  // elements between rows of a 2-D index (the block table)
};

struct KvAppendParams {
  DType dtype = DType::kFloat16;  // of the caches, k, v and the rotary tables alike
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  TensorStrides k_cache_strides;  // batch: between cache entries (pages when paged); row; head
  TensorStrides v_cache_strides;
  const void* k = nullptr;
  const void* v = nullptr;
  TensorStrides k_strides;
  TensorStrides v_strides;
  int64_t batch = 0;
  int64_t new_rows = 0;
  int64_t nheads_k = 0;
  int64_t head_dim = 0;
  int64_t cache_entries = 0;  // cache.shape[0]: entries, or pages when paged
  int64_t cache_rows = 0;     // rows of one sequence: cache.shape[1], or pages per sequence x page_size
  IndexArg lengths;           // (batch,) rows before the new ones; clamped to [0, cache_rows - new_rows]
  IndexArg entries;           // (batch,) cache entry of each sequence (default b); clamped to the entries
  IndexArg pages;             // (batch, pages per sequence) block table; clamped to the pages; null: not paged
  int64_t page_size = 0;
  IndexArg leftpad;           // (batch,) first cache row of each sequence; clamped to [0, cache_rows]
  // Rotary tables (seqlen_ro, rotary_dim / 2), null when k is not rotated: new row i of sequence b rotates at
  // position length - leftpad + i (GPT-J pairs when interleaved); positions outside the table stay unrotated.
  const void* cos = nullptr;
  const void* sin = nullptr;
  int64_t cos_row_stride = 0;
  int64_t sin_row_stride = 0;
  int64_t rotary_dim = 0;
  int64_t seqlen_ro = 0;
  bool interleaved = false;
  // The queries (batch, seqlen_q, nheads_q, head_dim), rotated into q_out in the same launch when the tables are
  // given (null: not rotated here): row i of sequence b at position length - leftpad + (q_per_row ? i : 0), Dao's
  // rule (per row when the call is causal or local, else the sequence's one position).
  const void* q = nullptr;
  void* q_out = nullptr;
  TensorStrides q_strides;
  TensorStrides q_out_strides;
  int64_t seqlen_q = 0;
  int64_t nheads_q = 0;
  bool q_per_row = false;
  // (batch,) int32 out: the keys sequence b's attention sees, max(length + new_rows - leftpad, 0); null: not written
  // (the decode kernels count them themselves, AttentionShape::appended_keys).
  int32_t* seqused = nullptr;
};

}  // namespace flash
