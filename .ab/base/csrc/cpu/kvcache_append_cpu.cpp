// run_kvcache_append (kvcache_append_cpu.h): one (sequence, new row) per parallel_for index, then one (sequence, query
// row) when q is rotated, in the accumulation type of the rotary path (float; double for float64); where rows land
// and their positions follow common/kvcache_append.h.
#include "kvcache_append_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "flash_attn/common/kvcache_append.h"
#include "flash_attn/common/rotary.h"

namespace flash::cpu {
namespace {

// Rows per parallel_for task: a row is a few heads x head_dim elements.
constexpr int64_t kRowsPerTask = 16;

// dst head h = src head h with its first rotary_dim columns' pairs rotated at `position` (unrotated outside the
// table), the other columns copied.
template <typename T>
void rotate_heads(const KvAppendParams& p, const T* src, int64_t src_head, T* dst, int64_t dst_head, int64_t nheads,
                  int64_t position) {
  using A = RotaryAcc<T>;
  const T* cos = static_cast<const T*>(p.cos);
  const T* sin = static_cast<const T*>(p.sin);
  const bool rotated = cos != nullptr && position < p.seqlen_ro;
  for (int64_t h = 0; h < nheads; ++h) {
    const T* s = src + h * src_head;
    T* d = dst + h * dst_head;
    const int64_t copied_from = rotated ? p.rotary_dim : 0;
    if (rotated) {
      for (int64_t pair_index = 0; pair_index < p.rotary_dim / 2; ++pair_index) {
        const RotaryPair pair = rotary_pair(p.interleaved, p.rotary_dim, pair_index);
        A x1 = static_cast<A>(s[pair.first]);
        A x2 = static_cast<A>(s[pair.second]);
        rotate_pair<A>(x1, x2, static_cast<A>(cos[position * p.cos_row_stride + pair_index]),
                       static_cast<A>(sin[position * p.sin_row_stride + pair_index]), false);
        d[pair.first] = static_cast<T>(x1);
        d[pair.second] = static_cast<T>(x2);
      }
    }
    for (int64_t c = copied_from; c < p.head_dim; ++c) d[c] = s[c];
  }
}

template <typename T>
void append_rows(const KvAppendParams& p) {
  for (int64_t b = 0; p.seqused != nullptr && b < p.batch; ++b) p.seqused[b] = append_seqused(p, b);
  at::parallel_for(0, p.batch * p.new_rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / p.new_rows, i = index % p.new_rows;
      const int64_t row = append_length(p, b) + i;
      T* k_dst = static_cast<T*>(p.k_cache) + append_cache_offset(p, p.k_cache_strides, b, row);
      T* v_dst = static_cast<T*>(p.v_cache) + append_cache_offset(p, p.v_cache_strides, b, row);
      const T* k_src = static_cast<const T*>(p.k) + b * p.k_strides.batch + i * p.k_strides.row;
      const T* v_src = static_cast<const T*>(p.v) + b * p.v_strides.batch + i * p.v_strides.row;
      rotate_heads(p, k_src, p.k_strides.head, k_dst, p.k_cache_strides.head, p.nheads_k, append_position(p, b, i));
      for (int64_t h = 0; h < p.nheads_k; ++h) {
        const T* vs = v_src + h * p.v_strides.head;
        T* vd = v_dst + h * p.v_cache_strides.head;
        for (int64_t d = 0; d < p.head_dim; ++d) vd[d] = vs[d];
      }
    }
  });
  if (p.q == nullptr) return;
  at::parallel_for(0, p.batch * p.seqlen_q, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / p.seqlen_q, i = index % p.seqlen_q;
      const T* src = static_cast<const T*>(p.q) + b * p.q_strides.batch + i * p.q_strides.row;
      T* dst = static_cast<T*>(p.q_out) + b * p.q_out_strides.batch + i * p.q_out_strides.row;
      rotate_heads(p, src, p.q_strides.head, dst, p.q_out_strides.head, p.nheads_q,
                   append_position(p, b, p.q_per_row ? i : 0));
    }
  });
}

}  // namespace

void run_kvcache_append(const KvAppendParams& params) {
  switch (params.dtype) {
    case DType::kFloat16: append_rows<at::Half>(params); break;
    case DType::kBFloat16: append_rows<at::BFloat16>(params); break;
    case DType::kFloat32: append_rows<float>(params); break;
    case DType::kFloat64: append_rows<double>(params); break;
  }
}

}  // namespace flash::cpu
