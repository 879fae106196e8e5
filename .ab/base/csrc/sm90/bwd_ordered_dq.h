// The ordered dQ writers of the Hopper backward's deterministic calls (bwd_tile_config.h bwd_orders_dq): two warps of
// the producer warpgroup take a CTA's steps in turn; for each, a writer adds the consumers' staged dQ tiles into the
// one fp32 accumulator once the key blocks before this one in the query block's order have added theirs (its counter
// in bwd_workspace.h dq_semaphores), then advances that counter. Every element thus receives its adds in one order,
// run after run.
#pragma once

#include <cstdint>

#include "flash_attn/bwd_workspace.h"
#include "flash_attn/ptx/bulk_reduce_sm90.h"
#include "flash_attn/ptx/fence_proxy_sm90.h"
#include "flash_attn/ptx/semaphore_sm90.h"
#include "flash_attn/ptx/warpgroup_sm90.h"
#include "sm90/bwd_cta.h"
#include "sm90/bwd_tile_config.h"
#include "sm90/kernel_common.h"

namespace flash::sm90 {

// Two writers, so that one waits for its reductions to complete (the counter may advance only then) while the other
// takes the next step (not measured against one writer). A third (the producer warpgroup's last warp) measured no
// change at hd 64 (twenty-sixth session), whose deterministic backward ran at 0.50-0.68x of the default on 64-row
// steps and at 0.95-1.0x on 128-row ones (twenty-eighth session).
constexpr int kBwdDqWriters = 2;
constexpr int kBwdDqFirstWriterWarp = 1;  // of the producer warpgroup (warp 0's first thread loads the tiles)
static_assert(kBwdDqFirstWriterWarp + kBwdDqWriters <= ptx::kWarpgroupThreads / kWarpSize,
              "the writers are warps of the producer warpgroup");
// Named barriers between the consumers and the writer of step i (ids beside bwd_kernel.h's; 8 and 9 are its staging
// barrier, which ordered calls do not use): + 2 (i % kBwdDqWriters) + consumer, and for a third writer the ids the
// narrow kernel leaves unused. A consumer's staging tile is free to write (a writer arrives, the consumer syncs) and
// written (the consumer arrives, the writer syncs).
constexpr int kBwdDqFullBarrier = 8;
constexpr int kBwdDqEmptyBarrier = 12;
constexpr int kBwdDqThirdFullBarrier = 1;   // 1 and 2: the wide kernel's and the forward's ids, not this kernel's
constexpr int kBwdDqThirdEmptyBarrier = 6;  // 6 and 7
constexpr int kBwdDqHandoffThreads = ptx::kWarpgroupThreads + kWarpSize;
// Whether step 0's staging tiles go through the empty handoff too (writer 0 arrives at once, the consumers wait).
// Without it each empty barrier has one writer for the whole CTA (step i + 1's frees come from step i's writer): the
// twenty-third session's guess for racecheck's hazards at hd 64, which were the own-keys sum's instead (clean with row
// halves, twenty-eighth session), so the handoff stays as it is.
constexpr bool kBwdDqFirstStepHandoff = true;
// Polls of a counter before a writer gives up with a trap (a missing add would otherwise hang the GPU): ~20 s.
constexpr int64_t kBwdDqMaxPolls = int64_t{1} << 25;

__device__ __forceinline__ int dq_handoff_barrier(int base, int step, int consumer) {
  static_assert(kBwdDqWriters <= 3, "barrier ids for at most three writers");
  const int writer = step % kBwdDqWriters;
  if constexpr (kBwdDqWriters == 3) {
    if (writer == 2) return (base == kBwdDqFullBarrier ? kBwdDqThirdFullBarrier : kBwdDqThirdEmptyBarrier) + consumer;
  }
  return base + kBwdConsumerWarpgroups * writer + consumer;
}


// How many adds into query block m_block of `head` come before this key block's, which adds at its step `step`
// (block_ranges.h dq_adds_before). The key blocks of the sequence are tested by the warp with the plan() their CTAs
// walk (lane l tests blocks l, l + 32, ...; in descending order only the higher ones), so the count cannot disagree
// with the steps they take; tests/cpp/sm90_block_ranges_check.cpp checks that the counts of a query block's adders
// are 0, 1, 2, ... on random shapes.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ int dq_predecessors(const BwdKernelArgs& args, const BwdCta<kBlockM, kBlockN>& cta,
                                               int n_block, int head, int m_block, int step, int lane) {
  const MaskParams& mask = args.params.fwd.mask;
  int count = 0;
  for (int base = args.dq_arrival_order ? 0 : n_block + 1; base < cta.seq_blocks; base += kWarpSize) {
    const int n = base + lane;
    const bool before = n < cta.seq_blocks && dq_adds_before(cta.plan(mask, n), n, n_block, head - cta.head0, m_block,
                                                             step, args.dq_arrival_order);
    count += __popc(__ballot_sync(0xffffffffu, before));
  }
  return count;
}

// Lane 0 of a writer: waits until `counter` shows `predecessors` adds (their reductions complete), then orders its own
// bulk reductions after that acquire.
__device__ __forceinline__ void await_dq_turn(const int* counter, int predecessors) {
  int64_t polls = 0;
  while (ptx::ld_acquire_gpu(counter) < predecessors) {
    if (++polls > kBwdDqMaxPolls) __trap();
  }
  ptx::fence_proxy_async_global();
}

// Lane 0 of a writer: once its bulk reductions are complete, advances the counter for the next key block.
__device__ __forceinline__ void pass_dq_turn(int* counter) {
  ptx::bulk_wait_group<0>();
  ptx::fence_proxy_async_global();
  ptx::red_release_gpu_add(counter, 1);
}

// Runs on every lane of writer `writer` (0 .. kBwdDqWriters - 1), which takes the steps i with i % kBwdDqWriters ==
// writer. Layout: the kernel's BwdSmemLayout (the consumers' staging tiles, box g of 16 columns x kDqRows rows at g *
// kDqRows * kDqSlotGroup floats).
template <typename Layout, int kHeadDim, int kBlockM, int kBlockN>
__device__ __forceinline__ void write_ordered_dq(const BwdKernelArgs& args, const BwdCta<kBlockM, kBlockN>& cta,
                                                 uint8_t* smem, int writer) {
  constexpr BwdDqSplit kDqSplit = bwd_dq_split(kHeadDim, kBlockM);
  constexpr bool kColumnHalves = kDqSplit == BwdDqSplit::kColumnHalves;
  constexpr bool kRowHalves = kDqSplit == BwdDqSplit::kRowHalves;
  constexpr int kDqColumns = kColumnHalves ? kHeadDim / kBwdConsumerWarpgroups : kHeadDim;
  constexpr int kDqRows = Layout::kDqRows;
  // Column or row halves: each consumer's tile goes out (at its columns or its rows); own keys: one summed tile.
  constexpr int kTilesOut = kDqSplit == BwdDqSplit::kOwnKeys ? 1 : kBwdConsumerWarpgroups;
  const int lane = threadIdx.x % kWarpSize;
  const BwdWorkspace& workspace = cta.workspace;
  float* stage = reinterpret_cast<float*>(smem + Layout::kDqStage);
  int* const counters = workspace.dq_semaphores + bwd_stats_block0(cta.global_q_row0, cta.batch);
  for (int n_block = cta.first_block; n_block < args.num_n_blocks; n_block += cta.block_stride) {
    const BwdBlock block = cta.plan(args.params.fwd.mask, n_block);
    // Step 0's tiles are free at once; a writer frees step i + 1's once its reductions have read step i's.
    if (kBwdDqFirstStepHandoff && writer == 0 && block.steps > 0) {
      for (int c = 0; c < kBwdConsumerWarpgroups; ++c) {
        ptx::named_barrier_arrive(dq_handoff_barrier(kBwdDqEmptyBarrier, 0, c), kBwdDqHandoffThreads);
      }
    }
    for (int i = writer; i < block.steps; i += kBwdDqWriters) {
      const int head = cta.step_head(i, block.m_count);
      const int m_block = BwdCta<kBlockM, kBlockN>::step_block(block, i);
      const int predecessors = dq_predecessors(args, cta, n_block, head, m_block, i, lane);
      for (int c = 0; c < kBwdConsumerWarpgroups; ++c) {
        ptx::named_barrier_sync(dq_handoff_barrier(kBwdDqFullBarrier, i, c), kBwdDqHandoffThreads);
      }
      if constexpr (kDqSplit == BwdDqSplit::kOwnKeys) {
        // Own keys (no table entry since hd 64 steps over 128 rows; kept for bwd_tile_config's A/Bs): both consumers
        // hold all columns over their own 64 keys; consumer 1's tile is added into consumer 0's (always in this order)
        // and that one tile goes out. racecheck reported these loads against the consumers' staging stores (hd 64 on
        // 64-row steps, twenty-third session), which the arrive-based handoff barriers order; with row halves nothing
        // is summed here and racecheck is clean (twenty-eighth session).
        float4* into = reinterpret_cast<float4*>(stage);
        const float4* from = reinterpret_cast<const float4*>(stage + Layout::kDqStageFloats);
        for (int k = lane; k < Layout::kDqStageFloats / 4; k += kWarpSize) {
          const float4 a = into[k];
          const float4 b = from[k];
          into[k] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
        }
        ptx::fence_proxy_async_shared();
        __syncwarp();
      }
      int* const counter = counters + head * workspace.semaphore_head_stride + m_block;
      if (lane == 0) {
        await_dq_turn(counter, predecessors);
        const int row = static_cast<int>(head * workspace.dq_head_rows + cta.global_q_row0 +
                                         static_cast<int64_t>(m_block) * kBlockM);
        for (int t = 0; t < kTilesOut; ++t) {
          const int column0 = kColumnHalves ? t * kSegmentElems : 0;
          const int row0 = kRowHalves ? t * kDqRows : 0;
          // Columns past the accumulator's rows (a head dim below its bucket) are not added (bwd_kernel.h dq_groups).
          const int64_t columns = workspace.dq_row_stride - column0;
          const int groups = static_cast<int>((columns < kDqColumns ? columns : kDqColumns) / kDqSlotGroup);
          for (int g = 0; g < groups; ++g) {
            ptx::bulk_reduce_add_2d(&args.dq_map.map, stage + t * Layout::kDqStageFloats + g * kDqRows * kDqSlotGroup,
                                    column0 + g * kDqSlotGroup, row + row0);
          }
        }
        ptx::bulk_commit_group();
        ptx::bulk_wait_group_read<0>();
      }
      __syncwarp();
      if (i + 1 < block.steps) {
        for (int c = 0; c < kBwdConsumerWarpgroups; ++c) {
          ptx::named_barrier_arrive(dq_handoff_barrier(kBwdDqEmptyBarrier, i + 1, c), kBwdDqHandoffThreads);
        }
      }
      if (lane == 0) pass_dq_turn(counter);
      __syncwarp();
    }
  }
}

// The wide kernel's writers (bwd_wide_kernel.h, kBwdDeterministicDqOrderedWide): its consumers stage dQ in their column
// segments of the step's Q and dO slots, the first half of the boxes in Q's, the second in dO's, and every consumer
// thread but the first releases the slot at once; a writer adds the boxes and, once the reductions have read them,
// releases the slot for the two first threads (q_empty, do_empty), which is what lets the producer refill it. The
// consumers' columns are disjoint, so both go out in one turn. Only full handoffs: the slot ring frees the tiles.
constexpr int kBwdWideDqFullBarrier = 8;  // + 2 (i % kBwdDqWriters) + consumer: the wide kernel's 8 and 9 are its
                                          // staging barrier, which ordered calls do not use
static_assert(kBwdWideDqFullBarrier + kBwdConsumerWarpgroups * kBwdDqWriters <= 16, "named barrier ids end at 15");
// kSplit: the consumers' columns (bwd_tile_config.h bwd_wide_split), consumer 1's from kSplit.columns0.
template <typename Layout, BwdWideSplit kSplit, int kBlockM, int kBlockN, int kStages>
__device__ __forceinline__ void write_ordered_dq_wide(const BwdKernelArgs& args, const BwdCta<kBlockM, kBlockN>& cta,
                                                      const BwdRing<Layout, kStages>& ring_tiles, int writer) {
  constexpr int kBoxBytes = kDqSlotGroup * kBlockM * static_cast<int>(sizeof(float));
  const int lane = threadIdx.x % kWarpSize;
  const BwdWorkspace& workspace = cta.workspace;
  int* const counters = workspace.dq_semaphores + bwd_stats_block0(cta.global_q_row0, cta.batch);
  int ring = 0;  // Q / dO ring iterations, counted across key blocks as the producer and the consumers count them
  for (int n_block = cta.first_block; n_block < args.num_n_blocks; n_block += cta.block_stride) {
    const BwdBlock block = cta.plan(args.params.fwd.mask, n_block);
    if (!block.has_keys) continue;
    for (int i = 0; i < block.steps; ++i, ++ring) {
      if (i % kBwdDqWriters != writer) continue;
      const RingSlot<kStages> slot(ring);
      const int head = cta.step_head(i, block.m_count);
      const int m_block = BwdCta<kBlockM, kBlockN>::step_block(block, i);
      const int predecessors = dq_predecessors(args, cta, n_block, head, m_block, i, lane);
      for (int c = 0; c < kBwdConsumerWarpgroups; ++c) {
        ptx::named_barrier_sync(kBwdWideDqFullBarrier + kBwdConsumerWarpgroups * writer + c, kBwdDqHandoffThreads);
      }
      int* const counter = counters + head * workspace.semaphore_head_stride + m_block;
      if (lane == 0) {
        await_dq_turn(counter, predecessors);
        const int row = static_cast<int>(head * workspace.dq_head_rows + cta.global_q_row0 +
                                         static_cast<int64_t>(m_block) * kBlockM);
        for (int c = 0; c < kBwdConsumerWarpgroups; ++c) {
          // Consumer c's columns and its boxes' place, as it staged them (bwd_wide_kernel.h).
          const int consumer_columns = c == 0 ? kSplit.columns0 : kSplit.columns1;
          const int column0 = c == 0 ? 0 : kSplit.columns0;
          const int boxes_per_slot = consumer_columns / kDqSlotGroup / 2;
          const int64_t columns = workspace.dq_row_stride - column0;
          const int64_t reached = columns < consumer_columns ? columns : consumer_columns;
          const int groups = columns <= 0 ? 0 : static_cast<int>(reached / kDqSlotGroup);
          const int64_t segments = static_cast<int64_t>(slot.stage) * Layout::kRowsBytes +
                                   static_cast<int64_t>(column0 / kSegmentElems) * kBlockM * kSegmentBytes;
          for (int g = 0; g < groups; ++g) {
            const uint8_t* half = (g < boxes_per_slot ? ring_tiles.q_tiles : ring_tiles.do_tiles) + segments;
            ptx::bulk_reduce_add_2d(&args.dq_map.map,
                                    reinterpret_cast<const float*>(half + (g % boxes_per_slot) * kBoxBytes),
                                    column0 + g * kDqSlotGroup, row);
          }
        }
        ptx::bulk_commit_group();
        ptx::bulk_wait_group_read<0>();
        for (int c = 0; c < kBwdConsumerWarpgroups; ++c) {
          ptx::mbarrier_arrive(&ring_tiles.q_empty[slot.stage]);
          ptx::mbarrier_arrive(&ring_tiles.do_empty[slot.stage]);
        }
        pass_dq_turn(counter);
      }
      __syncwarp();
    }
  }
}

}  // namespace flash::sm90
