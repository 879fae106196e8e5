// Main kernel of the sm80+ backward (FA2-style): one CTA of 8 warps per (key block, kv head, batch entry).
// K_j and V_j are staged in shared memory once; the CTA walks every (q head of the group, query block) that
// can see the key block, with Q_i / dO_i double-buffered by cp.async. Per block: S^T = K Q^T, P, dP^T = V dO^T,
// dS = P (dP - D) in registers; P and dS to shared memory; dV += P^T dO, dK += dS^T Q (registers, written
// once at the end, so GQA sums over the group in a fixed order); dQ_i += dS K into fp32 global accumulators
// (atomics, or per-CTA accumulators with plain read-add-write when deterministic).
#pragma once

#include <cmath>

#include "flash_attn/bwd_workspace.h"
#include "flash_attn/common/math.h"
#include "flash_attn/common/philox.h"
#include "flash_attn/ptx/red_sm90.h"
#include "sm80/bwd_common.h"

namespace flash::sm80::bwd {

// Windows are clamped to this so int32 index math cannot overflow (any larger window sees everything).
constexpr int64_t kWindowClamp = int64_t{1} << 30;

// Whether every (batch, row, head) of a tensor starts 16-byte aligned (so its rows can go through cp.async).
template <typename T>
__device__ __forceinline__ bool vector_tensor(const void* base, const TensorStrides& st, int64_t head_dim) {
  constexpr int kWidth = kVectorBytes / sizeof(T);
  return head_dim % kWidth == 0 && st.batch % kWidth == 0 && st.row % kWidth == 0 && st.head % kWidth == 0 &&
         reinterpret_cast<uintptr_t>(base) % kVectorBytes == 0;
}

// dq reductions: on sm90 lanes t and t^1 swap halves of a 16x8 fp32 fragment so each lane adds four
// consecutive floats of one row with a single vector reduction (4x fewer atomics than scalar adds): even
// lanes own row g, columns 2t..2t+3; odd lanes row g+8, columns 2t-2..2t+1. Below sm90 every lane adds its
// own four values with scalar atomics (rows g and g+8, columns 2t, 2t+1).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kVectorDqReduction = true;
#else
constexpr bool kVectorDqReduction = false;
#endif

// Row and column of a fragment where this lane's first reduction goes (see above).
struct DqLane {
  int row;
  int col;
};
__device__ __forceinline__ DqLane dq_lane(int g, int t) {
  if (kVectorDqReduction && t % 2 == 1) return DqLane{g + 8, 2 * t - 2};
  return DqLane{g, 2 * t};
}

// Adds one fragment at `dst` (this lane's dq_lane position). first_ok / second_ok: whether the lane's row
// (sm90), or rows g and g+8 (below sm90), exist. The caller hoists the address and row checks out of the
// fragment loop: computing them per fragment was ~23 instructions per reduction in the v2 SASS.
__device__ __forceinline__ void add_dq_fragment(float* dst, int64_t row_stride, const ptx::MmaC& c, int t,
                                                bool first_ok, bool second_ok) {
  if constexpr (kVectorDqReduction) {
    const bool even = t % 2 == 0;
    const float send0 = even ? c.reg[2] : c.reg[0];
    const float send1 = even ? c.reg[3] : c.reg[1];
    const float got0 = __shfl_xor_sync(0xffffffffu, send0, 1);
    const float got1 = __shfl_xor_sync(0xffffffffu, send1, 1);
    ptx::red_add_v4_f32(dst, even ? c.reg[0] : got0, even ? c.reg[1] : got1, even ? got0 : c.reg[2],
                        even ? got1 : c.reg[3], first_ok);
  } else {
    if (first_ok) {
      atomicAdd(dst, c.reg[0]);
      atomicAdd(dst + 1, c.reg[1]);
    }
    if (second_ok) {
      atomicAdd(dst + 8 * row_stride, c.reg[2]);
      atomicAdd(dst + 8 * row_stride + 1, c.reg[3]);
    }
  }
}

template <int kHeadDim, bool kFeatures>
struct BwdSmem {
  static constexpr BwdTileConfig kCfg = bwd_tile_config(kHeadDim, kFeatures);
  static constexpr int kStrideD = kHeadDim + kSmemRowPad;      // rows of Q, dO, K, V tiles
  static constexpr int kStrideM = kCfg.block_m + kSmemRowPad;  // rows of the P^T, dS^T tiles ([key][query])
  static constexpr int kKeyTile = kCfg.block_n * kStrideD;
  static constexpr int kQueryTile = kCfg.block_m * kStrideD;
  static constexpr int kScoreTile = kCfg.block_n * kStrideM;
  // K, V, 2 x Q, 2 x dO, P^T, dS^T (16-bit), then 2 x lse and 2 x delta (fp32).
  static constexpr int kElements = 2 * kKeyTile + 4 * kQueryTile + 2 * kScoreTile;
  template <typename T>
  static constexpr int bytes() {
    return kElements * static_cast<int>(sizeof(T)) + 4 * kCfg.block_m * static_cast<int>(sizeof(float));
  }
};

// kFeatures: softcap, ALiBi, bias, dropout or dbias may be on. The plain instantiation drops their code:
// measured with ptxas on hd128 causal, the general code path spills 292 bytes, the plain one 74.
template <typename T, int kHeadDim, MaskKind kMask, bool kFeatures>
__global__ void __launch_bounds__(kBwdThreads, 1) bwd_kernel(const BwdParams bp) {
  using Smem = BwdSmem<kHeadDim, kFeatures>;
  constexpr BwdTileConfig kCfg = bwd_tile_config(kHeadDim, kFeatures);
  constexpr int kBlockM = kCfg.block_m;
  constexpr int kBlockN = kCfg.block_n;
  constexpr int kStrideD = Smem::kStrideD;
  constexpr int kStrideM = Smem::kStrideM;
  // S^T / dP^T warp tiles: kSKeys x kSQueries.
  constexpr int kSWarpsN = kCfg.s_warps_n;
  constexpr int kSWarpsM = kBwdWarps / kSWarpsN;
  constexpr int kSKeys = kBlockN / kSWarpsN;
  constexpr int kSQueries = kBlockM / kSWarpsM;
  constexpr int kSMT = kSKeys / kMmaM;
  constexpr int kSNT = kSQueries / kMmaN;
  // dK / dV warp tiles: kKVKeys x kKVDims.
  constexpr int kKVWarpsN = kCfg.kv_warps_n;
  constexpr int kKVWarpsD = kBwdWarps / kKVWarpsN;
  constexpr int kKVKeys = kBlockN / kKVWarpsN;
  constexpr int kKVDims = kHeadDim / kKVWarpsD;
  constexpr int kKVMT = kKVKeys / kMmaM;
  constexpr int kKVNT = kKVDims / kMmaN;
  // dQ warp tiles: kQRows x kQDims, accumulated kQChunk n8 tiles at a time (at most 32 accumulator
  // registers live next to dK and dV).
  constexpr int kQWarpsM = kCfg.q_warps_m;
  constexpr int kQWarpsD = kBwdWarps / kQWarpsM;
  constexpr int kQRows = kBlockM / kQWarpsM;
  constexpr int kQMT = kQRows / kMmaM;
  constexpr int kQDims = kHeadDim / kQWarpsD;
  constexpr int kQNT = kQDims / kMmaN;
  constexpr int kQMaxChunk = 8 / kQMT;
  constexpr int kQChunk = kQNT <= kQMaxChunk ? kQNT
                          : (kQNT % kQMaxChunk == 0 ? kQMaxChunk : (kQNT % 4 == 0 && kQMaxChunk >= 4 ? 4 : 2));
  static_assert(kSMT >= 1 && kSNT % 2 == 0 && kKVMT >= 1 && kKVNT % 2 == 0 && kQMT >= 1 && kQNT % kQChunk == 0 &&
                    kQChunk % 2 == 0 && kHeadDim % kMmaK == 0,
                "tile shape");
  static_assert(2 * kBlockM <= kBwdThreads, "stage() fetches lse and delta with one thread per row each");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* s_k = reinterpret_cast<T*>(smem_raw);
  T* s_v = s_k + Smem::kKeyTile;
  T* s_q = s_v + Smem::kKeyTile;            // [2][kQueryTile]
  T* s_do = s_q + 2 * Smem::kQueryTile;     // [2][kQueryTile]
  T* s_p = s_do + 2 * Smem::kQueryTile;     // P^T (dropout applied) [key][query]
  T* s_ds = s_p + Smem::kScoreTile;         // dS^T [key][query]
  float* s_lse = reinterpret_cast<float*>(s_ds + Smem::kScoreTile);  // [2][kBlockM], natural log
  float* s_delta = s_lse + 2 * kBlockM;                               // [2][kBlockM]

  const FwdParams& p = bp.fwd;
  const AttentionShape& shape = p.shape;
  const int b = blockIdx.z;
  const int hk = blockIdx.y;
  const SeqInfo si = seq_info(shape, b);
  const int seqlen_q = si.seqlen_q;
  const int seqlen_k = si.seqlen_k;
  const int n_blocks = (seqlen_k + kBlockN - 1) / kBlockN;
  if (static_cast<int>(blockIdx.x) >= n_blocks) return;

  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int g = lane / 4;
  const int t = lane % 4;
  const int group = static_cast<int>(shape.nheads_q / shape.nheads_k);
  const int64_t head_dim = shape.head_dim;
  const int offset = p.mask.bottom_right ? seqlen_k - seqlen_q : 0;
  const bool left_bounded = p.mask.window_left != kUnboundedWindow;
  const bool right_bounded = p.mask.window_right != kUnboundedWindow;
  const int window_left = static_cast<int>(p.mask.window_left < kWindowClamp ? p.mask.window_left : kWindowClamp);
  const int window_right = static_cast<int>(p.mask.window_right < kWindowClamp ? p.mask.window_right : kWindowClamp);

  const float scale = static_cast<float>(p.softmax_scale);
  const float scale_log2 = static_cast<float>(p.softmax_scale * kLog2e);
  const float softcap = static_cast<float>(p.softcap);
  const bool has_softcap = kFeatures && p.softcap > 0.0;
  const float scale_over_cap = has_softcap ? static_cast<float>(p.softmax_scale / p.softcap) : 0.f;
  const bool has_alibi = kFeatures && p.mask.alibi_slopes != nullptr;
  const bool has_bias = kFeatures && p.mask.bias != nullptr;
  const bool write_dbias = kFeatures && bp.dbias != nullptr;
  const bool plain_scores = !has_softcap && !has_alibi && !has_bias;
  const bool dropout = kFeatures && p.dropout.p > 0.0;
  const uint64_t seed = dropout ? static_cast<uint64_t>(p.dropout.rng_state[0]) : 0;
  const uint64_t rng_offset = dropout ? static_cast<uint64_t>(p.dropout.rng_state[1]) : 0;
  const uint64_t keep_threshold = dropout_keep_threshold(p.dropout.p);
  const float inv_keep = dropout ? static_cast<float>(1.0 / (1.0 - p.dropout.p)) : 1.f;

  const bool vector_q = vector_tensor<T>(p.q, p.q_strides, head_dim);
  const bool vector_k = vector_tensor<T>(p.k, p.k_strides, head_dim);
  const bool vector_v = vector_tensor<T>(p.v, p.v_strides, head_dim);
  const bool vector_do = vector_tensor<T>(bp.dout, bp.dout_strides, head_dim);
  const bool pair_dk = vector_tensor<T>(bp.dk, bp.dk_strides, head_dim);
  const bool pair_dv = vector_tensor<T>(bp.dv, bp.dv_strides, head_dim);

  const BwdWorkspace ws = bwd_workspace(bp);
  const int64_t split = bp.deterministic ? blockIdx.x : 0;
  const float* lse_base = static_cast<const float*>(p.lse) + b * p.lse_batch_stride + si.q_row0;

  // Warp tile origins.
  const int s_key0 = (warp % kSWarpsN) * kSKeys;
  const int s_query0 = (warp / kSWarpsN) * kSQueries;
  const int kv_key0 = (warp % kKVWarpsN) * kKVKeys;
  const int kv_dim0 = (warp / kKVWarpsN) * kKVDims;
  const int q_row0 = (warp % kQWarpsM) * kQRows;
  const int q_dim0 = (warp / kQWarpsM) * kQDims;

  for (int n_block = blockIdx.x; n_block < n_blocks; n_block += gridDim.x) {
    const int n0 = n_block * kBlockN;
    const int n_end = min(n0 + kBlockN, seqlen_k);
    // Query rows that see any key of [n0, n_end): i + offset + right >= n0 and i + offset - left < n_end.
    int row_lo = 0, row_hi = seqlen_q;
    if (right_bounded) row_lo = max(0, n0 - offset - window_right);
    if (left_bounded) row_hi = min(seqlen_q, n_end - offset + window_left);
    const int m_first = row_lo / kBlockM;
    const int m_count = row_hi > row_lo ? (row_hi + kBlockM - 1) / kBlockM - m_first : 0;
    const int iterations = m_count * group;

    const T* k_tile = static_cast<const T*>(p.k) + b * p.k_strides.batch + (si.k_row0 + n0) * p.k_strides.row +
                      hk * p.k_strides.head;
    const T* v_tile = static_cast<const T*>(p.v) + b * p.v_strides.batch + (si.k_row0 + n0) * p.v_strides.row +
                      hk * p.v_strides.head;

    // Stages query block m0 of q head h into buffer buf: Q, dO, lse and delta, all by cp.async (the caller
    // commits). lse and delta of rows past the end are zero-filled: such rows only occur in blocks that are
    // not `full` below, where the visibility test zeroes P (the first version loaded lse and delta with plain
    // loads whose global latency stalled warps 0-1 at the top of every query block).
    auto stage = [&](int h, int m0, int buf) {
      const int64_t row = si.q_row0 + m0;
      const T* q_src = static_cast<const T*>(p.q) + b * p.q_strides.batch + row * p.q_strides.row +
                       h * p.q_strides.head;
      const T* do_src = static_cast<const T*>(bp.dout) + b * bp.dout_strides.batch + row * bp.dout_strides.row +
                        h * bp.dout_strides.head;
      load_tile<T, kBlockM, kHeadDim>(s_q + buf * Smem::kQueryTile, kStrideD, q_src, p.q_strides.row,
                                      seqlen_q - m0, static_cast<int>(head_dim), vector_q, tid);
      load_tile<T, kBlockM, kHeadDim>(s_do + buf * Smem::kQueryTile, kStrideD, do_src, bp.dout_strides.row,
                                      seqlen_q - m0, static_cast<int>(head_dim), vector_do, tid);
      // Threads [0, kBlockM) fetch lse, [kBlockM, 2 kBlockM) delta: whole warps each.
      if (tid < 2 * kBlockM) {
        const bool is_lse = tid < kBlockM;
        const int r = tid % kBlockM;
        const bool valid = m0 + r < seqlen_q;
        const float* src = is_lse ? lse_base + h * p.lse_head_stride + m0 + r
                                  : ws.delta + h * ws.delta_head_stride + si.global_q_row0 + m0 + r;
        float* dst = (is_lse ? s_lse : s_delta) + buf * kBlockM + r;
        ptx::cp_async_4(dst, valid ? src : lse_base, valid);
      }
    };

    __syncthreads();  // the previous key block's readers of s_k / s_v are done
    load_tile<T, kBlockN, kHeadDim>(s_k, kStrideD, k_tile, p.k_strides.row, seqlen_k - n0,
                                    static_cast<int>(head_dim), vector_k, tid);
    load_tile<T, kBlockN, kHeadDim>(s_v, kStrideD, v_tile, p.v_strides.row, seqlen_k - n0,
                                    static_cast<int>(head_dim), vector_v, tid);
    // Head and query block of the current iteration, advanced incrementally (query blocks inner).
    int cur_h = hk * group;
    int cur_m_block = m_first;
    if (iterations > 0) stage(cur_h, cur_m_block * kBlockM, 0);
    ptx::cp_async_commit();

    ptx::MmaC acc_dk[kKVMT][kKVNT];
    ptx::MmaC acc_dv[kKVMT][kKVNT];

    for (int it = 0; it < iterations; ++it) {
      const int buf = it & 1;
      const int h = cur_h;
      const int m0 = cur_m_block * kBlockM;
      const bool last_m_block = cur_m_block + 1 == m_first + m_count;
      const int next_h = last_m_block ? cur_h + 1 : cur_h;
      const int next_m_block = last_m_block ? m_first : cur_m_block + 1;
      cur_h = next_h;
      cur_m_block = next_m_block;
      const T* cur_q = s_q + buf * Smem::kQueryTile;
      const T* cur_do = s_do + buf * Smem::kQueryTile;
      const float* cur_lse = s_lse + buf * kBlockM;
      const float* cur_delta = s_delta + buf * kBlockM;
      ptx::cp_async_wait<0>();
      __syncthreads();  // this block's tiles are in; every warp is done with the previous block

      // ---- S^T = K Q^T and dP^T = V dO^T (keys x queries) ----
      ptx::MmaC acc_s[kSMT][kSNT];
      ptx::MmaC acc_dp[kSMT][kSNT];
#pragma unroll
      for (int kk = 0; kk < kHeadDim / kMmaK; ++kk) {
        ptx::MmaA a[kSMT];
#pragma unroll
        for (int mt = 0; mt < kSMT; ++mt) a[mt] = load_a(s_k, kStrideD, s_key0 + mt * kMmaM, kk * kMmaK, lane);
#pragma unroll
        for (int np = 0; np < kSNT / 2; ++np) {
          ptx::MmaB bq[2];
          load_b_pair(bq, cur_q, kStrideD, s_query0 + np * 2 * kMmaN, kk * kMmaK, lane);
#pragma unroll
          for (int mt = 0; mt < kSMT; ++mt) {
            ptx::mma_m16n8k16(acc_s[mt][2 * np], a[mt], bq[0], T{});
            ptx::mma_m16n8k16(acc_s[mt][2 * np + 1], a[mt], bq[1], T{});
          }
        }
      }
      // Prefetch the next block into the other buffer (its readers finished before the barrier above). Issued
      // after the S^T MMAs, not before: its address math then overlaps MMAs in flight instead of delaying the
      // first one after the barrier.
      if (it + 1 < iterations) stage(next_h, next_m_block * kBlockM, buf ^ 1);
      ptx::cp_async_commit();
#pragma unroll
      for (int kk = 0; kk < kHeadDim / kMmaK; ++kk) {
        ptx::MmaA a[kSMT];
#pragma unroll
        for (int mt = 0; mt < kSMT; ++mt) a[mt] = load_a(s_v, kStrideD, s_key0 + mt * kMmaM, kk * kMmaK, lane);
#pragma unroll
        for (int np = 0; np < kSNT / 2; ++np) {
          ptx::MmaB bo[2];
          load_b_pair(bo, cur_do, kStrideD, s_query0 + np * 2 * kMmaN, kk * kMmaK, lane);
#pragma unroll
          for (int mt = 0; mt < kSMT; ++mt) {
            ptx::mma_m16n8k16(acc_dp[mt][2 * np], a[mt], bo[0], T{});
            ptx::mma_m16n8k16(acc_dp[mt][2 * np + 1], a[mt], bo[1], T{});
          }
        }
      }

      // ---- P, dS elementwise (masking only where the block is not fully visible) ----
      bool full = m0 + kBlockM <= seqlen_q && n0 + kBlockN <= seqlen_k;
      if (kMask != MaskKind::kNone) {
        if (left_bounded) full = full && m0 + kBlockM - 1 + offset - window_left <= n0;
        if (right_bounded) full = full && m0 + offset + window_right + 1 >= n0 + kBlockN;
      }
      if (full && plain_scores && !dropout && !write_dbias) {
        // Interior block, no score modifiers: P = exp2(S * scale * log2e - lse * log2e), dS = P (dP - D).
#pragma unroll
        for (int nt = 0; nt < kSNT; ++nt) {
          const int query_local = s_query0 + nt * kMmaN + 2 * t;
          const float2 lse2 = *reinterpret_cast<const float2*>(cur_lse + query_local);
          const float2 delta2 = *reinterpret_cast<const float2*>(cur_delta + query_local);
#pragma unroll
          for (int mt = 0; mt < kSMT; ++mt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float lse_e = (e % 2 == 0 ? lse2.x : lse2.y) * static_cast<float>(kLog2e);
              const float delta_e = e % 2 == 0 ? delta2.x : delta2.y;
              const float prob = exp2f(fmaf(acc_s[mt][nt].reg[e], scale_log2, -lse_e));
              acc_s[mt][nt].reg[e] = prob;
              acc_dp[mt][nt].reg[e] = prob * (acc_dp[mt][nt].reg[e] - delta_e);
            }
          }
        }
      } else {
        const float alibi_slope = has_alibi ? p.mask.alibi_slopes[b * p.mask.alibi_batch_stride + h] : 0.f;
        const int64_t batch_head = static_cast<int64_t>(b) * shape.nheads_q + h;
#pragma unroll
        for (int mt = 0; mt < kSMT; ++mt) {
#pragma unroll
          for (int nt = 0; nt < kSNT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int key_local = s_key0 + mt * kMmaM + g + 8 * (e / 2);
              const int query_local = s_query0 + nt * kMmaN + 2 * t + (e % 2);
              const int key = n0 + key_local;
              const int query = m0 + query_local;
              const float s = acc_s[mt][nt].reg[e];
              float th = 0.f;
              float prob;
              if (plain_scores) {
                prob = exp2f(fmaf(s, scale_log2, -cur_lse[query_local] * static_cast<float>(kLog2e)));
              } else {
                float z;
                if (has_softcap) {
                  th = tanhf(s * scale_over_cap);
                  z = softcap * th;
                } else {
                  z = s * scale;
                }
                if (has_alibi) z -= alibi_slope * static_cast<float>(abs(query + offset - key));
                if (has_bias && query < seqlen_q && key < seqlen_k) {
                  const ScoreStrides& bs = p.mask.bias_strides;
                  z += read_bias(p.mask.bias, p.mask.bias_dtype,
                                 b * bs.batch + h * bs.head + query * bs.row + key * bs.col);
                }
                prob = exp2f(fmaf(z, static_cast<float>(kLog2e), -cur_lse[query_local] * static_cast<float>(kLog2e)));
              }
              if (!full) {
                bool visible = query < seqlen_q && key < seqlen_k;
                if (kMask != MaskKind::kNone) {
                  if (left_bounded) visible = visible && key >= query + offset - window_left;
                  if (right_bounded) visible = visible && key <= query + offset + window_right;
                }
                prob = visible ? prob : 0.f;
              }
              float dp = acc_dp[mt][nt].reg[e];
              float prob_used = prob;
              if (dropout) {
                const PhiloxBlock words = dropout_words(seed, rng_offset, batch_head, query, key / kPhiloxWordsPerCall);
                const bool keep = words.word[key % kPhiloxWordsPerCall] < keep_threshold;
                prob_used = keep ? prob * inv_keep : 0.f;
                dp = keep ? dp * inv_keep : 0.f;
              }
              const float dz = prob * (dp - cur_delta[query_local]);
              if (write_dbias && query < seqlen_q && key < seqlen_k) {
                const ScoreStrides& ds = bp.dbias_strides;
                static_cast<float*>(bp.dbias)[b * ds.batch + h * ds.head + query * ds.row + key * ds.col] = dz;
              }
              acc_s[mt][nt].reg[e] = prob_used;
              acc_dp[mt][nt].reg[e] = has_softcap ? dz * (1.f - th * th) : dz;
            }
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < kSMT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kSNT; ++nt) {
          const int key_local = s_key0 + mt * kMmaM + g;
          const int query_local = s_query0 + nt * kMmaN + 2 * t;
          uint32_t* p_lo = reinterpret_cast<uint32_t*>(s_p + key_local * kStrideM + query_local);
          uint32_t* p_hi = reinterpret_cast<uint32_t*>(s_p + (key_local + 8) * kStrideM + query_local);
          uint32_t* ds_lo = reinterpret_cast<uint32_t*>(s_ds + key_local * kStrideM + query_local);
          uint32_t* ds_hi = reinterpret_cast<uint32_t*>(s_ds + (key_local + 8) * kStrideM + query_local);
          *p_lo = pack_float2<T>(acc_s[mt][nt].reg[0], acc_s[mt][nt].reg[1]);
          *p_hi = pack_float2<T>(acc_s[mt][nt].reg[2], acc_s[mt][nt].reg[3]);
          *ds_lo = pack_float2<T>(acc_dp[mt][nt].reg[0], acc_dp[mt][nt].reg[1]);
          *ds_hi = pack_float2<T>(acc_dp[mt][nt].reg[2], acc_dp[mt][nt].reg[3]);
        }
      }
      __syncthreads();  // P^T and dS^T complete

      // ---- dV += P^T dO, dK += dS^T Q (keys x head dim) ----
#pragma unroll
      for (int kk = 0; kk < kBlockM / kMmaK; ++kk) {
        ptx::MmaA a_p[kKVMT], a_ds[kKVMT];
#pragma unroll
        for (int mt = 0; mt < kKVMT; ++mt) {
          a_p[mt] = load_a(s_p, kStrideM, kv_key0 + mt * kMmaM, kk * kMmaK, lane);
          a_ds[mt] = load_a(s_ds, kStrideM, kv_key0 + mt * kMmaM, kk * kMmaK, lane);
        }
#pragma unroll
        for (int np = 0; np < kKVNT / 2; ++np) {
          ptx::MmaB bo[2], bq[2];
          load_b_pair_trans(bo, cur_do, kStrideD, kv_dim0 + np * 2 * kMmaN, kk * kMmaK, lane);
          load_b_pair_trans(bq, cur_q, kStrideD, kv_dim0 + np * 2 * kMmaN, kk * kMmaK, lane);
#pragma unroll
          for (int mt = 0; mt < kKVMT; ++mt) {
            ptx::mma_m16n8k16(acc_dv[mt][2 * np], a_p[mt], bo[0], T{});
            ptx::mma_m16n8k16(acc_dv[mt][2 * np + 1], a_p[mt], bo[1], T{});
            ptx::mma_m16n8k16(acc_dk[mt][2 * np], a_ds[mt], bq[0], T{});
            ptx::mma_m16n8k16(acc_dk[mt][2 * np + 1], a_ds[mt], bq[1], T{});
          }
        }
      }

      // ---- dQ_i += dS K (queries x head dim), into the fp32 accumulator of this split ----
      float* dq_acc = ws.dq_accum + split * ws.dq_split_stride + h * ws.dq_head_stride +
                      (si.global_q_row0 + m0 + q_row0) * ws.dq_row_stride;
#pragma unroll
      for (int c0 = 0; c0 < kQNT; c0 += kQChunk) {
        ptx::MmaC acc_q[kQMT][kQChunk];
#pragma unroll
        for (int kk = 0; kk < kBlockN / kMmaK; ++kk) {
          ptx::MmaA a[kQMT];
#pragma unroll
          for (int mt = 0; mt < kQMT; ++mt) a[mt] = load_a_trans(s_ds, kStrideM, q_row0 + mt * kMmaM, kk * kMmaK, lane);
#pragma unroll
          for (int np = 0; np < kQChunk / 2; ++np) {
            ptx::MmaB bk[2];
            load_b_pair_trans(bk, s_k, kStrideD, q_dim0 + (c0 + 2 * np) * kMmaN, kk * kMmaK, lane);
#pragma unroll
            for (int mt = 0; mt < kQMT; ++mt) {
              ptx::mma_m16n8k16(acc_q[mt][2 * np], a[mt], bk[0], T{});
              ptx::mma_m16n8k16(acc_q[mt][2 * np + 1], a[mt], bk[1], T{});
            }
          }
        }
        if (bp.deterministic) {
          // This CTA is the only writer of its accumulator, and each element always has the same thread.
#pragma unroll
          for (int mt = 0; mt < kQMT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < kQChunk; ++nt) {
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                const int row = mt * kMmaM + g + 8 * r;
                if (m0 + q_row0 + row >= seqlen_q) continue;
                float2* dst = reinterpret_cast<float2*>(dq_acc + row * ws.dq_row_stride + q_dim0 +
                                                        (c0 + nt) * kMmaN + 2 * t);
                float2 sum = *dst;
                sum.x += acc_q[mt][nt].reg[2 * r];
                sum.y += acc_q[mt][nt].reg[2 * r + 1];
                *dst = sum;
              }
            }
          }
        } else {
          // This lane's reduction address and row checks, out of the fragment loop (computed after the MMAs
          // so they hold no registers during them).
          const DqLane lane_pos = dq_lane(g, t);
          float* dq_lane_acc = dq_acc + lane_pos.row * ws.dq_row_stride + q_dim0 + lane_pos.col;
          bool dq_row_ok[kQMT][2];
#pragma unroll
          for (int mt = 0; mt < kQMT; ++mt) {
            const int first_row = m0 + q_row0 + mt * kMmaM + lane_pos.row;
            dq_row_ok[mt][0] = first_row < seqlen_q;
            dq_row_ok[mt][1] = first_row + 8 < seqlen_q;
          }
#pragma unroll
          for (int mt = 0; mt < kQMT; ++mt) {
            float* dst = dq_lane_acc + mt * kMmaM * ws.dq_row_stride + (c0 * kMmaN);
#pragma unroll
            for (int nt = 0; nt < kQChunk; ++nt) {
              add_dq_fragment(dst + nt * kMmaN, ws.dq_row_stride, acc_q[mt][nt], t, dq_row_ok[mt][0],
                              dq_row_ok[mt][1]);
            }
          }
        }
      }
    }

    ptx::cp_async_wait<0>();  // nothing may still be writing s_k / s_v when the next key block reloads them

    // ---- dK = scale * dS^T Q, dV: this key block's rows of the kv head ----
    T* dk = static_cast<T*>(bp.dk) + b * bp.dk_strides.batch + (si.k_row0 + n0) * bp.dk_strides.row +
            hk * bp.dk_strides.head;
    T* dv = static_cast<T*>(bp.dv) + b * bp.dv_strides.batch + (si.k_row0 + n0) * bp.dv_strides.row +
            hk * bp.dv_strides.head;
#pragma unroll
    for (int mt = 0; mt < kKVMT; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int key_local = kv_key0 + mt * kMmaM + g + 8 * r;
        if (n0 + key_local >= seqlen_k) continue;
        T* dk_row = dk + key_local * bp.dk_strides.row;
        T* dv_row = dv + key_local * bp.dv_strides.row;
#pragma unroll
        for (int nt = 0; nt < kKVNT; ++nt) {
          const int col = kv_dim0 + nt * kMmaN + 2 * t;
          const float k0 = acc_dk[mt][nt].reg[2 * r] * scale, k1 = acc_dk[mt][nt].reg[2 * r + 1] * scale;
          const float v0 = acc_dv[mt][nt].reg[2 * r], v1 = acc_dv[mt][nt].reg[2 * r + 1];
          if (pair_dk && col < head_dim) {
            *reinterpret_cast<uint32_t*>(dk_row + col) = pack_float2<T>(k0, k1);
          } else if (!pair_dk) {
            if (col < head_dim) dk_row[col] = from_float<T>(k0);
            if (col + 1 < head_dim) dk_row[col + 1] = from_float<T>(k1);
          }
          if (pair_dv && col < head_dim) {
            *reinterpret_cast<uint32_t*>(dv_row + col) = pack_float2<T>(v0, v1);
          } else if (!pair_dv) {
            if (col < head_dim) dv_row[col] = from_float<T>(v0);
            if (col + 1 < head_dim) dv_row[col + 1] = from_float<T>(v1);
          }
        }
      }
    }
  }
}

}  // namespace flash::sm80::bwd
