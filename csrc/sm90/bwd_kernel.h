// The Hopper backward main kernel (sm_90a): per CTA block_n keys of one (batch entry, KV head), dK and dV in registers
// of two consumer warpgroups (64 keys each), walking every query block that sees those keys, for each query head of
// the KV head's group. Warpgroup 0's first thread loads K and V once and Q, dO per step by TMA. Per step, each
// consumer computes S^T = K.Q^T and dP^T = V.dO^T (wgmma, shared operands), P^T = exp2(S^T scale log2e - LSE log2e)
// (the step's LSE and D come with Q, one bulk copy from the workspace's statistics blocks),
// dS^T = P^T (dP^T - D), then dV += P^T.dO and dK += dS^T.Q with P^T, dS^T from registers, and dQ = dS.K through a
// shared dS^T tile, added to the fp32 accumulator (or, with one key block per sequence, stored: bwd_direct_dq.h). The
// portable path's preprocess (D, zeroed accumulator) and dQ conversion run around it (bwd_launch.h). Serves what
// dispatch/sm90_policy.h's sm90_bwd_declines() accepts.
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
#include "flash_attn/ptx/red_sm90.h"
#include "flash_attn/ptx/stmatrix_sm90.h"
#include "flash_attn/ptx/tma_load_sm90.h"
#include "flash_attn/ptx/warpgroup_sm90.h"
#include "flash_attn/ptx/wgmma_sm90_generated.h"
#include "flash_attn/tensor_map_sm90.h"
#include "sm90/block_ranges.h"
#include "sm90/bwd_cta.h"
#include "sm90/bwd_direct_dq.h"
#include "sm90/bwd_ordered_dq.h"
#include "sm90/bwd_step_delta.h"
#include "sm90/bwd_tile_config.h"
#include "sm90/fwd_tile_config.h"
#include "sm90/kernel_common.h"

namespace flash::sm90 {

template <int kHeadDim, int kBlockM, int kBlockN, int kStages>
struct BwdSmemLayout {
  static constexpr int kSegments = kHeadDim / kSegmentElems;
  static constexpr int kKvBytes = kBlockN * kHeadDim * 2;   // K (or V)
  static constexpr int kRowsBytes = kBlockM * kHeadDim * 2;  // one stage of Q (or dO)
  // One dS^T tile: block_m / 64 segments of block_n 128-byte lines (a key's 64 queries each).
  static constexpr int kDsSegmentBytes = kBlockN * kSegmentBytes;
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;
  // LSE (log2 units) then D of each 64-row statistics block of the step (bwd_workspace.h block_stats).
  static constexpr int kStatFloats = 2 * kBlockM;
  static constexpr int kStatBytes = kStatFloats * 4;
  static constexpr int kDqRows = bwd_dq_rows(kHeadDim, kBlockM);
  static constexpr int kDqStageFloats = kDqRows * kSegmentElems;  // a consumer's dQ: 64 columns x kDqRows rows
  static constexpr int kK = 0;
  static constexpr int kV = kK + kKvBytes;
  static constexpr int kQ = kV + kKvBytes;
  static constexpr int kDo = kQ + kStages * kRowsBytes;
  static constexpr int kDs = kDo + kStages * kRowsBytes;   // two tiles: step i writes tile i % 2
  static constexpr int kStats = kDs + 2 * kDsBytes;         // [stage][kStatFloats], loaded with the stage's Q
  static constexpr int kDqStage = kStats + kStages * kStatBytes;  // [consumer][box][row][16]
  static constexpr int kO = kDqStage + kBwdConsumerWarpgroups * kDqStageFloats * 4;  // a step's O (D in the kernel)
  static constexpr int kBarriers = kO + kRowsBytes;
  // kv_full, kv_empty, then per stage q_full, q_empty, do_full, do_empty; each dQ writer's sum_full (fused dQ); o_full,
  // o_empty and per stage d_full (D in the kernel)
  static constexpr int kSumBarriers = 2 + 4 * kStages;
  static constexpr int kDeltaBarriers = kSumBarriers + kBwdDqWriters;
  static constexpr int kBarrierCount = kDeltaBarriers + 2 + kStages;
  static constexpr int kBytes = kBarriers + kBarrierCount * 8;
  static constexpr int kLaunchBytes = kBytes + static_cast<int>(ptx::kSwizzleAtomBytes);
  static_assert(kBlockM % kSegmentElems == 0, "a key's dS^T queries are whole 128-byte swizzled lines of 64");
  static_assert(kRowsBytes % ptx::kSwizzleAtomBytes == 0 && kKvBytes % ptx::kSwizzleAtomBytes == 0 &&
                    kDsBytes % ptx::kSwizzleAtomBytes == 0 && kO % ptx::kSwizzleAtomBytes == 0,
                "every tile starts on a swizzle atom");
  static_assert(kLaunchBytes <= kMaxSmemPerBlock, "the tiles must fit the shared memory a block may opt into");
  static_assert(kBlockM % kBwdStatsRows == 0 && kBlockM <= kBwdStatsSequenceRows,
                "a step's statistics are whole blocks of the workspace's, inside its sequence's (bwd_workspace.h)");
  static_assert(kStats % 16 == 0 && kStatBytes % 16 == 0, "bulk copies move whole 16-byte units");
};

// Named barriers of the backward consumers (0 is __syncthreads): per-consumer barriers over its own 128 threads for
// (own-keys dQ) its dS^T rows, one over both consumers for column-half dQ.
constexpr int kBwdOwnDsBarrier = 3;     // + consumer
constexpr int kBwdSharedDsBarrier = 5;  // both consumers
static_assert(kBwdDeltaWarp >= kBwdDqFirstWriterWarp + kBwdDqWriters, "the delta warp is not a dQ writer");
constexpr int kBwdDqStageBarrier = 8;   // + consumer: its dQ staging tile written, the boxes may be issued (8-15:
                                        // ordered dQ's handoff instead, bwd_ordered_dq.h)

// kGeneral: softcap and / or ALiBi, recomputed as the forward's general kernels apply them (z = softcap tanh(s scale /
// softcap) - slope |distance|); dS then carries softcap's derivative 1 - tanh^2 (the final softmax_scale factors of dQ
// and dK stay where they are). kDirectDq: every sequence's keys fit one key block, each step's dQ is complete and
// stored into BwdParams::dq (bwd_direct_dq.h); its own instantiation, so the other kernels' step loop carries none of
// it (bwd_tile_config.h bwd_stores_dq_directly).
// kScoreDim: the head-dim columns S^T and dP^T run over (the 96 bucket: 6 k16 steps of its 128 stored columns, whose
// last 32 are TMA's zero fill); dK and dV take fwd_pv_columns(kScoreDim), dQ kHeadDim's.
template <typename T, int kHeadDim, MaskKind kMask, bool kGeneral, int kBlockM, int kBlockN, int kStages,
          bool kDirectDq, int kScoreDim = kHeadDim>
__global__ void __launch_bounds__(kBwdThreads, 1) bwd_kernel(const __grid_constant__ BwdKernelArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Layout = BwdSmemLayout<kHeadDim, kBlockM, kBlockN, kStages>;
  using Slot = RingSlot<kStages>;
  constexpr BwdDqSplit kDqSplit = bwd_dq_split(kHeadDim, kBlockM);
  constexpr bool kColumnHalves = kDqSplit == BwdDqSplit::kColumnHalves;
  constexpr bool kRowHalves = kDqSplit == BwdDqSplit::kRowHalves;
  constexpr bool kOwnKeys = kDqSplit == BwdDqSplit::kOwnKeys;
  constexpr bool kPrefetchScores = bwd_prefetches_scores(kHeadDim, kGeneral);
  constexpr int kDqColumns = kColumnHalves ? kHeadDim / kBwdConsumerWarpgroups : kHeadDim;
  constexpr int kDqKeys = kOwnKeys ? kBwdRowsPerConsumer : kBlockN;
  constexpr int kDqRows = Layout::kDqRows;
  constexpr int kStatRows = static_cast<int>(kBwdStatsRows);
  static_assert(kDqColumns == kSegmentElems, "each consumer's dQ columns are one 64-column segment of K");
  static_assert(kScoreDim <= kHeadDim && kScoreDim % 16 == 0, "S^T / dP^T over whole k16 steps of the stored columns");
  // dK and dV's columns (the N of their GEMMs): the forward's rule for O (fwd_tile_config.h fwd_pv_columns), the same
  // MN-major reads of a partial swizzle atom where it takes the bucket's.
  constexpr int kDkvCols = fwd_pv_columns(kScoreDim);
  static_assert(kDkvCols <= kHeadDim, "dK / dV within the stored columns");
  static_assert(kDqRows == kBwdRowsPerConsumer, "a consumer's dQ is one m64 accumulator");

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_dynamic_smem(smem_raw);
  const BwdRing<Layout, kStages> ring_tiles(smem);
  uint8_t* k_tile = ring_tiles.k_tile;
  uint8_t* v_tile = ring_tiles.v_tile;
  uint8_t* q_tiles = ring_tiles.q_tiles;
  uint8_t* do_tiles = ring_tiles.do_tiles;
  uint8_t* ds_tiles = smem + Layout::kDs;
  float* stats = ring_tiles.stats;
  uint64_t* kv_full = ring_tiles.kv_full;
  uint64_t* kv_empty = ring_tiles.kv_empty;
  uint64_t* q_full = ring_tiles.q_full;
  uint64_t* q_empty = ring_tiles.q_empty;
  uint64_t* do_full = ring_tiles.do_full;
  uint64_t* do_empty = ring_tiles.do_empty;
  uint64_t* sum_full = reinterpret_cast<uint64_t*>(smem + Layout::kBarriers) + Layout::kSumBarriers;
  uint64_t* delta_barriers = reinterpret_cast<uint64_t*>(smem + Layout::kBarriers) + Layout::kDeltaBarriers;
  const BwdDeltaRing delta{smem + Layout::kO, delta_barriers, delta_barriers + 1, delta_barriers + 2};

  const BwdParams& bp = args.params;
  const FwdParams& p = bp.fwd;
  if (threadIdx.x == 0) {
    prefetch_bwd_tensor_maps(args);
    // q_empty: every consumer thread arrives, since each read the stage's statistics block with plain loads; one
    // arrival per consumer after a named barrier orders them too, but racecheck does not follow that order and
    // reported the next bulk copy against the other threads' reads (docs/perf_log.md, seventeenth session).
    for (int w = 0; w < kBwdDqWriters; ++w) ptx::mbarrier_init(sum_full + w, 1);
    // o_full: the producer's arrival and the bytes; o_empty and d_full: the delta warp's one arrival.
    for (int b = 0; b < 2 + kStages; ++b) ptx::mbarrier_init(delta_barriers + b, 1);
    init_pipeline_barriers(kv_full, kv_empty, q_full, do_full, q_empty, do_empty, kStages, kBwdConsumerWarpgroups,
                           kBwdConsumerWarpgroups * ptx::kWarpgroupThreads, kBwdConsumerWarpgroups);
  }
  __syncthreads();

  const int warpgroup = ptx::warpgroup_index();
  if (warpgroup == 0) {
    ptx::release_registers<kProducerRegisters>();
    if (threadIdx.x == 0) {
      produce_bwd_tiles(args, BwdCta<kBlockM, kBlockN>(args), ring_tiles, delta);
    } else if (static_cast<int>(threadIdx.x) / kWarpSize == kBwdDeltaWarp) {
      if (args.d_in_kernel) compute_step_deltas<T>(args, BwdCta<kBlockM, kBlockN>(args), ring_tiles, delta);
    } else if (args.dq_ordered) {
      const int writer = static_cast<int>(threadIdx.x) / kWarpSize - kBwdDqFirstWriterWarp;
      if (writer >= 0 && writer < kBwdDqWriters) {
        constexpr bool kFusable = bwd_fuses_dq(kHeadDim, kGeneral) && !kDirectDq;
        write_ordered_dq<T, Layout, kHeadDim, kFusable>(args, BwdCta<kBlockM, kBlockN>(args), smem, sum_full + writer,
                                                        writer);
      }
    }
    return;
  }

  ptx::claim_registers<kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int thread = threadIdx.x % ptx::kWarpgroupThreads;
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  const int quad_col = 2 * (lane % kQuadLanes);
  // A operands of S^T and dP^T: this consumer's 64 rows of K and V (K-major, segments block_n rows apart).
  const uint64_t k_rows_desc = ptx::smem_descriptor(k_tile + consumer * kBwdRowsPerConsumer * kSegmentBytes,
                                                    ptx::kDescriptorUnitBytes, ptx::kSwizzleAtomBytes);
  const uint64_t v_rows_desc = ptx::smem_descriptor(v_tile + consumer * kBwdRowsPerConsumer * kSegmentBytes,
                                                    ptx::kDescriptorUnitBytes, ptx::kSwizzleAtomBytes);
  // B operand of dQ: K read MN-major (head-dim columns contiguous), this consumer's columns and keys; with row halves
  // its dQ rows are the step's query rows dq_row0 ... + 63.
  const int dq_key0 = kOwnKeys ? consumer * kBwdRowsPerConsumer : 0;
  const int dq_segment = kColumnHalves ? consumer : 0;
  const int dq_row0 = kRowHalves ? consumer * kBwdRowsPerConsumer : 0;
  // The accumulator's rows are the head dim rounded up to 32 (bwd_padded_head_dim), narrower than the bucket below
  // a multiple of 64 (hd 32: 32 of 64 columns, hd 96: 96 of 128): the slot groups past a row's end are not added.
  // Adding them (zeros) ran over the last row into the next allocation: an illegal address at hd 32, 4 x 64 heads x
  // 4k (H200, sixteenth session).
  const int dq_groups = static_cast<int>(
      std::min<int64_t>(kDqColumns, bwd_workspace(bp, DqLayout::kRows).dq_row_stride - dq_segment * kSegmentElems) /
      kDqSlotGroup);
  float* dq_stage = reinterpret_cast<float*>(smem + Layout::kDqStage) + consumer * Layout::kDqStageFloats;
  const bool bulk_dq = args.dq_map.enabled;
  // Deterministic calls with ordered dQ: the writer warp (bwd_ordered_dq.h) issues the staged tiles' reductions.
  const bool own_reductions = bulk_dq && !args.dq_ordered;
  const uint64_t k_dq_desc =
      ptx::smem_descriptor(k_tile + dq_segment * kBlockN * kSegmentBytes + dq_key0 * kSegmentBytes,
                           kBlockN * kSegmentBytes, ptx::kSwizzleAtomBytes);
  const BwdLogit logit(p);
  int ring = 0;       // Q / dO ring iterations, counted across key blocks (as the producer counts them)
  int loaded_kv = 0;  // key blocks whose K / V this consumer waited for

  // The CTA's key blocks and sequence, built by each warpgroup after its setmaxnreg rather than once before the
  // warpgroups split. H200, bf16, TFLOP/s before -> after, two A/B calls of two rounds (thirtieth session): hd 128
  // 512 274 -> 278-279, 1k 344 -> 348-363, 8k 453-457 -> 475-483; causal 512 170-173 -> 176-178, 1k 254-260 -> 266-267,
  // 2k 326-329 -> 340-342; hd 64 level. ptxas (hd 128 causal): spill 264 -> 432 bytes, all outside the step loop.
  const BwdCta<kBlockM, kBlockN> cta(args);
  const int batch = cta.batch;
  const int64_t seqlen_q = cta.sequence.seqlen_q;
  const int64_t seqlen_k = cta.sequence.seqlen_k;
  const int64_t offset = cta.offset;
  const int64_t global_q_row0 = cta.global_q_row0;
  const BwdWorkspace& workspace = cta.workspace;
  // The dq accumulator this consumer adds into: 0, or in deterministic calls the CTA's own (its consumer's own with
  // own-keys dQ, where both would add into the same elements: bwd_dq_accumulators_per_cta).
  const int64_t dq_accumulator = bp.deterministic && !args.dq_ordered
                                     ? cta.dq_split * bwd_dq_accumulators_per_cta(kHeadDim) + (kOwnKeys ? consumer : 0)
                                     : 0;

  for (int n_block = cta.first_block; n_block < args.num_n_blocks; n_block += cta.block_stride) {
    const BwdBlock block = cta.plan(p.mask, n_block);
    if constexpr (kDirectDq) {  // the sequence's only key block: the rows its walk does not reach get dQ = 0
      const int64_t reached0 = block.has_keys ? std::min<int64_t>(int64_t{block.m_min} * kBlockM, seqlen_q) : 0;
      const int64_t reached1 =
          block.has_keys ? std::clamp<int64_t>(int64_t{block.m_min + block.m_count} * kBlockM, reached0, seqlen_q)
                         : 0;
      zero_unreached_dq_rows<T>(bp, direct_dq_rows<T>(bp, batch, cta.sequence.q_row0), seqlen_q, cta.head0,
                                cta.heads_per_split, reached0, reached1, consumer * ptx::kWarpgroupThreads + thread,
                                kBwdConsumerWarpgroups * ptx::kWarpgroupThreads);
    }
    if (!block.has_keys) continue;
    // Deterministic bulk dQ (bwd_deterministic_dq_in_bulk): the previous key block's reductions complete before this
    // one's reach the same rows, so each element's adds arrive in key-block order.
    if (own_reductions && bp.deterministic && thread == 0) ptx::bulk_wait_group<0>();
    const int64_t key0 = block.key0;
    const int m_count = block.m_count, steps = block.steps;
    // This thread's two key rows (of the 64 its consumer owns) in every m64 accumulator, relative to the sequence.
    int64_t keys[2];
    for (int r = 0; r < 2; ++r) {
      keys[r] = key0 + consumer * kBwdRowsPerConsumer + warp * kRowsPerWarp + lane / kQuadLanes + kSecondRow * r;
    }

    float dv[kDkvCols / 2];
    float dk[kDkvCols / 2];
#pragma unroll
    for (int i = 0; i < kDkvCols / 2; ++i) dv[i] = dk[i] = 0.f;

    // S^T and dP^T of a step; with kPrefetchScores S^T is issued at the end of the previous step of the block.
    float s[kBlockM / 2];
    float dp[kBlockM / 2];
    auto issue_step_s = [&](const Slot& step_slot) {
      const uint8_t* q_slot = q_tiles + step_slot.stage * Layout::kRowsBytes;
      ptx::mbarrier_wait_parity(&q_full[step_slot.stage], step_slot.parity);
      issue_scores<T, kScoreDim, kBlockN, kBlockM>(
          s, k_rows_desc, ptx::smem_descriptor(q_slot, ptx::kDescriptorUnitBytes, ptx::kSwizzleAtomBytes));
    };
    auto issue_step_dp = [&](const Slot& step_slot) {
      const uint8_t* do_slot = do_tiles + step_slot.stage * Layout::kRowsBytes;
      ptx::mbarrier_wait_parity(&do_full[step_slot.stage], step_slot.parity);
      issue_scores<T, kScoreDim, kBlockN, kBlockM>(
          dp, v_rows_desc, ptx::smem_descriptor(do_slot, ptx::kDescriptorUnitBytes, ptx::kSwizzleAtomBytes));
    };
    auto issue_step_scores = [&](const Slot& step_slot) { issue_step_s(step_slot); issue_step_dp(step_slot); };
    if (steps > 0) {
      ptx::mbarrier_wait_parity(kv_full, loaded_kv & 1);
      if constexpr (kPrefetchScores) issue_step_s(Slot(ring));

      BwdStepWalk walk(cta.head0, block.rotation);
      for (int i = 0; i < steps; ++i, ++ring, walk.advance(m_count)) {
        const Slot slot(ring);
        const int head = walk.head;
        const int64_t q0 = static_cast<int64_t>(block.m_min + walk.local) * kBlockM;
        const float alibi_slope_log2 =
            kGeneral && p.mask.alibi_slopes != nullptr
                ? p.mask.alibi_slopes[batch * p.mask.alibi_batch_stride + head] * static_cast<float>(kLog2e)
                : 0.f;
        // ALiBi's distance of register 4j + 2r + e is distance0[r] + 8j + e: converted once per row, not per score (the
        // 64-bit conversion of every score is a quarter-rate I2F.S64); exact while |distance| < 2^24.
        float distance0[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) distance0[r] = static_cast<float>(q0 + quad_col + offset - keys[r]);

        // The step's LSE (log2 units; +inf for rows past the sequence, so P = 0 there) and D, brought with Q (the
        // S^T GEMM's wait on q_full covers them). Loaded by every consumer thread from global memory, stored and
        // published by a named barrier before the GEMMs, they held ~12 % of the stall samples (ncu, hd 128 and 64,
        // 4k, seventeenth session).
        const float* step_stats = stats + slot.stage * Layout::kStatFloats;
        // The LSE of query column 8j + quad_col + e % 2 of the step, in its 64-row statistics block (D: + kStatRows).
        auto stat_of = [&](int j, int e) {
          return (8 * j) / kStatRows * 2 * kStatRows + (8 * j) % kStatRows + quad_col + (e % 2);
        };

        const uint8_t* q_slot = q_tiles + slot.stage * Layout::kRowsBytes;
        const uint8_t* do_slot = do_tiles + slot.stage * Layout::kRowsBytes;
        if constexpr (!kPrefetchScores) issue_step_scores(slot);
        if constexpr (kPrefetchScores) issue_step_dp(slot);
        // D summed in the kernel: the delta warp has added the step's row sums into its statistics block.
        if (args.d_in_kernel) ptx::mbarrier_wait_parity(&delta.d_full[slot.stage], slot.parity);

        // P^T: register 4j + 2r + e holds key row keys[r], query column 8j + quad_col + e.
        const bool masked = block_pair_needs_mask(p.mask, kMask != MaskKind::kNone, q0, kBlockM, key0, kBlockN,
                                                  seqlen_q, seqlen_k, offset);
        // P^T, then dS^T = P^T (dP^T - D): step_scores_to_gradients (bwd_cta.h).
        auto probability = [&](int j, int e, float score, float& derivative) {
          return step_probability<kGeneral>(logit, args.scale_log2, score, alibi_slope_log2,
                                            distance0[e / 2], 8 * j + (e % 2),
                                            step_stats[stat_of(j, e)], derivative);
        };
        // Scores outside the mask (or past either sequence) get P^T = 0 (and dS^T = 0), in a pass of its own behind one
        // uniform branch: tested inside `probability`, it compiled to a predicate bit test and a branch per score (64
        // LOP3 + BRA pairs a step in every block, masked or not; ~10 % of the lean kernel's stall samples, ncu, hd
        // 128 4k, sixteenth session).
        auto apply_mask = [&](auto&... arrays) {
          if constexpr (kBwdMasksByLocalRange) {
            zero_unseen_scores<kBlockM>(p.mask, keys, offset, seqlen_q, seqlen_k, q0 + quad_col, arrays...);
          } else {
#pragma unroll
            for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int64_t q = q0 + 8 * j + quad_col + (e % 2);
                const int64_t key = keys[e / 2];
                const KeyRange seen = visible_keys(p.mask, q, offset, seqlen_k);
                const bool visible = q < seqlen_q && key < seqlen_k && key >= seen.begin && key < seen.end;
                ((arrays[4 * j + e] = visible ? arrays[4 * j + e] : 0.f), ...);
              }
            }
          }
        };
        auto score_gradient = [&](int j, int e, float prob, float d_prob, float derivative) {
          return prob * (d_prob - step_stats[kStatRows + stat_of(j, e)]) * derivative;
        };
        step_scores_to_gradients<kGeneral>(s, dp, masked, probability, score_gradient, apply_mask);
        uint32_t p_frag[kBlockM / 16][4];
        uint32_t ds_frag[kBlockM / 16][4];
        pack_probs<T, kBlockM>(s, p_frag);
        pack_probs<T, kBlockM>(dp, ds_frag);

        // dV += P^T.dO and dK += dS^T.Q: B read MN-major (head-dim columns contiguous), 16 query rows per k16 step.
        issue_pv<T, kDkvCols, kBlockM>(
            dv, p_frag, ptx::smem_descriptor(do_slot, kBlockM * kSegmentBytes, ptx::kSwizzleAtomBytes));
        issue_pv<T, kDkvCols, kBlockM>(
            dk, ds_frag, ptx::smem_descriptor(q_slot, kBlockM * kSegmentBytes, ptx::kSwizzleAtomBytes));

        // dS^T into its shared tile: line = key row of the block, 64 queries per line (queries 64s ... in segment s),
        // 128-byte swizzle. One stmatrix.x4 per 16 queries (4 instead of 16 32-bit stores a thread): matrix i holds key
        // rows + 8 (i % 2) and the 8-query chunk 2 (k % 4) + i / 2 of segment k / 4, i.e. ds_frag[k][i]; lane l gives
        // row l % 8 of matrix l / 8.
        uint8_t* ds_tile = ds_tiles + (ring % 2) * Layout::kDsBytes;
        {
          constexpr int kStepsPerSegment = kSegmentElems / 16;
          const int matrix = lane / 8;
          const int line = consumer * kBwdRowsPerConsumer + warp * kRowsPerWarp + lane % 8 + kSecondRow * (matrix % 2);
#pragma unroll
          for (int k = 0; k < kBlockM / 16; ++k) {
            const int chunk = (2 * (k % kStepsPerSegment) + matrix / 2) ^ (line % 8);
            ptx::stmatrix_x4(ds_tile + (k / kStepsPerSegment) * Layout::kDsSegmentBytes + line * kSegmentBytes + chunk * 16,
                             ds_frag[k][0], ds_frag[k][1], ds_frag[k][2], ds_frag[k][3]);
          }
        }
        ptx::fence_proxy_async_shared();
        // The previous step's dQ boxes have been read out of this consumer's staging tile before any of its threads
        // passes the barrier (and, after the dQ GEMM, writes the tile again); long done by now, a step later.
        if (own_reductions && thread == 0) ptx::bulk_wait_group_read<0>();
        if constexpr (!kOwnKeys) {
          ptx::named_barrier_sync(kBwdSharedDsBarrier, kBwdConsumerWarpgroups * ptx::kWarpgroupThreads);
        } else {
          ptx::named_barrier_sync(kBwdOwnDsBarrier + consumer, ptx::kWarpgroupThreads);
        }
        // dQ (this consumer's 64 rows x 64 columns) = dS.K over kDqKeys keys: A = dS^T read M-major (the segment of
        // its rows), B = K MN-major.
        float dq[kDqColumns / 2];
        {
          const uint64_t ds_desc = ptx::smem_descriptor(
              ds_tile + (dq_row0 / kSegmentElems) * Layout::kDsSegmentBytes + dq_key0 * kSegmentBytes,
              Layout::kDsSegmentBytes, ptx::kSwizzleAtomBytes);
          ptx::warpgroup_fence();
#pragma unroll
          for (int kk = 0; kk < kDqKeys / 16; ++kk) {
            ptx::Wgmma<T, kDqColumns>::template ss<1, 1>(dq, ptx::advance_descriptor(ds_desc, kk * kK16MnMajorBytes),
                                                         ptx::advance_descriptor(k_dq_desc, kk * kK16MnMajorBytes),
                                                         kk > 0);
          }
          ptx::warpgroup_commit();
        }
        ptx::warpgroup_wait<0>();
        pin_all(dv);
        pin_all(dk);
        pin_all(dq);
        ptx::mbarrier_arrive(&q_empty[slot.stage]);
        if (thread == 0) ptx::mbarrier_arrive(&do_empty[slot.stage]);
        // The next step's S^T goes to the tensor cores while this step's dQ reductions issue.
        if constexpr (kPrefetchScores) {
          if (i + 1 < steps) issue_step_s(Slot(ring + 1));
        }
        if constexpr (kDirectDq) {
          store_direct_dq<T, kDqColumns>(bp, direct_dq_rows<T>(bp, batch, cta.sequence.q_row0) +
                                                 head * bp.dq_strides.head,
                                         dq, q0 + dq_row0, seqlen_q, dq_segment * kSegmentElems, warp, lane, quad_col);
        } else if (bulk_dq) {
          // dQ in the fp32 accumulator's order (DqLayout::kRows, columns interleaved by dq_slot): a thread's columns
          // 8j + quad_col + e of j = 2g, 2g + 1 are slots 4 (lane % 4) .. + 3 of slot group g, one 16-byte value.
          // Staged as boxes of 16 columns x kDqRows dense rows (a warp's 8 rows x 64 bytes per store: conflict-free),
          // then added by the TMA unit. Rows past the sequence hold zeros (P = 0 there), so a box reaching into the
          // next sequence's or head's rows adds nothing; rows and columns past the map's end are skipped.
          if (args.dq_ordered && (kBwdDqFirstStepHandoff || i > 0)) {
            ptx::named_barrier_sync(dq_handoff_barrier(kBwdDqEmptyBarrier, i, consumer), kBwdDqHandoffThreads);
          }
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = warp * kRowsPerWarp + lane / kQuadLanes + kSecondRow * r;
#pragma unroll
            for (int g = 0; g < kDqColumns / kDqSlotGroup; ++g) {
              float* box = dq_stage + g * kDqRows * kDqSlotGroup;
              *reinterpret_cast<float4*>(box + row * kDqSlotGroup + 2 * quad_col) = make_float4(
                  dq[8 * g + 2 * r], dq[8 * g + 2 * r + 1], dq[8 * g + 4 + 2 * r], dq[8 * g + 4 + 2 * r + 1]);
            }
          }
          ptx::fence_proxy_async_shared();
          if (args.dq_ordered) {
            ptx::named_barrier_arrive(dq_handoff_barrier(kBwdDqFullBarrier, i, consumer), kBwdDqHandoffThreads);
          } else {
            ptx::named_barrier_sync(kBwdDqStageBarrier + consumer, ptx::kWarpgroupThreads);
          }
          if (own_reductions && thread == 0) {
            const int row = static_cast<int>((dq_accumulator * p.shape.nheads_q + head) * workspace.dq_head_rows +
                                             global_q_row0 + q0 + dq_row0);
#pragma unroll
            for (int g = 0; g < kDqColumns / kDqSlotGroup; ++g) {
              if (g < dq_groups) {
                ptx::bulk_reduce_add_2d(&args.dq_map.map, dq_stage + g * kDqRows * kDqSlotGroup,
                                        dq_segment * kSegmentElems + g * kDqSlotGroup, row);
              }
            }
            ptx::bulk_commit_group();
          }
        } else {
          float* dq_head =
              workspace.dq_accum + dq_accumulator * workspace.dq_split_stride + head * workspace.dq_head_stride;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int64_t q = q0 + dq_row0 + warp * kRowsPerWarp + lane / kQuadLanes + kSecondRow * r;
            if (q >= seqlen_q) continue;
            float* dq_row = dq_head + (global_q_row0 + q) * workspace.dq_row_stride + dq_segment * kSegmentElems;
#pragma unroll
            for (int g = 0; g < kDqColumns / kDqSlotGroup; ++g) {
              if (g >= dq_groups) continue;
              ptx::red_add_v4_f32(dq_row + g * kDqSlotGroup + 2 * quad_col, dq[8 * g + 2 * r], dq[8 * g + 2 * r + 1],
                                  dq[8 * g + 4 + 2 * r], dq[8 * g + 4 + 2 * r + 1]);
            }
          }
        }
      }
      if (thread == 0) ptx::mbarrier_arrive(kv_empty);  // the block's last GEMMs (the final wait above) are done
      ++loaded_kv;
    }

    // dK and dV of the keys this block owns (zeros where no query sees them).
    store_bwd_dkv<T, kDkvCols>(args, cta, keys, dk, dv, 0, quad_col);
  }
  if (own_reductions && thread == 0) ptx::bulk_wait_group<0>();  // the last boxes are added before the CTA ends
#else
  (void)args;
  __trap();
#endif
}

}  // namespace flash::sm90
