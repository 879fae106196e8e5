// The converting dQ writers of the Hopper backward (FLASH_ATTN_BWD_FUSED_DQ=convert; bwd_tile_config.h bwd_converts_dq):
// the two ordered-dQ writer warps add the consumers' staged tiles into the zeroed fp32 accumulator in whatever order
// the CTAs get there, count each completed add on the query block's counter, and prepare the step on which their CTA
// is the query block's last adder in arrival order: once the others' adds are complete they load the partial sum into
// the staging tiles, and the consumers store dq = softmax_scale (sum + their dQ) themselves. The conversion kernel
// then skips the query blocks so converted (kDqConvertedInKernel on their counter).
#pragma once

#include <cstdint>

#include "flash_attn/bwd_workspace.h"
#include "flash_attn/ptx/bulk_reduce_sm90.h"
#include "flash_attn/ptx/fence_proxy_sm90.h"
#include "flash_attn/ptx/semaphore_sm90.h"
#include "flash_attn/ptx/tma_load_sm90.h"
#include "flash_attn/ptx/warpgroup_sm90.h"
#include "sm90/bwd_cta.h"
#include "sm90/bwd_ordered_dq.h"
#include "sm90/bwd_tile_config.h"
#include "sm90/kernel_common.h"

namespace flash::sm90 {

// Runs on every lane of writer `writer` (0 .. kBwdDqWriters - 1), which adds the steps i with i % kBwdDqWriters ==
// writer and prepares step i + 1: it computes that step's place among its query block's adders (dq_turn, arrival
// order), writes step_flags[(i + 1) % 2] (1: the consumers convert, the sum is coming into their staging tiles on
// sum_full) and frees the staging tiles for it. Writer 0 prepares step 0. A writer completes and counts its own add
// before it waits for another CTA's (a CTA thus never waits while holding an uncounted add, and the waits follow
// arrival order, which bwd_launch.h allows only where a KV head's key blocks are resident at once, as for ordered dQ).
template <typename Layout, int kHeadDim, int kBlockM, int kBlockN>
__device__ __forceinline__ void write_converting_dq(const BwdKernelArgs& args, const BwdCta<kBlockM, kBlockN>& cta,
                                                    uint8_t* smem, uint64_t* sum_full, int* step_flags, int writer) {
  constexpr BwdDqSplit kDqSplit = bwd_dq_split(kHeadDim, kBlockM);
  static_assert(kDqSplit != BwdDqSplit::kOwnKeys, "converting dQ takes one staging tile per consumer");
  constexpr bool kColumnHalves = kDqSplit == BwdDqSplit::kColumnHalves;
  constexpr bool kRowHalves = kDqSplit == BwdDqSplit::kRowHalves;
  constexpr int kDqColumns = kColumnHalves ? kHeadDim / kBwdConsumerWarpgroups : kHeadDim;
  constexpr int kDqRows = Layout::kDqRows;
  constexpr uint32_t kBoxBytes = kDqRows * kDqSlotGroup * sizeof(float);
  const int lane = threadIdx.x % kWarpSize;
  const BwdWorkspace& workspace = cta.workspace;
  float* stage = reinterpret_cast<float*>(smem + Layout::kDqStage);
  int* const counters = workspace.dq_semaphores + bwd_stats_block0(cta.global_q_row0, cta.batch);
  auto tile_column0 = [](int t) { return kColumnHalves ? t * kSegmentElems : 0; };
  auto tile_row0 = [](int t) { return kRowHalves ? t * kDqRows : 0; };
  auto tile_groups = [&](int t) {
    const int64_t columns = workspace.dq_row_stride - tile_column0(t);
    return static_cast<int>((columns < kDqColumns ? columns : kDqColumns) / kDqSlotGroup);
  };
  // A step's query block: its counter, first accumulator row, and whether this CTA adds into it last.
  struct StepDq {
    int* counter;
    int row;
    int predecessors;
    bool last;
  };
  auto step_dq = [&](const BwdBlock& block, int n_block, int i) {
    const int head = cta.step_head(i, block.m_count);
    const int m_block = BwdCta<kBlockM, kBlockN>::step_block(block, i);
    const DqTurn turn = dq_turn(args, cta, n_block, head, m_block, i, lane, true);
    return StepDq{counters + head * workspace.semaphore_head_stride + m_block,
                  static_cast<int>(head * workspace.dq_head_rows + cta.global_q_row0 +
                                   static_cast<int64_t>(m_block) * kBlockM),
                  turn.predecessors, turn.predecessors + 1 == turn.adders};
  };
  // Frees the staging tiles for step i; where this CTA adds last, first waits until the others' adds are complete and
  // loads their sum into the tiles (the consumers wait on sum_full before reading it).
  auto prepare = [&](const StepDq& next, int i) {
    if (lane == 0) {
      if (next.last) {
        await_dq_turn(next.counter, next.predecessors);
        uint32_t bytes = 0;
        for (int t = 0; t < kBwdConsumerWarpgroups; ++t) bytes += tile_groups(t) * kBoxBytes;
        ptx::mbarrier_arrive_expect_tx(sum_full, bytes);
        for (int t = 0; t < kBwdConsumerWarpgroups; ++t) {
          for (int g = 0; g < tile_groups(t); ++g) {
            ptx::tma_load_2d(stage + t * Layout::kDqStageFloats + g * kDqRows * kDqSlotGroup, &args.dq_map.map,
                             sum_full, tile_column0(t) + g * kDqSlotGroup, next.row + tile_row0(t));
          }
        }
      }
      step_flags[i % 2] = next.last ? 1 : 0;
    }
    __syncwarp();
    for (int c = 0; c < kBwdConsumerWarpgroups; ++c) {
      ptx::named_barrier_arrive(dq_handoff_barrier(kBwdDqEmptyBarrier, i, c), kBwdDqHandoffThreads);
    }
  };
  for (int n_block = cta.first_block; n_block < args.num_n_blocks; n_block += cta.block_stride) {
    const BwdBlock block = cta.plan(args.params.fwd.mask, n_block);
    if (writer == 0 && block.steps > 0) prepare(step_dq(block, n_block, 0), 0);
    for (int i = writer; i < block.steps; i += kBwdDqWriters) {
      const StepDq now = step_dq(block, n_block, i);
      for (int c = 0; c < kBwdConsumerWarpgroups; ++c) {
        ptx::named_barrier_sync(dq_handoff_barrier(kBwdDqFullBarrier, i, c), kBwdDqHandoffThreads);
      }
      // Not last: add the tiles; last: the consumers have stored dq from the sum in the tiles and their own dQ.
      if (lane == 0 && !now.last) {
        for (int t = 0; t < kBwdConsumerWarpgroups; ++t) {
          for (int g = 0; g < tile_groups(t); ++g) {
            ptx::bulk_reduce_add_2d(&args.dq_map.map, stage + t * Layout::kDqStageFloats + g * kDqRows * kDqSlotGroup,
                                    tile_column0(t) + g * kDqSlotGroup, now.row + tile_row0(t));
          }
        }
        ptx::bulk_commit_group();
        ptx::bulk_wait_group_read<0>();
      }
      __syncwarp();
      const bool has_next = i + 1 < block.steps;
      const StepDq next = has_next ? step_dq(block, n_block, i + 1) : StepDq{nullptr, 0, 0, false};
      if (has_next && !next.last) prepare(next, i + 1);
      if (lane == 0) {
        if (now.last) {
          *now.counter = kDqConvertedInKernel;  // no adder is left: the conversion kernel reads it after this kernel
        } else {
          pass_dq_turn(now.counter);
        }
      }
      __syncwarp();
      if (has_next && next.last) prepare(next, i + 1);
    }
  }
}

}  // namespace flash::sm90
