// The return_attn_probs output on CUDA (declared in probs_kernel.h): P = exp(z - lse) per (batch, head, row,
// key), z the score after scale, softcap, ALiBi, bias and mask, lse the forward kernel's; sign-flipped where
// dropout dropped (the forward's Philox words), 0 where masked. Semantics of csrc/cpu/attention_cpu.cpp.
// Plain on purpose: one CTA per (16 query rows, head, batch entry), one thread per (row, key) of a 16-key
// tile, fp32 dot products from shared memory. It is a debugging output; nothing here is tuned.
#include "sm80/probs_kernel.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "flash_attn/common/mask.h"
#include "flash_attn/common/philox.h"
#include "flash_attn/common/seqlen.h"
#include "sm80/kernel_common.h"

namespace flash::sm80 {
namespace {

constexpr int kProbsRows = 16;  // query rows per CTA
constexpr int kProbsKeys = 16;  // keys per shared-memory tile
constexpr int kProbsThreads = kProbsRows * kProbsKeys;
// Shared rows are padded by one float so the 16 keys a warp reads at one head-dim index hit 16 banks.
constexpr int kSmemFloatPad = 1;

int64_t smem_row_floats(int64_t head_dim) { return head_dim + kSmemFloatPad; }

template <typename T>
__global__ void __launch_bounds__(kProbsThreads) probs_kernel(const FwdParams p) {
  extern __shared__ float smem[];
  const AttentionShape& shape = p.shape;
  const int64_t head_dim = shape.head_dim;
  const int64_t stride = head_dim + kSmemFloatPad;
  float* s_q = smem;
  float* s_k = smem + kProbsRows * stride;

  const int b = blockIdx.z;
  const int h = blockIdx.y;
  int64_t q_row0 = 0, k_row0 = 0, seqlen_q = shape.seqlen_q, seqlen_k = shape.seqlen_k;
  if (shape.cu_seqlens_q != nullptr) {
    const SequenceRows q_rows = varlen_rows(shape.cu_seqlens_q, b, shape.total_q, shape.seqlen_q);
    const SequenceRows k_rows = varlen_rows(shape.cu_seqlens_k, b, shape.total_k, shape.seqlen_k);
    q_row0 = q_rows.row0;
    seqlen_q = q_rows.length;
    k_row0 = k_rows.row0;
    seqlen_k = k_rows.length;
  }
  seqlen_k = used_keys(shape, b, seqlen_k);
  const int64_t row_begin = static_cast<int64_t>(blockIdx.x) * kProbsRows;
  if (row_begin >= seqlen_q) return;
  const int64_t offset = diagonal_offset(p.mask, seqlen_q, seqlen_k);
  const int64_t hk = h / (shape.nheads_q / shape.nheads_k);
  const T* q = static_cast<const T*>(p.q) + b * p.q_strides.batch + q_row0 * p.q_strides.row + h * p.q_strides.head;
  const T* k = static_cast<const T*>(p.k) + b * p.k_strides.batch + k_row0 * p.k_strides.row + hk * p.k_strides.head;

  const int tid = threadIdx.x;
  for (int64_t idx = tid; idx < kProbsRows * head_dim; idx += kProbsThreads) {
    const int64_t r = idx / head_dim, d = idx % head_dim;
    s_q[r * stride + d] = row_begin + r < seqlen_q ? to_float(q[(row_begin + r) * p.q_strides.row + d]) : 0.f;
  }

  const int r = tid / kProbsKeys;
  const int j = tid % kProbsKeys;
  const int64_t row = row_begin + r;
  const bool row_valid = row < seqlen_q;
  const float* lse = static_cast<const float*>(p.lse) + b * p.lse_batch_stride + h * p.lse_head_stride + q_row0;
  const float row_lse = row_valid ? lse[row] : 0.f;
  const KeyRange keys = visible_keys(p.mask, row, offset, seqlen_k);

  const float scale = static_cast<float>(p.softmax_scale);
  const float softcap = static_cast<float>(p.softcap);
  const float alibi_slope =
      p.mask.alibi_slopes != nullptr ? p.mask.alibi_slopes[b * p.mask.alibi_batch_stride + h] : 0.f;
  const bool dropout = p.dropout.p > 0.0;
  const uint64_t seed = dropout ? static_cast<uint64_t>(p.dropout.rng_state[0]) : 0;
  const uint64_t rng_offset = dropout ? static_cast<uint64_t>(p.dropout.rng_state[1]) : 0;
  const uint64_t keep_threshold = dropout_keep_threshold(p.dropout.p);
  const int64_t batch_head = static_cast<int64_t>(b) * shape.nheads_q + h;
  const ScoreStrides& ps = p.probs_strides;
  T* probs = static_cast<T*>(p.probs) + b * ps.batch + h * ps.head + row * ps.row;

  for (int64_t n0 = 0; n0 < seqlen_k; n0 += kProbsKeys) {
    __syncthreads();
    for (int64_t idx = tid; idx < kProbsKeys * head_dim; idx += kProbsThreads) {
      const int64_t c = idx / head_dim, d = idx % head_dim;
      s_k[c * stride + d] = n0 + c < seqlen_k ? to_float(k[(n0 + c) * p.k_strides.row + d]) : 0.f;
    }
    __syncthreads();
    const int64_t col = n0 + j;
    if (!row_valid || col >= seqlen_k) continue;
    float value = 0.f;
    if (col >= keys.begin && col < keys.end) {
      float z = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) z += s_q[r * stride + d] * s_k[j * stride + d];
      z = softcap > 0.f ? softcap * tanhf(z * (scale / softcap)) : z * scale;
      if (p.mask.alibi_slopes != nullptr) {
        const int64_t distance = row + offset - col;
        z -= alibi_slope * static_cast<float>(distance < 0 ? -distance : distance);
      }
      if (p.mask.bias != nullptr) {
        const ScoreStrides& bs = p.mask.bias_strides;
        z += read_bias(p.mask.bias, p.mask.bias_dtype, b * bs.batch + h * bs.head + row * bs.row + col * bs.col);
      }
      value = expf(z - row_lse);
      if (dropout) {
        const PhiloxBlock words = dropout_words(seed, rng_offset, batch_head, row, col / kPhiloxWordsPerCall);
        // Selected by value, not by a runtime index, so the block stays in registers (no local memory).
        const int w = static_cast<int>(col % kPhiloxWordsPerCall);
        const uint32_t word = w == 0 ? words.word[0] : w == 1 ? words.word[1] : w == 2 ? words.word[2] : words.word[3];
        if (word >= keep_threshold) value = -value;
      }
    }
    probs[col * ps.col] = from_float<T>(value);
  }
}

template <typename T>
void launch(const FwdParams& params, cudaStream_t stream) {
  const AttentionShape& shape = params.shape;
  const int64_t row_tiles = (shape.seqlen_q + kProbsRows - 1) / kProbsRows;
  if (row_tiles == 0 || shape.nheads_q == 0 || shape.batch == 0) return;
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(shape.nheads_q),
                  static_cast<unsigned>(shape.batch));
  const size_t smem_bytes = (kProbsRows + kProbsKeys) * smem_row_floats(shape.head_dim) * sizeof(float);
  probs_kernel<T><<<grid, kProbsThreads, smem_bytes, stream>>>(params);
}

}  // namespace

bool launch_probs(const FwdParams& params, void* stream) {
  if (params.shape.head_dim > kProbsMaxHeadDim) return false;
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  switch (params.dtype) {
    case DType::kFloat16: launch<__half>(params, cuda_stream); return true;
    case DType::kBFloat16: launch<__nv_bfloat16>(params, cuda_stream); return true;
    default: return false;
  }
}

}  // namespace flash::sm80
