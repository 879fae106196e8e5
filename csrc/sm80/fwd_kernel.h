// Forward attention kernel of the portable sm80+ path: one CTA of 4 warps per (query tile of 64 rows,
// head, batch entry); each warp owns 16 query rows, keeps its Q fragments and O accumulators in registers,
// and runs the online softmax over key tiles staged in shared memory, with mma.sync m16n8k16.
// First version: synchronous K/V staging (no cp.async pipeline), padded rather than swizzled shared memory;
// see docs/perf_log.md.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "flash_attn/common/mask.h"
#include "flash_attn/common/philox.h"
#include "flash_attn/params.h"
#include "flash_attn/ptx/ldmatrix_sm80.h"
#include "flash_attn/ptx/mma_sm80.h"

namespace flash::sm80 {

template <DType kDType>
struct Element;
template <>
struct Element<DType::kFloat16> {
  using type = __half;
};
template <>
struct Element<DType::kBFloat16> {
  using type = __nv_bfloat16;
};

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Tile shape: 4 warps x 16 rows; key tiles of 64 (32 for head dims > 128, so K and V tiles stay < 48 KB).
struct FwdTileConfig {
  int block_m;
  int block_n;
  int warps;
};
__host__ __device__ constexpr FwdTileConfig fwd_tile_config(int head_dim) { return {64, head_dim <= 128 ? 64 : 32, 4}; }

constexpr int kWarpSize = 32;
constexpr int kMmaM = 16;
constexpr int kMmaN = 8;
constexpr int kMmaK = 16;
// Shared-memory rows are padded by 8 elements (16 bytes) so the 8 rows a fragment load touches fall in
// different banks.
constexpr int kSmemRowPad = 8;

__device__ __forceinline__ float read_bias(const void* base, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::kFloat16: return __half2float(static_cast<const __half*>(base)[index]);
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[index]);
    case DType::kFloat32: return static_cast<const float*>(base)[index];
    case DType::kFloat64: return static_cast<float>(static_cast<const double*>(base)[index]);
  }
  return 0.f;
}

template <typename T, int kHeadDim, MaskKind kMask>
__global__ void __launch_bounds__(fwd_tile_config(kHeadDim).warps* kWarpSize)
    fwd_kernel(const FwdParams p) {
  constexpr FwdTileConfig kTile = fwd_tile_config(kHeadDim);
  constexpr int kBlockM = kTile.block_m;
  constexpr int kBlockN = kTile.block_n;
  constexpr int kThreads = kTile.warps * kWarpSize;
  constexpr int kStride = kHeadDim + kSmemRowPad;
  constexpr int kKSteps = kHeadDim / kMmaK;
  constexpr int kNTiles = kBlockN / kMmaN;
  constexpr int kDTiles = kHeadDim / kMmaN;
  static_assert(kHeadDim % kMmaK == 0 && kBlockM == kTile.warps * kMmaM, "tile shape");
  __shared__ __align__(16) T s_k[kBlockN * kStride];
  __shared__ __align__(16) T s_v[kBlockN * kStride];

  const int b = blockIdx.z;
  const int h = blockIdx.y;
  const AttentionShape& shape = p.shape;
  int64_t q_row0 = 0, k_row0 = 0, seqlen_q = shape.seqlen_q, seqlen_k = shape.seqlen_k;
  if (shape.cu_seqlens_q != nullptr) {
    q_row0 = shape.cu_seqlens_q[b];
    seqlen_q = shape.cu_seqlens_q[b + 1] - q_row0;
    k_row0 = shape.cu_seqlens_k[b];
    seqlen_k = shape.cu_seqlens_k[b + 1] - k_row0;
  }
  const int64_t row_begin = static_cast<int64_t>(blockIdx.x) * kBlockM;
  if (row_begin >= seqlen_q) return;
  const int64_t offset = diagonal_offset(p.mask, seqlen_q, seqlen_k);
  const int64_t hk = h / (shape.nheads_q / shape.nheads_k);
  const int64_t head_dim = shape.head_dim;

  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int g = lane / 4;
  const int t = lane % 4;
  const int64_t rows[2] = {row_begin + warp * kMmaM + g, row_begin + warp * kMmaM + g + 8};

  const T* q = static_cast<const T*>(p.q) + b * p.q_strides.batch + q_row0 * p.q_strides.row + h * p.q_strides.head;
  const T* k = static_cast<const T*>(p.k) + b * p.k_strides.batch + k_row0 * p.k_strides.row + hk * p.k_strides.head;
  const T* v = static_cast<const T*>(p.v) + b * p.v_strides.batch + k_row0 * p.v_strides.row + hk * p.v_strides.head;
  const T zero = from_float<T>(0.f);

  auto q_at = [&](int64_t row, int64_t col) {
    return row < seqlen_q && col < head_dim ? q[row * p.q_strides.row + col] : zero;
  };
  ptx::MmaA q_frag[kKSteps];
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    const int col = kk * kMmaK + 2 * t;
    q_frag[kk].reg[0] = ptx::pack2(q_at(rows[0], col), q_at(rows[0], col + 1));
    q_frag[kk].reg[1] = ptx::pack2(q_at(rows[1], col), q_at(rows[1], col + 1));
    q_frag[kk].reg[2] = ptx::pack2(q_at(rows[0], col + 8), q_at(rows[0], col + 9));
    q_frag[kk].reg[3] = ptx::pack2(q_at(rows[1], col + 8), q_at(rows[1], col + 9));
  }

  KeyRange row_keys[2];
  for (int r = 0; r < 2; ++r) row_keys[r] = visible_keys(p.mask, rows[r], offset, seqlen_k);
  const int64_t last_row = row_begin + kBlockM - 1 < seqlen_q ? row_begin + kBlockM - 1 : seqlen_q - 1;
  int64_t key_begin = visible_keys(p.mask, row_begin, offset, seqlen_k).begin;
  int64_t key_end = visible_keys(p.mask, last_row, offset, seqlen_k).end;
  key_begin = key_begin < 0 ? 0 : key_begin;
  key_end = key_end > seqlen_k ? seqlen_k : key_end;

  const float scale = static_cast<float>(p.softmax_scale);
  const float softcap = static_cast<float>(p.softcap);
  const float alibi_slope =
      p.mask.alibi_slopes != nullptr ? p.mask.alibi_slopes[b * p.mask.alibi_batch_stride + h] : 0.f;
  const bool dropout = p.dropout.p > 0.0;
  const uint64_t seed = dropout ? static_cast<uint64_t>(p.dropout.rng_state[0]) : 0;
  const uint64_t rng_offset = dropout ? static_cast<uint64_t>(p.dropout.rng_state[1]) : 0;
  const uint64_t keep_threshold = dropout_keep_threshold(p.dropout.p);
  const float inv_keep = dropout ? static_cast<float>(1.0 / (1.0 - p.dropout.p)) : 1.f;
  const int64_t batch_head = static_cast<int64_t>(b) * shape.nheads_q + h;

  // 16-byte loads of K/V rows when every row starts 16-byte aligned and the head dim fills the bucket.
  constexpr int kVectorWidth = 16 / sizeof(T);
  constexpr int kVectorsPerRow = kHeadDim / kVectorWidth;
  const bool vector_loads = head_dim == kHeadDim && p.k_strides.row % kVectorWidth == 0 &&
                            p.v_strides.row % kVectorWidth == 0 &&
                            reinterpret_cast<uintptr_t>(k) % 16 == 0 && reinterpret_cast<uintptr_t>(v) % 16 == 0;

  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  ptx::MmaC acc[kDTiles];

  for (int64_t n0 = key_begin; n0 < key_end; n0 += kBlockN) {
    __syncthreads();
    if (vector_loads) {
      for (int idx = tid; idx < kBlockN * kVectorsPerRow; idx += kThreads) {
        const int r = idx / kVectorsPerRow;
        const int c = (idx % kVectorsPerRow) * kVectorWidth;
        const bool valid = n0 + r < seqlen_k;
        const uint4 zeros = make_uint4(0u, 0u, 0u, 0u);
        *reinterpret_cast<uint4*>(s_k + r * kStride + c) =
            valid ? *reinterpret_cast<const uint4*>(k + (n0 + r) * p.k_strides.row + c) : zeros;
        *reinterpret_cast<uint4*>(s_v + r * kStride + c) =
            valid ? *reinterpret_cast<const uint4*>(v + (n0 + r) * p.v_strides.row + c) : zeros;
      }
    } else {
      for (int idx = tid; idx < kBlockN * kHeadDim; idx += kThreads) {
        const int r = idx / kHeadDim;
        const int c = idx % kHeadDim;
        const bool valid = n0 + r < seqlen_k && c < head_dim;
        s_k[r * kStride + c] = valid ? k[(n0 + r) * p.k_strides.row + c] : zero;
        s_v[r * kStride + c] = valid ? v[(n0 + r) * p.v_strides.row + c] : zero;
      }
    }
    __syncthreads();

    ptx::MmaC s[kNTiles];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        const T* k_row = s_k + (nt * kMmaN + g) * kStride + kk * kMmaK + 2 * t;
        ptx::MmaB frag;
        frag.reg[0] = *reinterpret_cast<const uint32_t*>(k_row);
        frag.reg[1] = *reinterpret_cast<const uint32_t*>(k_row + 8);
        ptx::mma_m16n8k16(s[nt], q_frag[kk], frag, zero);
      }
    }

    // Scores -> softmax inputs (scale, softcap, ALiBi, bias, mask), then the running max per row.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const int64_t col = n0 + nt * kMmaN + 2 * t + (e % 2);
        float z = s[nt].reg[e];
        z = softcap > 0.f ? softcap * tanhf(z * scale / softcap) : z * scale;
        if (p.mask.alibi_slopes != nullptr) {
          const int64_t distance = rows[r] + offset - col;
          z -= alibi_slope * static_cast<float>(distance < 0 ? -distance : distance);
        }
        const bool visible = rows[r] < seqlen_q && col < seqlen_k &&
                             (kMask == MaskKind::kNone || (col >= row_keys[r].begin && col < row_keys[r].end));
        if (visible && p.mask.bias != nullptr) {
          const ScoreStrides& bs = p.mask.bias_strides;
          z += read_bias(p.mask.bias, p.mask.bias_dtype,
                         b * bs.batch + h * bs.head + rows[r] * bs.row + col * bs.col);
        }
        z = visible ? z : -INFINITY;
        s[nt].reg[e] = z;
        tile_max[r] = fmaxf(tile_max[r], z);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      const float new_max = fmaxf(row_max[r], tile_max[r]);
      const float shift = new_max == -INFINITY ? 0.f : new_max;
      const float rescale = __expf(row_max[r] - shift);
      row_sum[r] *= rescale;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        acc[dt].reg[2 * r] *= rescale;
        acc[dt].reg[2 * r + 1] *= rescale;
      }
      row_max[r] = new_max;
      tile_max[r] = shift;
    }
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t col = n0 + nt * kMmaN + 2 * t;
        PhiloxBlock words{};
        if (dropout) words = dropout_words(seed, rng_offset, batch_head, rows[r], col / 4);
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float prob = __expf(s[nt].reg[2 * r + c] - tile_max[r]);
          row_sum[r] += prob;
          if (dropout) prob = words.word[(col + c) % 4] < keep_threshold ? prob * inv_keep : 0.f;
          s[nt].reg[2 * r + c] = prob;
        }
      }
    }

    // O += P V, P taken from the score accumulators (their C layout is the A layout of the next MMA).
#pragma unroll
    for (int kk = 0; kk < kBlockN / kMmaK; ++kk) {
      ptx::MmaA p_frag;
      const ptx::MmaC& left = s[2 * kk];
      const ptx::MmaC& right = s[2 * kk + 1];
      p_frag.reg[0] = ptx::pack2(from_float<T>(left.reg[0]), from_float<T>(left.reg[1]));
      p_frag.reg[1] = ptx::pack2(from_float<T>(left.reg[2]), from_float<T>(left.reg[3]));
      p_frag.reg[2] = ptx::pack2(from_float<T>(right.reg[0]), from_float<T>(right.reg[1]));
      p_frag.reg[3] = ptx::pack2(from_float<T>(right.reg[2]), from_float<T>(right.reg[3]));
      const T* v_row = s_v + (kk * kMmaK + lane % kMmaK) * kStride;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const ptx::MmaB frag = ptx::ldmatrix_x2_trans(v_row + dt * kMmaN);
        ptx::mma_m16n8k16(acc[dt], p_frag, frag, zero);
      }
    }
  }

  T* out = static_cast<T*>(p.out) + b * p.out_strides.batch + q_row0 * p.out_strides.row + h * p.out_strides.head;
  float* lse = static_cast<float*>(p.lse) + b * p.lse_batch_stride + h * p.lse_head_stride + q_row0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    if (rows[r] >= seqlen_q) continue;
    const bool empty = row_sum[r] == 0.f;
    const float inv_sum = empty ? 0.f : 1.f / row_sum[r];
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      const int col = dt * kMmaN + 2 * t;
      if (col < head_dim) out[rows[r] * p.out_strides.row + col] = from_float<T>(acc[dt].reg[2 * r] * inv_sum);
      if (col + 1 < head_dim) {
        out[rows[r] * p.out_strides.row + col + 1] = from_float<T>(acc[dt].reg[2 * r + 1] * inv_sum);
      }
    }
    if (t == 0) lse[rows[r]] = empty ? INFINITY : row_max[r] + logf(row_sum[r]);
  }
}

}  // namespace flash::sm80
