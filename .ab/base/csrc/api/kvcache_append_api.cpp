// The op torch.ops.flash_attn.kvcache_append_ (flash_attn_with_kvcache's in-place append of new keys and values):
// checks, KvAppendParams, and the CPU (csrc/cpu/kvcache_append_cpu.cpp) or CUDA (csrc/sm80/kvcache_append_kernel.cu)
// implementation. Index values are checked in Python (flash_attn/kvcache.py) and clamped by both implementations.
// The fake implementation lives in flash_attn/kvcache.py.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>
#include <optional>
#include <tuple>

#include "kvcache_append_api.h"
#include "../cpu/kvcache_append_cpu.h"
#include "error_message.h"
#include "input_checks.h"

#if defined(FLASH_WITH_CUDA)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../sm80/kvcache_append_kernel.h"
#endif

namespace flash::api {
namespace {

constexpr const char* kAppendOp = "flash_attn.kvcache_append_";

// An optional index tensor: int32 or int64, on the caches' device, `dims`-D with `rows` rows, unit last stride.
IndexArg index_arg(const char* name, const std::optional<at::Tensor>& t, const at::Tensor& cache, int64_t dims,
                   int64_t rows) {
  IndexArg arg;
  if (!t.has_value()) return arg;
  const at::Tensor& index = *t;
  FLASH_CHECK(index.scalar_type() == at::kInt || index.scalar_type() == at::kLong, kAppendOp, ": ", name,
              " must have dtype torch.int32 or torch.int64; got ", index.scalar_type());
  FLASH_CHECK(index.device() == cache.device(), kAppendOp, ": ", name, " must be on ", cache.device(), "; got ",
              index.device());
  FLASH_CHECK(index.dim() == dims && index.size(0) == rows, kAppendOp, ": ", name, " must be ", dims,
              "-D with ", rows, " rows (the batch); got shape ", index.sizes());
  FLASH_CHECK(index.size(-1) <= 1 || index.stride(-1) == 1, kAppendOp, ": ", name,
              " must have stride 1 in its last dimension; got strides ", index.strides());
  arg.data = index.data_ptr();
  arg.int64 = index.scalar_type() == at::kLong;
  arg.row_stride = dims == 2 ? index.stride(0) : 1;
  return arg;
}

void check_rows_tensor(const char* name, const at::Tensor& t, const at::Tensor& cache) {
  FLASH_CHECK(t.dim() == 4, kAppendOp, ": ", name, " must be 4-D; got shape ", t.sizes());
  FLASH_CHECK(t.scalar_type() == cache.scalar_type(), kAppendOp, ": ", name, " must have the cache's dtype ",
              cache.scalar_type(), "; got ", t.scalar_type());
  FLASH_CHECK(t.device() == cache.device(), kAppendOp, ": ", name, " must be on ", cache.device(), "; got ",
              t.device());
  FLASH_CHECK(t.size(3) <= 1 || t.stride(3) == 1, kAppendOp, ": ", name,
              " must have stride 1 in its last (head) dimension; got strides ", t.strides());
}

}  // namespace

KvAppendParams kvcache_append_params(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& cache_seqlens,
                                     const std::optional<at::Tensor>& cache_batch_idx,
                                     const std::optional<at::Tensor>& block_table,
                                     const std::optional<at::Tensor>& cache_leftpad,
                                     const std::optional<at::Tensor>& rotary_cos,
                                     const std::optional<at::Tensor>& rotary_sin, bool interleaved) {
  check_rows_tensor("k_cache", k_cache, k_cache);
  FLASH_CHECK(v_cache.sizes() == k_cache.sizes(), kAppendOp, ": v_cache must have k_cache's shape ", k_cache.sizes(),
              "; got ", v_cache.sizes());
  check_rows_tensor("v_cache", v_cache, k_cache);
  check_rows_tensor("k", k, k_cache);
  FLASH_CHECK(v.sizes() == k.sizes(), kAppendOp, ": v must have k's shape ", k.sizes(), "; got ", v.sizes());
  check_rows_tensor("v", v, k_cache);
  FLASH_CHECK(k_cache.is_cpu() || k_cache.is_cuda(), kAppendOp, ": the caches must be CPU or CUDA tensors; got ",
              k_cache.device());
  FLASH_CHECK(k_cache.is_cpu() || k_cache.scalar_type() != at::kDouble, kAppendOp,
              ": float64 is supported on CPU only");
  FLASH_CHECK(k.size(2) == k_cache.size(2) && k.size(3) == k_cache.size(3), kAppendOp,
              ": k must have the cache's heads and head dim (", k_cache.size(2), ", ", k_cache.size(3), "); got ",
              k.sizes());
  FLASH_CHECK(!(cache_batch_idx.has_value() && block_table.has_value()), kAppendOp,
              ": cache_batch_idx and block_table cannot be combined");
  FLASH_CHECK(!(cache_leftpad.has_value() && block_table.has_value()), kAppendOp,
              ": cache_leftpad and block_table cannot be combined");
  const int64_t batch = k.size(0);

  KvAppendParams p;
  p.dtype = to_dtype(k_cache.scalar_type());
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.k_cache_strides = strides_of(k_cache, false);
  p.v_cache_strides = strides_of(v_cache, false);
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.k_strides = strides_of(k, false);
  p.v_strides = strides_of(v, false);
  p.batch = batch;
  p.new_rows = k.size(1);
  p.nheads_k = k.size(2);
  p.head_dim = k.size(3);
  p.cache_entries = k_cache.size(0);
  p.lengths = index_arg("cache_seqlens", cache_seqlens, k_cache, 1, batch);
  p.entries = index_arg("cache_batch_idx", cache_batch_idx, k_cache, 1, batch);
  p.pages = index_arg("block_table", block_table, k_cache, 2, batch);
  p.leftpad = index_arg("cache_leftpad", cache_leftpad, k_cache, 1, batch);
  if (block_table.has_value()) {
    p.page_size = k_cache.size(1);
    p.cache_rows = block_table->size(1) * p.page_size;
  } else {
    p.cache_rows = k_cache.size(1);
    FLASH_CHECK(cache_batch_idx.has_value() || p.cache_entries == batch, kAppendOp, ": the cache has ",
                p.cache_entries, " entries for a batch of ", batch, "; pass cache_batch_idx");
  }
  FLASH_CHECK(p.new_rows <= p.cache_rows, kAppendOp, ": ", p.new_rows, " new rows do not fit the ", p.cache_rows,
              " cache rows of a sequence");
  FLASH_CHECK(batch == 0 || p.new_rows == 0 || p.cache_entries > 0, kAppendOp, ": the cache has no entries");
  FLASH_CHECK(batch * (p.new_rows > 0 ? p.new_rows : 1) < std::numeric_limits<int32_t>::max(), kAppendOp,
              ": more than 2^31 - 1 new rows (batch x new rows); split the call");
  FLASH_CHECK(rotary_cos.has_value() == rotary_sin.has_value(), kAppendOp,
              ": rotary_cos and rotary_sin must be given together");
  if (rotary_cos.has_value()) {
    const at::Tensor& cos = *rotary_cos;
    const at::Tensor& sin = *rotary_sin;
    for (const at::Tensor* table : {&cos, &sin}) {
      FLASH_CHECK(table->dim() == 2 && table->scalar_type() == k.scalar_type() && table->device() == k.device() &&
                      (table->size(1) <= 1 || table->stride(1) == 1),
                  kAppendOp, ": rotary_cos / rotary_sin must be 2-D (seqlen_ro, rotary_dim / 2) tensors of k's dtype ",
                  k.scalar_type(), " on ", k.device(), ", contiguous in their last dimension; got ",
                  table->scalar_type(), " ", table->sizes(), " on ", table->device());
    }
    FLASH_CHECK(cos.sizes() == sin.sizes(), kAppendOp, ": rotary_cos and rotary_sin must have the same shape; got ",
                cos.sizes(), " and ", sin.sizes());
    FLASH_CHECK(2 * cos.size(1) <= p.head_dim, kAppendOp, ": rotary_dim (2 x rotary_cos.shape[1] = ",
                2 * cos.size(1), ") must be at most the head dim ", p.head_dim);
    p.cos = cos.data_ptr();
    p.sin = sin.data_ptr();
    p.cos_row_stride = cos.stride(0);
    p.sin_row_stride = sin.stride(0);
    p.rotary_dim = 2 * cos.size(1);
    p.seqlen_ro = cos.size(0);
    p.interleaved = interleaved;
  }
  return p;
}

void launch_kvcache_append(const KvAppendParams& p, const at::Tensor& k_cache) {
  if (p.batch == 0) return;
  if (k_cache.is_cpu()) {
    cpu::run_kvcache_append(p);
    return;
  }
#if defined(FLASH_WITH_CUDA)
  const c10::cuda::CUDAGuard guard(k_cache.device());
  FLASH_CHECK(sm80::launch_kvcache_append(p, c10::cuda::getCurrentCUDAStream().stream()), kAppendOp,
              ": CUDA caches must be float16, bfloat16 or float32; got ", k_cache.scalar_type());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
#else
  FLASH_FAIL(kAppendOp, ": this build has no CUDA code; rebuild with the CUDA toolkit, or pass CPU tensors");
#endif
}

std::tuple<at::Tensor, at::Tensor> kvcache_append_(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                   const at::Tensor& k, const at::Tensor& v,
                                                   const at::Tensor& cache_seqlens,
                                                   const std::optional<at::Tensor>& cache_batch_idx,
                                                   const std::optional<at::Tensor>& block_table,
                                                   const std::optional<at::Tensor>& cache_leftpad,
                                                   const std::optional<at::Tensor>& rotary_cos,
                                                   const std::optional<at::Tensor>& rotary_sin, bool interleaved,
                                                   const std::optional<at::Tensor>& q, bool q_per_row) {
  KvAppendParams p = kvcache_append_params(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                                           cache_leftpad, rotary_cos, rotary_sin, interleaved);
  const int64_t batch = p.batch;
  at::Tensor q_out = at::empty({0}, k.options());
  if (q.has_value()) {
    FLASH_CHECK(rotary_cos.has_value(), kAppendOp, ": q is rotated here only with rotary_cos / rotary_sin; got q "
                "without them (pass q=None when the queries are not rotated)");
    check_rows_tensor("q", *q, k_cache);
    FLASH_CHECK(q->size(0) == batch && q->size(3) == p.head_dim, kAppendOp, ": q must be (batch, seqlen_q, nheads, ",
                p.head_dim, ") with batch ", batch, "; got shape ", q->sizes());
    FLASH_CHECK(q->size(0) * q->size(1) < std::numeric_limits<int32_t>::max(), kAppendOp,
                ": more than 2^31 - 1 query rows (batch x seqlen_q); split the call");
    q_out = at::empty(q->sizes(), q->options());
    p.q = q->data_ptr();
    p.q_out = q_out.data_ptr();
    p.q_strides = strides_of(*q, false);
    p.q_out_strides = strides_of(q_out, false);
    p.seqlen_q = q->size(1);
    p.nheads_q = q->size(2);
    p.q_per_row = q_per_row;
  }
  at::Tensor seqused = at::empty({batch}, k.options().dtype(at::kInt));
  p.seqused = seqused.data_ptr<int32_t>();
  launch_kvcache_append(p, k_cache);
  return {seqused, q_out};
}

}  // namespace flash::api

TORCH_LIBRARY_FRAGMENT(flash_attn, m) {
  m.def("kvcache_append_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor cache_seqlens, "
        "Tensor? cache_batch_idx, Tensor? block_table, Tensor? cache_leftpad, Tensor? rotary_cos, "
        "Tensor? rotary_sin, bool interleaved, Tensor? q, bool q_per_row) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flash_attn, CPU, m) { m.impl("kvcache_append_", &flash::api::kvcache_append_); }

TORCH_LIBRARY_IMPL(flash_attn, CUDA, m) { m.impl("kvcache_append_", &flash::api::kvcache_append_); }
