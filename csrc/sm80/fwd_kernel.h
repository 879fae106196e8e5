// Forward attention kernel of the portable sm80+ path: one CTA of 1, 4 or 8 warps per (query tile, head, batch
// entry [, key split]). Q is staged once in shared memory; K and V tiles stream through cp.async in a ring of
// one or more stages per kind (with one, V of tile n loads while S = Q K^T, and at some head dims the softmax,
// of tile n run, K of tile n-1 while P V runs; more stages issue each tile further ahead); every operand reaches
// the tensor cores through ldmatrix and mma.sync m16n8k16. Key tiles run last to first, so the tiles that need
// the window/causal mask come first and the rest skip it. Tile shapes: fwd_tile_config.h.
#pragma once

#include <cmath>
#include <cstdint>

#include "flash_attn/common/mask.h"
#include "flash_attn/common/math.h"
#include "flash_attn/common/philox.h"
#include "flash_attn/params.h"
#include "flash_attn/ptx/cp_async_sm80.h"
#include "flash_attn/ptx/ldmatrix_sm80.h"
#include "flash_attn/ptx/mma_sm80.h"
#include "sm80/fwd_tile_config.h"
#include "sm80/kernel_common.h"

namespace flash::sm80 {

static_assert(kFwdSmemRowPad == kSmemRowPad, "fwd_tile_config.h restates the shared-memory row padding");

// Which keys the rows of one CTA may see, from the call's mask: the window bounds as ints (clamped so sums
// cannot overflow) and the key range [lo, hi) any row of rows [m0, m_last] can see.
struct CtaWindow {
  bool has_left;
  bool has_right;
  int left;
  int right;
  int offset;
};

template <MaskKind kMask>
__device__ __forceinline__ CtaWindow cta_window(const MaskParams& mask, int seqlen_q, int seqlen_k) {
  // A window wider than both sequences together is the same as no bound; clamping keeps int arithmetic exact.
  const int64_t limit = static_cast<int64_t>(seqlen_q) + seqlen_k;
  auto clamp = [&](int64_t w) { return static_cast<int>(w < limit ? w : limit); };
  CtaWindow w;
  w.has_left = kMask == MaskKind::kLocal && mask.window_left != kUnboundedWindow;
  w.has_right = kMask == MaskKind::kCausal || (kMask == MaskKind::kLocal && mask.window_right != kUnboundedWindow);
  w.left = w.has_left ? clamp(mask.window_left) : 0;
  w.right = kMask == MaskKind::kCausal ? 0 : (w.has_right ? clamp(mask.window_right) : 0);
  w.offset = mask.bottom_right ? seqlen_k - seqlen_q : 0;
  return w;
}

template <typename T, int kHeadDim, MaskKind kMask, bool kGeneral, FwdTileKind kKind>
__global__ void __launch_bounds__(fwd_tile_config(kHeadDim, kGeneral, kKind).warps* kWarpSize)
    fwd_kernel(const FwdParams p) {
  constexpr FwdTileConfig kTile = fwd_tile_config(kHeadDim, kGeneral, kKind);
  constexpr int kBlockM = kTile.block_m;
  constexpr int kBlockN = kTile.block_n;
  constexpr int kWarps = kTile.warps;
  constexpr int kThreads = kWarps * kWarpSize;
  constexpr int kStrips = kBlockM / (kWarps * kMmaM);  // 16-row strips per warp
  constexpr int kStripStride = kWarps * kMmaM;          // rows between a warp's strips
  constexpr int kStride = kHeadDim + kSmemRowPad;
  constexpr int kKSteps = kHeadDim / kMmaK;
  constexpr int kNTiles = kBlockN / kMmaN;
  constexpr int kDTiles = kHeadDim / kMmaN;
  constexpr int kStages = kTile.kv_stages;
  // cp.async groups still in flight when K(n) or V(n) is awaited: the 2 * (kStages - 1) loads issued after it.
  constexpr int kYoungerGroups = 2 * (kStages - 1);
  constexpr bool kEarlyV = fwd_waits_v_before_softmax(kHeadDim, kMask != MaskKind::kNone);
  static_assert(kHeadDim % (2 * kMmaK) == 0 && kBlockN % (2 * kMmaK) == 0 && kStrips >= 1, "tile shape");
  static_assert(kStages >= 1 && kStages <= kMaxKvStages, "kv_stages");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* s_q = reinterpret_cast<T*>(smem_raw);
  T* const s_k_ring = s_q + kBlockM * kStride;
  T* const s_v_ring = s_k_ring + kStages * kBlockN * kStride;

  const AttentionShape& shape = p.shape;
  const int h = blockIdx.y;
  const int b = blockIdx.z / p.num_splits;
  const int split = blockIdx.z % p.num_splits;
  int64_t q_row0 = 0, k_row0 = 0;
  int seqlen_q = static_cast<int>(shape.seqlen_q), seqlen_k = static_cast<int>(shape.seqlen_k);
  if (shape.cu_seqlens_q != nullptr) {
    q_row0 = shape.cu_seqlens_q[b];
    seqlen_q = shape.cu_seqlens_q[b + 1] - static_cast<int>(q_row0);
    k_row0 = shape.cu_seqlens_k[b];
    seqlen_k = shape.cu_seqlens_k[b + 1] - static_cast<int>(k_row0);
  }
  seqlen_k = static_cast<int>(used_keys(shape, b, seqlen_k));
  // Causal calls take their query tiles in reverse launch order: the block scheduler dispatches blockIdx.x
  // upwards, so ascending tiles left the CTAs with the most key tiles (the last rows) for the end of each head's
  // run and of the grid, and the final wave waited on them (8k tokens: 7.75 waves of CTAs with 1 to 64 key
  // tiles at 128 rows). Longest first leaves the one-tile CTAs for the tail.
  const int m_block = kMask == MaskKind::kCausal ? static_cast<int>(gridDim.x - 1 - blockIdx.x)
                                                 : static_cast<int>(blockIdx.x);
  const int m0 = m_block * kBlockM;
  if (m0 >= seqlen_q) return;
  const CtaWindow win = cta_window<kMask>(p.mask, seqlen_q, seqlen_k);
  const int hk = h / static_cast<int>(shape.nheads_q / shape.nheads_k);
  const int head_dim = static_cast<int>(shape.head_dim);

  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int g = lane / 4;
  const int t = lane % 4;

  // Key tiles this CTA (and split) visits.
  const int m_last = min(m0 + kBlockM, seqlen_q) - 1;
  const int key_lo = win.has_left ? max(0, m0 + win.offset - win.left) : 0;
  const int key_hi = win.has_right ? min(seqlen_k, m_last + win.offset + win.right + 1) : seqlen_k;
  int n_first = key_lo / kBlockN;
  int n_last = key_hi > key_lo ? (key_hi - 1) / kBlockN : n_first - 1;
  // Splits share this sequence's own tiles; a split starting past n_last (a short seqused_k, or a window that
  // leaves few tiles) visits none and writes the empty partial (out 0, lse -inf) that the combine weights 0.
  if (p.num_splits > 1) {
    const int per_split = (n_last - n_first + p.num_splits) / p.num_splits;
    const int lo = n_first + split * per_split;
    n_last = min(n_last, lo + per_split - 1);
    n_first = lo;
  }

  const T* q = static_cast<const T*>(p.q) + b * p.q_strides.batch + (q_row0 + m0) * p.q_strides.row +
               h * p.q_strides.head;
  const T* k = static_cast<const T*>(p.k) + b * p.k_strides.batch + k_row0 * p.k_strides.row +
               static_cast<int64_t>(hk) * p.k_strides.head;
  const T* v = static_cast<const T*>(p.v) + b * p.v_strides.batch + k_row0 * p.v_strides.row +
               static_cast<int64_t>(hk) * p.v_strides.head;

  // Key block n lives in ring slot n % kStages. Each load commits one cp.async group, empty when the block is
  // outside the range, so the wait counts below hold at the end of the range too. Block indices in range are
  // >= 0: the unsigned modulo is a mask for two stages.
  auto ring_slot = [](int n) { return static_cast<int>(static_cast<unsigned>(n) % kStages); };
  auto load_kv = [&](T* ring, const T* base, int64_t row_stride, int n) {
    if (n >= n_first) {
      const int n0 = n * kBlockN;
      load_tile_async<kBlockN, kHeadDim, kThreads>(ring + ring_slot(n) * kBlockN * kStride, base + n0 * row_stride,
                                                   row_stride, seqlen_k - n0, head_dim, tid);
    }
    ptx::cp_async_commit();
  };
  // Load order: Q with K(n_last), then V(n + 1 - kStages) after K(n) has landed and K(n - kStages) after V(n)
  // has; the prologue issues everything before the first tile's wait. With two or more stages V(n_last) is in
  // the prologue, so the first tile no longer pays a whole memory latency for V after K landed (with few tiles
  // per CTA, as at 512 tokens or in split decode, that latency was exposed). The order keeps both waits at
  // kYoungerGroups on every tile, so the loop body has no first-tile branch (one cost up to 15 extra STL/LDL
  // per tile in the 4-warp kernels, which sit at 255 registers).
  load_tile_async<kBlockM, kHeadDim, kThreads>(s_q, q, p.q_strides.row, seqlen_q - m0, head_dim, tid);
  load_kv(s_k_ring, k, p.k_strides.row, n_last);
#pragma unroll
  for (int ahead = 1; ahead < kStages; ++ahead) {
    load_kv(s_v_ring, v, p.v_strides.row, n_last + 1 - ahead);
    load_kv(s_k_ring, k, p.k_strides.row, n_last - ahead);
  }

  // Softmax in the log2 domain: p = 2^(x * x_scale - m). The fast path keeps raw scores (x_scale folds the
  // softmax scale and log2(e) into one FFMA); the general path turns scores into log2-domain logits first.
  const float scale_log2 = static_cast<float>(p.softmax_scale * kLog2e);
  const float x_scale = kGeneral ? 1.f : scale_log2;
  const float scale = static_cast<float>(p.softmax_scale);
  const float softcap = static_cast<float>(p.softcap);
  const float log2e = static_cast<float>(kLog2e);
  float alibi_slope = 0.f;
  bool dropout = false;
  uint64_t seed = 0, rng_offset = 0, keep_threshold = 0;
  float inv_keep = 1.f;
  if constexpr (kGeneral) {
    alibi_slope = p.mask.alibi_slopes != nullptr ? p.mask.alibi_slopes[b * p.mask.alibi_batch_stride + h] : 0.f;
    dropout = p.dropout.p > 0.0;
    if (dropout) {
      seed = static_cast<uint64_t>(p.dropout.rng_state[0]);
      rng_offset = static_cast<uint64_t>(p.dropout.rng_state[1]);
      keep_threshold = dropout_keep_threshold(p.dropout.p);
      inv_keep = static_cast<float>(1.0 / (1.0 - p.dropout.p));
    }
  }
  const int64_t batch_head = static_cast<int64_t>(b) * shape.nheads_q + h;

  // Rows (within the sequence) of this thread's accumulator entries: strip s, half r -> g + 8r.
  int rows[kStrips][2];
#pragma unroll
  for (int s = 0; s < kStrips; ++s) {
    rows[s][0] = m0 + warp * kMmaM + s * kStripStride + g;
    rows[s][1] = rows[s][0] + 8;
  }

  float row_max[kStrips][2], row_sum[kStrips][2];
  ptx::MmaC acc[kStrips][kDTiles];
#pragma unroll
  for (int s = 0; s < kStrips; ++s) {
    row_max[s][0] = row_max[s][1] = -INFINITY;
    row_sum[s][0] = row_sum[s][1] = 0.f;
  }
  const T zero = from_float<T>(0.f);

  for (int n = n_last; n >= n_first; --n) {
    const int n0 = n * kBlockN;
    ptx::cp_async_wait<kYoungerGroups>();
    __syncthreads();  // K(n) (and Q) landed; every warp is done with V(n+1), whose slot takes V(n + 1 - kStages)
    load_kv(s_v_ring, v, p.v_strides.row, n + 1 - kStages);
    const T* s_k = s_k_ring + ring_slot(n) * kBlockN * kStride;
    const T* s_v = s_v_ring + ring_slot(n) * kBlockN * kStride;

    ptx::MmaC sc[kStrips][kNTiles];
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      ptx::MmaA a[kStrips];
#pragma unroll
      for (int s = 0; s < kStrips; ++s) {
        ptx::ldmatrix_x4(a[s].reg,
                         s_q + (warp * kMmaM + s * kStripStride + lane % 16) * kStride + kk * kMmaK + (lane / 16) * 8);
      }
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        uint32_t kb[4];
        ptx::ldmatrix_x4(kb, s_k + (np * 16 + lane % 8 + 8 * (lane / 16)) * kStride + kk * kMmaK +
                                 8 * ((lane / 8) % 2));
        const ptx::MmaB b0{{kb[0], kb[1]}};
        const ptx::MmaB b1{{kb[2], kb[3]}};
#pragma unroll
        for (int s = 0; s < kStrips; ++s) {
          ptx::mma_m16n8k16(sc[s][2 * np], a[s], b0, zero);
          ptx::mma_m16n8k16(sc[s][2 * np + 1], a[s], b1, zero);
        }
      }
    }

    // Either here or after the softmax (fwd_waits_v_before_softmax): V(n) landed; every warp is done with K(n),
    // whose slot takes K(n - kStages).
    auto await_v = [&] {
      ptx::cp_async_wait<kYoungerGroups>();
      __syncthreads();
      load_kv(s_k_ring, k, p.k_strides.row, n - kStages);
    };
    if constexpr (kEarlyV) await_v();

    // General path: scores -> log2-domain logits (scale, softcap, ALiBi, bias).
    if constexpr (kGeneral) {
#pragma unroll
      for (int s = 0; s < kStrips; ++s) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = rows[s][e / 2];
            const int col = n0 + nt * kMmaN + 2 * t + (e % 2);
            float z = sc[s][nt].reg[e] * scale;
            if (softcap > 0.f) z = softcap * tanhf(z / softcap);
            if (p.mask.alibi_slopes != nullptr) z -= alibi_slope * fabsf(static_cast<float>(row + win.offset - col));
            if (p.mask.bias != nullptr && row < seqlen_q && col < seqlen_k) {
              const ScoreStrides& bs = p.mask.bias_strides;
              z += read_bias(p.mask.bias, p.mask.bias_dtype,
                             b * bs.batch + h * bs.head + static_cast<int64_t>(row) * bs.row + col * bs.col);
            }
            sc[s][nt].reg[e] = z * log2e;
          }
        }
      }
    }

    // Mask only the tiles some row of this CTA cannot fully see.
    const bool needs_mask = n0 + kBlockN > seqlen_k || (win.has_right && n0 + kBlockN - 1 > m0 + win.offset + win.right) ||
                            (win.has_left && n0 < m0 + kBlockM - 1 + win.offset - win.left);
    if (needs_mask) {
#pragma unroll
      for (int s = 0; s < kStrips; ++s) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = rows[s][e / 2];
            const int col = n0 + nt * kMmaN + 2 * t + (e % 2);
            const bool visible = col < seqlen_k && (!win.has_left || col >= row + win.offset - win.left) &&
                                 (!win.has_right || col <= row + win.offset + win.right);
            if (!visible) sc[s][nt].reg[e] = -INFINITY;
          }
        }
      }
    }

    // Online softmax: new running max, rescale of the running sum and O, then P = 2^(x * x_scale - max).
#pragma unroll
    for (int s = 0; s < kStrips; ++s) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          tile_max = fmaxf(tile_max, fmaxf(sc[s][nt].reg[2 * r], sc[s][nt].reg[2 * r + 1]));
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        const float new_max = fmaxf(row_max[s][r], tile_max * x_scale);
        const float shift = new_max == -INFINITY ? 0.f : new_max;
        const float rescale = exp2f(row_max[s][r] - shift);
        row_max[s][r] = new_max;
        row_sum[s][r] *= rescale;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          acc[s][dt].reg[2 * r] *= rescale;
          acc[s][dt].reg[2 * r + 1] *= rescale;
        }
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float prob = exp2f(fmaf(sc[s][nt].reg[2 * r + c], x_scale, -shift));
            sum += prob;
            sc[s][nt].reg[2 * r + c] = prob;
          }
        }
        row_sum[s][r] += sum;
      }
    }

    // Dropout: the row sum keeps every probability; only P V sees the kept ones, scaled by 1 / (1 - p).
    if (kGeneral && dropout) {
#pragma unroll
      for (int s = 0; s < kStrips; ++s) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int col = n0 + nt * kMmaN + 2 * t;
            const PhiloxBlock words = dropout_words(seed, rng_offset, batch_head, rows[s][r], col / 4);
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              float& prob = sc[s][nt].reg[2 * r + c];
              prob = words.word[(col + c) % 4] < keep_threshold ? prob * inv_keep : 0.f;
            }
          }
        }
      }
    }

    if constexpr (!kEarlyV) await_v();

    // O += P V: two adjacent n8 accumulator tiles of P are one k16 A fragment.
#pragma unroll
    for (int kk = 0; kk < kBlockN / kMmaK; ++kk) {
      ptx::MmaA pa[kStrips];
#pragma unroll
      for (int s = 0; s < kStrips; ++s) {
        const ptx::MmaC& left = sc[s][2 * kk];
        const ptx::MmaC& right = sc[s][2 * kk + 1];
        pa[s].reg[0] = pack_float2<T>(left.reg[0], left.reg[1]);
        pa[s].reg[1] = pack_float2<T>(left.reg[2], left.reg[3]);
        pa[s].reg[2] = pack_float2<T>(right.reg[0], right.reg[1]);
        pa[s].reg[3] = pack_float2<T>(right.reg[2], right.reg[3]);
      }
#pragma unroll
      for (int dp = 0; dp < kHeadDim / 16; ++dp) {
        uint32_t vb[4];
        ptx::ldmatrix_x4_trans(vb, s_v + (kk * kMmaK + lane % 16) * kStride + dp * 16 + 8 * (lane / 16));
        const ptx::MmaB b0{{vb[0], vb[1]}};
        const ptx::MmaB b1{{vb[2], vb[3]}};
#pragma unroll
        for (int s = 0; s < kStrips; ++s) {
          ptx::mma_m16n8k16(acc[s][2 * dp], pa[s], b0, zero);
          ptx::mma_m16n8k16(acc[s][2 * dp + 1], pa[s], b1, zero);
        }
      }
    }
  }

  // Epilogue: normalise; a split writes fp32 partials, a whole call stages O (in T) through the warp's own Q
  // rows of shared memory and stores 16-byte chunks.
  ptx::cp_async_wait<0>();
  __syncthreads();
  const bool split_call = p.num_splits > 1;
  const int64_t split_row0 =
      ((static_cast<int64_t>(split) * shape.batch + b) * shape.nheads_q + h) * shape.seqlen_q;
#pragma unroll
  for (int s = 0; s < kStrips; ++s) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = row_sum[s][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const bool empty = sum == 0.f;
      const float inv_sum = empty ? 0.f : 1.f / sum;
      const float lse = empty ? (split_call ? -INFINITY : INFINITY)
                              : row_max[s][r] * static_cast<float>(kLn2) + logf(sum);
      const int row = rows[s][r];
      const int local = row - m0;
      if (split_call) {
        if (row < seqlen_q) {
          float* o = p.split_out + (split_row0 + row) * kHeadDim;
#pragma unroll
          for (int dt = 0; dt < kDTiles; ++dt) {
            const int col = dt * kMmaN + 2 * t;
            *reinterpret_cast<float2*>(o + col) =
                make_float2(acc[s][dt].reg[2 * r] * inv_sum, acc[s][dt].reg[2 * r + 1] * inv_sum);
          }
          if (t == 0) p.split_lse[split_row0 + row] = lse;
        }
      } else {
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          const int col = dt * kMmaN + 2 * t;
          *reinterpret_cast<uint32_t*>(s_q + local * kStride + col) =
              pack_float2<T>(acc[s][dt].reg[2 * r] * inv_sum, acc[s][dt].reg[2 * r + 1] * inv_sum);
        }
        if (t == 0 && row < seqlen_q) {
          float* lse_out = static_cast<float*>(p.lse) + b * p.lse_batch_stride + h * p.lse_head_stride + q_row0;
          lse_out[row] = lse;
        }
      }
    }
  }
  if (split_call) return;
  __syncwarp();
  T* out = static_cast<T*>(p.out) + b * p.out_strides.batch + (q_row0 + m0) * p.out_strides.row +
           h * p.out_strides.head;
  constexpr int kChunksPerRow = kHeadDim / kChunkElems;
#pragma unroll
  for (int s = 0; s < kStrips; ++s) {
    const int strip0 = warp * kMmaM + s * kStripStride;
#pragma unroll
    for (int c = lane; c < kMmaM * kChunksPerRow; c += kWarpSize) {
      const int local = strip0 + c / kChunksPerRow;
      const int col = (c % kChunksPerRow) * kChunkElems;
      if (m0 + local < seqlen_q && col < head_dim) {
        *reinterpret_cast<uint4*>(out + local * p.out_strides.row + col) =
            *reinterpret_cast<const uint4*>(s_q + local * kStride + col);
      }
    }
  }
}

}  // namespace flash::sm80
