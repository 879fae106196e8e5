// flash_attn_with_kvcache's append of new keys and values into a cache (kvcache_append_api.cpp): the checked
// KvAppendParams of a call, its launch (CPU or CUDA), and the op torch.ops.flash_attn.kvcache_append_, which the
// decode op (kvcache_decode_, flash_api.cpp) builds on.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "flash_attn/kvcache_append_params.h"

namespace flash::api {

// Checks the caches, the new rows, the index tensors and the rotary tables, and returns the append's params with
// neither the queries nor the key counts (q, q_out, seqused null).
KvAppendParams kvcache_append_params(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& cache_seqlens,
                                     const std::optional<at::Tensor>& cache_batch_idx,
                                     const std::optional<at::Tensor>& block_table,
                                     const std::optional<at::Tensor>& cache_leftpad,
                                     const std::optional<at::Tensor>& rotary_cos,
                                     const std::optional<at::Tensor>& rotary_sin, bool interleaved);

// Runs the append on k_cache's device (the current stream on CUDA).
void launch_kvcache_append(const KvAppendParams& p, const at::Tensor& k_cache);

// The op: appends, and returns the key counts (batch,) int32 and q rotated (empty when q is not given).
std::tuple<at::Tensor, at::Tensor> kvcache_append_(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                   const at::Tensor& k, const at::Tensor& v,
                                                   const at::Tensor& cache_seqlens,
                                                   const std::optional<at::Tensor>& cache_batch_idx,
                                                   const std::optional<at::Tensor>& block_table,
                                                   const std::optional<at::Tensor>& cache_leftpad,
                                                   const std::optional<at::Tensor>& rotary_cos,
                                                   const std::optional<at::Tensor>& rotary_sin, bool interleaved,
                                                   const std::optional<at::Tensor>& q, bool q_per_row);

}  // namespace flash::api
