// The Hopper forward kernel (sm_90a): per CTA one tile of block_m query rows of one (batch entry, head). Warpgroup 0
// is the producer: one thread loads Q once and K, V through `stages`-slot rings by TMA (full / empty mbarriers).
// Warpgroups 1.. are consumers of 64 rows each: S = Q.K^T by wgmma from shared memory, online softmax in registers,
// O += P.V by wgmma with P from registers and V read MN-major. Launched by fwd_launch.h; the calls it serves are
// listed in dispatch/sm90_policy.h (dense or varlen, KV-cache lengths, softcap and ALiBi; no dropout / bias).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "flash_attn/common/mask.h"
#include "flash_attn/common/exp2_polynomial.h"
#include "flash_attn/common/fast_divmod.h"
#include "flash_attn/common/fast_tanh.h"
#include "flash_attn/common/math.h"
#include "flash_attn/common/seqlen.h"
#include "flash_attn/params.h"
#include "flash_attn/ptx/tma_load_sm90.h"
#include "flash_attn/ptx/warpgroup_sm90.h"
#include "flash_attn/ptx/wgmma_sm90_generated.h"
#include "sm90/block_ranges.h"
#include "sm90/fwd_tile_config.h"
#include "sm90/kernel_common.h"
#include "sm90/tile_order.h"

namespace flash::sm90 {

// What a launch passes by value (__grid_constant__): the call, the three tensor maps and derived scalars.
struct FwdKernelArgs {
  CUtensorMap q_map;  // (head dim, head, row, batch) boxes of 64 columns x block_m rows
  CUtensorMap k_map;  // (head dim, kv head, key, batch) boxes of 64 columns x block_n keys
  CUtensorMap v_map;
  FwdParams params;
  float scale_log2;   // what multiplies a score in the exponent: softmax_scale * log2(e), or softcap * log2(e) in
                      // softcap calls, whose transform_scores leaves tanh(score * softmax_scale / softcap)
  int heads_per_kv;   // nheads_q / nheads_k
  // GQA packing (FwdParams::sm90_packed_heads = 2^pack_shift query heads of one KV head per tile): tile row l holds
  // query l >> pack_shift of head (l & (2^pack_shift - 1)) of the tile's heads, and the Q map's boxes span those heads;
  // tile_heads = nheads_q >> pack_shift head groups per batch entry (pack_shift 0: one head per tile).
  int pack_shift;
  int tile_heads;
  int num_m_blocks;   // query blocks of a (packed) sequence
  int64_t num_tiles;  // query blocks x key splits x tile heads x batch entries (persistent kernels walk them)
  int num_splits;     // key splits (FwdParams::num_splits; kSplit kernels): each tile's keys in num_splits parts,
                      // merged by the combine kernel from split_out / split_lse
  // plan_tile's divisors (tile_order.h; the plan keeps num_tiles below 2^31), remade by a persistent launch for its
  // CTAs.
  TileWalkDivisors walk;
};

// Split-KV partial rows (FwdParams::split_out) are the head dim rounded up to this many floats, as the call's
// scratch is allocated (api/fwd_cuda_plan.cpp) and the combine kernel reads them (sm80/fwd_combine_kernel.h).
constexpr int kSplitRowGranule = 32;

// Byte offsets of the tiles and barriers in the (1024-byte aligned) dynamic shared memory: kQStages Q tiles, then the
// K and V rings, of kStorageDim columns (fwd_storage_dim: whole 64-column segments).
template <int kStorageDim, int kBlockM, int kBlockN, int kStages, int kQStages>
struct FwdSmemLayout {
  static constexpr int kSegments = kStorageDim / kSegmentElems;
  static constexpr int kQBytes = kBlockM * kStorageDim * 2;
  static constexpr int kKvBytes = kBlockN * kStorageDim * 2;  // one K (or V) stage
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kQStages * kQBytes;
  static constexpr int kV = kK + kStages * kKvBytes;
  static constexpr int kBarriers = kV + kStages * kKvBytes;
  // per Q slot q_full, q_empty, then per stage k_full, k_empty, v_full, v_empty
  static constexpr int kBarrierCount = 2 * kQStages + 4 * kStages;
  static constexpr int kBytes = kBarriers + kBarrierCount * 8;
  static constexpr int kLaunchBytes = kBytes + static_cast<int>(ptx::kSwizzleAtomBytes);  // room to align the base
  static_assert(kStorageDim % kSegmentElems == 0, "TMA segments of 64 columns");
  static_assert(kQBytes % ptx::kSwizzleAtomBytes == 0 && kKvBytes % ptx::kSwizzleAtomBytes == 0,
                "every tile starts on a swizzle atom");
  static_assert(kLaunchBytes <= kMaxSmemPerBlock, "the tiles must fit the shared memory a block may opt into");
};

// Q slots of a CTA: two where a CTA walks several tiles carrying their tails (fwd_carries_tile_tail) and has room
// for them beside the K / V rings, so the producer loads the next tile's Q while the current tile's key blocks still
// read theirs; with one it may load it only once the current tile's last S GEMM is done, about one key block before
// the consumers wait for it.
template <int kStorageDim, int kBlockM, int kBlockN, int kStages, bool kCarry>
constexpr int fwd_q_stages() {
  constexpr int kTwoQBytes = 2 * kBlockM * kStorageDim * 2 + 2 * kStages * kBlockN * kStorageDim * 2 +
                             (4 + 4 * kStages) * 8 + static_cast<int>(ptx::kSwizzleAtomBytes);
  return kCarry && kFwdDoubleQ && kTwoQBytes <= kMaxSmemPerBlock ? 2 : 1;
}

// Per-thread state of one consumer thread: the two rows it holds in every m64 accumulator (lane / 4 and + 8 within
// its warp's 16 rows), their visible key ranges, running max and sum.
struct ConsumerRows {
  int64_t row[2];
  KeyRange keys[2];
  float max[2];
  float sum[2];
};

// Scores of keys a row does not see (window, causal, past seqlen_k) become -inf. Register 4j + 2r + e holds row r,
// column 8j + 2 (lane % 4) + e of the block.
// kUpperOnly (causal kernels, kFwdCausalMaskUpperOnly): every row sees keys from 0 on, so only the end is tested.
template <int kBlockN, bool kUpperOnly = false>
__device__ __forceinline__ void mask_scores(float (&s)[kBlockN / 2], const ConsumerRows& rows, int64_t col0) {
  if constexpr (kFwdMasksByLocalRange) {
    const LocalRange range[2] = {local_range(rows.keys[0].begin, rows.keys[0].end, col0, kBlockN),
                                 local_range(rows.keys[1].begin, rows.keys[1].end, col0, kBlockN)};
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int column = 8 * j + (e % 2);
        const bool seen = kUpperOnly ? column < range[e / 2].hi : in_local_range(range[e / 2], column);
        if (!seen) s[4 * j + e] = -INFINITY;
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const int64_t col = col0 + 8 * j + (e % 2);
        if (col < rows.keys[r].begin || col >= rows.keys[r].end) s[4 * j + e] = -INFINITY;
      }
    }
  }
}

// Online softmax of one key block: the max over raw scores (quad shuffles), the scale folded into the exponent (one
// FFMA + ex2 per score), S replaced by P, the running sum rescaled; `factor` is what O must be multiplied by. A row
// whose max is still -inf uses 0 in its place, so it gets P = 0 and factor 0, never NaN. kPolyEvery > 0: every
// kPolyEvery-th column group's exponentials run on the FMA pipe (exp2_polynomial), the rest on the MUFU unit.
// kLazy: lazy rescaling (fwd_tile_config.h fwd_lazy_rescale).
template <int kBlockN, int kPolyEvery, bool kLazy>
__device__ __forceinline__ void softmax_step(float (&s)[kBlockN / 2], ConsumerRows& rows, float scale_log2,
                                             float (&factor)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float block_max = rows.max[r];
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) block_max = fmaxf(block_max, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
    block_max = fmaxf(block_max, __shfl_xor_sync(kFullWarp, block_max, 1));
    block_max = fmaxf(block_max, __shfl_xor_sync(kFullWarp, block_max, 2));
    // Lazy rescaling keeps the applied max while the block's is within kFwdLazyRescaleLog2 of it (a row's first
    // finite max, -inf before, always moves it).
    if constexpr (kLazy) {
      if ((block_max - rows.max[r]) * scale_log2 <= kFwdLazyRescaleLog2) block_max = rows.max[r];
    }
    const float max_used = block_max == -INFINITY ? 0.f : block_max;
    factor[r] = exp2f((rows.max[r] - max_used) * scale_log2);
    rows.max[r] = block_max;
    const float bias = -max_used * scale_log2;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float exponent = fmaf(s[4 * j + 2 * r + e], scale_log2, bias);
        float prob;
        if constexpr (kPolyEvery > 0) {
          prob = j % kPolyEvery == kPolyEvery - 1 ? exp2_polynomial(exponent) : exp2f(exponent);
        } else {
          prob = exp2f(exponent);
        }
        s[4 * j + 2 * r + e] = prob;
        sum += prob;
      }
    }
    rows.sum[r] = rows.sum[r] * factor[r] + sum;
  }
}

// With lazy rescaling a warp none of whose rows moved its max (every factor exactly 1) skips the multiplies.
template <int kHeadDim, bool kLazy>
__device__ __forceinline__ void rescale_o(float (&o)[kHeadDim / 2], const float (&factor)[2]) {
  if constexpr (kLazy) {
    if (!__any_sync(kFullWarp, factor[0] != 1.f || factor[1] != 1.f)) return;
  }
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[4 * j + e] *= factor[e / 2];
  }
}

// The general kernels' per-score features, applied before the mask: softcap (on the scaled score) and ALiBi, in the
// units that softmax_step multiplies by FwdKernelArgs::scale_log2 in the exponent, so that the logit's scale costs no
// multiply of its own (the exponent's FFMA takes it, as in the lean kernels): tanh(s scale / softcap) - (slope /
// softcap) |distance| with softcap, s - (slope / scale) |distance| without; the same logit as the portable path's
// transform_scores.
struct ScoreTransform {
  float tanh_scale;   // softmax_scale / softcap; 0: no softcap
  float alibi_slope;  // the head's ALiBi slope over softcap (or over softmax_scale without softcap); 0: none
  int64_t offset;     // the diagonal offset ALiBi's distance is measured from
};

// Each feature is one uniform branch around its loop, and ALiBi's distance is converted once per row: the first form
// converted the 64-bit distance of every score (I2F.S64, a quarter-rate op, 126 per key block beside 132 MUFU.EX2) and
// ran both features' arithmetic for either, and the general kernel ran at 392-403 against 571-577 TFLOP/s for the
// lean one (H200, hd 128, 4k, softcap or ALiBi).
template <int kBlockN>
__device__ __forceinline__ void transform_scores(float (&s)[kBlockN / 2], const ConsumerRows& rows, int64_t col0,
                                                 const ScoreTransform& t) {
  if (t.tanh_scale > 0.f) {
#pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i) s[i] = fast_tanh(s[i] * t.tanh_scale);
  }
  if (t.alibi_slope != 0.f) {
    // Score 4j + e is row e / 2 at column col0 + 8j + e % 2; exact while |distance| < 2^24.
    const float distance0[2] = {static_cast<float>(rows.row[0] + t.offset - col0),
                                static_cast<float>(rows.row[1] + t.offset - col0)};
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[4 * j + e] -= t.alibi_slope * fabsf(distance0[e / 2] - static_cast<float>(8 * j + e % 2));
      }
    }
  }
}

// Ping-pong between the two consumer warpgroups: a warpgroup waits for its turn before issuing GEMMs and hands the
// turn on after. Barrier ids 1 and 2 (0 is __syncthreads); each completes with 128 syncing + 128 arriving threads.
constexpr int kPingpongBarrier = 1;
constexpr int kPingpongThreads = 2 * ptx::kWarpgroupThreads;
__device__ __forceinline__ void take_turn(int consumer) {
  ptx::named_barrier_sync(kPingpongBarrier + consumer, kPingpongThreads);
}
__device__ __forceinline__ void pass_turn(int consumer) {
  ptx::named_barrier_arrive(kPingpongBarrier + (1 - consumer), kPingpongThreads);
}

// A consumer warpgroup's own barrier (ids 3-5; 128 threads): generic-proxy writes to a tile are done and fenced before
// any warp of the warpgroup issues the wgmma that reads the tile.
constexpr int kOwnTileBarrier = kPingpongBarrier + 2;

// KV-cache calls (seqused_k): the V rows of a tile's highest key block past the sequence's used keys hold whatever the
// cache holds there (torch.empty: maybe NaN or inf), and P = 0 times NaN is NaN in O, so they become zeros (their
// scores are masked to -inf, so K's rows there need nothing). Whole 128-byte rows: the swizzle permutes 16-byte chunks
// within a row only. Each consumer warpgroup writes all of them itself (both write the same zeros, so neither waits
// for the other) before its first P.V of the block, fenced for the async proxy and synced over its own 128 threads.
// compute-sanitizer racecheck reports no hazard on it (test_kvcache_lengths, hd 128); sharing the rows out between
// the warpgroups behind one barrier of all consumer threads ran level with it (thirty-ninth session) and was dropped.
template <int kHeadDim, int kBlockN>
__device__ __forceinline__ void zero_value_rows_from(uint8_t* v_tile, int first_row, int consumer, int thread) {
  constexpr int kChunkBytes = 16;
  constexpr int kSegmentTileBytes = kBlockN * kSegmentBytes;
  constexpr int kWriters = ptx::kWarpgroupThreads;
  const int begin = first_row * kSegmentBytes + thread * kChunkBytes;
#pragma unroll
  for (int seg = 0; seg < kHeadDim / kSegmentElems; ++seg) {
    uint8_t* segment = v_tile + seg * kSegmentTileBytes;
    for (int offset = begin; offset < kSegmentTileBytes; offset += kWriters * kChunkBytes) {
      *reinterpret_cast<uint4*>(segment + offset) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  ptx::fence_proxy_async_shared();
  ptx::named_barrier_sync(kOwnTileBarrier + consumer, ptx::kWarpgroupThreads);
}

// Paged caches (FwdParams::block_table; sm90/fwd_tile_config.h fwd_pages_fit): the page numbers of the key block at
// key0 of one sequence, lane i of the producer warp holding the block's i-th page (a page of whole key blocks: lane 0
// its one page), so a block's page numbers cost one load latency whatever their count. `table`: the sequence's
// block-table row of `columns` pages. Columns are clamped to the table and pages to the pool: rows past a sequence's
// keys are masked, and their V rows zeroed (zero_value_rows_from). The producer loads a block's page numbers one block
// ahead, under the previous block's copies (fortieth session, with in-place reads widened: pages of 64 at 128 queries,
// H200 hd 128 GQA 32/8, 1 x 32k 153 us in place against 207 gathered; contiguous calls level).
template <int kBlockN>
__device__ __forceinline__ int lane_page(int key0, const int32_t* table, int columns, int page_size, int num_pages,
                                         int lane) {
  const int pages = page_size >= kBlockN ? 1 : kBlockN / page_size;
  if (lane >= pages) return 0;
  const int column = key0 / page_size + lane;
  const int entry = table[column < columns ? column : columns - 1];
  return entry < 0 ? 0 : (entry < num_pages ? entry : num_pages - 1);
}

// Key rows [key0, key0 + kBlockN) into a K or V slot from their pages (`page`: lane_page's, every lane of the warp
// calls this): one box per segment from a page of whole key blocks, else a box of page_size rows per page, each
// starting on a 1024-byte swizzle atom (pages of at least kFwdMinPageRows rows). `map` spans the page pool (head
// dim, kv head, page row, page) in boxes of min(page_size, kBlockN) rows. Lane 0 issues the copies.
template <int kSegments, int kBlockN>
__device__ __forceinline__ void load_paged_block(uint8_t* slot, const CUtensorMap* map, uint64_t* barrier,
                                                 int kv_head, int key0, int page, int page_size, int lane) {
  if (page_size >= kBlockN) {
    if (lane != 0) return;
#pragma unroll
    for (int seg = 0; seg < kSegments; ++seg) {
      ptx::tma_load_4d(slot + seg * kBlockN * kSegmentBytes, map, barrier, seg * kSegmentElems, kv_head,
                       key0 % page_size, page);
    }
    return;
  }
  const int pages = kBlockN / page_size;
  for (int i = 0; i < pages; ++i) {
    const int page_i = __shfl_sync(kFullWarp, page, i);
    if (lane != 0) continue;
    const int row_bytes = i * page_size * kSegmentBytes;
#pragma unroll
    for (int seg = 0; seg < kSegments; ++seg) {
      ptx::tma_load_4d(slot + seg * kBlockN * kSegmentBytes + row_bytes, map, barrier, seg * kSegmentElems, kv_head,
                       0, page_i);
    }
  }
}

// One work tile of a CTA: block_m query rows of one (batch entry, head), and the key blocks its rows see.
struct FwdTile {
  int m_block;
  int split;          // which of args.num_splits parts of the sequence's key blocks the tile sees
  int head;
  int batch;
  Sequence sequence;
  bool has_rows;      // false: a varlen sequence shorter than this tile's first row (nothing to do)
  int64_t offset;     // diagonal offset of the sequence
  int64_t row_first;  // first query row, relative to the sequence (packed tiles: of each of the tile's heads)
  int n_min;          // key blocks [n_min, n_max) hold every key some row of the tile sees
  int n_max;
  int full_lo;        // key blocks [full_lo, full_hi) need no mask for any row
  int full_hi;
};

// Tile `index` of the launch: the grid coordinates of a one-tile CTA, or, for persistent CTAs, a linear index: query
// block fastest (concurrent CTAs share a head's K/V in L2) without a mask or with one CTA per tile; with fewer CTAs,
// causal / local tiles longest first (tile_order.h masked_tile_at).
template <int kHeadDim, MaskKind kMask, bool kPersistent, int kBlockM, int kBlockN, bool kSplit>
__device__ __forceinline__ FwdTile plan_tile(const FwdKernelArgs& args, int64_t index) {
  const FwdParams& p = args.params;
  FwdTile tile;
  // The key split sits between the query block and the head: a (split, head) pair's query blocks are consecutive
  // tiles, sharing that split's K / V in L2.
  tile.split = 0;
  if constexpr (kPersistent) {
    // One CTA per tile (fwd_persistent_pays false) walks a masked call in the one-tile kernel's order, each head's
    // query blocks last first, so concurrent CTAs share a head's K / V in L2 (the longest-first order, across every
    // head, ran 4-12 % behind it at 4k / 16k keys: docs/perf_log.md, eighteenth session).
    const TileWalk walk = kMask == MaskKind::kNone       ? TileWalk::kInOrder
                          : gridDim.x >= args.num_tiles ? TileWalk::kLastFirst
                          : fwd_masked_tiles_in_chunks(kHeadDim, kMask) ? TileWalk::kLongestFirstInChunks
                                                                         : TileWalk::kLongestFirst;
    const TileCoordinates at = tile_coordinates(index, args.num_tiles, args.num_m_blocks, args.walk, walk, kSplit);
    tile.m_block = at.m_block;
    tile.split = at.split;
    tile.head = at.head_group << args.pack_shift;
    tile.batch = at.batch;
  } else {
    (void)index;
    int unit = static_cast<int>(blockIdx.x);
    if constexpr (kSplit) {
      tile.split = static_cast<int>(fast_div(unit, args.walk.order.m_blocks));
      unit -= tile.split * args.num_m_blocks;
    }
    tile.m_block = kMask == MaskKind::kNone ? unit : args.num_m_blocks - 1 - unit;
    tile.head = static_cast<int>(blockIdx.y) << args.pack_shift;
    tile.batch = blockIdx.z;
  }
  tile.sequence = locate_sequence(p.shape, tile.batch);
  const int64_t seqlen_q = tile.sequence.seqlen_q;
  const int64_t seqlen_k = tile.sequence.seqlen_k;
  tile.row_first = (static_cast<int64_t>(tile.m_block) * kBlockM) >> args.pack_shift;
  tile.has_rows = tile.row_first < seqlen_q;
  tile.offset = diagonal_offset(p.mask, seqlen_q, seqlen_k);
  const KeyBlocks blocks = key_blocks_of_rows(p.mask, tile.row_first, kBlockM >> args.pack_shift, seqlen_q, seqlen_k,
                                              tile.offset, kBlockN);
  tile.n_min = blocks.n_min;
  tile.n_max = tile.has_rows ? blocks.n_max : blocks.n_min;
  if constexpr (kSplit) {
    // Split s takes the sequence's key blocks [s per, (s + 1) per); a tile that sees none of them writes an empty
    // partial (O = 0, lse -inf), which the combine kernel weights 0.
    const int seq_blocks = static_cast<int>((seqlen_k + kBlockN - 1) / kBlockN);
    const int per = static_cast<int>(fast_div(seq_blocks + args.num_splits - 1, args.walk.splits));
    const int lo = tile.split * per;
    const int hi = lo + per;
    tile.n_min = tile.n_min > lo ? tile.n_min : lo;
    tile.n_max = tile.n_max < hi ? tile.n_max : hi;
    if (tile.n_max < tile.n_min) tile.n_max = tile.n_min;
  }
  tile.full_lo = blocks.full_lo;
  tile.full_hi = blocks.full_hi;
  return tile;
}

// What a tile's epilogue needs besides O: where its rows go (kept while a carried tile waits for its last P.V).
struct TileOutput {
  int batch;
  int head;
  int split;
  int64_t q_row0;
  int64_t seqlen_q;
};

// Epilogue: O / sum and LSE = max * scale_log2 * ln(2) + ln(sum) (max * softmax_scale where max is a raw score, max *
// softcap where it is a score's tanh: transform_scores); rows that saw no key give O = 0 and
// LSE = +inf. From registers: shared memory stays with the next tile's loads. Split calls write the tile's split's fp32
// partial and natural-log lse instead (-inf where a row saw no key of the split), rows of the combine kernel's layout
// ([split][batch][head][row], sm80/fwd_combine_kernel.h). tile_row: the thread's first row in the tile (its second is
// kSecondRow below), whose low pack_shift bits pick the row's head in a packed tile.
template <typename T, int kCols, bool kSplit>
__device__ __forceinline__ void write_output(const FwdKernelArgs& args, const TileOutput& tile,
                                             const ConsumerRows& rows, const float (&o)[kCols / 2], int lane,
                                             int tile_row) {
  const FwdParams& p = args.params;
  const int quad_col = 2 * (lane % kQuadLanes);
  const int head_mask = (1 << args.pack_shift) - 1;
  const float lse_scale = args.scale_log2 * static_cast<float>(kLn2);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = rows.sum[r];
    sum += __shfl_xor_sync(kFullWarp, sum, 1);
    sum += __shfl_xor_sync(kFullWarp, sum, 2);
    const float inverse = sum > 0.f ? 1.f / sum : 0.f;
    if (rows.row[r] >= tile.seqlen_q) continue;
    const int head = tile.head + ((tile_row + kSecondRow * r) & head_mask);
    if constexpr (kSplit) {
      const int64_t rows_total = p.shape.batch * p.shape.nheads_q * p.shape.seqlen_q;
      const int64_t flat = tile.split * rows_total + (tile.batch * p.shape.nheads_q + head) * p.shape.seqlen_q +
                           rows.row[r];
      const int width =
          (static_cast<int>(p.shape.head_dim) + kSplitRowGranule - 1) / kSplitRowGranule * kSplitRowGranule;
      float* part = p.split_out + flat * width;
#pragma unroll
      for (int j = 0; j < kCols / 8; ++j) {
        const int col = 8 * j + quad_col;
        if (col < width) {
          *reinterpret_cast<float2*>(part + col) =
              make_float2(o[4 * j + 2 * r] * inverse, o[4 * j + 2 * r + 1] * inverse);
        }
      }
      if (lane % kQuadLanes == 0) p.split_lse[flat] = sum > 0.f ? rows.max[r] * lse_scale + logf(sum) : -INFINITY;
      continue;
    }
    T* out_row = static_cast<T*>(p.out) + tile.batch * p.out_strides.batch + head * p.out_strides.head +
                 (tile.q_row0 + rows.row[r]) * p.out_strides.row;
#pragma unroll
    for (int j = 0; j < kCols / 8; ++j) {
      const int col = 8 * j + quad_col;
      if (col < p.shape.head_dim) {
        *reinterpret_cast<uint32_t*>(out_row + col) =
            pack_pair<T>(o[4 * j + 2 * r] * inverse, o[4 * j + 2 * r + 1] * inverse);
      }
    }
    if (lane % kQuadLanes == 0) {
      static_cast<float*>(p.lse)[tile.batch * p.lse_batch_stride + head * p.lse_head_stride + tile.q_row0 +
                                 rows.row[r]] = sum > 0.f ? rows.max[r] * lse_scale + logf(sum) : INFINITY;
    }
  }
}

template <int kCount>
__device__ __forceinline__ void zero_all(float (&values)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) values[i] = 0.f;
}

// kGeneral: softcap and / or ALiBi (transform_scores); the lean kernels fold the scale into the exponent alone.
// kBlockN, kStages: a FwdTileConfig's (nvcc's host stubs take no class-type template arguments for kernels).
// kPersistent: gridDim.x CTAs walk args.num_tiles tiles with a stride; the producer loads the next tile's Q into the
// free Q slot (fwd_q_stages) and its K / V through the same rings, so a tile's first loads overlap the previous tile;
// kCarry (CTAs that walk several tiles, overlapped schedule): a tile's last P.V and epilogue run under the next tile's
// first S GEMM and softmax (fwd_carries_tile_tail). Otherwise one tile per CTA from the grid coordinates.
// kPolyEvery: softmax_step's share of exponentials on the FMA pipe (0: none).
// kSplit: the call's keys are split (args.num_splits > 1): each tile sees its split's key blocks and writes fp32
// partials for the combine kernel. Its own instantiation: as run-time branches, the split's divisions in every tile's
// plan and its second epilogue cost unsplit calls 4-5 % at hd 128 up to 2k keys (H200, thirty-eighth session).
template <typename T, int kHeadDim, MaskKind kMask, FwdSchedule kSchedule, bool kGeneral, int kBlockM, int kBlockN,
          int kStages, bool kPersistent, int kPolyEvery, bool kCarry, bool kSplit>
__global__ void __launch_bounds__(fwd_threads(kBlockM), 1) fwd_kernel(const __grid_constant__ FwdKernelArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kConsumers = kBlockM / kRowsPerConsumer;
  constexpr bool kLazy = fwd_lazy_rescale(kHeadDim, kGeneral);
  // Tiles are stored and loaded in whole 64-column segments (kStorageDim; TMA zero-fills the columns past the head
  // dim), the S GEMM runs over kHeadDim's k16 steps, O over kPvCols columns (fwd_tile_config.h fwd_pv_columns), and
  // the policies measured per whole-segment bucket take kStorageDim.
  constexpr int kStorageDim = fwd_storage_dim(kHeadDim);
  constexpr int kPvCols = fwd_pv_columns(kHeadDim);
  static_assert(kBlockM % kRowsPerConsumer == 0, "one 64-row slice per consumer warpgroup");
  static_assert(kConsumers == 2 || kSchedule != FwdSchedule::kPingpong, "ping-pong pairs two warpgroups");
  static_assert(!kCarry || (kPersistent && kSchedule != FwdSchedule::kSerial), "carrying needs tiles to walk");
  static_assert(!kSplit || !kCarry, "split calls run a CTA per tile");
  constexpr int kQStages = fwd_q_stages<kStorageDim, kBlockM, kBlockN, kStages, kCarry>();
  using Layout = FwdSmemLayout<kStorageDim, kBlockM, kBlockN, kStages, kQStages>;
  constexpr int kSegments = Layout::kSegments;
  using Slot = RingSlot<kStages>;
  using QSlot = RingSlot<kQStages>;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_dynamic_smem(smem_raw);
  uint8_t* q_tiles = smem + Layout::kQ;
  uint8_t* k_tiles = smem + Layout::kK;
  uint8_t* v_tiles = smem + Layout::kV;
  uint64_t* barriers = reinterpret_cast<uint64_t*>(smem + Layout::kBarriers);
  uint64_t* q_full = barriers;
  uint64_t* q_empty = q_full + kQStages;
  uint64_t* k_full = q_empty + kQStages;
  uint64_t* k_empty = k_full + kStages;
  uint64_t* v_full = k_empty + kStages;
  uint64_t* v_empty = v_full + kStages;

  const FwdParams& p = args.params;
  const bool varlen = p.shape.cu_seqlens_q != nullptr;
  const int64_t tile_count = kPersistent ? args.num_tiles : 1;
  const int64_t tile_stride = kPersistent ? gridDim.x : 1;
  const int64_t tile_first = kPersistent ? blockIdx.x : 0;
  if (!kPersistent && !plan_tile<kStorageDim, kMask, kPersistent, kBlockM, kBlockN, kSplit>(args, 0).has_rows) return;

  if (threadIdx.x == 0) {
    if constexpr (kPrefetchesTensorMaps) {
      ptx::prefetch_tensor_map(&args.q_map);
      ptx::prefetch_tensor_map(&args.k_map);
      ptx::prefetch_tensor_map(&args.v_map);
    }
    init_pipeline_barriers(q_full, q_empty, k_full, v_full, k_empty, v_empty, kStages, kConsumers, kConsumers,
                           kConsumers);
    for (int q = 1; q < kQStages; ++q) {
      ptx::mbarrier_init(&q_full[q], 1);
      ptx::mbarrier_init(&q_empty[q], kConsumers);
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();

  const int warpgroup = ptx::warpgroup_index();
  if (warpgroup == 0) {
    // Producer: one thread (a paged call's: one warp, lane 0 issuing every copy and barrier arrival, every lane
    // loading one page number of a key block). Q of the q-th loaded tile into Q slot q % kQStages once the consumers
    // released that slot's previous tile; K[j] and V[j] of ring iteration i (counted across tiles) into slot
    // i % kStages once released.
    ptx::release_registers<kProducerRegisters>();
    const bool paged = p.block_table != nullptr;
    if (threadIdx.x >= (paged ? kWarpSize : 1)) return;
    const int lane = static_cast<int>(threadIdx.x);
    const bool leader = lane == 0;
    int ring = 0;
    int loaded_q = 0;
    // A key block's V by ring iteration and coordinates; with fwd_keys_before_values issued after the next block's K.
    constexpr bool kKeysBeforeValues = fwd_keys_before_values(kStorageDim);
    struct KvBlock {
      int ring;  // -1: none
      int kv_head;
      int row;
      int batch;
      int page;  // paged calls: this lane's page of the block (lane_page), shared by its K and V
    };
    auto load_v = [&](const KvBlock& block) {
      const Slot slot(block.ring);
      uint8_t* v_slot = v_tiles + slot.stage * Layout::kKvBytes;
      ptx::mbarrier_wait_parity(&v_empty[slot.stage], slot.parity ^ 1);
      if (leader) ptx::mbarrier_arrive_expect_tx(&v_full[slot.stage], Layout::kKvBytes);
      if (paged) {
        load_paged_block<kSegments, kBlockN>(v_slot, &args.v_map, &v_full[slot.stage], block.kv_head, block.row,
                                             block.page, p.page_size, lane);
        return;
      }
      for (int seg = 0; seg < kSegments; ++seg) {
        ptx::tma_load_4d(v_slot + seg * kBlockN * kSegmentBytes, &args.v_map, &v_full[slot.stage],
                         seg * kSegmentElems, block.kv_head, block.row, block.batch);
      }
    };
    KvBlock pending_v{-1, 0, 0, 0, 0};
    for (int64_t index = tile_first; index < tile_count; index += tile_stride) {
      const FwdTile tile = plan_tile<kStorageDim, kMask, kPersistent, kBlockM, kBlockN, kSplit>(args, index);
      if (tile.n_max <= tile.n_min) continue;  // no rows, or no key any row sees: the consumers write O = 0
      const int kv_head = tile.head / args.heads_per_kv;
      const int map_batch = varlen ? 0 : tile.batch;  // varlen maps are (head dim, head, total rows, 1)
      const QSlot q_slot(loaded_q);
      uint8_t* q_tile = q_tiles + q_slot.stage * Layout::kQBytes;
      ptx::mbarrier_wait_parity(&q_empty[q_slot.stage], q_slot.parity ^ 1);
      if (leader) {
        ptx::mbarrier_arrive_expect_tx(&q_full[q_slot.stage], Layout::kQBytes);
        for (int seg = 0; seg < kSegments; ++seg) {
          ptx::tma_load_4d(q_tile + seg * kBlockM * kSegmentBytes, &args.q_map, &q_full[q_slot.stage],
                           seg * kSegmentElems, tile.head, static_cast<int>(tile.sequence.q_row0 + tile.row_first),
                           map_batch);
        }
      }
      ++loaded_q;
      const int k_row0 = static_cast<int>(tile.sequence.k_row0);
      auto block_page = [&](int n) {
        return lane_page<kBlockN>(k_row0 + n * kBlockN, p.block_table + map_batch * p.block_table_stride,
                                  static_cast<int>(p.shape.seqlen_k / p.page_size), p.page_size, p.num_pages, lane);
      };
      int page_ahead = paged ? block_page(tile.n_max - 1) : 0;
      for (int n = tile.n_max - 1; n >= tile.n_min; --n, ++ring) {
        const Slot slot(ring);
        uint8_t* k_slot = k_tiles + slot.stage * Layout::kKvBytes;
        // A paged block's page numbers were loaded a block ahead; the next block's load here, before the wait for this
        // block's slot, hides its latency under the wait and this block's copies.
        const int page = page_ahead;
        if (paged && n > tile.n_min) page_ahead = block_page(n - 1);
        ptx::mbarrier_wait_parity(&k_empty[slot.stage], slot.parity ^ 1);
        if (leader) ptx::mbarrier_arrive_expect_tx(&k_full[slot.stage], Layout::kKvBytes);
        if (paged) {
          load_paged_block<kSegments, kBlockN>(k_slot, &args.k_map, &k_full[slot.stage], kv_head,
                                               k_row0 + n * kBlockN, page, p.page_size, lane);
        } else {
          for (int seg = 0; seg < kSegments; ++seg) {
            ptx::tma_load_4d(k_slot + seg * kBlockN * kSegmentBytes, &args.k_map, &k_full[slot.stage],
                             seg * kSegmentElems, kv_head, k_row0 + n * kBlockN, map_batch);
          }
        }
        const KvBlock block{ring, kv_head, k_row0 + n * kBlockN, map_batch, page};
        if constexpr (kKeysBeforeValues) {
          if (pending_v.ring >= 0) load_v(pending_v);
          pending_v = block;
        } else {
          load_v(block);
        }
      }
    }
    if (kKeysBeforeValues && pending_v.ring >= 0) load_v(pending_v);
    return;
  }

  ptx::claim_registers<consumer_registers(kConsumers)>();
  const int consumer = warpgroup - 1;
  const int thread = threadIdx.x % ptx::kWarpgroupThreads;
  const int warp = thread / kWarpSize;
  const int lane = thread % kWarpSize;
  const int quad_col = 2 * (lane % kQuadLanes);
  const int tile_row = consumer * kRowsPerConsumer + warp * kRowsPerWarp + lane / kQuadLanes;
  auto release = [&](uint64_t* barrier) {
    if (thread == 0) ptx::mbarrier_arrive(barrier);
  };
  // Q slot 0's descriptor, made once: per tile the slot's is an offset of it (one made per tile from the slot's
  // address was kept in vector registers and moved to uniform ones before every wgmma, +73 instructions in the hd
  // 128 key loop).
  const uint64_t q_desc_first = ptx::smem_descriptor(q_tiles + consumer * kRowsPerConsumer * kSegmentBytes,
                                                     ptx::kDescriptorUnitBytes, ptx::kSwizzleAtomBytes);
  auto q_desc = [&](const QSlot& slot) {
    return slot.stage == 0 ? q_desc_first : ptx::advance_descriptor(q_desc_first, slot.stage * Layout::kQBytes);
  };
  auto k_desc = [&](const Slot& slot) {
    return ptx::smem_descriptor(k_tiles + slot.stage * Layout::kKvBytes, ptx::kDescriptorUnitBytes,
                                ptx::kSwizzleAtomBytes);
  };
  auto v_desc = [&](const Slot& slot) {
    return ptx::smem_descriptor(v_tiles + slot.stage * Layout::kKvBytes, kBlockN * kSegmentBytes,
                                ptx::kSwizzleAtomBytes);
  };
  int ring = 0;
  int loaded_q = 0;
  float o[kPvCols / 2];
  uint32_t a[kBlockN / 16][4];
  // kCarry: the previous tile's P of its last key block (in `a`, its V in ring slot ring - 1) is not yet multiplied
  // into O, nor O written.
  bool carrying = false;
  TileOutput carried_tile{};
  ConsumerRows carried_rows{};
  auto finish_carried = [&]() {
    const Slot last(ring - 1);
    ptx::mbarrier_wait_parity(&v_full[last.stage], last.parity);
    issue_pv<T, kPvCols, kBlockN>(o, a, v_desc(last));
    ptx::warpgroup_wait<0>();
    pin_all(o);
    release(&v_empty[last.stage]);
    write_output<T, kPvCols, kSplit>(args, carried_tile, carried_rows, o, lane, tile_row);
    carrying = false;
  };

  constexpr bool kCarriedPingpong = kCarry && kSchedule == FwdSchedule::kPingpong;
  if (kCarriedPingpong && consumer == 1) pass_turn(consumer);  // warpgroup 0 takes the CTA's first turn
  for (int64_t index = tile_first; index < tile_count; index += tile_stride) {
    const FwdTile tile = plan_tile<kStorageDim, kMask, kPersistent, kBlockM, kBlockN, kSplit>(args, index);
    if (!tile.has_rows) continue;
    const int64_t seqlen_q = tile.sequence.seqlen_q;
    const int64_t seqlen_k = tile.sequence.seqlen_k;
    const int n_min = tile.n_min, n_max = tile.n_max;
    const TileOutput output{tile.batch, tile.head, tile.split, tile.sequence.q_row0, seqlen_q};

    ConsumerRows rows;
    for (int r = 0; r < 2; ++r) {
      rows.row[r] = tile.row_first + ((tile_row + kSecondRow * r) >> args.pack_shift);
      rows.keys[r] = visible_keys(p.mask, rows.row[r], tile.offset, seqlen_k);
      if (rows.keys[r].end > seqlen_k) rows.keys[r].end = seqlen_k;
      rows.max[r] = -INFINITY;
      rows.sum[r] = 0.f;
    }

    // No key any row sees: O = 0, LSE = +inf. (The carrying kernel writes such a tile here, the others after the
    // key loop as every tile: each form is the one that kept ptxas's key loop as short as without carrying, 869
    // instructions at hd 128; the other took 931-986, or spilled.)
    if (kCarry && n_max <= n_min) {
      if (carrying) finish_carried();
      zero_all(o);
      write_output<T, kPvCols, kSplit>(args, output, rows, o, lane, tile_row);
      continue;
    }
    if (n_max <= n_min) {
      zero_all(o);
    } else {
      auto masked = [&](int n) { return n < tile.full_lo || n >= tile.full_hi; };
      const bool softcap = p.softcap > 0.0;
      ScoreTransform transform{softcap ? static_cast<float>(p.softmax_scale / p.softcap) : 0.f, 0.f, tile.offset};
      if (kGeneral && p.mask.alibi_slopes != nullptr) {  // one head per tile: packing declines ALiBi's per-head slopes
        transform.alibi_slope = p.mask.alibi_slopes[tile.batch * p.mask.alibi_batch_stride + tile.head] /
                                static_cast<float>(softcap ? p.softcap : p.softmax_scale);
      }
      // S of key block n -> what softmax_step exponentiates: the general transform, then the mask where needed.
      auto prepare_scores = [&](float (&scores)[kBlockN / 2], int n) {
        const int64_t col0 = static_cast<int64_t>(n) * kBlockN + quad_col;
        if constexpr (kGeneral) transform_scores<kBlockN>(scores, rows, col0, transform);
        if (masked(n)) mask_scores<kBlockN, kFwdCausalMaskUpperOnly && kMask == MaskKind::kCausal>(scores, rows, col0);
      };
      const QSlot q_slot(loaded_q);
      const uint64_t q_tile_desc = q_desc(q_slot);
      // After the tile's last S GEMM (key block n_min) has completed, its Q slot may take a later tile's Q.
      auto scores_done = [&](int n) {
        if (n == n_min) release(&q_empty[q_slot.stage]);
      };
      float s[kBlockN / 2];
      float factor[2];
      // Rows of the highest key block's V that hold keys (zero_value_rows_from); a full block without seqused_k,
      // whose rows past seqlen_k are TMA's zero fill or (varlen) the next sequence's keys.
      const int v_rows = p.shape.seqused_k == nullptr
                             ? kBlockN
                             : static_cast<int>(seqlen_k - static_cast<int64_t>(n_max - 1) * kBlockN);
      ptx::mbarrier_wait_parity(&q_full[q_slot.stage], q_slot.parity);

      if constexpr (kSchedule == FwdSchedule::kSerial) {
        zero_all(o);
        for (int n = n_max - 1; n >= n_min; --n, ++ring) {
          const Slot slot(ring);
          ptx::mbarrier_wait_parity(&k_full[slot.stage], slot.parity);
          issue_scores<T, kHeadDim, kBlockM, kBlockN>(s, q_tile_desc, k_desc(slot));
          ptx::warpgroup_wait<0>();
          pin_all(s);
          release(&k_empty[slot.stage]);
          scores_done(n);
          prepare_scores(s, n);
          softmax_step<kBlockN, kPolyEvery, kLazy>(s, rows, args.scale_log2, factor);
          rescale_o<kPvCols, kLazy>(o, factor);
          pack_probs<T, kBlockN>(s, a);
          ptx::mbarrier_wait_parity(&v_full[slot.stage], slot.parity);
          if (n == n_max - 1 && v_rows < kBlockN) {
            zero_value_rows_from<kStorageDim, kBlockN>(v_tiles + slot.stage * Layout::kKvBytes, v_rows,
                                                                consumer, thread);
          }
          issue_pv<T, kPvCols, kBlockN>(o, a, v_desc(slot));
          ptx::warpgroup_wait<0>();
          pin_all(o);
          release(&v_empty[slot.stage]);
        }
      } else {
        // Overlapped: block j's P.V is issued right after block j+1's S GEMM, and block j+1's softmax runs while it
        // is on the tensor cores; O is rescaled once that P.V has landed. The first S is peeled, and with it the
        // carried tile's last P.V (kCarry); without kCarry the last P.V is peeled too. Running a carried tile's first
        // block in the key loop instead, its epilogue in a branch there (~600 fewer instructions a short tile), lost
        // 3-7 % at hd 128 512-2k keys on the H200 (fifty-fourth session's A/B, docs/perf_log.md): the peel stays.
        constexpr bool kPingpong = kSchedule == FwdSchedule::kPingpong;
        // Warpgroup 0 takes the first turn: per tile, or with kCarry once per CTA (below), since carried tiles have
        // no turn of their own for the last P.V and so one turn per key block in either warpgroup.
        if (kPingpong && !kCarry && consumer == 1) pass_turn(consumer);
        const Slot first(ring);
        const Slot carried_v(ring - 1);
        const bool finishes_carried = kCarry && carrying;
        ptx::mbarrier_wait_parity(&k_full[first.stage], first.parity);
        if (kPingpong) take_turn(consumer);
        issue_scores<T, kHeadDim, kBlockM, kBlockN>(s, q_tile_desc, k_desc(first));
        auto first_softmax = [&]() {
          pin_all(s);
          release(&k_empty[first.stage]);
          scores_done(n_max - 1);
          prepare_scores(s, n_max - 1);
          // O is 0 for this tile: no rescale.
          softmax_step<kBlockN, kPolyEvery, kLazy>(s, rows, args.scale_log2, factor);
        };
        // Each branch ends with no GEMM in flight: waits that differ between paths which then merge made ptxas
        // serialise every wgmma of the kernel (C7515: warpgroup.wait injected before each).
        if (finishes_carried) {
          ptx::mbarrier_wait_parity(&v_full[carried_v.stage], carried_v.parity);
          issue_pv<T, kPvCols, kBlockN>(o, a, v_desc(carried_v));
          if (kPingpong) pass_turn(consumer);
          ptx::warpgroup_wait<1>();
          first_softmax();
          ptx::warpgroup_wait<0>();
          pin_all(o);
          release(&v_empty[carried_v.stage]);
          write_output<T, kPvCols, kSplit>(args, carried_tile, carried_rows, o, lane, tile_row);
          carrying = false;
        } else {
          if (kPingpong) pass_turn(consumer);
          ptx::warpgroup_wait<0>();
          first_softmax();
        }
        zero_all(o);
        pack_probs<T, kBlockN>(s, a);
        if (v_rows < kBlockN) {
          ptx::mbarrier_wait_parity(&v_full[first.stage], first.parity);
          zero_value_rows_from<kStorageDim, kBlockN>(v_tiles + first.stage * Layout::kKvBytes, v_rows,
                                                              consumer, thread);
        }
        ++ring;
        for (int n = n_max - 2; n >= n_min; --n, ++ring) {
          const Slot slot(ring), previous(ring - 1);
          ptx::mbarrier_wait_parity(&k_full[slot.stage], slot.parity);
          if (kPingpong) take_turn(consumer);
          issue_scores<T, kHeadDim, kBlockM, kBlockN>(s, q_tile_desc, k_desc(slot));
          ptx::mbarrier_wait_parity(&v_full[previous.stage], previous.parity);
          issue_pv<T, kPvCols, kBlockN>(o, a, v_desc(previous));
          if (kPingpong) pass_turn(consumer);
          ptx::warpgroup_wait<1>();
          pin_all(s);
          release(&k_empty[slot.stage]);
          scores_done(n);
          prepare_scores(s, n);
          softmax_step<kBlockN, kPolyEvery, kLazy>(s, rows, args.scale_log2, factor);
          ptx::warpgroup_wait<0>();
          pin_all(o);
          release(&v_empty[previous.stage]);
          rescale_o<kPvCols, kLazy>(o, factor);
          pack_probs<T, kBlockN>(s, a);
        }
        if constexpr (kCarry) {
          carrying = true;
          carried_tile = output;
          carried_rows = rows;
        } else {
          const Slot last(ring - 1);
          ptx::mbarrier_wait_parity(&v_full[last.stage], last.parity);
          if (kPingpong) take_turn(consumer);
          issue_pv<T, kPvCols, kBlockN>(o, a, v_desc(last));
          if (kPingpong) pass_turn(consumer);
          ptx::warpgroup_wait<0>();
          pin_all(o);
          release(&v_empty[last.stage]);
          if (kPingpong && consumer == 0) take_turn(consumer);  // consumes warpgroup 1's last hand-over
        }
      }
      ++loaded_q;
    }
    if constexpr (!kCarry) write_output<T, kPvCols, kSplit>(args, output, rows, o, lane, tile_row);
  }
  if (kCarry && carrying) finish_carried();
  if (kCarriedPingpong && consumer == 0) take_turn(consumer);  // consumes warpgroup 1's last hand-over
#else
  (void)args;
  __trap();
#endif
}

}  // namespace flash::sm90
