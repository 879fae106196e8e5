// Input validation of the flash_attn ops and the translation of checked tensors into FwdParams / BwdParams.
// Every message names the argument, the requirement, what was received and, where it helps, the fix.
// Only csrc/api/ includes torch; what it hands down is the plain params structs.
#pragma once

#include <torch/library.h>

#include <optional>

#include "checked_values_cache.h"
#include "flash_attn/params.h"

namespace flash::api {

// The call's tensors after checking: sizes read once; varlen lengths validated on CPU (see check_call).
struct CheckedCall {
  FwdParams params;
  bool varlen = false;
  int64_t total_q = 0;  // rows of q (varlen) or batch * seqlen_q
  int64_t total_k = 0;
  // Varlen: whether q (k) may have rows past cu_seqlens[-1], which belong to no sequence, so the kernels never
  // write them and their outputs / gradients must start at 0. From the values where this call read them; true
  // otherwise (a remembered check, CUDA-graph capture, or FLASH_ATTN_CHECK_DEVICE_VALUES=0).
  bool unowned_rows_q = false;
  bool unowned_rows_k = false;
  // Varlen: whether both cu_seqlens passed the checks (in this call or remembered). Every row before cu_seqlens[-1]
  // then belongs to a sequence and a device kernel zeroes the rows past it (flash_api.cpp zero_unowned_rows);
  // unchecked values (capture, checks off) may leave rows inside uncovered, so the outputs are zero-filled instead.
  bool cu_seqlens_passed = false;
  // No query row, no key or no sequence: every output row (if any) is 0 with lse +inf, and no kernel runs.
  bool no_work = false;
  at::Tensor cu_seqlens_q_device;  // varlen: what params.shape points at, on the call's device
  at::Tensor cu_seqlens_k_device;
  at::Tensor seqused_k_device;  // dense calls with seqused_k: what params.shape points at
};

struct CallArgs {
  const at::Tensor& q;
  const at::Tensor& k;
  const at::Tensor& v;
  const std::optional<at::Tensor>& cu_seqlens_q;
  const std::optional<at::Tensor>& cu_seqlens_k;
  int64_t max_seqlen_q;
  int64_t max_seqlen_k;
  double dropout_p;
  double softmax_scale;
  int64_t window_left;
  int64_t window_right;
  bool bottom_right;
  double softcap;
  const std::optional<at::Tensor>& alibi_slopes;
  const std::optional<at::Tensor>& attn_bias;
  const std::optional<at::Tensor>& rng_state;
  const std::optional<at::Tensor>& seqused_k;
  // > 0: k and v are a paged cache's (num_pages, page_size, nheads_k, head_dim) pools (check_paged_cache) and each
  // sequence has this many rows (block_table's width x page_size); 0: dense or varlen k / v.
  int64_t paged_rows = 0;
};

// Checks q, k, v and every option; fills params except the output pointers. cu_seqlens values (start at 0,
// non-decreasing, within the tensors, max_seqlen >= every length) are validated on CPU always and on CUDA once per
// tensor version (checked_values_cache.h: one synchronisation the first time a tensor is seen, none under CUDA-graph
// capture). seqused_k values (in [0, seqlen_k]) are validated for CPU tensors; the kernels clamp them on CUDA.
CheckedCall check_call(const char* op, const CallArgs& args);

// A paged cache call (the fwd op's block_table): k / v 4-D pools (num_pages, page_size, nheads_k, head_dim) of one
// shape, block_table a 2-D int32 (batch, pages per sequence) tensor on q's device, q dense, and seqused_k given
// (the pages past a sequence's length are never read). Returns the rows per sequence (pages per sequence x
// page_size). Table values are the caller's to check (flash_attn/paged_kv.py); the kernels clamp them.
int64_t check_paged_cache(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& block_table, bool varlen, bool has_seqused_k);

DType to_dtype(at::ScalarType type);

// Checks the values of a cu_seqlens tensor (start at 0, non-decreasing, last entry <= total, no length above
// max_seqlen): on CPU always, on CUDA once per tensor version (checked_values_cache.h). Returns its last entry when
// this call read the values, nullopt otherwise (remembered, CUDA-graph capture, or checks turned off). *passed (when
// given): whether the values passed, in this call or in a remembered one.
std::optional<int64_t> check_cu_seqlens(const char* op, const char* name, const at::Tensor& cu, int64_t total,
                                        int64_t max_seqlen, const char* max_name, const char* tensor_name,
                                        CheckedArgument argument, bool* passed = nullptr);

// Element strides of a (batch, seqlen, heads, dim) tensor, or of a varlen (total, heads, dim) one.
TensorStrides strides_of(const at::Tensor& t, bool varlen);

// Checks that `t` has the sizes, dtype and device of `like` and a unit last stride; names it in the message.
void check_same_layout(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like);

}  // namespace flash::api
