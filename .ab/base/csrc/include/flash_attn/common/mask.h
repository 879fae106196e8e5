// Which keys a query row may see: the window / causal rule of MaskParams, shared by every backend.
// used_keys() gives a sequence's key count (seqused_k), visible_keys() the half-open key range of one row;
// mask_kind() folds a call's window into the kernel-table mask kind (none, causal, local).
#pragma once

#include <cstdint>

#include "flash_attn/common/host_device.h"
#include "flash_attn/params.h"

namespace flash {

struct KeyRange {
  int64_t begin;  // first visible key
  int64_t end;    // one past the last visible key; empty when end <= begin
};

// Keys of sequence b before an append in the same call (AttentionShape::appended_keys): seqused_k[b] clamped to
// [0, seqlen_k - appended_keys], as the append (common/kvcache_append.h append_length) clamps the row it writes at.
FLASH_HOST_DEVICE int64_t keys_before_append(const AttentionShape& shape, int64_t b, int64_t seqlen_k) {
  if (shape.seqused_k == nullptr) return seqlen_k;
  const int64_t high = seqlen_k - shape.appended_keys;
  const int64_t used = shape.seqused_k[b];
  return used < 0 ? 0 : (used < high ? used : (high < 0 ? 0 : high));
}

// Keys sequence b uses: seqlen_k (its own for varlen), cut to seqused_k[b] (plus the appended keys) when the call
// gives seqused_k, clamped to [0, seqlen_k] so a bad length cannot make a kernel read past the key rows.
FLASH_HOST_DEVICE int64_t used_keys(const AttentionShape& shape, int64_t b, int64_t seqlen_k) {
  if (shape.seqused_k == nullptr) return seqlen_k;
  const int64_t used = keys_before_append(shape, b, seqlen_k) + shape.appended_keys;
  return used < seqlen_k ? used : seqlen_k;
}

// Diagonal offset of a sequence: query i lines up with key i + offset.
FLASH_HOST_DEVICE int64_t diagonal_offset(const MaskParams& mask, int64_t seqlen_q, int64_t seqlen_k) {
  return mask.bottom_right ? seqlen_k - seqlen_q : 0;
}

FLASH_HOST_DEVICE KeyRange visible_keys(const MaskParams& mask, int64_t row, int64_t offset, int64_t seqlen_k) {
  int64_t begin = 0;
  int64_t end = seqlen_k;
  if (mask.window_left != kUnboundedWindow) {
    const int64_t lo = row + offset - mask.window_left;
    begin = lo > begin ? lo : begin;
  }
  if (mask.window_right != kUnboundedWindow) {
    const int64_t hi = row + offset + mask.window_right + 1;
    end = hi < end ? hi : end;
  }
  return KeyRange{begin, end};
}

inline MaskKind mask_kind(const MaskParams& mask) {
  if (mask.window_left == kUnboundedWindow && mask.window_right == kUnboundedWindow) return MaskKind::kNone;
  if (mask.window_left == kUnboundedWindow && mask.window_right == 0) return MaskKind::kCausal;
  return MaskKind::kLocal;
}

}  // namespace flash
