// What both Hopper backward kernels (bwd_kernel.h, bwd_wide_kernel.h) share about a CTA: its launch arguments, its
// sequence and key blocks (BwdCta), the shared-memory ring of K / V, Q / dO and the statistics blocks (BwdRing), the
// producer thread that fills it, and the epilogue that writes (or, split over query heads, adds) dK and dV.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "flash_attn/bwd_workspace.h"
#include "flash_attn/common/fast_tanh.h"
#include "flash_attn/common/math.h"
#include "flash_attn/common/mask.h"
#include "flash_attn/params.h"
#include "flash_attn/ptx/red_sm90.h"
#include "flash_attn/ptx/tma_load_sm90.h"
#include "flash_attn/ptx/warpgroup_sm90.h"
#include "flash_attn/tensor_map_sm90.h"
#include "sm90/block_ranges.h"
#include "sm90/kernel_common.h"

namespace flash::sm90 {

struct BwdKernelArgs {
  CUtensorMap q_map;   // (head dim, head, row, batch) boxes of 64 columns x block_m rows
  CUtensorMap do_map;  // the same for dO
  CUtensorMap k_map;   // (head dim, kv head, key, batch) boxes of 64 columns x block_n keys
  CUtensorMap v_map;
  // The dq accumulator (DqLayout::kRows) as a 2D map: dq_row_stride columns, q head x total_q rows, in boxes of
  // kDqSlotGroup columns x block_m rows. Enabled (bwd_reduces_dq_in_bulk, calls that are not deterministic): dQ goes
  // through the staging tile and bulk reductions; otherwise through register reductions.
  TensorMapArg dq_map;
  CUtensorMap o_map;  // O as q_map has Q (d_in_kernel only)
  BwdParams params;
  float scale_log2;  // softmax_scale * log2(e)
  int heads_per_kv;
  int num_n_blocks;  // key blocks of the longest sequence; CTA x takes blocks x, x + gridDim.x, ...
  // Deterministic calls with ordered dQ (bwd_tile_config.h bwd_orders_dq): CTA x takes key block num_n_blocks - 1 - x
  // alone and adds a query block's dQ into accumulator 0 after the key blocks before it in that query block's order
  // (bwd_ordered_dq.h): every higher key block that sees it, or, with dq_arrival_order, every key block that reaches
  // it at an earlier step (ties: the higher first), unmasked calls then starting each key block's walk at its own
  // query block (BwdBlock::rotation). Arrival order makes a CTA wait for CTAs launched after it, so it needs the whole
  // key-block range of a (batch, KV head) resident at once: at most one CTA per SM of them (the launcher's check).
  bool dq_ordered;
  // Fused dQ (bwd_tile_config.h bwd_fuses_dq; ordered, deterministic or not): a query block's first adder stores its
  // tiles into the accumulator, its last adder's writer stores dq from the sum (bwd_ordered_dq.h).
  bool dq_fused;
  bool dq_arrival_order;
  bool dq_rotates;  // arrival order in a call without a mask
  // D = rowsum(dO o O) summed in the kernel (bwd_tile_config.h bwd_computes_d_in_kernel, bwd_step_delta.h): the
  // producer loads each step's O rows after its dO, and the consumers wait for the step's D (BwdDeltaRing::d_full).
  bool d_in_kernel;
  // BwdParams::head_splits: CTA x takes query heads (x % head_splits) * heads_per_split ... of its KV head's group
  // for key block x / head_splits and adds dK, dV into the workspace's fp32 accumulators (head_splits > 1 only in
  // calls that are not deterministic: one CTA per key block and split).
  int head_splits;
  int heads_per_split;
};

// The maps a backward CTA copies with, fetched by its first thread while the barriers are set up
// (kernel_common.h kPrefetchesTensorMaps), not by the first copies.
__device__ __forceinline__ void prefetch_bwd_tensor_maps(const BwdKernelArgs& args) {
  if constexpr (!kPrefetchesTensorMaps) return;
  ptx::prefetch_tensor_map(&args.q_map);
  ptx::prefetch_tensor_map(&args.do_map);
  ptx::prefetch_tensor_map(&args.k_map);
  ptx::prefetch_tensor_map(&args.v_map);
  if (args.dq_map.enabled) ptx::prefetch_tensor_map(&args.dq_map.map);
  if (args.d_in_kernel) ptx::prefetch_tensor_map(&args.o_map);
}

// A CTA's (batch entry, KV head), its sequence, and which key blocks and query heads it walks.
template <int kBlockM, int kBlockN>
struct BwdCta {
  int kv_head;
  int batch;
  Sequence sequence;
  int64_t offset;  // the causal / window diagonal's offset (common/mask.h)
  bool varlen;
  int map_batch;   // the TMA maps' batch coordinate: varlen maps are (head dim, head, total rows, 1)
  BwdWorkspace workspace;
  int64_t global_q_row0;     // the sequence's first row in the workspace's per-head rows
  const float* stat_blocks;  // its statistics blocks, head 0 (bwd_workspace.h): block m holds query block m
  // Deterministic calls without ordered dQ: CTA x adds dQ into its own accumulators alone (x, or 2x and 2x + 1 by
  // consumer: bwd_dq_accumulators_per_cta; the dq conversion sums them in a fixed order) and walks its key blocks in
  // order; otherwise gridDim.x covers every key block and all add into accumulator 0.
  int64_t dq_split;
  int first_block;
  int block_stride;
  int head0;  // this split's first query head
  int heads_per_split;
  int seq_blocks;  // key blocks of this sequence
  bool rotates;    // ordered dQ in arrival order without a mask: each key block starts at its own query block

  __device__ __forceinline__ explicit BwdCta(const BwdKernelArgs& args) {
    const BwdParams& bp = args.params;
    const FwdParams& p = bp.fwd;
    kv_head = blockIdx.y;
    batch = blockIdx.z;
    sequence = locate_sequence(p.shape, batch);
    offset = diagonal_offset(p.mask, sequence.seqlen_q, sequence.seqlen_k);
    varlen = p.shape.cu_seqlens_q != nullptr;
    map_batch = varlen ? 0 : batch;
    workspace = bwd_workspace(bp, DqLayout::kRows);
    global_q_row0 = varlen ? sequence.q_row0 : static_cast<int64_t>(batch) * p.shape.seqlen_q;
    stat_blocks = workspace.stats + bwd_stats_block0(global_q_row0, batch) * 2 * kBwdStatsRows;
    dq_split = bp.deterministic && !args.dq_ordered ? blockIdx.x : 0;
    const int head_split = static_cast<int>(blockIdx.x) % args.head_splits;
    first_block = static_cast<int>(blockIdx.x) / args.head_splits;
    block_stride = static_cast<int>(gridDim.x) / args.head_splits;
    if (args.dq_ordered) {  // highest key block first: the blocks a CTA waits for were launched before it
      first_block = args.num_n_blocks - 1 - static_cast<int>(blockIdx.x);
      block_stride = args.num_n_blocks;
    }
    head0 = kv_head * args.heads_per_kv + head_split * args.heads_per_split;
    heads_per_split = args.heads_per_split;
    seq_blocks = static_cast<int>((sequence.seqlen_k + kBlockN - 1) / kBlockN);
    rotates = args.dq_rotates;
  }

  // The query head of step i of a key block: this split's heads of the group, m_count query blocks each.
  __device__ __forceinline__ int step_head(int i, int m_count) const { return head0 + i / m_count; }

  // This split's walk of key block n_block (block_ranges.h plan_key_block).
  __device__ __forceinline__ BwdBlock plan(const MaskParams& mask, int n_block) const {
    return plan_key_block(mask, n_block, kBlockM, kBlockN, sequence.seqlen_q, sequence.seqlen_k, offset,
                          heads_per_split, seq_blocks, rotates);
  }

  // The query block of step i of a block (its query head: step_head).
  __device__ __forceinline__ static int step_block(const BwdBlock& block, int i) { return step_query_block(block, i); }
};

// A key block's steps in order, advanced by one per step, for the main kernel's consumers: BwdCta::step_head and
// step_block (which the producer and the ordered-dQ writers use) divide the step index by m_count, ~40 instructions
// at each step's start; step i's head is head0 + i / m_count and its query block m_min + (i % m_count + rotation) %
// m_count. ptxas + cuobjdump, hd 128 causal step loop 937 -> 916 instructions; timed with the uniform warpgroup
// index (warpgroup_sm90.h, thirty-first session): together +1-7 % at 512-2k keys at hd 64 / 128.
struct BwdStepWalk {
  int head;
  int local;   // the query block less m_min
  int walked;  // steps of the current head so far

  __device__ __forceinline__ BwdStepWalk(int head0, int rotation) : head(head0), local(rotation), walked(0) {}

  // m_count increments of `local` wrap it back to the rotation, so a new head starts where the last one did.
  __device__ __forceinline__ void advance(int m_count) {
    if (++local == m_count) local = 0;
    if (++walked == m_count) {
      walked = 0;
      ++head;
    }
  }
};

// The shared-memory ring of a Layout (BwdSmemLayout or BwdWideSmemLayout): K and V of the key block, kStages slots of
// Q (with its statistics block) and dO, and their mbarriers.
template <typename Layout, int kStages>
struct BwdRing {
  uint8_t* k_tile;
  uint8_t* v_tile;
  uint8_t* q_tiles;
  uint8_t* do_tiles;
  float* stats;
  uint64_t* kv_full;
  uint64_t* kv_empty;
  uint64_t* q_full;
  uint64_t* q_empty;
  uint64_t* do_full;
  uint64_t* do_empty;

  __device__ __forceinline__ explicit BwdRing(uint8_t* smem) {
    k_tile = smem + Layout::kK;
    v_tile = smem + Layout::kV;
    q_tiles = smem + Layout::kQ;
    do_tiles = smem + Layout::kDo;
    stats = reinterpret_cast<float*>(smem + Layout::kStats);
    uint64_t* barriers = reinterpret_cast<uint64_t*>(smem + Layout::kBarriers);
    kv_full = barriers;
    kv_empty = barriers + 1;
    q_full = barriers + 2;
    q_empty = q_full + kStages;
    do_full = q_empty + kStages;
    do_empty = do_full + kStages;
  }
};

// The narrow kernel's tiles for D in the kernel (bwd_step_delta.h): one buffer of a step's O rows with its full /
// empty barriers, and per ring stage the barrier that publishes the step's D; null in the wide kernel.
struct BwdDeltaRing {
  uint8_t* o_tile = nullptr;
  uint64_t* o_full = nullptr;
  uint64_t* o_empty = nullptr;
  uint64_t* d_full = nullptr;  // [stages]
};

// The producer thread: per key block with any step, K and V once; per step Q with its statistics block, then dO, each
// into ring slot (ring % kStages) once the consumers released it, and with args.d_in_kernel the step's O into the one
// O buffer once the delta warp released it.
template <typename Layout, int kBlockM, int kBlockN, int kStages>
__device__ __forceinline__ void produce_bwd_tiles(const BwdKernelArgs& args, const BwdCta<kBlockM, kBlockN>& cta,
                                                  const BwdRing<Layout, kStages>& ring_tiles,
                                                  const BwdDeltaRing& delta = BwdDeltaRing{}) {
  using Slot = RingSlot<kStages>;
  const MaskParams& mask = args.params.fwd.mask;
  int ring = 0;       // Q / dO ring iterations, counted across key blocks
  int loaded_kv = 0;  // key blocks whose K / V were loaded
  int o_loads = 0;    // steps whose O was loaded (d_in_kernel)
  for (int n_block = cta.first_block; n_block < args.num_n_blocks; n_block += cta.block_stride) {
    const BwdBlock block = cta.plan(mask, n_block);
    if (block.steps == 0) continue;  // no keys, or no query sees them: the consumers write zeros
    if (loaded_kv > 0) ptx::mbarrier_wait_parity(ring_tiles.kv_empty, (loaded_kv - 1) & 1);
    const int k_row = static_cast<int>(cta.sequence.k_row0 + block.key0);
    ptx::mbarrier_arrive_expect_tx(ring_tiles.kv_full, 2 * Layout::kKvBytes);
    for (int seg = 0; seg < Layout::kSegments; ++seg) {
      ptx::tma_load_4d(ring_tiles.k_tile + seg * kBlockN * kSegmentBytes, &args.k_map, ring_tiles.kv_full,
                       seg * kSegmentElems, cta.kv_head, k_row, cta.map_batch);
      ptx::tma_load_4d(ring_tiles.v_tile + seg * kBlockN * kSegmentBytes, &args.v_map, ring_tiles.kv_full,
                       seg * kSegmentElems, cta.kv_head, k_row, cta.map_batch);
    }
    ++loaded_kv;
    for (int i = 0; i < block.steps; ++i, ++ring) {
      const Slot slot(ring);
      const int head = cta.step_head(i, block.m_count);
      const int m_block = BwdCta<kBlockM, kBlockN>::step_block(block, i);
      const int q_row = static_cast<int>(cta.sequence.q_row0 + static_cast<int64_t>(m_block) * kBlockM);
      uint64_t* q_full = &ring_tiles.q_full[slot.stage];
      ptx::mbarrier_wait_parity(&ring_tiles.q_empty[slot.stage], slot.parity ^ 1);
      ptx::mbarrier_arrive_expect_tx(q_full, Layout::kRowsBytes + Layout::kStatBytes);
      for (int seg = 0; seg < Layout::kSegments; ++seg) {
        ptx::tma_load_4d(ring_tiles.q_tiles + slot.stage * Layout::kRowsBytes + seg * kBlockM * kSegmentBytes,
                         &args.q_map, q_full, seg * kSegmentElems, head, q_row, cta.map_batch);
      }
      ptx::bulk_load(ring_tiles.stats + slot.stage * Layout::kStatFloats,
                     cta.stat_blocks + head * cta.workspace.stats_head_stride +
                         static_cast<int64_t>(m_block) * Layout::kStatFloats,
                     Layout::kStatBytes, q_full);
      uint64_t* do_full = &ring_tiles.do_full[slot.stage];
      ptx::mbarrier_wait_parity(&ring_tiles.do_empty[slot.stage], slot.parity ^ 1);
      ptx::mbarrier_arrive_expect_tx(do_full, Layout::kRowsBytes);
      for (int seg = 0; seg < Layout::kSegments; ++seg) {
        ptx::tma_load_4d(ring_tiles.do_tiles + slot.stage * Layout::kRowsBytes + seg * kBlockM * kSegmentBytes,
                         &args.do_map, do_full, seg * kSegmentElems, head, q_row, cta.map_batch);
      }
      if (args.d_in_kernel && delta.o_tile != nullptr) {
        ptx::mbarrier_wait_parity(delta.o_empty, RingSlot<1>(o_loads++).parity ^ 1);
        ptx::mbarrier_arrive_expect_tx(delta.o_full, Layout::kRowsBytes);
        for (int seg = 0; seg < Layout::kSegments; ++seg) {
          ptx::tma_load_4d(delta.o_tile + seg * kBlockM * kSegmentBytes, &args.o_map, delta.o_full,
                           seg * kSegmentElems, head, q_row, cta.map_batch);
        }
      }
    }
  }
}

// The logit of a score in log2 units, as the forward's transform_scores forms it: softcap_log2 tanh(s tanh_scale) or
// s scale_log2, less ALiBi's alibi_slope_log2 |distance| (general kernels; lean ones take s scale_log2). scale_log2
// stays a kernel argument (BwdKernelArgs), read from the constant bank where the FFMA takes it.
struct BwdLogit {
  bool has_softcap;
  float tanh_scale;
  float softcap_log2;
  __device__ explicit BwdLogit(const FwdParams& p)
      : has_softcap(p.softcap > 0.0),
        tanh_scale(has_softcap ? static_cast<float>(p.softmax_scale / p.softcap) : 0.f),  // members in order
        softcap_log2(static_cast<float>(p.softcap * kLog2e)) {}
};

// P^T of one score: exp2 of its logit less its query row's LSE (log2 units), and, with softcap, the derivative
// 1 - tanh^2 that dS^T takes (both kernels' per-score step, bwd_kernel.h and bwd_wide_kernel.h). The score's query
// minus key position is distance_row + column, formed only with ALiBi (formed at the call, the general kernels' SASS
// changed in ~6-11 k of their instructions).
template <bool kGeneral>
__device__ __forceinline__ float step_probability(const BwdLogit& logit, float scale_log2, float score,
                                                  float alibi_slope_log2, float distance_row, int column,
                                                  float lse, float& derivative) {
  if constexpr (kGeneral) {
    float z;
    if (logit.has_softcap) {
      const float th = fast_tanh(score * logit.tanh_scale);
      z = logit.softcap_log2 * th;
      derivative = 1.f - th * th;
    } else {
      z = score * scale_log2;
    }
    if (alibi_slope_log2 != 0.f) {
      z -= alibi_slope_log2 * fabsf(distance_row + static_cast<float>(column));
    }
    return exp2f(z - lse);
  } else {
    (void)alibi_slope_log2;
    (void)distance_row;
    (void)column;
    (void)derivative;
    return exp2f(fmaf(score, scale_log2, -lse));
  }
}

// A step's P^T and dS^T = P^T (dP^T - D) in place of its S^T and dP^T accumulators (both kernels' consumers): general
// kernels wait for both GEMMs and do both in one pass, so softcap's derivative 1 - tanh^2 needs no registers of its own
// (stored, it spilled 156 bytes at hd 128); lean ones exponentiate while dP^T is still on the tensor cores. Register
// 4j + 2r + e: probability(j, e, score, derivative) and gradient(j, e, p, dp, derivative) form it; apply_mask(arrays...)
// zeroes the scores outside the mask (only P^T in lean kernels: dP^T's wgmma is still in flight, and dS^T = 0 follows
// from P^T = 0), where `masked` says the step needs it.
template <bool kGeneral, int kCount, typename Probability, typename Gradient, typename Mask>
__device__ __forceinline__ void step_scores_to_gradients(float (&s)[kCount], float (&dp)[kCount], bool masked,
                                                         Probability&& probability, Gradient&& gradient,
                                                         Mask&& apply_mask) {
  if constexpr (kGeneral) {
    ptx::warpgroup_wait<0>();
    pin_all(s);
    pin_all(dp);
#pragma unroll
    for (int j = 0; j < kCount / 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float derivative = 1.f;
        s[4 * j + e] = probability(j, e, s[4 * j + e], derivative);
        dp[4 * j + e] = gradient(j, e, s[4 * j + e], dp[4 * j + e], derivative);
      }
    }
    if (masked) apply_mask(s, dp);
  } else {
    ptx::warpgroup_wait<1>();
    pin_all(s);
#pragma unroll
    for (int j = 0; j < kCount / 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float unused = 1.f;
        s[4 * j + e] = probability(j, e, s[4 * j + e], unused);
      }
    }
    if (masked) apply_mask(s);
    ptx::warpgroup_wait<0>();
    pin_all(dp);
#pragma unroll
    for (int j = 0; j < kCount / 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[4 * j + e] = gradient(j, e, s[4 * j + e], dp[4 * j + e], 1.f);
    }
  }
}

// The backward's per-element mask by local ranges (bwd_tile_config.h kBwdMasksByLocalRange): register 4j + 2r + e of
// each array holds key row keys[r] and query column0 + 8j + e of the step (column0: its first query plus the thread's
// quad offset); scores whose query does not see the key become 0.
template <int kColumns, typename... Arrays>
__device__ __forceinline__ void zero_unseen_scores(const MaskParams& mask, const int64_t (&keys)[2], int64_t offset,
                                                   int64_t seqlen_q, int64_t seqlen_k, int64_t column0,
                                                   Arrays&... arrays) {
  LocalRange range[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const QueryRows seen = rows_seeing_key(mask, keys[r], offset, seqlen_q, seqlen_k);
    range[r] = local_range(seen.begin, seen.end, column0, kColumns);
  }
#pragma unroll
  for (int j = 0; j < kColumns / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool visible = in_local_range(range[e / 2], 8 * j + (e % 2));
      ((arrays[4 * j + e] = visible ? arrays[4 * j + e] : 0.f), ...);
    }
  }
}

// dK = softmax_scale * sum dS^T.Q and dV = sum P^T.dO of a consumer's kColumns columns from column0, for its two key
// rows `keys` (register 4j + 2r + e: key keys[r], column column0 + 8j + quad_col + e; zeros where no query saw the
// keys). Split over query heads (head_splits > 1), added into the workspace's fp32 accumulators (rows: the dense or
// packed key row, then the KV head), which bwd_launch.h converts once every split has added; otherwise stored.
template <typename T, int kColumns, int kBlockM, int kBlockN>
__device__ __forceinline__ void store_bwd_dkv(const BwdKernelArgs& args, const BwdCta<kBlockM, kBlockN>& cta,
                                              const int64_t (&keys)[2], const float (&dk)[kColumns / 2],
                                              const float (&dv)[kColumns / 2], int column0, int quad_col) {
  const BwdParams& bp = args.params;
  const FwdParams& p = bp.fwd;
  const float scale = static_cast<float>(p.softmax_scale);
  const int64_t seqlen_k = cta.sequence.seqlen_k;
  if (args.head_splits > 1) {
    const int64_t global_k_row0 =
        cta.varlen ? cta.sequence.k_row0 : static_cast<int64_t>(cta.batch) * p.shape.seqlen_k;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (keys[r] >= seqlen_k) continue;
      const int64_t accum_row =
          ((global_k_row0 + keys[r]) * p.shape.nheads_k + cta.kv_head) * cta.workspace.dkv_row_stride + column0;
#pragma unroll
      for (int j = 0; j < kColumns / 8; ++j) {
        const int col = 8 * j + quad_col;
        if (column0 + col < p.shape.head_dim) {
          ptx::red_add_v2_f32(cta.workspace.dk_accum + accum_row + col, dk[4 * j + 2 * r] * scale,
                              dk[4 * j + 2 * r + 1] * scale);
          ptx::red_add_v2_f32(cta.workspace.dv_accum + accum_row + col, dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]);
        }
      }
    }
  } else {
    T* dk_out = static_cast<T*>(bp.dk) + cta.batch * bp.dk_strides.batch + cta.kv_head * bp.dk_strides.head;
    T* dv_out = static_cast<T*>(bp.dv) + cta.batch * bp.dv_strides.batch + cta.kv_head * bp.dv_strides.head;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (keys[r] >= seqlen_k) continue;
      T* dk_row = dk_out + (cta.sequence.k_row0 + keys[r]) * bp.dk_strides.row + column0;
      T* dv_row = dv_out + (cta.sequence.k_row0 + keys[r]) * bp.dv_strides.row + column0;
#pragma unroll
      for (int j = 0; j < kColumns / 8; ++j) {
        const int col = 8 * j + quad_col;
        if (column0 + col < p.shape.head_dim) {
          *reinterpret_cast<uint32_t*>(dk_row + col) =
              pack_pair<T>(dk[4 * j + 2 * r] * scale, dk[4 * j + 2 * r + 1] * scale);
          *reinterpret_cast<uint32_t*>(dv_row + col) = pack_pair<T>(dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]);
        }
      }
    }
  }
}

}  // namespace flash::sm90
