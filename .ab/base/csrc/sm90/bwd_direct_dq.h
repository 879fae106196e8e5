// Direct dQ of the Hopper backward (bwd_kernel's kDirectDq): when every sequence's keys fit one key block, a step's
// dQ = dS.K is complete in the consumers' registers, so they store it, scaled and converted, straight into dq instead
// of adding it into the zeroed fp32 accumulator that the conversion kernel reads back (bwd_launch.h skips both).
// The rows no step reaches (no key visible to them) get dQ = 0 here, as the zeroed accumulator gave them.
#pragma once

#include <cstdint>

#include "flash_attn/params.h"
#include "sm90/kernel_common.h"

namespace flash::sm90 {

// Row 0 of a sequence's dq rows (head 0).
template <typename T>
__device__ __forceinline__ T* direct_dq_rows(const BwdParams& bp, int batch, int64_t q_row0) {
  return static_cast<T*>(bp.dq) + batch * bp.dq_strides.batch + q_row0 * bp.dq_strides.row;
}

// One consumer's m64 x kColumns dQ accumulator (register 4j + 2r + e: row lane / 4 + 8r of the warp's 16, column
// 8j + quad_col + e) for query rows q_first ... of the sequence, columns column0 ...: softmax_scale dQ, rounded once,
// as the conversion kernel rounds the accumulator's single addend. dq_head points at the sequence's row 0 of the head.
template <typename T, int kColumns>
__device__ __forceinline__ void store_direct_dq(const BwdParams& bp, T* dq_head, const float (&dq)[kColumns / 2],
                                                int64_t q_first, int64_t seqlen_q, int column0, int warp, int lane,
                                                int quad_col) {
  const float scale = static_cast<float>(bp.fwd.softmax_scale);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t q = q_first + warp * kRowsPerWarp + lane / kQuadLanes + kSecondRow * r;
    if (q >= seqlen_q) continue;
    T* dq_row = dq_head + q * bp.dq_strides.row + column0;
#pragma unroll
    for (int j = 0; j < kColumns / 8; ++j) {
      const int col = 8 * j + quad_col;
      if (column0 + col < bp.fwd.shape.head_dim) {
        *reinterpret_cast<uint32_t*>(dq_row + col) =
            pack_pair<T>(dq[4 * j + 2 * r] * scale, dq[4 * j + 2 * r + 1] * scale);
      }
    }
  }
}

// dQ = 0 in rows [0, reached0) and [reached1, seqlen_q) of query heads head0 ... head0 + heads - 1, 16 bytes a store
// (rows of the kernel layout: a head dim that is a multiple of 8, contiguous), spread over `workers` threads. Nothing
// to do in calls without a mask, or causal ones whose every query sees a key.
template <typename T>
__device__ __forceinline__ void zero_unreached_dq_rows(const BwdParams& bp, T* dq_sequence, int64_t seqlen_q,
                                                       int head0, int heads, int64_t reached0, int64_t reached1,
                                                       int worker, int workers) {
  constexpr int kVectorElems = 16 / sizeof(T);
  const int64_t per_head = reached0 + (seqlen_q - reached1);
  const int64_t vectors = bp.fwd.shape.head_dim / kVectorElems;
  const int64_t items = heads * per_head * vectors;
  for (int64_t item = worker; item < items; item += workers) {
    const int64_t row_item = item / vectors;
    const int head = head0 + static_cast<int>(row_item / per_head);
    int64_t row = row_item % per_head;
    if (row >= reached0) row += reached1 - reached0;
    T* dst = dq_sequence + row * bp.dq_strides.row + head * bp.dq_strides.head;
    reinterpret_cast<uint4*>(dst)[item % vectors] = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace flash::sm90
