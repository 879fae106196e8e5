// The host<->kernel contract of the rotary embedding (flash_attn.layers.rotary, flash_attn_with_kvcache's rotary_cos /
// rotary_sin): x (batch, seqlen, nheads, head_dim), or varlen (total, nheads, head_dim) with cu_seqlens, rotated in its
// first rotary_dim columns at position seqlen_offset(b) + row by cos / sin (seqlen_ro, rotary_dim / 2). Built by
// csrc/api/rotary_api.cpp; read by csrc/cpu/rotary_cpu.cpp and csrc/sm80/rotary_kernel.cu. No torch types.
#pragma once

#include <cstdint>

#include "flash_attn/params.h"

namespace flash {

struct RotaryParams {
  DType dtype = DType::kFloat16;  // of x, out, cos and sin alike
  const void* x = nullptr;
  void* out = nullptr;  // may equal x (in place): each element is read before it is written, by the same thread
  TensorStrides x_strides;    // batch stride 0 for varlen
  TensorStrides out_strides;
  const void* cos = nullptr;  // (seqlen_ro, rotary_dim / 2), rows cos_row_stride elements apart; sin likewise
  const void* sin = nullptr;
  int64_t cos_row_stride = 0;
  int64_t sin_row_stride = 0;
  int64_t batch = 0;
  int64_t seqlen = 0;  // dense: x.shape[1]; varlen: max_seqlen (longer sequences are cut there)
  int64_t nheads = 0;
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;  // even, <= head_dim; columns past it are copied unchanged
  int64_t seqlen_ro = 0;   // rows of cos / sin: a position outside [0, seqlen_ro) is left unrotated
  // Varlen: int32 (batch + 1,) prefix sums, read through varlen_rows() (clamped to total_rows); null when dense.
  const int32_t* cu_seqlens = nullptr;
  int64_t total_rows = 0;
  // Position of row 0 of sequence b: seqlen_offset, plus seqlen_offsets[b] when given (int32 or int64).
  int64_t seqlen_offset = 0;
  const void* seqlen_offsets = nullptr;
  bool seqlen_offsets_int64 = false;
  bool interleaved = false;  // rotate pairs (2i, 2i + 1) (GPT-J) instead of (i, i + rotary_dim / 2) (GPT-NeoX)
  bool conjugate = false;    // rotate by -angle: the backward
};

}  // namespace flash
