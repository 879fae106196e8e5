// D = rowsum(dO o O) of each backward step, summed inside the Hopper backward's narrow kernel (bwd_tile_config.h
// bwd_computes_d_in_kernel) by one warp of the producer warpgroup: it waits for the step's Q (its statistics block),
// dO and O tiles, adds each row's sum into the D slot of the statistics block (where the preprocess left -dlse, or 0),
// and publishes the step on d_full[stage], which the consumers wait for before they form dS^T.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "flash_attn/bwd_workspace.h"
#include "flash_attn/ptx/fence_proxy_sm90.h"
#include "flash_attn/ptx/tma_load_sm90.h"
#include "flash_attn/ptx/warpgroup_sm90.h"
#include "sm90/bwd_cta.h"
#include "sm90/kernel_common.h"

namespace flash::sm90 {

// The producer warpgroup's warp that sums D: warp 0's first lane loads the tiles, warps 1 and 2 are the ordered dQ's
// writers (bwd_ordered_dq.h).
constexpr int kBwdDeltaWarp = 3;
static_assert(kBwdDeltaWarp < ptx::kWarpgroupThreads / kWarpSize, "the delta warp is a warp of the producer warpgroup");

// acc + the dot product of two 16-byte chunks of 8 elements each.
template <typename T>
__device__ __forceinline__ float chunk_dot(const uint4& a, const uint4& b, float acc) {
  const uint32_t aw[4] = {a.x, a.y, a.z, a.w};
  const uint32_t bw[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    float2 x;
    float2 y;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&aw[w]));
      y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bw[w]));
    } else {
      x = __half22float2(*reinterpret_cast<const __half2*>(&aw[w]));
      y = __half22float2(*reinterpret_cast<const __half2*>(&bw[w]));
    }
    acc = fmaf(x.x, y.x, acc);
    acc = fmaf(x.y, y.y, acc);
  }
  return acc;
}

// Runs on every lane of warp kBwdDeltaWarp, over the same key blocks and steps as the producer (blocks without steps
// skipped, the ring counted across key blocks). Lane l sums rows l, l + 32, ... of the step: the dO and O tiles share
// the 128-byte swizzle, so a lane reads the same physical chunks of its row in both, and chunk c ^ (row % 8) puts a
// quarter-warp's 16-byte loads (8 consecutive rows) on 8 distinct bank groups. Rows past the sequence keep the
// preprocess's D = 0 (their P is 0; in varlen calls their tiles hold the next sequence's rows).
template <typename T, typename Layout, int kBlockM, int kBlockN, int kStages>
__device__ __forceinline__ void compute_step_deltas(const BwdKernelArgs& args, const BwdCta<kBlockM, kBlockN>& cta,
                                                    const BwdRing<Layout, kStages>& ring_tiles,
                                                    const BwdDeltaRing& delta) {
  using Slot = RingSlot<kStages>;
  constexpr int kChunks = kSegmentBytes / 16;  // 16-byte chunks of a row's segment
  constexpr int kStatRows = static_cast<int>(kBwdStatsRows);
  const int lane = threadIdx.x % kWarpSize;
  int ring = 0;
  int o_loads = 0;
  for (int n_block = cta.first_block; n_block < args.num_n_blocks; n_block += cta.block_stride) {
    const BwdBlock block = cta.plan(args.params.fwd.mask, n_block);
    if (block.steps == 0) continue;
    for (int i = 0; i < block.steps; ++i, ++ring, ++o_loads) {
      const Slot slot(ring);
      const int64_t q0 = static_cast<int64_t>(BwdCta<kBlockM, kBlockN>::step_block(block, i)) * kBlockM;
      ptx::mbarrier_wait_parity(&ring_tiles.q_full[slot.stage], slot.parity);
      ptx::mbarrier_wait_parity(&ring_tiles.do_full[slot.stage], slot.parity);
      ptx::mbarrier_wait_parity(delta.o_full, RingSlot<1>(o_loads).parity);
      const uint8_t* do_rows = ring_tiles.do_tiles + slot.stage * Layout::kRowsBytes;
      float* step_stats = ring_tiles.stats + slot.stage * Layout::kStatFloats;
      for (int row = lane; row < kBlockM; row += kWarpSize) {
        if (q0 + row >= cta.sequence.seqlen_q) break;
        float dot = 0.f;
#pragma unroll 1
        for (int seg = 0; seg < Layout::kSegments; ++seg) {
          const int line = seg * kBlockM * kSegmentBytes + row * kSegmentBytes;
#pragma unroll 2
          for (int c = 0; c < kChunks; ++c) {
            const int at = line + ((c ^ (row % 8)) * 16);
            dot = chunk_dot<T>(*reinterpret_cast<const uint4*>(do_rows + at),
                               *reinterpret_cast<const uint4*>(delta.o_tile + at), dot);
          }
        }
        step_stats[row / kStatRows * 2 * kStatRows + kStatRows + row % kStatRows] += dot;
      }
      // The D slots are rewritten by the next bulk copy of this stage's statistics (async proxy), which the chain
      // d_full -> consumers -> q_empty -> producer orders after these writes.
      ptx::fence_proxy_async_shared();
      __syncwarp();
      if (lane == 0) {
        ptx::mbarrier_arrive(&delta.d_full[slot.stage]);
        ptx::mbarrier_arrive(delta.o_empty);
      }
    }
  }
}

}  // namespace flash::sm90
