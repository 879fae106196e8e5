// The append rule shared by the CPU implementation and the CUDA kernel of kvcache_append_ (kvcache_append_params.h):
// where new row i of sequence b lands in a cache, at which rotary position, and the key count the attention then
// sees. Every index read from a tensor is clamped, so any values keep the writes inside the caches.
#pragma once

#include <cstdint>

#include "flash_attn/common/host_device.h"
#include "flash_attn/kvcache_append_params.h"

namespace flash {

FLASH_HOST_DEVICE int64_t index_at(const IndexArg& arg, int64_t i) {
  return arg.int64 ? static_cast<const int64_t*>(arg.data)[i] : static_cast<const int32_t*>(arg.data)[i];
}

FLASH_HOST_DEVICE int64_t clamp_to(int64_t value, int64_t low, int64_t high) {
  return value < low ? low : (value > high ? high : value);
}

// Rows of sequence b before the new ones.
FLASH_HOST_DEVICE int64_t append_length(const KvAppendParams& p, int64_t b) {
  return clamp_to(index_at(p.lengths, b), 0, p.cache_rows - p.new_rows);
}

FLASH_HOST_DEVICE int64_t append_leftpad(const KvAppendParams& p, int64_t b) {
  return p.leftpad.data == nullptr ? 0 : clamp_to(index_at(p.leftpad, b), 0, p.cache_rows);
}

// The keys sequence b's attention sees after the append (KvAppendParams::seqused).
FLASH_HOST_DEVICE int32_t append_seqused(const KvAppendParams& p, int64_t b) {
  const int64_t used = append_length(p, b) + p.new_rows - append_leftpad(p, b);
  return static_cast<int32_t>(used < 0 ? 0 : used);
}

// Element offset of cache row `row` (0 <= row < cache_rows) of sequence b, for a cache with `strides`: row
// row % page_size of page pages[b][row / page_size] when paged, else row `row` of entry entries[b] (or b).
FLASH_HOST_DEVICE int64_t append_cache_offset(const KvAppendParams& p, const TensorStrides& strides, int64_t b,
                                              int64_t row) {
  if (p.pages.data != nullptr) {
    const int64_t page = clamp_to(index_at(p.pages, b * p.pages.row_stride + row / p.page_size), 0,
                                  p.cache_entries - 1);
    return page * strides.batch + (row % p.page_size) * strides.row;
  }
  const int64_t entry = p.entries.data == nullptr ? b : clamp_to(index_at(p.entries, b), 0, p.cache_entries - 1);
  return entry * strides.batch + row * strides.row;
}

// Rotary position of new row i of sequence b.
FLASH_HOST_DEVICE int64_t append_position(const KvAppendParams& p, int64_t b, int64_t i) {
  const int64_t position = append_length(p, b) - append_leftpad(p, b);
  return (position < 0 ? 0 : position) + i;
}

}  // namespace flash
