// The rotary rule shared by the CPU implementation and the CUDA kernel: which columns form pair i, and the rotated
// values of one pair. Positions outside the cos / sin table rotate by angle 0 (cos 1, sin 0), so any offsets read
// from a tensor stay inside the table.
#pragma once

#include <cstdint>
#include <type_traits>

#include "flash_attn/common/host_device.h"
#include "flash_attn/common/seqlen.h"
#include "flash_attn/rotary_params.h"

namespace flash {

struct RotaryPair {
  int64_t first;   // column of the pair's first element
  int64_t second;  // column of its second element
};

FLASH_HOST_DEVICE RotaryPair rotary_pair(bool interleaved, int64_t rotary_dim, int64_t i) {
  return interleaved ? RotaryPair{2 * i, 2 * i + 1} : RotaryPair{i, i + rotary_dim / 2};
}

FLASH_HOST_DEVICE RotaryPair rotary_pair(const RotaryParams& p, int64_t i) {
  return rotary_pair(p.interleaved, p.rotary_dim, i);
}

// The position of row `row` of sequence b.
FLASH_HOST_DEVICE int64_t rotary_position(const RotaryParams& p, int64_t b, int64_t row) {
  int64_t offset = p.seqlen_offset;
  if (p.seqlen_offsets != nullptr) {
    offset += p.seqlen_offsets_int64 ? static_cast<const int64_t*>(p.seqlen_offsets)[b]
                                     : static_cast<const int32_t*>(p.seqlen_offsets)[b];
  }
  return offset + row;
}

FLASH_HOST_DEVICE bool rotary_position_in_table(const RotaryParams& p, int64_t position) {
  return position >= 0 && position < p.seqlen_ro;
}

// The accumulation type of a rotation of T elements: double for float64 inputs (the CPU path), float otherwise.
template <typename T>
using RotaryAcc = std::conditional_t<std::is_same_v<T, double>, double, float>;

// (x1, x2) rotated by the angle whose cosine and sine are c and s (by minus it when conjugate), in the accumulation
// type A (float; double for float64 inputs).
template <typename A>
FLASH_HOST_DEVICE void rotate_pair(A& x1, A& x2, A c, A s, bool conjugate) {
  const A sine = conjugate ? -s : s;
  const A r1 = x1 * c - x2 * sine;
  const A r2 = x1 * sine + x2 * c;
  x1 = r1;
  x2 = r2;
}

// Where row `row` of sequence b lives in x (and out): its element offset from the base, given the tensor's strides;
// -1 when the row is past the sequence's end (varlen, lengths clamped by varlen_rows).
FLASH_HOST_DEVICE int64_t rotary_row_offset(const RotaryParams& p, const TensorStrides& strides, int64_t b,
                                            int64_t row) {
  if (p.cu_seqlens == nullptr) return b * strides.batch + row * strides.row;
  const SequenceRows rows = varlen_rows(p.cu_seqlens, b, p.total_rows, p.seqlen);
  return row < rows.length ? (rows.row0 + row) * strides.row : -1;
}

}  // namespace flash
