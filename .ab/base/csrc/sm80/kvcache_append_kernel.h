// launch_kvcache_append: the CUDA append of flash_attn_with_kvcache's new rows (kvcache_append_params.h), one kernel
// for contiguous, indexed (cache_batch_idx), left-padded and paged caches, k rotated when the tables are given.
// Called by csrc/api/kvcache_append_api.cpp.
#pragma once

#include "flash_attn/kvcache_append_params.h"

namespace flash::sm80 {

// Launches on `stream` (a cudaStream_t). Returns false, launching nothing, for a dtype other than fp16, bf16, fp32.
bool launch_kvcache_append(const KvAppendParams& params, void* stream);

}  // namespace flash::sm80
