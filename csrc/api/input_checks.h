// Input validation of the flash_attn ops and the translation of checked tensors into FwdParams / BwdParams.
// Every message names the argument, the requirement, what was received and, where it helps, the fix.
// Only csrc/api/ includes torch; what it hands down is the plain params structs.
#pragma once

#include <torch/library.h>

#include <optional>

#include "flash_attn/params.h"

namespace flash::api {

// The call's tensors after checking: sizes read once; varlen lengths validated on CPU (see check_call).
struct CheckedCall {
  FwdParams params;
  bool varlen = false;
  int64_t total_q = 0;  // rows of q (varlen) or batch * seqlen_q
  int64_t total_k = 0;
  // Varlen: whether q (k) may have rows past cu_seqlens[-1], which belong to no sequence, so the kernels never
  // write them and their outputs / gradients must start at 0. Read from the values on CPU; always true for
  // CUDA calls, whose cu_seqlens values are never read on the host (that would synchronise with the stream).
  bool unowned_rows_q = false;
  bool unowned_rows_k = false;
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
};

// Checks q, k, v and every option; fills params except the output pointers. cu_seqlens values (start at 0,
// non-decreasing, within the tensors, max_seqlen >= every length) and seqused_k values (in [0, seqlen_k]) are
// validated for CPU tensors only: for CUDA tensors only their dtype, device and shape are checked, so a CUDA
// call never synchronises with the host.
CheckedCall check_call(const char* op, const CallArgs& args);

DType to_dtype(at::ScalarType type);

// Element strides of a (batch, seqlen, heads, dim) tensor, or of a varlen (total, heads, dim) one.
TensorStrides strides_of(const at::Tensor& t, bool varlen);

// Checks that `t` has the sizes, dtype and device of `like` and a unit last stride; names it in the message.
void check_same_layout(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like);

}  // namespace flash::api
