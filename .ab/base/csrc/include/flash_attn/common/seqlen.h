// varlen_rows(): one sequence's first row and length in a varlen tensor, read from cu_seqlens and clamped so that
// any values (decreasing, negative, past the tensor's rows, longer than max_seqlen) keep every access inside the
// tensor: the start to [0, total_rows], the end to [start, total_rows], the length to max_seqlen. Valid values pass
// unchanged. Shared by every kernel that reads cu_seqlens (forward, combine, backward, probabilities).
#pragma once

#include <cstdint>

#include "flash_attn/common/host_device.h"

namespace flash {

struct SequenceRows {
  int64_t row0;    // first row of the sequence in the (total_rows, ...) tensor
  int64_t length;  // rows it owns, at most max_length
};

FLASH_HOST_DEVICE SequenceRows varlen_rows(const int32_t* cu_seqlens, int64_t b, int64_t total_rows,
                                           int64_t max_length) {
  const int64_t start_value = cu_seqlens[b];
  const int64_t end_value = cu_seqlens[b + 1];
  const int64_t start = start_value < 0 ? 0 : (start_value < total_rows ? start_value : total_rows);
  const int64_t end = end_value < start ? start : (end_value < total_rows ? end_value : total_rows);
  const int64_t length = end - start;
  return SequenceRows{start, length < max_length ? length : max_length};
}

}  // namespace flash
