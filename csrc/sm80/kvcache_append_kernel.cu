// kvcache_append_kernel: one CTA per (sequence, new row); its threads visit the row's (head, column) items of k
// (rotary pairs first when rotated, then the remaining columns) and of v (for_each_head_item). The first row's CTA of each sequence stores
// the key count. Where rows land and their positions: common/kvcache_append.h, shared with the CPU implementation.
#include "sm80/kvcache_append_kernel.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "flash_attn/common/kvcache_append.h"
#include "flash_attn/common/rotary.h"
#include "sm80/kernel_common.h"

namespace flash::sm80 {
namespace {

constexpr int kAppendThreads = 128;

// Grid: batch x max(new_rows, 1) CTAs, so a call without new rows still stores the key counts.
template <typename T>
__global__ void __launch_bounds__(kAppendThreads) kvcache_append_kernel(const KvAppendParams p) {
  const int64_t rows_per_sequence = p.new_rows > 0 ? p.new_rows : 1;
  const int64_t b = blockIdx.x / rows_per_sequence;
  const int64_t i = blockIdx.x % rows_per_sequence;
  if (i == 0 && threadIdx.x == 0) p.seqused[b] = append_seqused(p, b);
  if (i >= p.new_rows) return;
  const int64_t row = append_length(p, b) + i;
  const int64_t position = append_position(p, b, i);
  const bool rotated = p.cos != nullptr && position < p.seqlen_ro;
  T* k_dst = static_cast<T*>(p.k_cache) + append_cache_offset(p, p.k_cache_strides, b, row);
  T* v_dst = static_cast<T*>(p.v_cache) + append_cache_offset(p, p.v_cache_strides, b, row);
  const T* k_src = static_cast<const T*>(p.k) + b * p.k_strides.batch + i * p.k_strides.row;
  const T* v_src = static_cast<const T*>(p.v) + b * p.v_strides.batch + i * p.v_strides.row;
  const int nheads = static_cast<int>(p.nheads_k);
  const int head_dim = static_cast<int>(p.head_dim);
  const int pairs = rotated ? static_cast<int>(p.rotary_dim / 2) : 0;
  if (rotated) {
    const T* cos = static_cast<const T*>(p.cos) + position * p.cos_row_stride;
    const T* sin = static_cast<const T*>(p.sin) + position * p.sin_row_stride;
    for_each_head_item<kAppendThreads>(nheads, pairs, [&](int h, int j) {
      const RotaryPair pair = rotary_pair(p.interleaved, p.rotary_dim, j);
      const T* src = k_src + h * p.k_strides.head;
      T* dst = k_dst + h * p.k_cache_strides.head;
      float x1 = to_float(src[pair.first]);
      float x2 = to_float(src[pair.second]);
      rotate_pair<float>(x1, x2, to_float(cos[j]), to_float(sin[j]), false);
      dst[pair.first] = from_float<T>(x1);
      dst[pair.second] = from_float<T>(x2);
    });
  }
  const int copied_from = 2 * pairs;  // the rotated pairs cover columns [0, rotary_dim)
  for_each_head_item<kAppendThreads>(nheads, head_dim - copied_from, [&](int h, int c) {
    k_dst[h * p.k_cache_strides.head + copied_from + c] = k_src[h * p.k_strides.head + copied_from + c];
  });
  for_each_head_item<kAppendThreads>(nheads, head_dim, [&](int h, int d) {
    v_dst[h * p.v_cache_strides.head + d] = v_src[h * p.v_strides.head + d];
  });
}

template <typename T>
void launch(const KvAppendParams& params, cudaStream_t stream) {
  const int64_t ctas = params.batch * (params.new_rows > 0 ? params.new_rows : 1);
  if (ctas == 0) return;
  kvcache_append_kernel<T><<<static_cast<unsigned>(ctas), kAppendThreads, 0, stream>>>(params);
}

}  // namespace

bool launch_kvcache_append(const KvAppendParams& params, void* stream) {
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  switch (params.dtype) {
    case DType::kFloat16: launch<__half>(params, cuda_stream); return true;
    case DType::kBFloat16: launch<__nv_bfloat16>(params, cuda_stream); return true;
    case DType::kFloat32: launch<float>(params, cuda_stream); return true;
    default: return false;
  }
}

}  // namespace flash::sm80
