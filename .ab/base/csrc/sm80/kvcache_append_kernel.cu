// kvcache_append_kernel: one CTA per (sequence, new row) writes the row's k (rotated when the tables are given) and v
// into the cache, then, when the queries are rotated too, one CTA per (sequence, query row) writes q rotated into
// q_out: one launch for the whole append (rotate_rows.h). The first row's CTA of each sequence stores the key count.
// Where rows land and their positions: common/kvcache_append.h, shared with the CPU implementation.
#include "sm80/kvcache_append_kernel.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "flash_attn/common/kvcache_append.h"
#include "flash_attn/ptx/griddep_sm90.h"
#include "sm80/kernel_common.h"
#include "sm80/rotate_rows.h"

namespace flash::sm80 {
namespace {

constexpr int kAppendThreads = 128;

// Grid: batch x max(new_rows, 1) CTAs for the caches (so a call without new rows still stores the key counts), then
// batch x seqlen_q CTAs for the queries when p.q is given.
template <typename T>
__global__ void __launch_bounds__(kAppendThreads) kvcache_append_kernel(const KvAppendParams p) {
  // The attention kernel after this one (a programmatic dependent on sm90, fwd_launch.h) may launch now; it waits
  // for this grid's writes before it reads anything.
  ptx::allow_dependent_launch();
  const int64_t rows_per_sequence = p.new_rows > 0 ? p.new_rows : 1;
  const int64_t cache_ctas = p.batch * rows_per_sequence;
  const int head_dim = static_cast<int>(p.head_dim);
  if (static_cast<int64_t>(blockIdx.x) >= cache_ctas) {
    const int64_t index = blockIdx.x - cache_ctas;
    const int64_t b = index / p.seqlen_q;
    const int64_t i = index % p.seqlen_q;
    const int64_t position = append_position(p, b, p.q_per_row ? i : 0);
    HeadRow<T> q;
    q.src = static_cast<const T*>(p.q) + b * p.q_strides.batch + i * p.q_strides.row;
    q.dst = static_cast<T*>(p.q_out) + b * p.q_out_strides.batch + i * p.q_out_strides.row;
    q.src_head = p.q_strides.head;
    q.dst_head = p.q_out_strides.head;
    q.nheads = static_cast<int>(p.nheads_q);
    q.rotary_dim = static_cast<int>(p.rotary_dim);
    if (position < p.seqlen_ro) {
      q.cos = static_cast<const T*>(p.cos) + position * p.cos_row_stride;
      q.sin = static_cast<const T*>(p.sin) + position * p.sin_row_stride;
    }
    rotate_rows<kAppendThreads>(q, HeadRow<T>{}, head_dim, p.interleaved, false);
    return;
  }
  const int64_t b = blockIdx.x / rows_per_sequence;
  const int64_t i = blockIdx.x % rows_per_sequence;
  if (i == 0 && threadIdx.x == 0 && p.seqused != nullptr) p.seqused[b] = append_seqused(p, b);
  if (i >= p.new_rows) return;
  const int64_t row = append_length(p, b) + i;
  const int64_t position = append_position(p, b, i);
  HeadRow<T> k, v;
  k.src = static_cast<const T*>(p.k) + b * p.k_strides.batch + i * p.k_strides.row;
  k.dst = static_cast<T*>(p.k_cache) + append_cache_offset(p, p.k_cache_strides, b, row);
  k.src_head = p.k_strides.head;
  k.dst_head = p.k_cache_strides.head;
  k.nheads = static_cast<int>(p.nheads_k);
  if (p.cos != nullptr && position < p.seqlen_ro) {
    k.rotary_dim = static_cast<int>(p.rotary_dim);
    k.cos = static_cast<const T*>(p.cos) + position * p.cos_row_stride;
    k.sin = static_cast<const T*>(p.sin) + position * p.sin_row_stride;
  }
  v.src = static_cast<const T*>(p.v) + b * p.v_strides.batch + i * p.v_strides.row;
  v.dst = static_cast<T*>(p.v_cache) + append_cache_offset(p, p.v_cache_strides, b, row);
  v.src_head = p.v_strides.head;
  v.dst_head = p.v_cache_strides.head;
  v.nheads = static_cast<int>(p.nheads_k);
  rotate_rows<kAppendThreads>(k, v, head_dim, p.interleaved, false);
}

template <typename T>
void launch(const KvAppendParams& params, cudaStream_t stream) {
  const int64_t ctas = params.batch * (params.new_rows > 0 ? params.new_rows : 1) +
                       (params.q != nullptr ? params.batch * params.seqlen_q : 0);
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
