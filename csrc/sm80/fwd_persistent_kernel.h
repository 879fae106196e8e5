// Persistent form of the forward kernel's standard tiles for non-causal calls with one key split and no varlen: the
// CTAs an SM holds walk the work items (query tile, head, batch entry, in grid order) with stride gridDim.x and,
// during their last key tile, issue the next item's Q (into a second Q tile) and first K tile, so they load while
// this item finishes instead of after it. At 512 tokens an item has 8 key tiles, and a per-CTA fit put our fixed
// cost at 2.2 tiles against FA2's 1.1 at hd 256, 1.8 against 1.6 at hd 128 (docs/perf_log.md "fifth session").
// At head dim 256 K and V arrive by TMA (fwd_persistent_loads_kv_by_tma), Q still by cp.async.
#pragma once

#include "sm80/fwd_kernel.h"

namespace flash::sm80 {

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(fwd_tile_config(kHeadDim).warps* kWarpSize)
    fwd_persistent_kernel(const FwdParams p, const __grid_constant__ FwdKvMaps maps) {
  constexpr MaskKind kMask = MaskKind::kNone;
  constexpr FwdTileKind kKind = FwdTileKind::kStandard;
  constexpr FwdTileConfig kTile = fwd_tile_config(kHeadDim, false, kKind);
  constexpr int kBlockM = kTile.block_m;
  constexpr int kBlockN = kTile.block_n;
  constexpr int kWarps = kTile.warps;
  constexpr int kThreads = kWarps * kWarpSize;
  constexpr int kStrips = kBlockM / (kWarps * kMmaM);
  constexpr int kStripStride = kWarps * kMmaM;
  constexpr int kStride = kHeadDim + kSmemRowPad;
  constexpr int kNTiles = kBlockN / kMmaN;
  constexpr int kDTiles = kHeadDim / kMmaN;
  constexpr int kStages = kTile.kv_stages;
  constexpr bool kTma = fwd_persistent_loads_kv_by_tma(kHeadDim);
  constexpr bool kEarlyV = fwd_waits_v_before_softmax(kHeadDim, false, kTma);
  using KvLayout = std::conditional_t<kTma, SegmentSwizzledRows<kBlockN, kHeadDim>,
                                      TileLayout<fwd_swizzles_kv(kHeadDim, false, kKind, false), kHeadDim>>;
  // The prefetch below takes the place of the one-stage order's last K load (where V is awaited: after S = Q K^T
  // or after the softmax); the first V is not in the prologue.
  static_assert(fwd_runs_persistent(kHeadDim, false, kKind, false) && kStages == 1 &&
                    !fwd_prefetches_first_v(kHeadDim, false, kWarps, kStages),
                "the persistent kernel follows the one-stage order without the first V in the prologue");

  extern __shared__ __align__(kSmemAlign) unsigned char smem_raw[];
  // With TMA: the tiles from the next kTmaBoxAlign boundary (the launcher asks for the slack), then the barriers.
  unsigned char* const smem = kTma ? tma_aligned_smem(smem_raw) : smem_raw;
  TmaKvBarriers bars;
  if constexpr (kTma) bars.init(smem + fwd_persistent_smem_bytes(kHeadDim, sizeof(T)));

  const unsigned query_tiles = static_cast<unsigned>((p.shape.seqlen_q + kBlockM - 1) / kBlockM);
  const unsigned heads = static_cast<unsigned>(p.shape.nheads_q);
  const unsigned items = query_tiles * heads * static_cast<unsigned>(p.shape.batch);  // the launcher checks the range
  auto item_at = [&](unsigned item) {
    return make_uint3(item % query_tiles, (item / query_tiles) % heads, item / (query_tiles * heads));
  };

  bool prefetched = false;  // this item's Q and first K were issued by the previous item
  int q_buffer = 0;
  for (unsigned item = blockIdx.x; item < items; item += gridDim.x, q_buffer ^= 1) {
    FwdCta cta = locate_cta<kMask, kBlockM>(p, item_at(item), query_tiles);
    plan_key_tiles<kMask, kBlockM, kBlockN>(p, cta);
    const FwdTiles<T> tiles = locate_tiles<kHeadDim, kBlockM, kBlockN, kStages, T>(smem, p, cta, q_buffer);
    // The item's Q and first K: cp.async for both, or Q by cp.async (one group) and K by TMA.
    auto issue_prologue = [&](const FwdCta& c, const FwdTiles<T>& t) {
      if constexpr (kTma) {
        load_prologue_tma<kHeadDim, kBlockM, kBlockN, kThreads>(p, c, t, maps, bars);
      } else {
        load_prologue<KvLayout, kHeadDim, kBlockM, kBlockN, kThreads, kStages, false>(p, c, t);
      }
    };
    if (!prefetched) issue_prologue(cta, tiles);
    prefetched = false;
    const FwdScoreParams sp = read_score_params<false>(p, cta);

    int rows[kStrips][2];
    find_rows<kStripStride>(rows, cta);
    float row_max[kStrips][2], row_sum[kStrips][2];
    ptx::MmaC acc[kStrips][kDTiles];
    init_softmax(row_max, row_sum);

    for (int n = cta.n_last; n >= cta.n_first; --n) {
      const int n0 = n * kBlockN;
      if constexpr (kTma) {
        ptx::cp_async_wait<0>();  // Q, on the item's first tile
        bars.wait_k();
        __syncthreads();  // every thread's Q copies landed; every warp is done with V(n + 1)'s slot
        if (cta.tid == 0) issue_kv_tile_tma<kHeadDim, kBlockN>(tiles.s_v_ring, maps.v, bars.v_full, cta, n);
      } else {
        await_k<KvLayout, kHeadDim, kBlockN, kThreads, kStages, false>(p, cta, tiles, n);
      }
      const T* s_k = tiles.s_k_ring + ring_slot<kStages>(n) * kBlockN * kStride;
      const T* s_v = tiles.s_v_ring + ring_slot<kStages>(n) * kBlockN * kStride;
      ptx::MmaC sc[kStrips][kNTiles];
      ptx::MmaA a[kStrips];
      compute_scores<KvLayout, kHeadDim, kStripStride, kMask == MaskKind::kCausal>(sc, a, tiles.s_q, s_k, cta.warp,
                                                                                cta.lane);
      // Awaits V(n); on the item's last key tile, with a next item, the K slot and the other Q tile (the previous
      // item's, whose epilogue every warp finished before this item's first barrier) then take that item's Q and first
      // K instead of the (empty) K load that follows. With TMA the barrier after V's wait frees K's slot for K(n - 1).
      auto await_v_or_prefetch = [&] {
        const unsigned next = item + gridDim.x;
        if constexpr (kTma) {
          bars.wait_v();
        } else if (n == cta.n_first && next < items) {
          ptx::cp_async_wait<0>();
        }
        if (n == cta.n_first && next < items) {
          __syncthreads();
          FwdCta next_cta = locate_cta<kMask, kBlockM>(p, item_at(next), query_tiles);
          plan_key_tiles<kMask, kBlockM, kBlockN>(p, next_cta);
          const FwdTiles<T> next_tiles =
              locate_tiles<kHeadDim, kBlockM, kBlockN, kStages, T>(smem, p, next_cta, q_buffer ^ 1);
          issue_prologue(next_cta, next_tiles);
          prefetched = true;
        } else if constexpr (kTma) {
          __syncthreads();  // every warp is done with K(n)
          if (cta.tid == 0 && n > cta.n_first) {
            issue_kv_tile_tma<kHeadDim, kBlockN>(tiles.s_k_ring, maps.k, bars.k_full, cta, n - 1);
          }
        } else {
          await_v<KvLayout, kHeadDim, kBlockN, kThreads, kStages>(p, cta, tiles, n);
        }
      };
      if constexpr (kEarlyV) await_v_or_prefetch();

      // Keys past seqlen_k (the only mask here) in the last tile of a ragged range.
      if (n0 + kBlockN > cta.seqlen_k) {
#pragma unroll
        for (int s = 0; s < kStrips; ++s) {
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              if (n0 + nt * kMmaN + 2 * cta.t + (e % 2) >= cta.seqlen_k) sc[s][nt].reg[e] = -INFINITY;
            }
          }
        }
      }
      online_softmax(sc, acc, row_max, row_sum, sp.x_scale);
      if constexpr (!kEarlyV) await_v_or_prefetch();
      ptx::MmaA pa[kStrips];
      accumulate_pv<KvLayout, kHeadDim>(acc, pa, sc, s_v, cta.lane);
    }

    // Epilogue as the one-item kernel's, without its wait and barrier: each warp stages O in its own Q rows, and the
    // next item's copies (in flight) go elsewhere. An item without keys (seqused_k 0) never waited for its Q copies,
    // which any thread may have issued into any row.
    if (cta.n_last < cta.n_first) {
      ptx::cp_async_wait<0>();
      __syncthreads();
    }
    normalise_output<kHeadDim>(acc, row_max, row_sum, rows, tiles.s_q, p, cta, false);
    store_output<kHeadDim, kStripStride, kStrips>(tiles.s_q, p, cta);
  }
}

}  // namespace flash::sm80
