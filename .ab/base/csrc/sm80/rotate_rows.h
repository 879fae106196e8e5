// rotate_rows: one CTA rotates (or copies) the heads of up to two rows in 16-byte vectors, every load of a thread's
// items issued before its first store, so a row costs one memory latency instead of one per head (the element loop
// of the nineteenth session, each store ordered before the next head's load, cost ~9 us per decode append on the
// H200). Rows whose pointers, strides or rotary_dim do not allow whole vectors take the element loop.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flash_attn/common/rotary.h"
#include "sm80/kernel_common.h"

namespace flash::sm80 {

// One row of `nheads` heads: dst head h = src head h with the pairs of its first rotary_dim columns rotated by the
// position's cos / sin row (null: copied unrotated), the columns past rotary_dim copied when copy_rest.
template <typename T>
struct HeadRow {
  const T* src = nullptr;
  T* dst = nullptr;
  int64_t src_head = 0;  // elements between heads
  int64_t dst_head = 0;
  int nheads = 0;
  int rotary_dim = 0;  // 0: a plain copy
  const T* cos = nullptr;
  const T* sin = nullptr;
  bool copy_rest = true;
};

// Items in flight per thread between its loads and its stores.
constexpr int kRotateUnroll = 4;
constexpr int kVectorBytes = 16;

__device__ __forceinline__ bool aligned_to(const void* ptr, int bytes) {
  return (reinterpret_cast<uintptr_t>(ptr) & static_cast<uintptr_t>(bytes - 1)) == 0;
}

// Whether `row` can move in whole vectors of kVectorBytes: every column group, head start and cos / sin chunk aligned.
template <typename T>
__device__ __forceinline__ bool row_takes_vectors(const HeadRow<T>& row, int head_dim, bool interleaved) {
  constexpr int kV = kVectorBytes / sizeof(T);
  const int rotary_group = interleaved ? kV : 2 * kV;
  const int table_bytes = interleaved ? kVectorBytes / 2 : kVectorBytes;
  return head_dim % kV == 0 && row.rotary_dim % rotary_group == 0 && row.src_head % kV == 0 &&
         row.dst_head % kV == 0 && aligned_to(row.src, kVectorBytes) && aligned_to(row.dst, kVectorBytes) &&
         (row.cos == nullptr || (aligned_to(row.cos, table_bytes) && aligned_to(row.sin, table_bytes)));
}

// Vector units of a row's head: rotary units (a chunk when interleaved, a chunk and its partner rotary_dim / 2 later
// otherwise), then the copied chunks past rotary_dim.
struct RowUnits {
  int rotary = 0;
  int per_head = 0;
  int total = 0;
};

template <typename T>
__device__ __forceinline__ RowUnits row_units(const HeadRow<T>& row, int head_dim, bool interleaved) {
  constexpr int kV = kVectorBytes / sizeof(T);
  RowUnits u;
  u.rotary = interleaved ? row.rotary_dim / kV : row.rotary_dim / (2 * kV);
  const int rest = row.copy_rest ? (head_dim - row.rotary_dim) / kV : 0;
  u.per_head = u.rotary + rest;
  u.total = row.nheads * u.per_head;
  return u;
}

// A unit's loaded data: x (and its partner x2 when half-split), the cos / sin chunk.
struct UnitData {
  uint4 x, x2, c, s;
};

template <bool kInterleaved, typename T>
__device__ __forceinline__ void load_unit(const HeadRow<T>& row, const RowUnits& u, int index, int& h, int& col,
                                          bool& rotary, UnitData& d) {
  constexpr int kV = kVectorBytes / sizeof(T);
  h = index / u.per_head;
  const int unit = index - h * u.per_head;
  const T* src = row.src + h * row.src_head;
  rotary = unit < u.rotary;
  col = rotary ? unit * kV : row.rotary_dim + (unit - u.rotary) * kV;
  d.x = *reinterpret_cast<const uint4*>(src + col);
  if (!rotary) return;
  if (!kInterleaved) d.x2 = *reinterpret_cast<const uint4*>(src + col + row.rotary_dim / 2);
  if (row.cos == nullptr) return;
  if (kInterleaved) {  // kV / 2 pairs: half a vector of cos and of sin
    const uint2 c = *reinterpret_cast<const uint2*>(row.cos + col / 2);
    const uint2 s = *reinterpret_cast<const uint2*>(row.sin + col / 2);
    d.c = make_uint4(c.x, c.y, 0, 0);
    d.s = make_uint4(s.x, s.y, 0, 0);
  } else {
    d.c = *reinterpret_cast<const uint4*>(row.cos + col);
    d.s = *reinterpret_cast<const uint4*>(row.sin + col);
  }
}

// The kVectorBytes / sizeof(T) elements of a vector, and back.
template <typename T>
struct VectorElements {
  T e[kVectorBytes / sizeof(T)];
};

template <typename T>
__device__ __forceinline__ VectorElements<T> elements_of(const uint4& v) {
  return reinterpret_cast<const VectorElements<T>&>(v);
}

template <typename T>
__device__ __forceinline__ uint4 vector_of(const VectorElements<T>& e) {
  return reinterpret_cast<const uint4&>(e);
}

template <bool kInterleaved, typename T>
__device__ __forceinline__ void store_unit(const HeadRow<T>& row, bool conjugate, int h, int col, bool rotary,
                                           UnitData& d) {
  constexpr int kV = kVectorBytes / sizeof(T);
  T* dst = row.dst + h * row.dst_head;
  if (rotary && row.cos != nullptr) {
    VectorElements<T> x = elements_of<T>(d.x), x2 = elements_of<T>(d.x2);
    const VectorElements<T> c = elements_of<T>(d.c), s = elements_of<T>(d.s);
#pragma unroll
    for (int e = 0; e < (kInterleaved ? kV / 2 : kV); ++e) {
      T& first = kInterleaved ? x.e[2 * e] : x.e[e];
      T& second = kInterleaved ? x.e[2 * e + 1] : x2.e[e];
      float a = to_float(first), b = to_float(second);
      rotate_pair<float>(a, b, to_float(c.e[e]), to_float(s.e[e]), conjugate);
      first = from_float<T>(a);
      second = from_float<T>(b);
    }
    d.x = vector_of(x);
    d.x2 = vector_of(x2);
  }
  *reinterpret_cast<uint4*>(dst + col) = d.x;
  if (rotary && !kInterleaved) *reinterpret_cast<uint4*>(dst + col + row.rotary_dim / 2) = d.x2;
}

// The element loop for rows that do not take vectors.
template <int kThreads, typename T>
__device__ __forceinline__ void rotate_row_elements(const HeadRow<T>& row, int head_dim, bool interleaved,
                                                    bool conjugate) {
  const int pairs = row.rotary_dim / 2;
  for_each_head_item<kThreads>(row.nheads, pairs, [&](int h, int j) {
    const RotaryPair pair = rotary_pair(interleaved, row.rotary_dim, j);
    const T* src = row.src + h * row.src_head;
    T* dst = row.dst + h * row.dst_head;
    float x1 = to_float(src[pair.first]);
    float x2 = to_float(src[pair.second]);
    if (row.cos != nullptr) rotate_pair<float>(x1, x2, to_float(row.cos[j]), to_float(row.sin[j]), conjugate);
    dst[pair.first] = from_float<T>(x1);
    dst[pair.second] = from_float<T>(x2);
  });
  if (!row.copy_rest) return;
  for_each_head_item<kThreads>(row.nheads, head_dim - row.rotary_dim, [&](int h, int c) {
    row.dst[h * row.dst_head + row.rotary_dim + c] = row.src[h * row.src_head + row.rotary_dim + c];
  });
}

// The vector path of rotate_rows: every thread loads up to kUnroll units, then rotates and stores them.
template <int kThreads, bool kInterleaved, int kUnroll, typename T>
__device__ __forceinline__ void rotate_row_vectors(const HeadRow<T>& a, const HeadRow<T>& b, int head_dim,
                                                   bool conjugate) {
  const RowUnits ua = row_units(a, head_dim, kInterleaved);
  const RowUnits ub = b.nheads > 0 ? row_units(b, head_dim, kInterleaved) : RowUnits{};
  const int total = ua.total + ub.total;
  // Threads of one group of kThreads (a CTA may hold several: the key-warps decode tile runs one per warp).
  for (int base = static_cast<int>(threadIdx.x % kThreads); base < total; base += kThreads * kUnroll) {
    UnitData d[kUnroll];
    int h[kUnroll], col[kUnroll];
    bool rotary[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int index = base + k * kThreads;
      if (index < ua.total) {
        load_unit<kInterleaved>(a, ua, index, h[k], col[k], rotary[k], d[k]);
      } else if (index < total) {
        load_unit<kInterleaved>(b, ub, index - ua.total, h[k], col[k], rotary[k], d[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int index = base + k * kThreads;
      if (index < ua.total) {
        store_unit<kInterleaved>(a, conjugate, h[k], col[k], rotary[k], d[k]);
      } else if (index < total) {
        store_unit<kInterleaved>(b, conjugate, h[k], col[k], rotary[k], d[k]);
      }
    }
  }
}

// Rotates / copies rows a and b (b.nheads 0: none) across the CTA. In place (dst == src) is safe: a thread reads
// every element it writes, and no other thread touches it. kUnroll: units in flight per thread (the decode kernels
// take 2, which keeps their main loops' registers: at 4 the hd 128 paged-rows decode kernel spilled 120 bytes and
// loaded 30 of them per key tile, at 2 it spills 36 / 44 bytes and loads 4, as without the rotation).
template <int kThreads, typename T, int kUnroll = kRotateUnroll>
__device__ __forceinline__ void rotate_rows(const HeadRow<T>& a, const HeadRow<T>& b, int head_dim, bool interleaved,
                                            bool conjugate) {
  const bool vectors = row_takes_vectors(a, head_dim, interleaved) &&
                       (b.nheads == 0 || row_takes_vectors(b, head_dim, interleaved));
  if (!vectors) {
    rotate_row_elements<kThreads>(a, head_dim, interleaved, conjugate);
    if (b.nheads > 0) rotate_row_elements<kThreads>(b, head_dim, interleaved, conjugate);
  } else if (interleaved) {
    rotate_row_vectors<kThreads, true, kUnroll>(a, b, head_dim, conjugate);
  } else {
    rotate_row_vectors<kThreads, false, kUnroll>(a, b, head_dim, conjugate);
  }
}

}  // namespace flash::sm80
