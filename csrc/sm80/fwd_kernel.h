// Forward attention kernel of the portable sm80+ path: one CTA of 1, 4 or 8 warps (the key-warps decode tile: four
// one-warp tiles on their own keys) per (query tile, head, batch entry [, key split]), as the step functions below. Q
// is staged in shared memory; K and V tiles stream through a cp.async ring (more stages issue each tile further
// ahead); ldmatrix feeds mma.sync m16n8k16. Key tiles run last to first, so those that need the window/causal mask
// come first. Tile shapes: fwd_tile_config.h.
#pragma once

#include <cmath>
#include <cstdint>

#include "flash_attn/common/exp2_polynomial.h"
#include "flash_attn/common/fast_tanh.h"
#include "flash_attn/common/mask.h"
#include "flash_attn/common/math.h"
#include "flash_attn/common/philox.h"
#include "flash_attn/params.h"
#include "flash_attn/ptx/cluster_sm90.h"
#include "flash_attn/ptx/cp_async_sm80.h"
#include "flash_attn/common/seqlen.h"
#include "flash_attn/ptx/griddep_sm90.h"
#include "flash_attn/ptx/ldmatrix_sm80.h"
#include "flash_attn/ptx/mma_sm80.h"
#include "flash_attn/ptx/tma_load_sm90.h"
#include "sm80/fwd_tile_config.h"
#include "sm80/kernel_common.h"
#include "sm80/rotate_rows.h"
#include "flash_attn/tensor_map_sm90.h"

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
  // Key col is visible to row r iff r + lo_shift <= col <= r + hi_shift (with col < seqlen_k): the window's bounds
  // folded into two shifts, an unbounded side's past every key (kFwdLocalMaskByShifts).
  int lo_shift;
  int hi_shift;
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
  // Unbounded: row - (seqlen_q + seqlen_k) < 0 <= col and row + seqlen_q + seqlen_k >= seqlen_k > col for every row.
  w.lo_shift = w.has_left ? w.offset - w.left : -clamp(limit);
  w.hi_shift = w.has_right ? w.offset + w.right : clamp(limit);
  return w;
}

// One CTA's work and this thread's place in it: head (and kv head), batch entry and split; where the batch
// entry's rows start and how long its sequences are; the first query row m0; the mask window; the key tiles
// [n_first, n_last] the CTA visits; the thread's warp and lane (g = lane / 4, t = lane % 4 in the fragments).
struct FwdCta {
  int h;
  int b;
  int split;
  int64_t q_row0;
  int64_t k_row0;
  int seqlen_q;
  int seqlen_k;
  int m0;
  CtaWindow win;
  int hk;
  int head_dim;
  int tid;
  int warp;
  int lane;
  int g;
  int t;
  int n_first;
  int n_last;
};

// Where the CTA's operands live: Q and the K and V rings in shared memory (Q's rows later stage O), and its Q
// rows and its kv head's K and V in global memory.
// How a kernel reads K and V: dense, or through a paged cache's block table, whole key blocks per page (kBlocks) or
// rows of pages smaller than a block (kRows). Separate instantiations: with both page paths in one decode kernel
// ptxas took 255 registers (172 without pages) and ncu saw it stall on instruction fetch (no_instruction 7.8 per
// issue against 0.6): page 256 at 1 x 8k ran 28.8 us against 12.8 dense (H200, twentieth session).
enum class KvPaging { kNone, kBlocks, kRows };

// The pages of a paged cache's sequence (FwdParams::block_table): key row r is row r % page_size of page table[r /
// page_size], clamped to [0, num_pages).
struct KvPages {
  const int32_t* table;
  int page_size;
  int page_shift;  // log2(page_size) where it is a power of two (pages smaller than a key block)
  int num_pages;
};

// Pages smaller than a key block (kPagedIndexByLanes): looked up once per tile, a lane per page, and handed to the
// chunks' threads by shuffles (load_small_pages_by_lanes) instead of a table load and clamp per chunk. SASS (hd 128
// decode, sm_90a, hottest loop): 1,742 instructions per tile (556 IMAD, 32 LDG, 25 BSSY) -> 1,344 (2 LDG, 36 SHFL),
// the dense kernel's 664. Page 16 against the per-chunk lookups, H200, bf16, GQA 32/8, hd 128, us from a CUDA graph,
// best of 3 interleaved rounds (twenty-first session): 1 x 8k 37.9 -> 23.6, 16 x 8k 238.5 -> 211.8, 64 x 4k 426 -> 402
// (contiguous 20.4 / 138.7 / 255).
constexpr bool kPagedIndexByLanes = true;
// With the lanes' lookups: each thread's source address found once per page and stepped by whole rows within it
// (load_small_pages_by_lanes), instead of a shuffle and a 64-bit multiply-add per chunk. Page 16 still ran 1.5-1.6x
// the contiguous time at batch >= 16 (twenty-first session; 1,344 instructions per tile at hd 128 against the dense
// kernel's 664, one warp per CTA, four per SM: issue-bound). SASS (hd 128 decode, sm_90a, hottest loop): 1,344 ->
// 1,227 static instructions, the lookups' shuffles and multiply-adds now behind uniform branches taken twice per tile
// at page 16 (IMAD 501 -> 322); ptxas spill 0 -> 28 / 44 bytes (255 registers both). Page 16, us from a CUDA graph,
// best of 2 interleaved rounds (twenty-second session A/B): 1 x 8k 23.7 -> 22.0, 16 x 8k 210.4 -> 143.3, 64 x 4k
// 400.7 -> 264.1 (contiguous 20.5 / 136.7 / 250.2); page 256 and contiguous unchanged.
constexpr bool kPagedRowsStepped = true;

// Copies a thread's small-page loads (load_small_pages_by_lanes, both forms) unroll at once above
// kPagedRowsFullUnrollMaxHeadDim (all up to it). Fully unrolled, ptxas spilled the decode kernels with row pages
// (sm_90a, bf16, split / key-warps tile: hd 256 1,140 / 0 bytes of spill stores, hd 224 588 / 512, and 20-145 local
// loads a key block in their loops at hd 160-256, the survey in docs/perf_log.md, thirty-second session); 4 at a time,
// none at hd 160-256 (hd 256 loop 2,613 -> 896 instructions). hd 256 decode over pages of 16, us from a CUDA graph
// (benchmarks/bench_kvcache.py --headdim 256, H200, best of 2 rounds, thirty-third session): 1 x 8k 63.9 -> 31.4, 16 x
// 8k 440.6 -> 271.3 (contiguous 30.1 / 254.9, pages of 256 32.3 / 257.9).
constexpr int kPagedRowsFullUnrollMaxHeadDim = 128;
constexpr int kPagedRowsUnrollWide = 4;
// Whether local (sliding-window) kernels test visibility against the two shifts of CtaWindow (two compares per score,
// two ints live through the key loop) instead of the window's flags, bounds and offset. The lean hd 128 local kernel
// spills 144 / 200 bytes (ptxas, sm_90a) where the causal one spills none, and a window cost the portable forward
// 27-32 % against the same call without it (twenty-first / twenty-second sessions' sweeps; bar 15 %). With the shifts
// the hottest loop at hd 128 is 1,202 instructions (BRA 3) against 2,069 (BRA 522). Measured (H200, bf16, window
// left = seqlen / 4, two interleaved rounds, best TFLOP/s, flags -> shifts; twenty-third session): hd 64 2k / 8k
// 218 / 331 -> 294 / 355, causal 132 / 273 -> 227 / 329; hd 128 223 / 289 -> 264 / 311, causal 164 / 258 -> 214 /
// 293; hd 256 278 / 310 -> 286 / 328, causal 230 / 300 -> 244 / 312; hd 96 causal 151 / 261 -> 206 / 290.
constexpr bool kFwdLocalMaskByShifts = true;

template <typename T>
struct FwdTiles {
  T* s_q;
  T* s_k_ring;
  T* s_v_ring;
  const T* q;
  const T* k;  // paged: the kv head's column of page 0
  const T* v;
  KvPages pages;  // paged kernels only (kPaging)
};

// Per-call constants of the score transform, the softmax and dropout (the lean kernel uses x_scale only).
struct FwdScoreParams {
  float x_scale;  // what the softmax multiplies a (transformed) score by in the exponent
  // The general transform: z = tanh(s tanh_scale) with softcap (x_scale = softcap log2(e) then, so the softcap's
  // multiply rides the exponent's FFMA: one FMUL a score less), else z = s scale_log2 (x_scale 1; softmax_scale may
  // be any value here, so it stays out of the exponent); less alibi_slope |distance|, plus bias_scale times the bias,
  // both in z's units (log2(e) / x_scale folded in).
  float scale_log2;
  float tanh_scale;  // softmax_scale / softcap (0 without softcap)
  bool softcap;
  float bias_scale;
  float alibi_slope;
  bool score_mods;  // the lean kernel's softcap / ALiBi call (fwd_lean_runs_score_mods): transform_scores runs
  bool poly_exp;    // the lean kernel's softcap call without ALiBi: its share of exponentials on the FMA pipe
  bool raw_alibi;   // the lean kernel's ALiBi call without softcap keeps raw scores (fwd_alibi_keeps_raw_scores)
  bool dropout;
  uint64_t seed;
  uint64_t rng_offset;
  uint64_t keep_threshold;
  float inv_keep;
  int64_t batch_head;
};

// cp.async groups still in flight when K(n) or V(n) is awaited: the 2 * (kStages - 1) loads issued after it.
template <int kStages>
constexpr int kYoungerGroups = 2 * (kStages - 1);

// Finds the head, batch entry, split, sequence bounds and first query row of the work item at grid coordinate
// `item` (x: query tile, y: head, z: batch entry x splits; none left: m0 >= seqlen_q). query_tiles: the grid's x
// extent.
template <MaskKind kMask, int kBlockM>
__device__ __forceinline__ FwdCta locate_cta(const FwdParams& p, uint3 item, unsigned query_tiles) {
  const AttentionShape& shape = p.shape;
  FwdCta cta;
  cta.h = item.y;
  cta.b = item.z / p.num_splits;
  cta.split = item.z % p.num_splits;
  cta.q_row0 = 0;
  cta.k_row0 = 0;
  cta.seqlen_q = static_cast<int>(shape.seqlen_q);
  cta.seqlen_k = static_cast<int>(shape.seqlen_k);
  if (shape.cu_seqlens_q != nullptr) {
    const SequenceRows q_rows = varlen_rows(shape.cu_seqlens_q, cta.b, shape.total_q, shape.seqlen_q);
    const SequenceRows k_rows = varlen_rows(shape.cu_seqlens_k, cta.b, shape.total_k, shape.seqlen_k);
    cta.q_row0 = q_rows.row0;
    cta.seqlen_q = static_cast<int>(q_rows.length);
    cta.k_row0 = k_rows.row0;
    cta.seqlen_k = static_cast<int>(k_rows.length);
  }
  cta.seqlen_k = static_cast<int>(used_keys(shape, cta.b, cta.seqlen_k));
  // Causal calls take their query tiles in reverse launch order: the block scheduler dispatches blockIdx.x
  // upwards, so ascending tiles left the CTAs with the most key tiles (the last rows) for the end of each head's
  // run and of the grid, and the final wave waited on them (8k tokens: 7.75 waves of CTAs with 1 to 64 key
  // tiles at 128 rows). Longest first leaves the one-tile CTAs for the tail.
  const int m_block = kMask == MaskKind::kCausal ? static_cast<int>(query_tiles - 1 - item.x)
                                                 : static_cast<int>(item.x);
  cta.m0 = m_block * kBlockM;
  return cta;
}

// Completes the context of a CTA that has rows: its mask window, kv head, head dim, this thread's coordinates,
// and the key tiles [n_first, n_last] it (and its split) visits. kAppends: a decode kernel that takes appends, whose
// calls with an appended split (FwdParams::appended_split) give the tiles that hold the new rows to the last split
// alone, which writes them (fwd_tile), and the tiles before them to the others.
// kKeyGroups > 1 (the key-warps decode tile, one warp per group): each warp is a split of its own, the CTA's split s
// being splits [s * kKeyGroups, (s + 1) * kKeyGroups) of p.num_splits * kKeyGroups; cta.split stays the CTA's.
template <MaskKind kMask, int kBlockM, int kBlockN, bool kAppends = false, int kKeyGroups = 1>
__device__ __forceinline__ void plan_key_tiles(const FwdParams& p, FwdCta& cta) {
  const AttentionShape& shape = p.shape;
  cta.win = cta_window<kMask>(p.mask, cta.seqlen_q, cta.seqlen_k);
  cta.hk = cta.h / static_cast<int>(shape.nheads_q / shape.nheads_k);
  cta.head_dim = static_cast<int>(shape.head_dim);

  cta.tid = kKeyGroups > 1 ? static_cast<int>(threadIdx.x) % kWarpSize : static_cast<int>(threadIdx.x);
  cta.warp = cta.tid / kWarpSize;
  cta.lane = cta.tid % kWarpSize;
  cta.g = cta.lane / 4;
  cta.t = cta.lane % 4;

  // Key tiles this CTA (and split) visits.
  const CtaWindow& win = cta.win;
  const int m0 = cta.m0;
  const int m_last = min(m0 + kBlockM, cta.seqlen_q) - 1;
  const int key_lo = win.has_left ? max(0, m0 + win.offset - win.left) : 0;
  const int key_hi = win.has_right ? min(cta.seqlen_k, m_last + win.offset + win.right + 1) : cta.seqlen_k;
  int n_first = key_lo / kBlockN;
  int n_last = key_hi > key_lo ? (key_hi - 1) / kBlockN : n_first - 1;
  // Splits share this sequence's own tiles; a split starting past n_last (a short seqused_k, or a window that
  // leaves few tiles) visits none and writes the empty partial (out 0, lse -inf) that the combine weights 0.
  const int splits = p.num_splits * kKeyGroups;
  const int split = cta.split * kKeyGroups + (kKeyGroups > 1 ? static_cast<int>(threadIdx.x) / kWarpSize : 0);
  if (kAppends && p.appended_split) {
    const int first_new = (cta.seqlen_k - static_cast<int>(p.shape.appended_keys)) / kBlockN;
    if (split == splits - 1) {
      n_first = max(n_first, first_new);
    } else {  // the tiles before the new rows, evened out over the other splits
      const int old_tiles = max(0, min(n_last, first_new - 1) - n_first + 1);
      const int others = splits - 1;
      const int lo = n_first + split * old_tiles / others;
      n_last = n_first + (split + 1) * old_tiles / others - 1;
      n_first = lo;
    }
  } else if (splits > 1) {
    const int per_split = (n_last - n_first + splits) / splits;
    const int lo = n_first + split * per_split;
    n_last = min(n_last, lo + per_split - 1);
    n_first = lo;
  }
  cta.n_first = n_first;
  cta.n_last = n_last;
}

// Locates the CTA's tiles: Q, then the K ring, then the V ring in shared memory, and its rows in global memory.
// q_buffer: which of the persistent kernel's two Q tiles (after the K and V rings); 0 otherwise. kPaging: K / V rows
// are found through the sequence's pages (load_kv), from its kv head's column of the first page.
template <int kHeadDim, int kBlockM, int kBlockN, int kStages, typename T, KvPaging kPaging = KvPaging::kNone>
__device__ __forceinline__ FwdTiles<T> locate_tiles(unsigned char* smem_raw, const FwdParams& p, const FwdCta& cta,
                                                    int q_buffer = 0) {
  constexpr int kStride = kHeadDim + kSmemRowPad;
  FwdTiles<T> tiles;
  T* const base = reinterpret_cast<T*>(smem_raw);
  tiles.s_k_ring = base + kBlockM * kStride;
  tiles.s_v_ring = tiles.s_k_ring + kStages * kBlockN * kStride;
  tiles.s_q = q_buffer == 0 ? base : tiles.s_v_ring + kStages * kBlockN * kStride;
  tiles.q = static_cast<const T*>(p.q) + cta.b * p.q_strides.batch + (cta.q_row0 + cta.m0) * p.q_strides.row +
            cta.h * p.q_strides.head;
  tiles.k = static_cast<const T*>(p.k) + cta.b * p.k_strides.batch + cta.k_row0 * p.k_strides.row +
            static_cast<int64_t>(cta.hk) * p.k_strides.head;
  tiles.v = static_cast<const T*>(p.v) + cta.b * p.v_strides.batch + cta.k_row0 * p.v_strides.row +
            static_cast<int64_t>(cta.hk) * p.v_strides.head;
  if constexpr (kPaging != KvPaging::kNone) {
    tiles.k = static_cast<const T*>(p.k) + static_cast<int64_t>(cta.hk) * p.k_strides.head;
    tiles.v = static_cast<const T*>(p.v) + static_cast<int64_t>(cta.hk) * p.v_strides.head;
    tiles.pages = KvPages{p.block_table + cta.b * p.block_table_stride, p.page_size, 31 - __clz(p.page_size),
                          p.num_pages};
  }
  return tiles;
}

// Key block n lives in ring slot n % kStages. Block indices in range are >= 0: the unsigned modulo is a mask for
// two stages.
template <int kStages>
__device__ __forceinline__ int ring_slot(int n) {
  return static_cast<int>(static_cast<unsigned>(n) % kStages);
}

// The page of key block n of a paged cache whose pages hold whole key blocks (page_size a multiple of kBlockN,
// dispatch/fwd_plan.h fwd_reads_pages), clamped; kNoPage where n is outside the CTA's blocks or the pages are
// smaller than a block (load_small_pages_async). Read before a wait (await_k, await_v), so the lookup's latency
// hides behind it.
constexpr int kNoPage = -1;
template <int kBlockN>
__device__ __forceinline__ int block_page(const KvPages& pages, int n, const FwdCta& cta) {
  if (n < cta.n_first || pages.page_size < kBlockN) return kNoPage;
  return min(max(pages.table[n * kBlockN / pages.page_size], 0), pages.num_pages - 1);
}

// Issues cp.async for the kRows x kHeadDim tile of key rows [row0, row0 + kRows) of a paged cache whose pages are
// smaller than the tile (page_size a power of two dividing kRows): each chunk's row finds its page by a shift and
// its row in it by a mask, every lookup issued before the first copy (the copies' asm orders memory) and served by
// L1 after the first tile (a sequence's table row is a few KB). The first form, a 64-bit division and modulo per
// chunk, ran at 0.8 TB/s (H200, nineteenth session). Rows at or beyond rows_valid (counted from row0) and columns
// at or beyond head_dim are zero-filled.
template <int kRows, int kHeadDim, int kThreads, typename Layout, typename T>
__device__ __forceinline__ void load_small_pages_async(T* smem, const T* base, int64_t row_stride,
                                                       int64_t page_stride, const KvPages& pages, int row0,
                                                       int rows_valid, int head_dim, int tid) {
  constexpr int kChunksPerRow = kHeadDim / kChunkElems;
  constexpr int kChunks = kRows * kChunksPerRow;
  constexpr int kIters = (kChunks + kThreads - 1) / kThreads;
  const int row_mask = pages.page_size - 1;
  int page_of[kIters];
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int c = tid + i * kThreads;
    const int row = c / kChunksPerRow;
    const bool valid = (kChunks % kThreads == 0 || c < kChunks) && row < rows_valid;
    page_of[i] = valid ? pages.table[(row0 + row) >> pages.page_shift] : 0;
  }
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int c = tid + i * kThreads;
    if (kChunks % kThreads == 0 || c < kChunks) {
      const int row = c / kChunksPerRow;
      const int col = (c % kChunksPerRow) * kChunkElems;
      const bool valid = row < rows_valid && col < head_dim;
      const int page = min(max(page_of[i], 0), pages.num_pages - 1);
      const int64_t in_page = (row0 + row) & row_mask;
      const T* src = valid ? base + page * page_stride + in_page * row_stride + col : base;
      ptx::cp_async_16(smem + Layout::offset(row, col), src, valid);
    }
  }
}

// load_small_pages_async with the tile's pages looked up once (kPagedIndexByLanes): lane j of each warp reads the
// table entry of the tile's page j (kRows / page_size <= 32 pages: page_size divides kRows <= 32), clamped, and each
// chunk's thread takes its row's page by a shuffle. Same chunks, rows and zero-fill as load_small_pages_async.
template <int kRows, int kHeadDim, int kThreads, typename Layout, typename T>
__device__ __forceinline__ void load_small_pages_by_lanes(T* smem, const T* base, int64_t row_stride,
                                                          int64_t page_stride, const KvPages& pages, int row0,
                                                          int rows_valid, int head_dim, int tid) {
  static_assert(kRows <= kWarpSize && kThreads % kWarpSize == 0, "a lane per page of the tile");
  constexpr int kChunksPerRow = kHeadDim / kChunkElems;
  constexpr int kChunks = kRows * kChunksPerRow;
  constexpr int kIters = (kChunks + kThreads - 1) / kThreads;
  const int lane = tid % kWarpSize;
  const int shift = pages.page_shift;
  int lane_page = 0;
  if (lane < (kRows >> shift) && (lane << shift) < rows_valid) {
    lane_page = min(max(pages.table[(row0 >> shift) + lane], 0), pages.num_pages - 1);
  }
  const int row_mask = pages.page_size - 1;
  if constexpr (kPagedRowsStepped && kThreads == kWarpSize && kThreads % kChunksPerRow == 0) {
    // Iteration i covers rows [i * kRowsPerIter, (i + 1) * kRowsPerIter), a thread the same row offset and column in
    // each. A thread's row enters a new page exactly where ((i * kRowsPerIter) & row_mask) < kRowsPerIter (pages and
    // kRowsPerIter are powers of two; row0 is a whole number of pages), the same i for the whole warp: only there is
    // its page shuffled in and its address recomputed; elsewhere the address steps kRowsPerIter rows.
    constexpr int kRowsPerIter = kThreads / kChunksPerRow;
    const int thread_row = tid / kChunksPerRow;
    const int col = (tid % kChunksPerRow) * kChunkElems;
    const T* src = base;
    if constexpr (kHeadDim > kPagedRowsFullUnrollMaxHeadDim) {
#pragma unroll(kPagedRowsUnrollWide)
      for (int i = 0; i < kIters; ++i) {
        const int row = i * kRowsPerIter + thread_row;
        if (((i * kRowsPerIter) & row_mask) < kRowsPerIter) {
          const int page = __shfl_sync(0xffffffffu, lane_page, min(row, kRows - 1) >> shift);
          src = base + page * page_stride + static_cast<int64_t>(row & row_mask) * row_stride + col;
        } else {
          src += kRowsPerIter * row_stride;
        }
        const bool valid = row < rows_valid && col < head_dim;
        ptx::cp_async_16(smem + Layout::offset(row, col), valid ? src : base, valid);
      }
    } else {
      // The same loop fully unrolled, as its own statement: one shared lambda body changed every paged decode
      // kernel's SASS (ptxas), and so did one loop under #pragma unroll(count) with the count kIters here (hd 128
      // causal): the kernels up to hd 128 keep the form they were measured in.
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        const int row = i * kRowsPerIter + thread_row;
        if (((i * kRowsPerIter) & row_mask) < kRowsPerIter) {
          const int page = __shfl_sync(0xffffffffu, lane_page, min(row, kRows - 1) >> shift);
          src = base + page * page_stride + static_cast<int64_t>(row & row_mask) * row_stride + col;
        } else {
          src += kRowsPerIter * row_stride;
        }
        const bool valid = row < rows_valid && col < head_dim;
        ptx::cp_async_16(smem + Layout::offset(row, col), valid ? src : base, valid);
      }
    }
  } else if constexpr (kHeadDim > kPagedRowsFullUnrollMaxHeadDim) {
#pragma unroll(kPagedRowsUnrollWide)
    for (int i = 0; i < kIters; ++i) {
      const int c = tid + i * kThreads;
      const int row = min(c / kChunksPerRow, kRows - 1);
      const int page = __shfl_sync(0xffffffffu, lane_page, row >> shift);
      if (kChunks % kThreads == 0 || c < kChunks) {
        const int col = (c % kChunksPerRow) * kChunkElems;
        const bool valid = row < rows_valid && col < head_dim;
        const int64_t in_page = (row0 + row) & row_mask;
        const T* src = valid ? base + page * page_stride + in_page * row_stride + col : base;
        ptx::cp_async_16(smem + Layout::offset(row, col), src, valid);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int c = tid + i * kThreads;
      const int row = min(c / kChunksPerRow, kRows - 1);
      const int page = __shfl_sync(0xffffffffu, lane_page, row >> shift);
      if (kChunks % kThreads == 0 || c < kChunks) {
        const int col = (c % kChunksPerRow) * kChunkElems;
        const bool valid = row < rows_valid && col < head_dim;
        const int64_t in_page = (row0 + row) & row_mask;
        const T* src = valid ? base + page * page_stride + in_page * row_stride + col : base;
        ptx::cp_async_16(smem + Layout::offset(row, col), src, valid);
      }
    }
  }
}

// Issues the cp.async loads of key block n of K or V (rows at base) into its slot of `ring`. Each load commits
// one cp.async group, empty when the block is outside the range, so the wait counts below hold at the end of the
// range too. kPaging (page_stride elements between pages): kBlocks, a block within one page loads as a dense one
// from it (`page`, from block_page, or looked up here); kRows, pages smaller than a block, row by row
// (load_small_pages_async).
// kFillsPastRange (fwd_fills_past_kv_range): a block before the range zero-fills the one slot from a valid address
// instead of skipping behind a branch, so the caller's key loop stays one basic block.
template <typename KvLayout, int kHeadDim, int kBlockN, int kThreads, int kStages, KvPaging kPaging = KvPaging::kNone,
          bool kFillsPastRange = false, typename T>
__device__ __forceinline__ void load_kv(T* ring, const T* base, int64_t row_stride, int n, const FwdCta& cta,
                                        int64_t page_stride = 0, const KvPages* pages = nullptr, int page = kNoPage) {
  constexpr int kStride = kHeadDim + kSmemRowPad;  // slots are allocated with padded rows (kernel_common.h)
  if constexpr (kFillsPastRange) {
    static_assert(kPaging == KvPaging::kNone && kStages == 1, "zero fill past the range: dense K / V, one slot");
    (void)page_stride;
    (void)pages;
    (void)page;
    const bool in_range = n >= cta.n_first;
    const int n0 = in_range ? n * kBlockN : 0;
    load_tile_async<kBlockN, kHeadDim, kThreads, KvLayout>(ring, base + n0 * row_stride, row_stride,
                                                           in_range ? cta.seqlen_k - n0 : 0, cta.head_dim, cta.tid);
  } else if (n >= cta.n_first) {
    const int n0 = n * kBlockN;
    T* const slot = ring + ring_slot<kStages>(n) * kBlockN * kStride;
    if constexpr (kPaging != KvPaging::kNone) {
      if constexpr (kPaging == KvPaging::kBlocks) {
        if (page == kNoPage) page = block_page<kBlockN>(*pages, n, cta);
        const T* block = base + page * page_stride + static_cast<int64_t>(n0 % pages->page_size) * row_stride;
        load_tile_async<kBlockN, kHeadDim, kThreads, KvLayout>(slot, block, row_stride, cta.seqlen_k - n0,
                                                               cta.head_dim, cta.tid);
      } else {
        if constexpr (kPagedIndexByLanes) {
          load_small_pages_by_lanes<kBlockN, kHeadDim, kThreads, KvLayout>(slot, base, row_stride, page_stride,
                                                                           *pages, n0, cta.seqlen_k - n0,
                                                                           cta.head_dim, cta.tid);
        } else {
          load_small_pages_async<kBlockN, kHeadDim, kThreads, KvLayout>(slot, base, row_stride, page_stride, *pages,
                                                                        n0, cta.seqlen_k - n0, cta.head_dim, cta.tid);
        }
      }
    } else {
      (void)page_stride;
      (void)pages;
      (void)page;
      load_tile_async<kBlockN, kHeadDim, kThreads, KvLayout>(slot, base + n0 * row_stride, row_stride,
                                                             cta.seqlen_k - n0, cta.head_dim, cta.tid);
    }
  }
  ptx::cp_async_commit();
}

// Issues the prologue's loads: Q, K(n_last), then V and K of the tiles the deeper ring stages hold.
// Load order: Q with K(n_last), then V(n + 1 - kStages) after K(n) has landed and K(n - kStages) after V(n)
// has; the prologue issues everything before the first tile's wait. With two or more stages V(n_last) is in
// the prologue, so the first tile no longer pays a whole memory latency for V after K landed (with few tiles
// per CTA, as at 512 tokens or in split decode, that latency was exposed). The order keeps both waits at
// kYoungerGroups on every tile, so the loop body has no first-tile branch (one cost up to 15 extra STL/LDL
// per tile in the 4-warp kernels, which sit at 255 registers).
// kFirstV: one stage, and V(n_last) follows as a group of its own (fwd_prefetches_first_v).
template <typename KvLayout, int kHeadDim, int kBlockM, int kBlockN, int kThreads, int kStages, bool kFirstV,
          KvPaging kPaging = KvPaging::kNone, typename T>
__device__ __forceinline__ void load_prologue(const FwdParams& p, const FwdCta& cta, const FwdTiles<T>& tiles,
                                              bool loads_q = true) {
  // Q's loads branch on whole tiles and keep fixed or grouped columns where K's and V's do (fwd_branches_whole_tiles,
  // fwd_loads_fixed_columns, fwd_loads_grouped_columns).
  using QChecked = std::conditional_t<KvLayout::kWholeTileBranch, WholeTileLoads<PaddedRows<kHeadDim>>,
                                      PaddedRows<kHeadDim>>;
  using QFixed = std::conditional_t<KvLayout::kFixedColumnLoads, FixedColumnLoads<QChecked>, QChecked>;
  using QLayout = std::conditional_t<KvLayout::kGroupedColumnLoads, GroupedColumnLoads<QChecked>, QFixed>;
  if (loads_q) {
    load_tile_async<kBlockM, kHeadDim, kThreads, QLayout>(tiles.s_q, tiles.q, p.q_strides.row, cta.seqlen_q - cta.m0,
                                                          cta.head_dim, cta.tid);
  }
  // Paged: the pages of every block the prologue issues (K and V of a block share one) are read before its first
  // copy, so their lookups wait once, not once per load (the copies' asm orders memory).
  int page[kStages];
#pragma unroll
  for (int ahead = 0; ahead < kStages; ++ahead) {
    page[ahead] = kNoPage;
    if constexpr (kPaging != KvPaging::kNone) page[ahead] = block_page<kBlockN>(tiles.pages, cta.n_last - ahead, cta);
  }
  load_kv<KvLayout, kHeadDim, kBlockN, kThreads, kStages, kPaging>(tiles.s_k_ring, tiles.k, p.k_strides.row,
                                                                  cta.n_last, cta, p.k_strides.batch, &tiles.pages,
                                                                  page[0]);
  if constexpr (kFirstV) {
    load_kv<KvLayout, kHeadDim, kBlockN, kThreads, kStages, kPaging>(tiles.s_v_ring, tiles.v, p.v_strides.row,
                                                                    cta.n_last, cta, p.v_strides.batch, &tiles.pages,
                                                                    page[0]);
  }
#pragma unroll
  for (int ahead = 1; ahead < kStages; ++ahead) {
    load_kv<KvLayout, kHeadDim, kBlockN, kThreads, kStages, kPaging>(tiles.s_v_ring, tiles.v, p.v_strides.row,
                                                                    cta.n_last + 1 - ahead, cta, p.v_strides.batch,
                                                                    &tiles.pages, page[ahead - 1]);
    load_kv<KvLayout, kHeadDim, kBlockN, kThreads, kStages, kPaging>(tiles.s_k_ring, tiles.k, p.k_strides.row,
                                                                    cta.n_last - ahead, cta, p.k_strides.batch,
                                                                    &tiles.pages, page[ahead]);
  }
}

// Units in flight per thread when a decode CTA rotates rows (rotate_rows.h says why 2).
constexpr int kDecodeRotateUnroll = 2;

// flash_attn_with_kvcache's append by the decode CTA of a sequence and kv head that holds its last key tile
// (FwdParams::kv_append): new row i goes to cache row keys_before_append + i, through the sequence's pages when
// paged (the page number clamped), k rotated at that position (rotate_rows, every load before any store).
template <int kThreads, KvPaging kPaging, typename T>
__device__ __forceinline__ void write_appended_rows(const FwdParams& p, const FwdCta& cta, const FwdTiles<T>& tiles) {
  const FwdParams::KvAppend& a = p.kv_append;
  const FwdParams::Rotary& r = p.rotary;
  const int64_t old_keys = cta.seqlen_k - p.shape.appended_keys;
  for (int i = 0; i < static_cast<int>(p.shape.appended_keys); ++i) {
    const int64_t row = old_keys + i;
    int64_t k_offset = row * p.k_strides.row;
    int64_t v_offset = row * p.v_strides.row;
    if constexpr (kPaging != KvPaging::kNone) {
      const int page = min(max(tiles.pages.table[row / tiles.pages.page_size], 0), tiles.pages.num_pages - 1);
      const int64_t in_page = row % tiles.pages.page_size;
      k_offset = page * p.k_strides.batch + in_page * p.k_strides.row;
      v_offset = page * p.v_strides.batch + in_page * p.v_strides.row;
    }
    HeadRow<T> k, v;
    k.src = static_cast<const T*>(a.k) + cta.b * a.k_strides.batch + i * a.k_strides.row + cta.hk * a.k_strides.head;
    k.dst = const_cast<T*>(tiles.k) + k_offset;
    k.nheads = 1;
    if (r.cos != nullptr && row < r.seqlen_ro) {
      k.rotary_dim = static_cast<int>(r.rotary_dim);
      k.cos = static_cast<const T*>(r.cos) + row * r.cos_row_stride;
      k.sin = static_cast<const T*>(r.sin) + row * r.sin_row_stride;
    }
    v.src = static_cast<const T*>(a.v) + cta.b * a.v_strides.batch + i * a.v_strides.row + cta.hk * a.v_strides.head;
    v.dst = const_cast<T*>(tiles.v) + v_offset;
    v.nheads = 1;
    rotate_rows<kThreads, T, kDecodeRotateUnroll>(k, v, cta.head_dim, r.interleaved, false);
  }
}

// Q of a decode CTA rotated as it is loaded (FwdParams::rotary): the CTA's rows (query heads of one sequence,
// which share one position, the sequence's keys before the append) go from global memory through registers into
// the Q tile (rotate_rows, every load before any store); the padding rows and columns become 0 as the cp.async
// path's zero fill makes them. Called after the prologue's K / V copies are issued, so its loads overlap theirs;
// the first await_k's barrier orders its stores before the first S = Q K^T.
template <int kHeadDim, int kBlockM, int kThreads, typename T>
__device__ __forceinline__ void load_rotated_q(const FwdParams& p, const FwdCta& cta, const FwdTiles<T>& tiles) {
  constexpr int kStride = kHeadDim + kSmemRowPad;
  constexpr int kChunksPerRow = kHeadDim / kChunkElems;
  const int rows = min(kBlockM, cta.seqlen_q - cta.m0);
  for (int c = cta.tid; c < kBlockM * kChunksPerRow; c += kThreads) {
    const int row = c / kChunksPerRow, col = c % kChunksPerRow * kChunkElems;
    if (row >= rows || col >= cta.head_dim) {
      *reinterpret_cast<uint4*>(tiles.s_q + row * kStride + col) = make_uint4(0, 0, 0, 0);
    }
  }
  const FwdParams::Rotary& r = p.rotary;
  const int64_t position = cta.seqlen_k - p.shape.appended_keys;
  HeadRow<T> q;
  q.src = tiles.q;
  q.dst = tiles.s_q;
  q.src_head = p.q_strides.row;
  q.dst_head = kStride;
  q.nheads = rows;
  q.rotary_dim = static_cast<int>(r.rotary_dim);
  if (position < r.seqlen_ro) {
    q.cos = static_cast<const T*>(r.cos) + position * r.cos_row_stride;
    q.sin = static_cast<const T*>(r.sin) + position * r.sin_row_stride;
  }
  rotate_rows<kThreads, T, kDecodeRotateUnroll>(q, HeadRow<T>{}, cta.head_dim, r.interleaved, false);
}

// Reads the call's score, softmax and dropout constants (ALiBi slope of this head, dropout RNG state).
// Softmax in the log2 domain: p = 2^(x * x_scale - m). The fast path keeps raw scores (x_scale folds the
// softmax scale and log2(e) into one FFMA); the general path turns scores into log2-domain logits first.
// kLeanMods: a lean kernel that runs softcap / ALiBi calls too (score_mods: their scores go through the general
// transform, so x_scale is 1 for them, except kRawAlibi's ALiBi calls without softcap: raw scores, slope / scale).
template <bool kGeneral, bool kLeanMods = false, bool kRawAlibi = false>
__device__ __forceinline__ FwdScoreParams read_score_params(const FwdParams& p, const FwdCta& cta) {
  FwdScoreParams sp;
  const float scale_log2 = static_cast<float>(p.softmax_scale * kLog2e);
  sp.score_mods =
      kLeanMods && (p.softcap > 0.0 || p.mask.alibi_slopes != nullptr || !softmax_scale_folds(p.softmax_scale));
  sp.softcap = p.softcap > 0.0;
  sp.poly_exp = kLeanMods && sp.softcap && p.mask.alibi_slopes == nullptr;
  const float transformed_scale = sp.softcap ? static_cast<float>(p.softcap * kLog2e) : 1.f;
  sp.x_scale = kGeneral || sp.score_mods ? transformed_scale : scale_log2;
  sp.scale_log2 = scale_log2;
  sp.tanh_scale = sp.softcap ? static_cast<float>(p.softmax_scale / p.softcap) : 0.f;
  sp.bias_scale = static_cast<float>(kLog2e) / transformed_scale;
  sp.alibi_slope = 0.f;
  sp.raw_alibi = false;
  sp.dropout = false;
  sp.seed = 0;
  sp.rng_offset = 0;
  sp.keep_threshold = 0;
  sp.inv_keep = 1.f;
  if constexpr (kGeneral || kLeanMods) {
    sp.alibi_slope = p.mask.alibi_slopes != nullptr
                         ? p.mask.alibi_slopes[cta.b * p.mask.alibi_batch_stride + cta.h] * sp.bias_scale
                         : 0.f;
  }
  if constexpr (kLeanMods && kRawAlibi) {
    // Raw scores: z = s - slope / scale |distance|, and the softmax's x_scale = scale log2(e), as a plain call's.
    const float raw_slope = sp.alibi_slope / scale_log2;
    sp.raw_alibi = sp.score_mods && !sp.softcap && softmax_scale_folds(p.softmax_scale) && isfinite(raw_slope);
    if (sp.raw_alibi) {
      sp.alibi_slope = raw_slope;
      sp.x_scale = scale_log2;
    }
  }
  if constexpr (kGeneral) {
    sp.dropout = p.dropout.p > 0.0;
    if (sp.dropout) {
      sp.seed = static_cast<uint64_t>(p.dropout.rng_state[0]);
      sp.rng_offset = static_cast<uint64_t>(p.dropout.rng_state[1]);
      sp.keep_threshold = dropout_keep_threshold(p.dropout.p);
      sp.inv_keep = static_cast<float>(1.0 / (1.0 - p.dropout.p));
    }
  }
  sp.batch_head = static_cast<int64_t>(cta.b) * p.shape.nheads_q + cta.h;
  return sp;
}

// Rows (within the sequence) of this thread's accumulator entries: strip s, half r -> g + 8r.
template <int kStripStride, int kStrips>
__device__ __forceinline__ void find_rows(int (&rows)[kStrips][2], const FwdCta& cta) {
#pragma unroll
  for (int s = 0; s < kStrips; ++s) {
    rows[s][0] = cta.m0 + cta.warp * kMmaM + s * kStripStride + cta.g;
    rows[s][1] = rows[s][0] + 8;
  }
}

// Starts the online softmax of every row with no keys seen: running max -inf, running sum 0.
template <int kStrips>
__device__ __forceinline__ void init_softmax(float (&row_max)[kStrips][2], float (&row_sum)[kStrips][2]) {
#pragma unroll
  for (int s = 0; s < kStrips; ++s) {
    row_max[s][0] = row_max[s][1] = -INFINITY;
    row_sum[s][0] = row_sum[s][1] = 0.f;
  }
}

// The barrier of one tile's threads: the CTA's, or the warp's where a tile is one warp (the decode tiles, whose
// key-warps CTA runs four one-warp tiles that meet only in the epilogue).
template <int kThreads>
__device__ __forceinline__ void tile_sync() {
  if constexpr (kThreads == kWarpSize) {
    __syncwarp();
  } else {
    __syncthreads();
  }
}

// Waits for K(n) (and, on the first tile, Q); then V(n + 1 - kStages) starts loading into the slot of V(n + 1).
// await_k and await_v take the tile index by reference, as the lambda they replace captured it: the loop counter
// then stays in memory until inlining. Passed by value, it changed how the 1-warp decode kernels (three K/V
// stages) compute their load addresses: the hd32 decode main loop grew from 289 to 307 instructions (SASS).
// kFirstV (fwd_prefetches_first_v): the prologue issued V(n_last) after Q and K(n_last); the first tile waits for
// Q and K only and issues nothing.
template <typename KvLayout, int kHeadDim, int kBlockN, int kThreads, int kStages, bool kFirstV,
          KvPaging kPaging = KvPaging::kNone, typename T>
__device__ __forceinline__ void await_k(const FwdParams& p, const FwdCta& cta, const FwdTiles<T>& tiles,
                                        const int& n) {
  if (kFirstV && n == cta.n_last) {
    ptx::cp_async_wait<kYoungerGroups<kStages> + 1>();
    tile_sync<kThreads>();  // Q and K(n_last) landed; V(n_last) may still be loading
    return;
  }
  int v_page = kNoPage;
  if constexpr (kPaging != KvPaging::kNone) v_page = block_page<kBlockN>(tiles.pages, n + 1 - kStages, cta);
  ptx::cp_async_wait<kYoungerGroups<kStages>>();
  tile_sync<kThreads>();  // K(n) (and Q) landed; every warp is done with V(n+1), whose slot takes V(n + 1 - kStages)
  load_kv<KvLayout, kHeadDim, kBlockN, kThreads, kStages, kPaging>(tiles.s_v_ring, tiles.v, p.v_strides.row,
                                                                  n + 1 - kStages, cta, p.v_strides.batch,
                                                                  &tiles.pages, v_page);
}

// Either right after S = Q K^T or after the softmax (fwd_waits_v_before_softmax): V(n) landed; every warp is
// done with K(n), whose slot takes K(n - kStages).
template <typename KvLayout, int kHeadDim, int kBlockN, int kThreads, int kStages, KvPaging kPaging = KvPaging::kNone,
          bool kFillsPastRange = false, typename T>
__device__ __forceinline__ void await_v(const FwdParams& p, const FwdCta& cta, const FwdTiles<T>& tiles,
                                        const int& n) {
  int k_page = kNoPage;
  if constexpr (kPaging != KvPaging::kNone) k_page = block_page<kBlockN>(tiles.pages, n - kStages, cta);
  ptx::cp_async_wait<kYoungerGroups<kStages>>();
  tile_sync<kThreads>();
  load_kv<KvLayout, kHeadDim, kBlockN, kThreads, kStages, kPaging, kFillsPastRange>(
      tiles.s_k_ring, tiles.k, p.k_strides.row, n - kStages, cta, p.k_strides.batch, &tiles.pages, k_page);
}

// S = Q K^T of this warp's strips against the key tile s_k: each K fragment feeds every strip. `a` holds one k16
// step of Q's A fragments (the caller's array; see the kernel).
template <typename KLayout, int kHeadDim, int kStripStride, bool kCausal, int kStrips, int kNTiles, typename T>
__device__ __forceinline__ void compute_scores(ptx::MmaC (&sc)[kStrips][kNTiles], ptx::MmaA (&a)[kStrips],
                                               const T* s_q, const T* s_k, int warp, int lane) {
  constexpr int kStride = kHeadDim + kSmemRowPad;
  constexpr int kKSteps = kHeadDim / kMmaK;
  int k_lane = KLayout::lane_offset(lane % 8 + 8 * (lane / 16), 8 * ((lane / 8) % 2));
  if constexpr (KLayout::kSplitAddress && fwd_hides_key_lane_offset(kHeadDim, kStrips)) hide_from_compiler(k_lane);
  const T zero = from_float<T>(0.f);
  // B fragments of key n8 tiles 2 np and 2 np + 1 at k16 step kk.
  auto load_k_pair = [&](uint32_t(&kb)[4], int np, int kk) {
    if constexpr (KLayout::kSplitAddress) {
      ptx::ldmatrix_x4(kb, s_k + KLayout::ldmatrix_offset(k_lane, np * 16, kk * kMmaK));
    } else {
      ptx::ldmatrix_x4(kb, s_k + (np * 16 + lane % 8 + 8 * (lane / 16)) * kStride + kk * kMmaK + 8 * ((lane / 8) % 2));
    }
  };
  if constexpr (fwd_prefetches_score_fragments(kHeadDim, kStrips, kCausal)) {
    // Fragments of step kk + kAhead load while the MMAs of step kk issue (kAhead + 1 register sets, named by
    // kk % kSets).
    constexpr int kAhead = fwd_score_fragments_ahead(kHeadDim, kStrips);
    constexpr int kSets = kAhead + 1;
    uint32_t kb[kSets][kNTiles / 2][4];
    ptx::MmaA qa[kSets][kStrips];
    const T* q_row = s_q + (warp * kMmaM + lane % 16) * kStride + (lane / 16) * 8;
    auto load_step = [&](int kk, int set) {
#pragma unroll
      for (int s = 0; s < kStrips; ++s) ptx::ldmatrix_x4(qa[set][s].reg, q_row + s * kStripStride * kStride + kk * kMmaK);
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) load_k_pair(kb[set][np], np, kk);
    };
#pragma unroll
    for (int kk = 0; kk < kAhead && kk < kKSteps; ++kk) load_step(kk, kk);
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      if (kk + kAhead < kKSteps) load_step(kk + kAhead, (kk + kAhead) % kSets);
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        const ptx::MmaB b0{{kb[kk % kSets][np][0], kb[kk % kSets][np][1]}};
        const ptx::MmaB b1{{kb[kk % kSets][np][2], kb[kk % kSets][np][3]}};
#pragma unroll
        for (int s = 0; s < kStrips; ++s) {
          ptx::mma_m16n8k16(sc[s][2 * np], qa[kk % kSets][s], b0, zero);
          ptx::mma_m16n8k16(sc[s][2 * np + 1], qa[kk % kSets][s], b1, zero);
        }
      }
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
      for (int s = 0; s < kStrips; ++s) {
        ptx::ldmatrix_x4(a[s].reg,
                         s_q + (warp * kMmaM + s * kStripStride + lane % 16) * kStride + kk * kMmaK + (lane / 16) * 8);
      }
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        uint32_t kb[4];
        load_k_pair(kb, np, kk);
        const ptx::MmaB b0{{kb[0], kb[1]}};
        const ptx::MmaB b1{{kb[2], kb[3]}};
#pragma unroll
        for (int s = 0; s < kStrips; ++s) {
          ptx::mma_m16n8k16(sc[s][2 * np], a[s], b0, zero);
          ptx::mma_m16n8k16(sc[s][2 * np + 1], a[s], b1, zero);
        }
      }
    }
  }
}

// ALiBi: -slope |row + offset - col| added to each score, its distance converted once per row and tile (exact while
// |distance| < 2^24), as in the Hopper kernels.
template <int kStrips, int kNTiles>
__device__ __forceinline__ void alibi_scores(ptx::MmaC (&sc)[kStrips][kNTiles], const int (&rows)[kStrips][2], int n0,
                                             const FwdCta& cta, const FwdScoreParams& sp) {
#pragma unroll
  for (int s = 0; s < kStrips; ++s) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float distance0 = static_cast<float>(rows[s][r] + cta.win.offset - (n0 + 2 * cta.t));
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float distance = distance0 - static_cast<float>(nt * kMmaN + e);
          sc[s][nt].reg[2 * r + e] -= sp.alibi_slope * fabsf(distance);
        }
      }
    }
  }
}

// General path: scores -> log2-domain logits (scale, softcap, ALiBi, bias), one uniform branch per feature around
// whole loops. With the tests inside the per-score loop, the bias test compiled to a branch per score (BSSY / BSYNC
// around each of the 64 scores of a tile) and the softcap / ALiBi work to predicated code interleaved with it: the
// general kernel ran softcap and ALiBi at 132 against 383 TFLOP/s without them (H200, hd 128, 4k, sixteenth session).
// kBias false: the lean kernel's form (its calls have no bias), without the bias loop's code. kAlibi false: without
// ALiBi, which the caller adds (alibi_scores or linear_alibi_scores).
template <bool kBias = true, bool kAlibi = true, int kStrips, int kNTiles>
__device__ __forceinline__ void transform_scores(ptx::MmaC (&sc)[kStrips][kNTiles], const int (&rows)[kStrips][2],
                                                 int n0, const FwdParams& p, const FwdCta& cta,
                                                 const FwdScoreParams& sp) {
  if (sp.softcap) {
#pragma unroll
    for (int s = 0; s < kStrips; ++s) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[s][nt].reg[e] = fast_tanh(sc[s][nt].reg[e] * sp.tanh_scale);
      }
    }
  } else if (!sp.raw_alibi) {
#pragma unroll
    for (int s = 0; s < kStrips; ++s) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[s][nt].reg[e] *= sp.scale_log2;
      }
    }
  }
  if (kAlibi && p.mask.alibi_slopes != nullptr) alibi_scores(sc, rows, n0, cta, sp);
  if (kBias && p.mask.bias != nullptr) {
    const ScoreStrides& bs = p.mask.bias_strides;
#pragma unroll
    for (int s = 0; s < kStrips; ++s) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = rows[s][e / 2];
          const int col = n0 + nt * kMmaN + 2 * cta.t + (e % 2);
          if (row < cta.seqlen_q && col < cta.seqlen_k) {
            sc[s][nt].reg[e] +=
                sp.bias_scale * read_bias(p.mask.bias, p.mask.bias_dtype,
                                     cta.b * bs.batch + cta.h * bs.head + static_cast<int64_t>(row) * bs.row +
                                         col * bs.col);
          }
        }
      }
    }
  }
}

// ALiBi on a key tile whose visible keys all lie on one side of every row's diagonal (side +1: key <= row + offset,
// as in every causal tile; -1: key >= row + offset): -slope |distance| = side slope (c - distance0), with c = nt * 8
// + e the score's compile-time column offset and distance0 = row + offset - (n0 + 2 t) the thread's per-row base.
// The score takes side slope c (one FFMA with an immediate, against an FADD and an FFMA for |distance|); the row's
// -side slope distance0 goes to online_softmax as its row bias. |slope| <= kMaxLinearAlibiSlope keeps both parts
// finite for any distance below 2^31 (2^64 x 2^31 x x_scale < 2^128).
constexpr float kMaxLinearAlibiSlope = 18446744073709551616.f;  // 2^64
template <int kStrips, int kNTiles>
__device__ __forceinline__ void linear_alibi_scores(ptx::MmaC (&sc)[kStrips][kNTiles], const int (&rows)[kStrips][2],
                                                    int n0, const FwdCta& cta, const FwdScoreParams& sp, int side,
                                                    float (&row_bias)[kStrips][2]) {
  const float slope = side > 0 ? sp.alibi_slope : -sp.alibi_slope;
#pragma unroll
  for (int s = 0; s < kStrips; ++s) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_bias[s][r] = -slope * static_cast<float>(rows[s][r] + cta.win.offset - (n0 + 2 * cta.t));
    }
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sc[s][nt].reg[e] = fmaf(slope, static_cast<float>(nt * kMmaN + e % 2), sc[s][nt].reg[e]);
      }
    }
  }
}

// Online softmax: new running max, rescale of the running sum and O, then P = 2^(x * x_scale - max). kPolyEvery > 0:
// every kPolyEvery-th column group's exponentials on the FMA pipe (fwd_tile_config.h fwd_score_mods_poly_exp_every).
// kRowBias: a score's value is x + row_bias[s][r] (linear_alibi_scores), the bias added to each thread's maximum
// before the quad's and to the exponent's offset.
template <int kPolyEvery = 0, bool kRowBias = false, int kStrips, int kNTiles, int kDTiles>
__device__ __forceinline__ void online_softmax(ptx::MmaC (&sc)[kStrips][kNTiles], ptx::MmaC (&acc)[kStrips][kDTiles],
                                               float (&row_max)[kStrips][2], float (&row_sum)[kStrips][2],
                                               float x_scale, const float (*row_bias)[2] = nullptr) {
  constexpr int kPolyPeriod = kPolyEvery > 0 ? kPolyEvery : 1;  // no modulo by zero where none moves
  auto thread_max = [&](int s, int r) {
    float tile_max = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      tile_max = fmaxf(tile_max, fmaxf(sc[s][nt].reg[2 * r], sc[s][nt].reg[2 * r + 1]));
    }
    return tile_max;
  };
  auto quad_max = [](float tile_max, int lanes) {
    return fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, lanes));
  };
  auto finish_row = [&](int s, int r, float tile_max) {
    const float new_max = fmaxf(row_max[s][r], tile_max * x_scale);
    const float shift = new_max == -INFINITY ? 0.f : new_max;
    const float offset = kRowBias ? fmaf(row_bias[s][r], x_scale, -shift) : -shift;
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
        const float exponent = fmaf(sc[s][nt].reg[2 * r + c], x_scale, offset);
        const float prob = kPolyEvery > 0 && nt % kPolyPeriod == kPolyPeriod - 1 ? exp2_polynomial(exponent)
                                                                                  : exp2f(exponent);
        sum += prob;
        sc[s][nt].reg[2 * r + c] = prob;
      }
    }
    row_sum[s][r] += sum;
  };
#pragma unroll
  for (int s = 0; s < kStrips; ++s) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float thread_value_max = kRowBias ? thread_max(s, r) + row_bias[s][r] : thread_max(s, r);
      finish_row(s, r, quad_max(quad_max(thread_value_max, 1), 2));
    }
  }
}

// Dropout: the row sum keeps every probability; only P V sees the kept ones, scaled by 1 / (1 - p).
template <int kStrips, int kNTiles>
__device__ __forceinline__ void apply_dropout(ptx::MmaC (&sc)[kStrips][kNTiles], const int (&rows)[kStrips][2],
                                              int n0, int t, const FwdScoreParams& sp) {
#pragma unroll
  for (int s = 0; s < kStrips; ++s) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int col = n0 + nt * kMmaN + 2 * t;
        const PhiloxBlock words = dropout_words(sp.seed, sp.rng_offset, sp.batch_head, rows[s][r], col / 4);
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float& prob = sc[s][nt].reg[2 * r + c];
          prob = words.word[(col + c) % 4] < sp.keep_threshold ? prob * sp.inv_keep : 0.f;
        }
      }
    }
  }
}

// O += P V: two adjacent n8 accumulator tiles of P are one k16 A fragment (`pa`, the caller's array; see the
// kernel).
template <typename VLayout, int kHeadDim, int kStrips, int kNTiles, int kDTiles, typename T>
__device__ __forceinline__ void accumulate_pv(ptx::MmaC (&acc)[kStrips][kDTiles], ptx::MmaA (&pa)[kStrips],
                                              const ptx::MmaC (&sc)[kStrips][kNTiles], const T* s_v, int lane) {
  constexpr int kStride = kHeadDim + kSmemRowPad;
  constexpr int kBlockN = kNTiles * kMmaN;
  const int v_lane = VLayout::lane_offset(lane % 16, 8 * (lane / 16));
  const T zero = from_float<T>(0.f);
#pragma unroll
  for (int kk = 0; kk < kBlockN / kMmaK; ++kk) {
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
      if constexpr (VLayout::kSplitAddress) {
        ptx::ldmatrix_x4_trans(vb, s_v + VLayout::ldmatrix_offset(v_lane, kk * kMmaK, dp * 16));
      } else {
        ptx::ldmatrix_x4_trans(vb, s_v + (kk * kMmaK + lane % 16) * kStride + dp * 16 + 8 * (lane / 16));
      }
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

// A row's final softmax statistics from one thread's running max (log2 domain) and partial sum: the sum over the quad
// of lanes that hold the row's columns, its inverse (0 for a row that saw no key) and the natural-log lse (empty_lse
// for such a row).
struct RowTotal {
  float inv_sum;
  float lse;
};
__device__ __forceinline__ RowTotal row_total(float row_max, float partial_sum, float empty_lse) {
  float sum = partial_sum;
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  const bool empty = sum == 0.f;
  return RowTotal{empty ? 0.f : 1.f / sum, empty ? empty_lse : row_max * static_cast<float>(kLn2) + logf(sum)};
}

// Normalises O by the row sums and writes each row's LSE: a split writes its fp32 partial straight to global
// memory, a whole call stages O (in T) in this warp's own Q rows of shared memory for store_output.
template <int kHeadDim, int kStrips, int kDTiles, typename T>
__device__ __forceinline__ void normalise_output(const ptx::MmaC (&acc)[kStrips][kDTiles],
                                                 const float (&row_max)[kStrips][2],
                                                 const float (&row_sum)[kStrips][2], const int (&rows)[kStrips][2],
                                                 T* s_q, const FwdParams& p, const FwdCta& cta, bool split_call) {
  constexpr int kStride = kHeadDim + kSmemRowPad;
  const AttentionShape& shape = p.shape;
  const int t = cta.t;
  const int64_t split_row0 =
      ((static_cast<int64_t>(cta.split) * shape.batch + cta.b) * shape.nheads_q + cta.h) * shape.seqlen_q;
#pragma unroll
  for (int s = 0; s < kStrips; ++s) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const RowTotal total = row_total(row_max[s][r], row_sum[s][r], split_call ? -INFINITY : INFINITY);
      const float inv_sum = total.inv_sum;
      const float lse = total.lse;
      const int row = rows[s][r];
      const int local = row - cta.m0;
      if (split_call) {
        if (row < cta.seqlen_q) {
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
        if (t == 0 && row < cta.seqlen_q) {
          float* lse_out =
              static_cast<float*>(p.lse) + cta.b * p.lse_batch_stride + cta.h * p.lse_head_stride + cta.q_row0;
          lse_out[row] = lse;
        }
      }
    }
  }
}

// Row stride (floats) of a staged partial output (stage_partial_output): 4 floats of padding put the 8 row groups of a
// fragment's float2 stores in distinct banks and keep rows 16-byte aligned for v4 loads.
template <int kHeadDim>
constexpr int kPartialStageStride = kHeadDim + 4;

// Stages this warp's normalised fp32 partial output (kBlockM rows of kPartialStageStride floats) and its rows' lses
// (-inf where no key was seen; kBlockM floats after the rows) at `stage`, for a merge of several partials.
template <int kHeadDim, int kBlockM, int kStrips, int kDTiles>
__device__ __forceinline__ void stage_partial_output(const ptx::MmaC (&acc)[kStrips][kDTiles],
                                                     const float (&row_max)[kStrips][2],
                                                     const float (&row_sum)[kStrips][2],
                                                     const int (&rows)[kStrips][2], float* stage, const FwdCta& cta) {
  constexpr int kStride = kPartialStageStride<kHeadDim>;
  float* const stage_lse = stage + kBlockM * kStride;
#pragma unroll
  for (int s = 0; s < kStrips; ++s) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const RowTotal total = row_total(row_max[s][r], row_sum[s][r], -INFINITY);
      const int local = rows[s][r] - cta.m0;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        *reinterpret_cast<float2*>(stage + local * kStride + dt * kMmaN + 2 * cta.t) =
            make_float2(acc[s][dt].reg[2 * r] * total.inv_sum, acc[s][dt].reg[2 * r + 1] * total.inv_sum);
      }
      if (cta.t == 0) stage_lse[local] = total.lse;
    }
  }
}

// Merges kParts partial rows of one 4-column chunk by their lses (as the combine kernel, fwd_combine_kernel.h): the
// merged chunk, and its lse in `lse` (-inf where no part saw a key).
template <int kParts>
__device__ __forceinline__ float4 merge_partials(const float (&lses)[kParts], const float4 (&parts)[kParts],
                                                 float& lse) {
  float max_lse = -INFINITY;
#pragma unroll
  for (int s = 0; s < kParts; ++s) max_lse = fmaxf(max_lse, lses[s]);
  float total = 0.f;
  if (max_lse != -INFINITY) {
#pragma unroll
    for (int s = 0; s < kParts; ++s) total += expf(lses[s] - max_lse);
  }
  const bool empty = total == 0.f;
  lse = empty ? -INFINITY : max_lse + logf(total);
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int s = 0; s < kParts; ++s) {
    const float w = empty ? 0.f : expf(lses[s] - lse);
    o.x += w * parts[s].x;
    o.y += w * parts[s].y;
    o.z += w * parts[s].z;
    o.w += w * parts[s].w;
  }
  return o;
}

// Writes a merged chunk of row `local` (of the CTA's rows) at column col to the output, and its lse from the chunk
// at column 0; rows with no visible key get O = 0 (merge_partials' weights) and lse +inf, the unsplit contract.
template <typename T>
__device__ __forceinline__ void store_merged_chunk(const float4& o, float lse, int local, int col, const FwdParams& p,
                                                   const FwdCta& cta) {
  // head_dim is a multiple of 8 (the API pads), so a chunk is wholly inside or outside the row.
  if (col < cta.head_dim) {
    T* const out = static_cast<T*>(p.out) + cta.b * p.out_strides.batch +
                   (cta.q_row0 + cta.m0 + local) * p.out_strides.row + cta.h * p.out_strides.head + col;
    *reinterpret_cast<uint2*>(out) = make_uint2(pack_float2<T>(o.x, o.y), pack_float2<T>(o.z, o.w));
  }
  if (col == 0) {
    float* const lse_out = static_cast<float*>(p.lse) + cta.b * p.lse_batch_stride + cta.h * p.lse_head_stride +
                           cta.q_row0 + cta.m0;
    lse_out[local] = lse == -INFINITY ? INFINITY : lse;
  }
}

// The epilogue of the key-warps decode tile (kKeyGroups one-warp groups, each on its own key tiles): every group
// stages its partial in its own K ring (free after the main loop), then the CTA's threads merge the groups' partials
// per (row, 4-column chunk) and write the output (one split) or the CTA's split partial for the combine kernel.
template <int kHeadDim, int kBlockM, int kGroupThreads, int kKeyGroups, int kGroupSmemBytes, typename T, int kStrips,
          int kDTiles>
__device__ __forceinline__ void merge_key_groups(const ptx::MmaC (&acc)[kStrips][kDTiles],
                                                 const float (&row_max)[kStrips][2],
                                                 const float (&row_sum)[kStrips][2], const int (&rows)[kStrips][2],
                                                 unsigned char* smem, const FwdParams& p, const FwdCta& cta) {
  constexpr int kStride = kPartialStageStride<kHeadDim>;
  constexpr int kChunks = kHeadDim / 4;
  constexpr int kRingOffset = kBlockM * (kHeadDim + kSmemRowPad) * static_cast<int>(sizeof(T));  // locate_tiles
  static_assert((kBlockM * kStride + kBlockM) * sizeof(float) + kRingOffset <= kGroupSmemBytes,
                "a group's partial output fits in its K / V rings");
  auto stage_of = [&](int group) { return reinterpret_cast<float*>(smem + group * kGroupSmemBytes + kRingOffset); };
  stage_partial_output<kHeadDim, kBlockM>(acc, row_max, row_sum, rows, stage_of(threadIdx.x / kGroupThreads), cta);
  __syncthreads();
  const AttentionShape& shape = p.shape;
  const int64_t split_row0 =
      ((static_cast<int64_t>(cta.split) * shape.batch + cta.b) * shape.nheads_q + cta.h) * shape.seqlen_q + cta.m0;
  const int items = min(kBlockM, cta.seqlen_q - cta.m0) * kChunks;
  for (int item = threadIdx.x; item < items; item += kGroupThreads * kKeyGroups) {
    const int local = item / kChunks;
    const int col = (item % kChunks) * 4;
    float lses[kKeyGroups];
    float4 parts[kKeyGroups];
#pragma unroll
    for (int g = 0; g < kKeyGroups; ++g) {
      const float* stage = stage_of(g);
      lses[g] = stage[kBlockM * kStride + local];
      parts[g] = *reinterpret_cast<const float4*>(stage + local * kStride + col);
    }
    float lse;
    const float4 o = merge_partials(lses, parts, lse);
    if (p.num_splits == 1) {
      store_merged_chunk<T>(o, lse, local, col, p, cta);
    } else {  // split_out rows are kHeadDim (the bucket) floats wide; columns past head_dim merge zeros
      *reinterpret_cast<float4*>(p.split_out + (split_row0 + local) * kHeadDim + col) = o;
      if (col == 0) p.split_lse[split_row0 + local] = lse;
    }
  }
}

// The epilogue of a split whose sequence's splits run as one cluster (FwdParams::splits_meet_in_cluster, sm90): each
// split stages its partial in its own K / V rings (stage_partial_output), the cluster syncs, and each CTA merges a
// share of the (row, 4-column chunk) items: it reads the item's partial and lse from every split's shared memory and
// writes out / lse. A second sync keeps each CTA's shared memory alive until every split has read it. Replaces the
// split_out / split_lse round trip through global memory and the combine kernel's launch.
template <int kHeadDim, int kBlockM, int kThreads, typename T, int kStrips, int kDTiles>
__device__ __forceinline__ void combine_splits_in_cluster(const ptx::MmaC (&acc)[kStrips][kDTiles],
                                                          const float (&row_max)[kStrips][2],
                                                          const float (&row_sum)[kStrips][2],
                                                          const int (&rows)[kStrips][2], float* stage,
                                                          const FwdParams& p, const FwdCta& cta) {
  constexpr int kStride = kPartialStageStride<kHeadDim>;
  constexpr int kChunks = kHeadDim / 4;
  float* const stage_lse = stage + kBlockM * kStride;
  stage_partial_output<kHeadDim, kBlockM>(acc, row_max, row_sum, rows, stage, cta);
  ptx::cluster_sync();

  const int splits = p.num_splits;  // the cluster's size
  const int first = static_cast<int>(ptx::cluster_cta_rank()) * kThreads + cta.tid;
  const int items = min(kBlockM, cta.seqlen_q - cta.m0) * kChunks;
  const uint32_t stage_at = ptx::smem_address(stage);
  const uint32_t lse_at = ptx::smem_address(stage_lse);
  for (int item = first; item < items; item += splits * kThreads) {
    const int local = item / kChunks;
    const int col = (item % kChunks) * 4;
    // Every split's loads are issued before any is used (remote shared memory: a few hundred cycles each).
    float lses[kMaxClusterSplits];
    float4 parts[kMaxClusterSplits];
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      lses[s] = -INFINITY;  // past the cluster: weighted 0
      parts[s] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (s < splits) {
        lses[s] = ptx::ld_shared_cluster_f32(ptx::map_shared_to_rank(lse_at + local * 4, s));
        parts[s] = ptx::ld_shared_cluster_v4_f32(ptx::map_shared_to_rank(stage_at + (local * kStride + col) * 4, s));
      }
    }
    float lse;
    const float4 o = merge_partials(lses, parts, lse);
    store_merged_chunk<T>(o, lse, local, col, p, cta);
  }
  ptx::cluster_sync();
}

// Copies this warp's staged O rows from shared memory to the output in 16-byte chunks.
template <int kHeadDim, int kStripStride, int kStrips, typename T>
__device__ __forceinline__ void store_output(const T* s_q, const FwdParams& p, const FwdCta& cta) {
  constexpr int kStride = kHeadDim + kSmemRowPad;
  constexpr int kChunksPerRow = kHeadDim / kChunkElems;
  __syncwarp();
  T* out = static_cast<T*>(p.out) + cta.b * p.out_strides.batch + (cta.q_row0 + cta.m0) * p.out_strides.row +
           cta.h * p.out_strides.head;
#pragma unroll
  for (int s = 0; s < kStrips; ++s) {
    const int strip0 = cta.warp * kMmaM + s * kStripStride;
#pragma unroll
    for (int c = cta.lane; c < kMmaM * kChunksPerRow; c += kWarpSize) {
      const int local = strip0 + c / kChunksPerRow;
      const int col = (c % kChunksPerRow) * kChunkElems;
      if (cta.m0 + local < cta.seqlen_q && col < cta.head_dim) {
        *reinterpret_cast<uint4*>(out + local * p.out_strides.row + col) =
            *reinterpret_cast<const uint4*>(s_q + local * kStride + col);
      }
    }
  }
}

// Tensor maps of K and V as (head dim, kv head, key, batch entry), boxes of 64 columns x one key tile (fwd_launch.h).
struct FwdKvMaps {
  TensorMapArg k;
  TensorMapArg v;
};

// Thread 0: issues the TMA loads of key tile n of K or V (one box per 64-column segment) into `slot`, counted on
// `barrier`. Rows past the key range arrive as zeros, as cp.async's zero fill writes them.
template <int kHeadDim, int kBlockN, typename T>
__device__ __forceinline__ void issue_kv_tile_tma(T* slot, const TensorMapArg& map, uint64_t* barrier,
                                                  const FwdCta& cta, int n) {
  constexpr int kSegments = kHeadDim / kSegmentElems;
  constexpr uint32_t kTileBytes = kBlockN * kHeadDim * sizeof(T);
  ptx::mbarrier_arrive_expect_tx(barrier, kTileBytes);
#pragma unroll
  for (int segment = 0; segment < kSegments; ++segment) {
    ptx::tma_load_4d(slot + segment * kBlockN * kSegmentElems, &map.map, barrier, segment * kSegmentElems, cta.hk,
                     static_cast<int>(cta.k_row0) + n * kBlockN, cta.b);
  }
}

// The K and V slots' barriers of a kernel that loads them by TMA, each completing one phase per key tile, and the
// parity of the phase each waits for next. init() readies them (every thread calls it; a CTA barrier follows).
struct TmaKvBarriers {
  uint64_t* k_full;
  uint64_t* v_full;
  uint32_t k_parity;
  uint32_t v_parity;
  __device__ __forceinline__ void init(unsigned char* at) {
    k_full = reinterpret_cast<uint64_t*>(at);
    v_full = k_full + 1;
    k_parity = 0;
    v_parity = 0;
    if (threadIdx.x == 0) {
      ptx::mbarrier_init(k_full, 1);
      ptx::mbarrier_init(v_full, 1);
      ptx::fence_barrier_init();
    }
    __syncthreads();
  }
  __device__ __forceinline__ void wait_k() {
    ptx::mbarrier_wait_parity(k_full, k_parity);
    k_parity ^= 1;
  }
  __device__ __forceinline__ void wait_v() {
    ptx::mbarrier_wait_parity(v_full, v_parity);
    v_parity ^= 1;
  }
};

// The first kTmaBoxAlign boundary at or after the dynamic shared memory's start: TMA kernels lay their tiles out
// from there (their launch asks for kTmaBoxAlign bytes of slack).
__device__ __forceinline__ unsigned char* tma_aligned_smem(unsigned char* smem_raw) {
  return smem_raw + (kTmaBoxAlign - ptx::smem_address(smem_raw) % kTmaBoxAlign) % kTmaBoxAlign;
}

// The prologue of a CTA (or persistent item) whose K and V arrive by TMA: Q by cp.async as one group, and thread 0
// issues K(n_last) (none for an item without keys).
template <int kHeadDim, int kBlockM, int kBlockN, int kThreads, typename T>
__device__ __forceinline__ void load_prologue_tma(const FwdParams& p, const FwdCta& cta, const FwdTiles<T>& tiles,
                                                  const FwdKvMaps& maps, const TmaKvBarriers& bars) {
  load_tile_async<kBlockM, kHeadDim, kThreads, PaddedRows<kHeadDim>>(tiles.s_q, tiles.q, p.q_strides.row,
                                                                    cta.seqlen_q - cta.m0, cta.head_dim, cta.tid);
  ptx::cp_async_commit();
  if (cta.tid == 0 && cta.n_last >= cta.n_first) {
    issue_kv_tile_tma<kHeadDim, kBlockN>(tiles.s_k_ring, maps.k, bars.k_full, cta, cta.n_last);
  }
}

// The forward of one CTA (kernels below). kTma: K and V arrive by TMA (fwd_loads_kv_by_tma), `maps` their tensor
// maps; otherwise by cp.async and `maps` is unused. kPaging: K and V are a paged cache's (decode tiles only).
// kLeanMods: the lean kernel's softcap / ALiBi instantiation (fwd_lean_runs_score_mods). kAppends: the decode
// instantiation for flash_attn_with_kvcache's appends (FwdParams::kv_append, rotary, appended_split): a kernel of its
// own, so the plain decode kernels keep their code (compiled into the rows-paged kernel, the append's code cost its
// calls 10-46 %, twenty-fourth session).
template <typename T, int kHeadDim, MaskKind kMask, bool kGeneral, FwdTileKind kKind, bool kTma,
          KvPaging kPaging = KvPaging::kNone, bool kLeanMods = false, bool kAppends = false>
__device__ __forceinline__ void fwd_tile(const FwdParams& p, const FwdKvMaps& maps) {
  constexpr FwdTileConfig kTile = fwd_tile_config(kHeadDim, kGeneral, kKind);
  constexpr int kBlockM = kTile.block_m;
  constexpr int kBlockN = kTile.block_n;
  constexpr int kWarps = kTile.warps;
  constexpr int kThreads = kWarps * kWarpSize;
  constexpr int kStrips = kBlockM / (kWarps * kMmaM);  // 16-row strips per warp
  constexpr int kStripStride = kWarps * kMmaM;          // rows between a warp's strips
  constexpr int kStride = kHeadDim + kSmemRowPad;
  constexpr int kNTiles = kBlockN / kMmaN;
  constexpr int kDTiles = kHeadDim / kMmaN;
  constexpr int kStages = kTile.kv_stages;
  constexpr bool kEarlyV = fwd_waits_v_before_softmax(kHeadDim, kMask != MaskKind::kNone, kTma);
  constexpr bool kFirstV = fwd_prefetches_first_v(kHeadDim, kGeneral, kWarps, kStages);
  // The loop ends with cp_async_wait<0> before the epilogue, so a zero fill past the range lands before any reuse.
  // Not in the softcap / ALiBi lean kernel: there it spilled (hd 96, 253 -> 255 registers and 24 bytes of stack).
  constexpr bool kFillsPastRange =
      !kTma && !kLeanMods && kPaging == KvPaging::kNone && fwd_fills_past_kv_range(kHeadDim, kKind, kStages);
  constexpr bool kHalfSegments =
      fwd_swizzles_half_segments(kHeadDim, kGeneral, kKind, kLeanMods, kPaging != KvPaging::kNone,
                                 kMask != MaskKind::kNone);
  using HalfSegmentTiles = HalfSegmentSwizzledRows<kHalfSegments ? kHeadDim : kFwdHalfSegmentSwizzleHeadDim>;
  using KvTiles = std::conditional_t<kHalfSegments, HalfSegmentTiles,
                                     TileLayout<fwd_swizzles_kv(kHeadDim, kGeneral, kKind, kMask != MaskKind::kNone),
                                                kHeadDim>>;
  using CheckedLayout =
      std::conditional_t<fwd_branches_whole_tiles(kHeadDim, kGeneral, kKind, kMask != MaskKind::kNone),
                         WholeTileLoads<KvTiles>, KvTiles>;
  using FixedLayout =
      std::conditional_t<fwd_loads_fixed_columns(kHeadDim, kGeneral, kKind, kMask != MaskKind::kNone, kLeanMods),
                         FixedColumnLoads<CheckedLayout>, CheckedLayout>;
  using CpAsyncLayout = std::conditional_t<fwd_loads_grouped_columns(kHeadDim, kGeneral, kKind),
                                           GroupedColumnLoads<CheckedLayout>, FixedLayout>;
  using KvLayout = std::conditional_t<kTma, SegmentSwizzledRows<kBlockN, kHeadDim>, CpAsyncLayout>;
  static_assert(kHeadDim % (2 * kMmaK) == 0 && kBlockN % (2 * kMmaK) == 0 && kStrips >= 1, "tile shape");
  static_assert(kStages >= 1 && kStages <= kMaxKvStages, "kv_stages");
  static_assert(!kTma || (kStages == 1 && !kFirstV && !kGeneral), "TMA loads: one stage, the first V after K");

  extern __shared__ __align__(kSmemAlign) unsigned char smem_raw[];
  unsigned char* const smem = kTma ? tma_aligned_smem(smem_raw) : smem_raw;

  // A decode kernel is itself a programmatic dependent on sm90 (fwd_launch.h): it may start while the kernel before
  // it runs, so it waits for that grid's writes before touching any memory. A split decode grid fits in one wave
  // (choose_fwd_num_splits), so every CTA is resident when the last one allows the combine kernel (its programmatic
  // dependent, fwd_launch.h) to start: no combine CTA takes a slot that a split CTA still waits for. Without a
  // dependent launch both do nothing.
  constexpr bool kDecode = fwd_is_decode_kind(kKind);
  if constexpr (kDecode) {
    ptx::wait_for_primary_grid();
    ptx::allow_dependent_launch();
  }
  // Key groups (the key-warps decode tile): each warp runs the tile on its own key tiles in its own buffers.
  constexpr int kKeyGroups = kTile.key_groups;
  static_assert(kKeyGroups == 1 || (kDecode && kWarps == 1 && !kTma), "key groups: one-warp decode tiles");
  constexpr int kGroupSmemBytes = fwd_group_smem_bytes(kHeadDim, kGeneral, kKind, sizeof(T));
  FwdCta cta = locate_cta<kMask, kBlockM>(p, blockIdx, gridDim.x);
  if (cta.m0 >= cta.seqlen_q) return;
  plan_key_tiles<kMask, kBlockM, kBlockN, kAppends, kKeyGroups>(p, cta);
  unsigned char* const group_smem = smem + (kKeyGroups > 1 ? threadIdx.x / kThreads * kGroupSmemBytes : 0);
  const FwdTiles<T> tiles = locate_tiles<kHeadDim, kBlockM, kBlockN, kStages, T, kPaging>(group_smem, p, cta);
  static_assert(!kAppends || (kDecode && kPaging != KvPaging::kRows), "appends: dense or whole-block decode tiles");
  const bool rotates_q = kAppends && p.rotary.cos != nullptr;
  if constexpr (kAppends) {
    // The split that holds the last key's tile writes the appended rows, which its own loads then read (the barrier
    // orders the stores before them). Its tiles hold every new row where the plan gives them a split of their own
    // (plan_key_tiles) or there is one new row; the API launches the append kernel first otherwise.
    const int last_tile = (cta.seqlen_k - 1) / kBlockN;
    if (p.kv_append.k != nullptr && cta.n_first <= last_tile && last_tile <= cta.n_last && cta.m0 == 0) {
      write_appended_rows<kThreads, kPaging>(p, cta, tiles);
      tile_sync<kThreads>();
    }
  }
  TmaKvBarriers bars;
  if constexpr (kTma) {
    bars.init(smem + fwd_smem_bytes(kHeadDim, kGeneral, kKind, sizeof(T)));  // the barriers follow the tiles
    load_prologue_tma<kHeadDim, kBlockM, kBlockN, kThreads>(p, cta, tiles, maps, bars);
  } else {
    load_prologue<KvLayout, kHeadDim, kBlockM, kBlockN, kThreads, kStages, kFirstV, kPaging>(p, cta, tiles,
                                                                                             !rotates_q);
  }
  if constexpr (kAppends) {
    if (rotates_q) load_rotated_q<kHeadDim, kBlockM, kThreads>(p, cta, tiles);
  }
  static_assert(!kLeanMods || (!kGeneral && kPaging == KvPaging::kNone &&
                                (kKind == FwdTileKind::kStandard || kKind == FwdTileKind::kCompact)),
                "score mods in the lean kernel: its standard (cp.async or TMA) and compact tiles only");
  const FwdScoreParams sp = read_score_params<kGeneral, kLeanMods, fwd_alibi_keeps_raw_scores(kHeadDim)>(p, cta);

  int rows[kStrips][2];
  find_rows<kStripStride>(rows, cta);
  // ALiBi calls of the lean kernel in the linear form where a tile allows it (fwd_alibi_linear_tiles).
  constexpr bool kLinearAlibi = kLeanMods && fwd_alibi_linear_tiles(kHeadDim);
  const bool linear_alibi = kLinearAlibi && sp.score_mods && p.mask.alibi_slopes != nullptr &&
                            fabsf(sp.alibi_slope) <= kMaxLinearAlibiSlope;
  float row_max[kStrips][2], row_sum[kStrips][2];
  ptx::MmaC acc[kStrips][kDTiles];
  init_softmax(row_max, row_sum);

  // V(n) landed; every warp is done with K(n), whose slot takes K(n - kStages).
  auto await_v_tile = [&](const int& n) {
    if constexpr (kTma) {
      bars.wait_v();
      __syncthreads();
      if (cta.tid == 0 && n > cta.n_first) {
        issue_kv_tile_tma<kHeadDim, kBlockN>(tiles.s_k_ring, maps.k, bars.k_full, cta, n - 1);
      }
    } else {
      await_v<KvLayout, kHeadDim, kBlockN, kThreads, kStages, kPaging, kFillsPastRange>(p, cta, tiles, n);
    }
  };
  for (int n = cta.n_last; n >= cta.n_first; --n) {
    const int n0 = n * kBlockN;
    if constexpr (kTma) {
      ptx::cp_async_wait<0>();  // Q, on the first tile
      bars.wait_k();
      __syncthreads();  // every thread's Q copies landed; every warp is done with V(n + 1)'s slot
      if (cta.tid == 0) issue_kv_tile_tma<kHeadDim, kBlockN>(tiles.s_v_ring, maps.v, bars.v_full, cta, n);
    } else {
      await_k<KvLayout, kHeadDim, kBlockN, kThreads, kStages, kFirstV, kPaging>(p, cta, tiles, n);
    }
    const T* s_k = tiles.s_k_ring + ring_slot<kStages>(n) * kBlockN * kStride;
    const T* s_v = tiles.s_v_ring + ring_slot<kStages>(n) * kBlockN * kStride;

    // The A-fragment arrays of both GEMMs (a: Q, pa: P) are declared here and passed in: declared inside
    // compute_scores / accumulate_pv, they are allocated ahead of this kernel's own arrays once inlined, and ptxas
    // then assigned registers differently (the standard-tile kernels' SASS changed at 3 of the 4 head dims checked;
    // hd128 causal general: main loop 7719 -> 7720 instructions).
    ptx::MmaC sc[kStrips][kNTiles];
    ptx::MmaA a[kStrips];
    compute_scores<KvLayout, kHeadDim, kStripStride, kMask == MaskKind::kCausal>(sc, a, tiles.s_q, s_k, cta.warp,
                                                                              cta.lane);
    if constexpr (kEarlyV) await_v_tile(n);
    // fwd_alibi_linear_tiles: the side of the diagonal every visible key of this tile lies on (0: both or unknown).
    int alibi_side = 0;
    float row_bias[kStrips][2];
    if constexpr (kLinearAlibi) {
      if (linear_alibi) {
        const CtaWindow& w = cta.win;
        const bool left_of_diagonal =
            cta.m0 + w.offset - (n0 + kBlockN - 1) >= 0 || (w.has_right && w.right <= 0);
        alibi_side = left_of_diagonal ? 1 : (cta.m0 + kBlockM - 1 + w.offset - n0 <= 0 ? -1 : 0);
      }
    }
    if constexpr (kGeneral) {
      transform_scores(sc, rows, n0, p, cta, sp);
    } else if constexpr (kLinearAlibi) {
      // One transform and one softmax for every call (two instances of either raised the spill and the loop's size:
      // hd 64 TMA kernel 12 / 20 -> 96 / 96 bytes): a tile in the abs form keeps row bias 0.
      if (sp.score_mods) transform_scores<false, false>(sc, rows, n0, p, cta, sp);
      if (alibi_side != 0) {
        linear_alibi_scores(sc, rows, n0, cta, sp, alibi_side, row_bias);
      } else {
        if (sp.score_mods && p.mask.alibi_slopes != nullptr) alibi_scores(sc, rows, n0, cta, sp);
#pragma unroll
        for (int st = 0; st < kStrips; ++st) row_bias[st][0] = row_bias[st][1] = 0.f;
      }
    } else if constexpr (kLeanMods) {
      if (sp.score_mods) transform_scores<false>(sc, rows, n0, p, cta, sp);
    }

    // Mask only the tiles some row of this CTA cannot fully see: scores of keys past seqlen_k or outside the
    // window become -inf. Written here rather than as a function: every function form tried (test and masking
    // loop in one function or two, the tile's first key by value or by reference) changed the SASS of some 1-warp
    // decode kernels, e.g. sm90 sliding-window hd160: 36 more bytes of spill loads and 2 more main-loop
    // instructions; or sm90 no-mask hd32: main loop 289 -> 304 instructions.
    const CtaWindow& win = cta.win;
    constexpr bool kShifts = kMask == MaskKind::kLocal && kFwdLocalMaskByShifts;
    const bool needs_mask =
        kShifts ? n0 + kBlockN > cta.seqlen_k || n0 + kBlockN - 1 > cta.m0 + win.hi_shift ||
                      n0 < cta.m0 + kBlockM - 1 + win.lo_shift
                : n0 + kBlockN > cta.seqlen_k || (win.has_right && n0 + kBlockN - 1 > cta.m0 + win.offset + win.right) ||
                      (win.has_left && n0 < cta.m0 + kBlockM - 1 + win.offset - win.left);
    if (needs_mask) {
#pragma unroll
      for (int s = 0; s < kStrips; ++s) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = rows[s][e / 2];
            const int col = n0 + nt * kMmaN + 2 * cta.t + (e % 2);
            const bool visible =
                kShifts ? col < cta.seqlen_k && col >= row + win.lo_shift && col <= row + win.hi_shift
                        : col < cta.seqlen_k && (!win.has_left || col >= row + win.offset - win.left) &&
                              (!win.has_right || col <= row + win.offset + win.right);
            if (!visible) sc[s][nt].reg[e] = -INFINITY;
          }
        }
      }
    }

    // fwd_score_mods_poly_exp_every: only softcap calls without ALiBi, whose MUFU time exceeds their issue slots.
    constexpr int kPolyEvery = kLeanMods ? fwd_score_mods_poly_exp_every(kHeadDim, kMask != MaskKind::kNone) : 0;
    if (kPolyEvery > 0 && sp.poly_exp) {
      online_softmax<kPolyEvery>(sc, acc, row_max, row_sum, sp.x_scale);
    } else if constexpr (kLinearAlibi) {
      online_softmax<0, true>(sc, acc, row_max, row_sum, sp.x_scale, row_bias);
    } else {
      online_softmax(sc, acc, row_max, row_sum, sp.x_scale);
    }
    if (kGeneral && sp.dropout) apply_dropout(sc, rows, n0, cta.t, sp);
    if constexpr (!kEarlyV) await_v_tile(n);
    ptx::MmaA pa[kStrips];
    accumulate_pv<KvLayout, kHeadDim>(acc, pa, sc, s_v, cta.lane);
  }

  // Epilogue: normalise; a split writes fp32 partials, a whole call stages O (in T) through the warp's own Q
  // rows of shared memory and stores 16-byte chunks.
  ptx::cp_async_wait<0>();
  __syncthreads();
  if constexpr (kKeyGroups > 1) {
    merge_key_groups<kHeadDim, kBlockM, kThreads, kKeyGroups, kGroupSmemBytes, T>(acc, row_max, row_sum, rows, smem,
                                                                                  p, cta);
    return;
  }
  if constexpr (kDecode) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    static_assert((kBlockM * kPartialStageStride<kHeadDim> + kBlockM) * sizeof(float) <=
                      2 * kStages * kBlockN * kStride * sizeof(T),
                  "a cluster split's partial output fits in its K / V rings");
    if (p.splits_meet_in_cluster) {
      combine_splits_in_cluster<kHeadDim, kBlockM, kThreads, T>(acc, row_max, row_sum, rows,
                                                             reinterpret_cast<float*>(tiles.s_k_ring), p, cta);
      return;
    }
#endif
  }
  const bool split_call = p.num_splits > 1;
  normalise_output<kHeadDim>(acc, row_max, row_sum, rows, tiles.s_q, p, cta, split_call);
  if (split_call) return;
  store_output<kHeadDim, kStripStride, kStrips>(tiles.s_q, p, cta);
}

template <typename T, int kHeadDim, MaskKind kMask, bool kGeneral, FwdTileKind kKind,
          KvPaging kPaging = KvPaging::kNone, bool kLeanMods = false, bool kAppends = false>
__global__ void __launch_bounds__(fwd_cta_threads(kHeadDim, kGeneral, kKind)) fwd_kernel(const FwdParams p) {
  static_assert(kPaging == KvPaging::kNone || fwd_is_decode_kind(kKind), "paged K / V: decode tiles only");
  fwd_tile<T, kHeadDim, kMask, kGeneral, kKind, false, kPaging, kLeanMods, kAppends>(p, FwdKvMaps{});
}

// The same with K and V by TMA (sm90+; fwd_loads_kv_by_tma), the launch asking for fwd_tma_smem_bytes. kLeanMods:
// the softcap / ALiBi instantiation (fwd_launch.h launch_fwd_kernel).
template <typename T, int kHeadDim, MaskKind kMask, FwdTileKind kKind, bool kLeanMods = false>
__global__ void __launch_bounds__(fwd_tile_config(kHeadDim, false, kKind).warps* kWarpSize)
    fwd_tma_kernel(const FwdParams p, const __grid_constant__ FwdKvMaps maps) {
  fwd_tile<T, kHeadDim, kMask, false, kKind, true, KvPaging::kNone, kLeanMods>(p, maps);
}

}  // namespace flash::sm80
