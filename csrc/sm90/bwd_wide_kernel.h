// The Hopper backward for head dims above 128 (sm_90a): dK and dV of 64 keys x 256 columns do not fit one warpgroup's
// registers, so a CTA's two consumers share its 64 keys and split the work by columns, as FA3 does at hd 256. Per step
// (64 query rows), each consumer computes S^T and dP^T for its query rows of the step (wgmma, K and V as A), writes
// its share of P^T and dS^T to shared tiles, and after one barrier both read the whole tiles: consumer 0 adds dV, dK
// for head-dim columns 0 .. 127 and computes dQ for them (dS read M-major from the dS^T tile), consumer 1 for the
// bucket's columns from 128 (bwd_tile_config.h bwd_wide_split: fewer columns, more rows at hd 160 / 192). dQ is added
// to the fp32 accumulator with red.global.add.v4, or (a dq map: bwd_reduces_dq_in_bulk) staged in the consumer's own
// column segments of the step's Q and dO slots for bulk reductions. Buckets 160 ... 224 run it on 256 stored columns,
// the rest zero-filled. Producer, statistics blocks and epilogue: bwd_cta.h; masks as bwd_kernel.h.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "flash_attn/bwd_workspace.h"
#include "flash_attn/common/fast_tanh.h"
#include "flash_attn/common/mask.h"
#include "flash_attn/common/math.h"
#include "flash_attn/params.h"
#include "flash_attn/ptx/bulk_reduce_sm90.h"
#include "flash_attn/ptx/fence_proxy_sm90.h"
#include "flash_attn/ptx/red_sm90.h"
#include "flash_attn/ptx/stmatrix_sm90.h"
#include "flash_attn/ptx/tma_load_sm90.h"
#include "flash_attn/ptx/warpgroup_sm90.h"
#include "flash_attn/ptx/wgmma_sm90_generated.h"
#include "sm90/block_ranges.h"
#include "sm90/bwd_kernel.h"
#include "sm90/kernel_common.h"

namespace flash::sm90 {

template <int kHeadDim, int kBlockM, int kBlockN, int kStages>
struct BwdWideSmemLayout {
  static constexpr int kSegments = kHeadDim / kSegmentElems;
  static constexpr int kKvBytes = kBlockN * kHeadDim * 2;    // K (or V)
  static constexpr int kRowsBytes = kBlockM * kHeadDim * 2;  // one stage of Q (or dO)
  static constexpr int kScoreBytes = kBlockN * kBlockM * 2;  // a P^T or dS^T tile: a 128-byte line of queries per key
  static constexpr int kStatFloats = 2 * kBlockM;            // LSE (log2 units) then D of one step
  static constexpr int kStatBytes = kStatFloats * 4;
  static constexpr int kK = 0;
  static constexpr int kV = kK + kKvBytes;
  static constexpr int kQ = kV + kKvBytes;
  static constexpr int kDo = kQ + kStages * kRowsBytes;
  static constexpr int kP = kDo + kStages * kRowsBytes;  // two P^T tiles: step i writes tile i % 2
  static constexpr int kDs = kP + 2 * kScoreBytes;        // two dS^T tiles
  static constexpr int kStats = kDs + 2 * kScoreBytes;    // [stage][kStatFloats], loaded with the stage's Q
  static constexpr int kBarriers = kStats + kStages * kStatBytes;
  // kv_full, kv_empty, then per stage q_full, q_empty, do_full, do_empty
  static constexpr int kBarrierCount = 2 + 4 * kStages;
  static constexpr int kBytes = kBarriers + kBarrierCount * 8;
  static constexpr int kLaunchBytes = kBytes + static_cast<int>(ptx::kSwizzleAtomBytes);
  static_assert(kBlockM * 2 == kSegmentBytes, "a P^T / dS^T line is one 128-byte swizzled line of block_m queries");
  static_assert(kBlockM == kBwdStatsRows, "a step's statistics are one block of the workspace's (bwd_workspace.h)");
  static_assert(kBlockN == kBwdRowsPerConsumer, "both consumers share the CTA's one m64 block of keys");
  static_assert(kRowsBytes % ptx::kSwizzleAtomBytes == 0 && kKvBytes % ptx::kSwizzleAtomBytes == 0 &&
                    kScoreBytes % ptx::kSwizzleAtomBytes == 0,
                "every tile starts on a swizzle atom");
  static_assert(kLaunchBytes <= kMaxSmemPerBlock, "the tiles must fit the shared memory a block may opt into");
};

// Named barriers of the wide kernel's consumers, + consumer: that consumer's half of P^T and dS^T written (it arrives,
// the other syncs). Not one barrier both sync on: the consumers are two template instances of one body, so they would
// reach it from two instructions, while bar.sync (.aligned) wants one for every thread; compute-sanitizer synccheck
// reported that as divergence and aborted the kernel (fifty-fifth session, 2,400 reports at hd 160).
constexpr int kBwdWideScoresBarrier = 1;  // 1 and 2
constexpr int kBwdWideScoresThreads = kBwdConsumerWarpgroups * ptx::kWarpgroupThreads;

// S^T (or dP^T) of this consumer's kN query rows: A = kBlockN keys of K (or V), B = rows row0 .. row0 + kN - 1 of a
// kBlockM-row Q (or dO) stage, both K-major over the head dim in [segment][rows][64] tiles.
template <typename T, int kHeadDim, int kBlockN, int kBlockM, int kN>
__device__ __forceinline__ void issue_half_scores(float (&s)[kN / 2], const uint8_t* a_tile, const uint8_t* b_tile,
                                                  int row0) {
  const uint64_t a_desc = ptx::smem_descriptor(a_tile, ptx::kDescriptorUnitBytes, ptx::kSwizzleAtomBytes);
  const uint64_t b_desc =
      ptx::smem_descriptor(b_tile + row0 * kSegmentBytes, ptx::kDescriptorUnitBytes, ptx::kSwizzleAtomBytes);
  ptx::warpgroup_fence();
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    const uint32_t step = (kk % 4) * kK16Bytes;
    ptx::Wgmma<T, kN>::ss(s, ptx::advance_descriptor(a_desc, (kk / 4) * kBlockN * kSegmentBytes + step),
                          ptx::advance_descriptor(b_desc, (kk / 4) * kBlockM * kSegmentBytes + step), kk > 0);
  }
  ptx::warpgroup_commit();
}

// acc += A.B over kK rows: A = a P^T or dS^T tile (K-major: kK queries per 128-byte key line), B = kColumns
// head-dim columns of a Q or dO stage from column segment `segment0`, read MN-major.
template <typename T, int kColumns, int kK, int kRowsB>
__device__ __forceinline__ void issue_tile_gemm(float (&acc)[kColumns / 2], const uint8_t* a_tile,
                                                const uint8_t* b_tile, int segment0) {
  const uint64_t a_desc = ptx::smem_descriptor(a_tile, ptx::kDescriptorUnitBytes, ptx::kSwizzleAtomBytes);
  const uint64_t b_desc = ptx::smem_descriptor(b_tile + segment0 * kRowsB * kSegmentBytes, kRowsB * kSegmentBytes,
                                               ptx::kSwizzleAtomBytes);
  ptx::warpgroup_fence();
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    ptx::Wgmma<T, kColumns>::template ss<0, 1>(acc, ptx::advance_descriptor(a_desc, kk * kK16Bytes),
                                               ptx::advance_descriptor(b_desc, kk * kK16MnMajorBytes), true);
  }
  ptx::warpgroup_commit();
}

// One consumer's share of a step (bwd_tile_config.h bwd_wide_split): S^T / dP^T rows kQuery0 .. + kQueries - 1,
// dK / dV / dQ columns kColumn0 .. + kColumns - 1.
template <int Queries, int Columns, int Query0, int Column0>
struct BwdWideConsumer {
  static constexpr int kQueries = Queries;
  static constexpr int kColumns = Columns;
  static constexpr int kQuery0 = Query0;
  static constexpr int kColumn0 = Column0;
  static_assert(kQueries % 16 == 0 && kColumns % 32 == 0, "16-query P^T stores, 2 dQ boxes of 16 columns a slot pair");
};

// kGeneral: softcap and / or ALiBi, as bwd_kernel.h's general kernels recompute them. kScoreDim: the columns S^T and
// dP^T run over (the call's bucket: 160 / 192 / 224 of the 256 stored, whose rest is TMA's zero fill); dK, dV and dQ
// keep kHeadDim's. kOrderedDq: the deterministic calls' instantiation, whose producer warpgroup's writers add dQ in
// the query blocks' order (bwd_tile_config.h kBwdDeterministicDqOrderedWide); an instantiation of its own so that the
// other calls' kernel keeps its code (the writers spill 512 bytes and the step loop's branch on the order adds ~20
// instructions, fifty-seventh session).
template <typename T, int kHeadDim, MaskKind kMask, bool kGeneral, int kBlockM, int kBlockN, int kStages,
          int kScoreDim = kHeadDim, bool kOrderedDq = false>
__global__ void __launch_bounds__(kBwdThreads, 1) bwd_wide_kernel(const __grid_constant__ BwdKernelArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Layout = BwdWideSmemLayout<kHeadDim, kBlockM, kBlockN, kStages>;
  using Slot = RingSlot<kStages>;
  static_assert(kScoreDim <= kHeadDim && kScoreDim % 16 == 0, "S^T / dP^T over whole k16 steps of the stored columns");
  // Each consumer's rows and columns of a step (bwd_tile_config.h bwd_wide_split).
  constexpr BwdWideSplit kSplit = bwd_wide_split(kScoreDim, kBlockM);
  static_assert(kSplit.columns0 % kSegmentElems == 0 && kSplit.columns0 + kSplit.columns1 <= kHeadDim,
                "consumer 1's columns start on a 64-column segment, inside the stored columns");

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_dynamic_smem(smem_raw);
  const BwdRing<Layout, kStages> ring_tiles(smem);
  uint8_t* k_tile = ring_tiles.k_tile;
  uint8_t* v_tile = ring_tiles.v_tile;
  uint8_t* q_tiles = ring_tiles.q_tiles;
  uint8_t* do_tiles = ring_tiles.do_tiles;
  uint8_t* p_tiles = smem + Layout::kP;
  uint8_t* ds_tiles = smem + Layout::kDs;
  uint64_t* kv_full = ring_tiles.kv_full;
  uint64_t* q_full = ring_tiles.q_full;
  uint64_t* q_empty = ring_tiles.q_empty;
  uint64_t* do_full = ring_tiles.do_full;
  uint64_t* do_empty = ring_tiles.do_empty;

  const BwdParams& bp = args.params;
  const FwdParams& p = bp.fwd;

  const bool bulk_dq = args.dq_map.enabled;  // dQ by bulk reductions, staged in the Q and dO slots (below)
  // Deterministic calls with ordered dQ (bwd_tile_config.h bwd_orders_dq; launch_bwd picks this instantiation for them).
  constexpr bool dq_ordered = kOrderedDq;
  if (threadIdx.x == 0) {
    prefetch_bwd_tensor_maps(args);
    // q_empty: every consumer thread arrives, since each read the stage's statistics with plain loads: an arrival
    // releases the arriving thread's own reads (one arrival per consumer after a named barrier left racecheck
    // reporting the next bulk copy against the other threads' reads; docs/perf_log.md, seventeenth session). do_empty
    // likewise when the threads wrote dQ boxes into the dO slot; otherwise one arrival per consumer.
    constexpr int kEveryConsumerThread = kBwdConsumerWarpgroups * ptx::kWarpgroupThreads;
    init_pipeline_barriers(kv_full, ring_tiles.kv_empty, q_full, do_full, q_empty, do_empty, kStages,
                           kBwdConsumerWarpgroups, kEveryConsumerThread,
                           bulk_dq ? kEveryConsumerThread : kBwdConsumerWarpgroups);
  }
  __syncthreads();

  const int warpgroup = ptx::warpgroup_index();
  if (warpgroup == 0) {
    ptx::release_registers<kProducerRegisters>();
    if (threadIdx.x == 0) {
      produce_bwd_tiles(args, BwdCta<kBlockM, kBlockN>(args), ring_tiles);
    } else if (dq_ordered) {
      const int writer = static_cast<int>(threadIdx.x) / kWarpSize - kBwdDqFirstWriterWarp;
      if (writer >= 0 && writer < kBwdDqWriters) {
        write_ordered_dq_wide<Layout, kSplit, kBlockM, kBlockN, kStages>(args, BwdCta<kBlockM, kBlockN>(args),
                                                                          ring_tiles, writer);
      }
    }
    return;
  }

  ptx::claim_registers<kConsumerRegisters>();
  // The CTA's plan is built after setmaxnreg, in each warpgroup (as bwd_kernel.h): built once before the split it was
  // live across it and spilled (hd 256 causal: 164 B, 11 local loads a step -> 0; with the uniform warpgroup index
  // the step loop 1,398 -> 1,075 instructions; the two timed together: +3-6 % at 512-2k keys, thirty-first session).
  // Deterministic calls (cta.dq_split): the two consumers' dQ columns are disjoint, so no order between them is needed.
  const BwdCta<kBlockM, kBlockN> cta(args);
  const int64_t seqlen_q = cta.sequence.seqlen_q;
  const int64_t seqlen_k = cta.sequence.seqlen_k;
  const int64_t offset = cta.offset;
  const BwdWorkspace& workspace = cta.workspace;
  const int consumer = warpgroup - 1;
  const int thread = threadIdx.x % ptx::kWarpgroupThreads;
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  const int quad_col = 2 * (lane % kQuadLanes);
  // The consumer's step loop, compiled once per consumer (its rows and columns are template constants).
  auto consume = [&](auto shape) {
    using Shape = decltype(shape);
    constexpr int kQueries = Shape::kQueries;  // this consumer's S^T / dP^T rows of a step, from query0
    constexpr int kColumns = Shape::kColumns;  // its dK / dV / dQ columns, from column0
    constexpr int query0 = Shape::kQuery0;
    constexpr int column0 = Shape::kColumn0;
    constexpr int column_segment0 = column0 / kSegmentElems;
    constexpr int kColumnSegments = (kColumns + kSegmentElems - 1) / kSegmentElems;
    // Slot groups of the dq accumulator's rows (bwd_padded_head_dim wide) this consumer's columns reach.
    const int dq_groups = static_cast<int>(
        std::max<int64_t>(std::min<int64_t>(kColumns, workspace.dq_row_stride - column0), 0) / kDqSlotGroup);
    const BwdLogit logit(p);
    // Bulk dQ: a consumer's boxes of kDqSlotGroup columns x kBlockM rows, the first half in its two column segments of
    // the step's Q slot, the second in those of its dO slot (after its own dK / dV GEMMs nothing reads them: the
    // other consumer's read its own segments, and S^T / dP^T, which read every segment, finished before the scores
    // barrier). Thread 0 releases the slot once the TMA unit has read the boxes: pending_stage until then.
    constexpr int kDqBoxes = kColumns / kDqSlotGroup;
    constexpr int kBoxesPerSlot = kDqBoxes / 2;
    constexpr int kBoxFloats = kDqSlotGroup * kBlockM;
    static_assert(kDqBoxes % 2 == 0 && kBoxesPerSlot * kBoxFloats * 4 <= kColumnSegments * kBlockM * kSegmentBytes,
                  "half of a consumer's dQ boxes fit its column segments of one Q or dO slot");
    constexpr int kNoStage = -1;
    int pending_stage = kNoStage;
    auto release_pending = [&]() {
      if (pending_stage == kNoStage) return;
      ptx::bulk_wait_group_read<0>();
      ptx::mbarrier_arrive(&q_empty[pending_stage]);
      ptx::mbarrier_arrive(&do_empty[pending_stage]);
      pending_stage = kNoStage;
    };
    int ring = 0;
    int loaded_kv = 0;

    for (int n_block = cta.first_block; n_block < args.num_n_blocks; n_block += cta.block_stride) {
      const BwdBlock block = cta.plan(p.mask, n_block);
      if (!block.has_keys) continue;
      // Deterministic bulk dQ (bwd_deterministic_dq_in_bulk): the previous key block's reductions complete before this
      // one's reach the same rows, so each element's adds arrive in key-block order.
      if (bulk_dq && bp.deterministic && thread == 0) ptx::bulk_wait_group<0>();
      const int64_t key0 = block.key0;
      const int m_count = block.m_count, steps = block.steps;
      // This thread's two key rows of the m64 accumulators (the same 64 keys in both consumers).
      int64_t keys[2];
      for (int r = 0; r < 2; ++r) keys[r] = key0 + warp * kRowsPerWarp + lane / kQuadLanes + kSecondRow * r;

      float dv[kColumns / 2];
      float dk[kColumns / 2];
#pragma unroll
      for (int i = 0; i < kColumns / 2; ++i) dv[i] = dk[i] = 0.f;

      if (steps > 0) {
        ptx::mbarrier_wait_parity(kv_full, loaded_kv & 1);
        for (int i = 0; i < steps; ++i, ++ring) {
          const Slot slot(ring);
          const int head = cta.step_head(i, m_count);
          const int64_t q0 = static_cast<int64_t>(cta.step_block(block, i)) * kBlockM;
          const uint8_t* q_slot = q_tiles + slot.stage * Layout::kRowsBytes;
          const uint8_t* do_slot = do_tiles + slot.stage * Layout::kRowsBytes;
          float s[kQueries / 2];
          float dp[kQueries / 2];
          ptx::mbarrier_wait_parity(&q_full[slot.stage], slot.parity);
          issue_half_scores<T, kScoreDim, kBlockN, kBlockM, kQueries>(s, k_tile, q_slot, query0);
          ptx::mbarrier_wait_parity(&do_full[slot.stage], slot.parity);
          issue_half_scores<T, kScoreDim, kBlockN, kBlockM, kQueries>(dp, v_tile, do_slot, query0);
          release_pending();  // the previous step's slot, while this step's S^T and dP^T run

          const float alibi_slope_log2 =
              kGeneral && p.mask.alibi_slopes != nullptr
                  ? p.mask.alibi_slopes[cta.batch * p.mask.alibi_batch_stride + head] * static_cast<float>(kLog2e)
                  : 0.f;
          float distance0[2];
#pragma unroll
          for (int r = 0; r < 2; ++r) distance0[r] = static_cast<float>(q0 + query0 + quad_col + offset - keys[r]);
          // The step's LSE (log2 units; +inf past the sequence) and D, brought with Q.
          const float* step_stats = ring_tiles.stats + slot.stage * Layout::kStatFloats;
          const bool masked = block_pair_needs_mask(p.mask, kMask != MaskKind::kNone, q0, kBlockM, key0, kBlockN,
                                                    seqlen_q, seqlen_k, offset);
          // Register 4j + 2r + e: key row keys[r], query column query0 + 8j + quad_col + e of the step.
          auto probability = [&](int j, int e, float score, float& derivative) {
            return step_probability<kGeneral>(logit, args.scale_log2, score, alibi_slope_log2,
                                              distance0[e / 2], 8 * j + (e % 2),
                                              step_stats[query0 + 8 * j + quad_col + (e % 2)], derivative);
          };
          auto score_gradient = [&](int j, int e, float prob, float d_prob, float derivative) {
            return prob * (d_prob - step_stats[kBlockM + query0 + 8 * j + quad_col + (e % 2)]) * derivative;
          };
          auto apply_mask = [&](auto&... arrays) {
            if constexpr (kBwdMasksByLocalRange) {
              zero_unseen_scores<kQueries>(p.mask, keys, offset, seqlen_q, seqlen_k, q0 + query0 + quad_col, arrays...);
            } else {
#pragma unroll
              for (int j = 0; j < kQueries / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                  const int64_t q = q0 + query0 + 8 * j + quad_col + (e % 2);
                  const int64_t key = keys[e / 2];
                  const KeyRange seen = visible_keys(p.mask, q, offset, seqlen_k);
                  const bool visible = q < seqlen_q && key < seqlen_k && key >= seen.begin && key < seen.end;
                  ((arrays[4 * j + e] = visible ? arrays[4 * j + e] : 0.f), ...);
                }
              }
            }
          };
          step_scores_to_gradients<kGeneral>(s, dp, masked, probability, score_gradient, apply_mask);
          uint32_t p_frag[kQueries / 16][4];
          uint32_t ds_frag[kQueries / 16][4];
          pack_probs<T, kQueries>(s, p_frag);
          pack_probs<T, kQueries>(dp, ds_frag);

          // This consumer's query chunks of every key line of the P^T and dS^T tiles (128-byte swizzle): stmatrix.x4
          // matrix i of instruction k holds key rows + 8 (i % 2) and the 8-query chunk 2k + i / 2 of its kQueries.
          uint8_t* p_tile = p_tiles + (ring % 2) * Layout::kScoreBytes;
          uint8_t* ds_tile = ds_tiles + (ring % 2) * Layout::kScoreBytes;
          {
            const int matrix = lane / 8;
            const int line = warp * kRowsPerWarp + lane % 8 + kSecondRow * (matrix % 2);
#pragma unroll
            for (int k = 0; k < kQueries / 16; ++k) {
              const int chunk = (query0 / 8 + 2 * k + matrix / 2) ^ (line % 8);
              ptx::stmatrix_x4(p_tile + line * kSegmentBytes + chunk * 16, p_frag[k][0], p_frag[k][1], p_frag[k][2],
                               p_frag[k][3]);
              ptx::stmatrix_x4(ds_tile + line * kSegmentBytes + chunk * 16, ds_frag[k][0], ds_frag[k][1],
                               ds_frag[k][2], ds_frag[k][3]);
            }
          }
          ptx::fence_proxy_async_shared();
          ptx::named_barrier_arrive(kBwdWideScoresBarrier + consumer, kBwdWideScoresThreads);
          ptx::named_barrier_sync(kBwdWideScoresBarrier + 1 - consumer, kBwdWideScoresThreads);

          // dV += P^T.dO and dK += dS^T.Q over the step's kBlockM queries, this consumer's columns; dQ (kBlockM rows x
          // its columns) = dS.K over the kBlockN keys: A = dS^T read M-major, B = K MN-major.
          issue_tile_gemm<T, kColumns, kBlockM, kBlockM>(dv, p_tile, do_slot, column_segment0);
          issue_tile_gemm<T, kColumns, kBlockM, kBlockM>(dk, ds_tile, q_slot, column_segment0);
          float dq[kColumns / 2];
          {
            const uint64_t ds_desc = ptx::smem_descriptor(ds_tile, kBlockN * kSegmentBytes, ptx::kSwizzleAtomBytes);
            const uint64_t k_desc = ptx::smem_descriptor(k_tile + column_segment0 * kBlockN * kSegmentBytes,
                                                         kBlockN * kSegmentBytes, ptx::kSwizzleAtomBytes);
            ptx::warpgroup_fence();
#pragma unroll
            for (int kk = 0; kk < kBlockN / 16; ++kk) {
              ptx::Wgmma<T, kColumns>::template ss<1, 1>(dq,
                                                         ptx::advance_descriptor(ds_desc, kk * kK16MnMajorBytes),
                                                         ptx::advance_descriptor(k_desc, kk * kK16MnMajorBytes),
                                                         kk > 0);
            }
            ptx::warpgroup_commit();
          }
          ptx::warpgroup_wait<0>();
          pin_all(dv);
          pin_all(dk);
          pin_all(dq);
          // dQ in the fp32 accumulator's order (DqLayout::kRows, columns interleaved by dq_slot): a thread's
          // columns 8j + quad_col + e of j = 2g, 2g + 1 are slots 4 (lane % 4) .. + 3 of slot group g, one 16-byte
          // value.
          if (bulk_dq) {
            uint8_t* const halves[2] = {
                q_tiles + slot.stage * Layout::kRowsBytes + column_segment0 * kBlockM * kSegmentBytes,
                do_tiles + slot.stage * Layout::kRowsBytes + column_segment0 * kBlockM * kSegmentBytes};
            auto box = [&](int g) {
              return reinterpret_cast<float*>(halves[g / kBoxesPerSlot]) + (g % kBoxesPerSlot) * kBoxFloats;
            };
            // Dense rows of 64 bytes (a warp's 8 rows x 64 bytes per store: conflict-free). Rows past the sequence
            // hold zeros (P = 0 there), as in bwd_kernel.h's staging.
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int row = warp * kRowsPerWarp + lane / kQuadLanes + kSecondRow * r;
#pragma unroll
              for (int g = 0; g < kDqBoxes; ++g) {
                *reinterpret_cast<float4*>(box(g) + row * kDqSlotGroup + 2 * quad_col) = make_float4(
                    dq[8 * g + 2 * r], dq[8 * g + 2 * r + 1], dq[8 * g + 4 + 2 * r], dq[8 * g + 4 + 2 * r + 1]);
              }
            }
            ptx::fence_proxy_async_shared();
            if (dq_ordered) {
              // A writer (bwd_ordered_dq.h write_ordered_dq_wide) adds the boxes in the query block's order and
              // releases the slot for this consumer's first thread once they are read.
              if (thread != 0) {
                ptx::mbarrier_arrive(&q_empty[slot.stage]);
                ptx::mbarrier_arrive(&do_empty[slot.stage]);
              }
              ptx::named_barrier_arrive(kBwdWideDqFullBarrier + kBwdConsumerWarpgroups * (i % kBwdDqWriters) + consumer,
                                        kBwdDqHandoffThreads);
            } else {
              ptx::named_barrier_sync(kBwdDqStageBarrier + consumer, ptx::kWarpgroupThreads);
              if (thread == 0) {
                const int row = static_cast<int>((cta.dq_split * p.shape.nheads_q + head) * workspace.dq_head_rows +
                                                 cta.global_q_row0 + q0);
#pragma unroll
                for (int g = 0; g < kDqBoxes; ++g) {
                  if (g < dq_groups) ptx::bulk_reduce_add_2d(&args.dq_map.map, box(g), column0 + g * kDqSlotGroup, row);
                }
                ptx::bulk_commit_group();
                pending_stage = slot.stage;
              } else {
                ptx::mbarrier_arrive(&q_empty[slot.stage]);
                ptx::mbarrier_arrive(&do_empty[slot.stage]);
              }
            }
          } else {
            ptx::mbarrier_arrive(&q_empty[slot.stage]);
            if (thread == 0) ptx::mbarrier_arrive(&do_empty[slot.stage]);
            float* dq_head =
                workspace.dq_accum + cta.dq_split * workspace.dq_split_stride + head * workspace.dq_head_stride;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int64_t q = q0 + warp * kRowsPerWarp + lane / kQuadLanes + kSecondRow * r;
              if (q >= seqlen_q) continue;
              float* dq_row = dq_head + (cta.global_q_row0 + q) * workspace.dq_row_stride + column0;
#pragma unroll
              for (int g = 0; g < kDqBoxes; ++g) {
                if (g >= dq_groups) continue;
                ptx::red_add_v4_f32(dq_row + g * kDqSlotGroup + 2 * quad_col, dq[8 * g + 2 * r], dq[8 * g + 2 * r + 1],
                                    dq[8 * g + 4 + 2 * r], dq[8 * g + 4 + 2 * r + 1]);
              }
            }
          }
        }
        release_pending();  // the block's last slot: the producer may wait for it before the next block's K / V
        if (thread == 0) ptx::mbarrier_arrive(ring_tiles.kv_empty);
        ++loaded_kv;
      }

      // dK and dV of this consumer's columns of the block's keys.
      store_bwd_dkv<T, kColumns>(args, cta, keys, dk, dv, column0, quad_col);
    }
  };
  if (consumer == 0) {
    consume(BwdWideConsumer<kSplit.queries0, kSplit.columns0, 0, 0>{});
  } else {
    consume(BwdWideConsumer<kBlockM - kSplit.queries0, kSplit.columns1, kSplit.queries0, kSplit.columns0>{});
  }
  if (bulk_dq && thread == 0) ptx::bulk_wait_group<0>();  // the last boxes are added before the CTA ends
#else
  (void)args;
  __trap();
#endif
}

}  // namespace flash::sm90
