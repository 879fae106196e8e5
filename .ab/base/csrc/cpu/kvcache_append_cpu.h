// The CPU append of flash_attn_with_kvcache's new rows (kvcache_append_params.h): every (sequence, new row) written
// into the caches, k rotated when the tables are given, and the key counts stored.
#pragma once

#include "flash_attn/kvcache_append_params.h"

namespace flash::cpu {

void run_kvcache_append(const KvAppendParams& params);

}  // namespace flash::cpu
