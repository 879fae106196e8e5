// Pieces every sm80+ kernel shares: element types, fp32 <-> 16-bit conversions, the mma tile constants, the
// shared-memory tile layouts (padded and swizzled rows), and the cp.async tile loader. Device code only; no torch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "flash_attn/params.h"
#include "flash_attn/ptx/cp_async_sm80.h"
#include "flash_attn/ptx/mma_sm80.h"

namespace flash::sm80 {

template <DType kDType>
struct Element;
template <>
struct Element<DType::kFloat16> {
  using type = __half;
};
template <>
struct Element<DType::kBFloat16> {
  using type = __nv_bfloat16;
};

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }  // the fp32 elementwise kernels (rotary, append)
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }

// Calls f(head, item) once for every head in [0, nheads) and item in [0, items) of a row, across a CTA of kThreads
// threads, with 32-bit indices and one division per thread: with items <= kThreads, thread t takes item t % items of
// heads t / items, + kThreads / items, ... (threads past a whole number of item rows idle, so no pair is visited
// twice: rotary rotates in place); otherwise every head in turn, items strided by kThreads. The elementwise kernels'
// former (head, item) = divmod(i, items) on 64-bit i cost ~10 us of device time per decode append (H200, nineteenth
// session).
template <int kThreads, typename F>
__device__ __forceinline__ void for_each_head_item(int nheads, int items, F&& f) {
  const int t = static_cast<int>(threadIdx.x % kThreads);  // one group of kThreads (rotate_rows says why)
  if (items <= 0) return;
  if (items <= kThreads) {
    const int step = kThreads / items;
    if (t >= step * items) return;
    const int item = t % items;
    for (int h = t / items; h < nheads; h += step) f(h, item);
    return;
  }
  for (int h = 0; h < nheads; ++h) {
    for (int item = t; item < items; item += kThreads) f(h, item);
  }
}

// Two floats -> one packed register (low = a), rounded to nearest: one cvt instruction for the pair.
template <typename T>
__device__ __forceinline__ uint32_t pack_float2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack_float2<__half>(float a, float b) {
  const __half2 pair = __floats2half2_rn(a, b);
  return reinterpret_cast<const uint32_t&>(pair);
}
template <>
__device__ __forceinline__ uint32_t pack_float2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(a, b);
  return reinterpret_cast<const uint32_t&>(pair);
}

constexpr int kWarpSize = 32;
constexpr int kMmaM = 16;
constexpr int kMmaN = 8;
constexpr int kMmaK = 16;
// Shared-memory rows are padded by 8 elements (16 bytes): the 8 rows one ldmatrix phase reads then start in
// 8 different 4-bank groups, so fragment loads are conflict-free. Tiles are allocated with padded rows even where
// they are laid out as SwizzledRows (below), so every tile and ring slot starts on a 128-byte boundary.
constexpr int kSmemRowPad = 8;
// Elements per 16-byte cp.async chunk.
constexpr int kChunkElems = 8;
// Elements per 128-byte segment: the span of the 32 shared-memory banks.
constexpr int kSegmentElems = 64;
// Alignment of the dynamic shared memory, so that segments of the tiles start on bank 0.
constexpr int kSmemAlign = 128;

// Shared-memory layouts of a tile with kCols-element rows, as the element offset of (row, col) for col a multiple
// of kChunkElems (plus col % kChunkElems within the chunk). Readers and writers of a tile use the same layout.
// Fragment (ldmatrix) addresses come in two forms. Split (kSplitAddress): a lane's offset within its 8x8 matrix,
// lane_offset(row_lane, col_lane) with row_lane < 16 and col_lane 0 or 8, computed once, then the matrix origin
// (row_base a multiple of 8, col_base a multiple of 16) from loop indices: ldmatrix_offset(lane_offset, row_base,
// col_base). Direct: row * kStride + col as one expression. SwizzledRows needs the split form; padded tiles take
// the form of the kernel they are in (see the kernels), as the two give ptxas different register pressure.
//
// The load strategies every layout starts without; the wrappers below (OpaqueLaneOffset, WholeTileLoads,
// FixedColumnLoads, GroupedColumnLoads) each turn one on.
struct PlainLoads {
  static constexpr bool kOpaqueLaneOffset = false;
  static constexpr bool kWholeTileBranch = false;
  static constexpr bool kFixedColumnLoads = false;
  static constexpr bool kGroupedColumnLoads = false;
};

template <int kCols, bool kSplit = false>
struct PaddedRows : PlainLoads {
  static constexpr int kStride = kCols + kSmemRowPad;
  static constexpr bool kSplitAddress = kSplit;
  static constexpr int kRowPeriod = 1;  // offset(row + kRowPeriod, col) == offset(row, col) + kRowPeriod * kStride
  static constexpr __host__ __device__ int offset(int row, int col) { return row * kStride + col; }
  static constexpr __host__ __device__ int lane_offset(int row_lane, int col_lane) {
    return offset(row_lane, col_lane);
  }
  static constexpr __host__ __device__ int ldmatrix_offset(int lane_offset, int row_base, int col_base) {
    return lane_offset + row_base * kStride + col_base;
  }
};
// Unpadded rows of whole 128-byte segments, the 16-byte chunk index within each segment XORed with row % 8. For
// the tiles cp.async fills: with padded rows (stride 16 mod 128 bytes) seven rows in eight start mid-segment,
// and ncu counted 2.2-2.6x the ideal shared-memory wavefronts for those copies (hd 256 forward 2k: 89.5 M
// against FA2's 34.1 M, a quarter of all the kernel's shared-memory wavefronts; hd 256 backward 8k: 329 M
// against 135 M; FA2 swizzles the same way). ldmatrix stays conflict-free: the 8 rows of one of its 8x8
// matrices have 8 different row % 8, so their chunks land in 8 different bank groups.
// For ldmatrix the swizzle of (row_base + row_lane, col_base + col_lane) is the lane's own swizzled offset XORed with
// col_base's place in its segment (col_base and col_lane have disjoint bits, row_base keeps row % 8): written so,
// ptxas keeps at most one register per distinct col_base % 64 instead of one address per fragment (the direct
// form spilled 328 bytes in the hd 256 forward).
template <int kCols>
struct SwizzledRows : PlainLoads {
  static_assert(kCols % kSegmentElems == 0, "swizzled rows are whole 128-byte segments");
  static constexpr int kStride = kCols;
  static constexpr bool kSplitAddress = true;
  static constexpr int kChunksPerSegment = kSegmentElems / kChunkElems;
  static constexpr int kRowPeriod = kChunksPerSegment;  // the XOR pattern repeats every 8 rows
  static constexpr __host__ __device__ int offset(int row, int col) {
    return row * kCols + (col ^ ((row % kChunksPerSegment) * kChunkElems));
  }
  static constexpr __host__ __device__ int lane_offset(int row_lane, int col_lane) {
    return offset(row_lane, col_lane);
  }
  static constexpr __host__ __device__ int ldmatrix_offset(int lane_offset, int row_base, int col_base) {
    const int in_segment = col_base % kSegmentElems;
    return (lane_offset ^ in_segment) + row_base * kCols + (col_base - in_segment);
  }
};

// Unpadded rows of an odd number of 64-byte half segments (hd 32 / 96 / 160 / 224), the chunk index's low two bits
// XORed with (row / 2) % 4. Such rows start on bank group 0 or 4 (hd 96: 192 bytes = 48 words), so unswizzled the 8
// rows of an ldmatrix matrix hit 2 bank groups; the XOR spreads them over all 8. cp.async stays conflict-free too: one
// 8-chunk phase covers either 8 chunks of one row or 4 + 4 of two rows with the same XOR, one on groups 0-3, the other
// on 4-7. Padded rows (13 chunks at hd 96) conflict on those copies instead: ncu counted 3.0x the ideal wavefronts for
// the hd 96 backward's Q / dO copies (28.5 M against 9.5 M, 1k; FA2, 64-byte swizzle, 2.0x). The XOR touches only
// column bits 3-4, so the split form XORs col_base's bit 4 into the lane offset, as SwizzledRows does.
template <int kCols>
struct HalfSegmentSwizzledRows : PlainLoads {
  static constexpr int kHalfSegmentElems = kSegmentElems / 2;
  static_assert(kCols % kSegmentElems == kHalfSegmentElems, "an odd number of 64-byte half segments per row");
  static constexpr int kStride = kCols;
  static constexpr bool kSplitAddress = true;
  static constexpr int kChunksPerHalfSegment = kHalfSegmentElems / kChunkElems;
  static constexpr int kRowPeriod = 2 * kChunksPerHalfSegment;  // the XOR pattern repeats every 8 rows
  static constexpr __host__ __device__ int offset(int row, int col) {
    return row * kCols + (col ^ ((row / 2 % kChunksPerHalfSegment) * kChunkElems));
  }
  static constexpr __host__ __device__ int lane_offset(int row_lane, int col_lane) {
    return offset(row_lane, col_lane);
  }
  static constexpr __host__ __device__ int ldmatrix_offset(int lane_offset, int row_base, int col_base) {
    const int in_half = col_base % kHalfSegmentElems;
    return (lane_offset ^ in_half) + row_base * kCols + (col_base - in_half);
  }
};

// The layout a TMA tile load with the 128-byte swizzle writes (tma_load_sm90.h): the tile as kCols / 64 blocks of
// kRows x 64 elements (one per 128-byte segment of a row, each block its own TMA box), rows of 128 bytes, the
// 16-byte chunk index XORed with row % 8, as in SwizzledRows but segment-major. The blocks start 1024-byte aligned
// (kRows a multiple of 8 and an aligned tile), which the swizzle's hardware address pattern assumes.
template <int kRows, int kCols>
struct SegmentSwizzledRows : PlainLoads {
  static_assert(kCols % kSegmentElems == 0 && kRows % kChunkElems == 0, "whole segments, whole 8-row periods");
  static constexpr int kBlockElems = kRows * kSegmentElems;  // one segment's block
  static constexpr int kStride = kSegmentElems;
  static constexpr bool kSplitAddress = true;
  static constexpr int kChunksPerSegment = kSegmentElems / kChunkElems;
  static constexpr int kRowPeriod = kChunksPerSegment;
  static constexpr __host__ __device__ int offset(int row, int col) {
    return (col / kSegmentElems) * kBlockElems + row * kSegmentElems +
           ((col % kSegmentElems) ^ ((row % kChunksPerSegment) * kChunkElems));
  }
  static constexpr __host__ __device__ int lane_offset(int row_lane, int col_lane) {
    return offset(row_lane, col_lane);
  }
  static constexpr __host__ __device__ int ldmatrix_offset(int lane_offset, int row_base, int col_base) {
    const int in_segment = col_base % kSegmentElems;
    return (lane_offset ^ in_segment) + row_base * kSegmentElems + (col_base / kSegmentElems) * kBlockElems;
  }
};

// Layout with the split form whose lane offsets the loaders hide from ptxas (hide_from_compiler): it then keeps one
// register per lane offset instead of folding each into the address of every fragment. In the hd 128 backward,
// where the swizzled Q/dO addresses pushed the kernel past 255 registers, this halved the spill (52 -> 28 bytes,
// ptxas) and made the swizzled tiles win (bwd_common.h bwd_swizzles_queries).
template <typename Layout>
struct OpaqueLaneOffset : Layout {
  static_assert(Layout::kSplitAddress, "only split-form addresses have a lane offset to hide");
  static constexpr bool kOpaqueLaneOffset = true;
};

// Layout whose cp.async tile loads (load_tile_async here, bwd_common.h load_tile) branch on whole tiles: when every
// row and column of the tile is in range, the copies go without bounds checks, address selects or predicates, from
// one shared-memory base with immediate offsets (rows per step a multiple of kRowPeriod). Per 16-byte copy that is 3
// instructions instead of 6-9 (SASS), but the branch moves ptxas's register allocation around the whole loop, so the
// kernels take it only where it measured faster (fwd_tile_config.h fwd_branches_whole_tiles, bwd_common.h
// bwd_branches_whole_tiles).
template <typename Layout>
struct WholeTileLoads : Layout {
  static constexpr bool kWholeTileBranch = true;
};

// Layout whose cp.async tile loads (load_tile_async) keep one column chunk per thread even where the row's 16-byte
// chunks do not divide the threads (hd 96: 12 chunks against 128 threads; hd 160 / 192 / 224: 20 / 24 / 28): the
// largest multiple of the row's chunks loads (120 threads at hd 96, 10 rows a step), the rest idle. The generic form's
// per-copy row and column offsets are what ptxas held across the key loop (hd 96 standard forward: 92-116 bytes of
// spill, 25 local loads a key block; with this form none). The forward takes it where it measured faster
// (fwd_tile_config.h fwd_loads_fixed_columns), the backward's load_tile always (bwd_common.h).
template <typename Layout>
struct FixedColumnLoads : Layout {
  static constexpr bool kFixedColumnLoads = true;
};

// Layout whose cp.async tile loads (load_tile_async) split a row's 16-byte chunks into equal groups that divide the
// threads (hd 96: 12 chunks as 3 groups of 4, so 128 threads cover 32 rows a step), as FA2 loads its 32-column blocks:
// every thread issues the same number of copies (hd 96, 64 rows: 6), all from one source pointer and one row step
// with constant group offsets. The fixed-column form leaves threads idle where the row's chunks do not divide them
// (8 of 128 at hd 96, and 7 copies for some threads against 6), the generic one holds per-copy offsets across the
// key loop. The forward takes it where fwd_tile_config.h fwd_loads_grouped_columns says so.
template <typename Layout>
struct GroupedColumnLoads : Layout {
  static constexpr bool kGroupedColumnLoads = true;
};

// An empty asm that claims to change v: ptxas can no longer see where v came from or rematerialise it.
__device__ __forceinline__ void hide_from_compiler(int& v) { asm volatile("" : "+r"(v)); }

// Compile-time checks of a layout over a 64-row tile: the split ldmatrix form gives the same element as offset(),
// and every 8x8 ldmatrix matrix (8 consecutive rows from a multiple of 8, one 16-byte chunk each) touches 8
// different 16-byte bank groups.
constexpr int kLayoutCheckRows = 64;
template <typename Layout, int kCols>
constexpr bool split_form_matches() {
  for (int row_lane = 0; row_lane < 2 * kChunkElems; ++row_lane) {
    for (int col_lane = 0; col_lane <= kChunkElems; col_lane += kChunkElems) {
      const int lane = Layout::lane_offset(row_lane, col_lane);
      for (int row_base = 0; row_base < kLayoutCheckRows; row_base += kChunkElems) {
        for (int col_base = 0; col_base < kCols; col_base += 2 * kChunkElems) {
          if (Layout::ldmatrix_offset(lane, row_base, col_base) !=
              Layout::offset(row_base + row_lane, col_base + col_lane)) {
            return false;
          }
        }
      }
    }
  }
  return true;
}
template <typename Layout, int kCols>
constexpr bool ldmatrix_conflict_free() {
  constexpr int kBankGroups = kSegmentElems / kChunkElems;
  for (int row0 = 0; row0 < kLayoutCheckRows; row0 += kChunkElems) {
    for (int col = 0; col < kCols; col += kChunkElems) {
      unsigned groups = 0;
      for (int r = 0; r < kChunkElems; ++r) groups |= 1u << (Layout::offset(row0 + r, col) / kChunkElems % kBankGroups);
      if (groups != (1u << kBankGroups) - 1) return false;
    }
  }
  return true;
}
static_assert(split_form_matches<SwizzledRows<64>, 64>() && split_form_matches<SwizzledRows<256>, 256>() &&
                  split_form_matches<PaddedRows<96, true>, 96>() &&
                  split_form_matches<SegmentSwizzledRows<kLayoutCheckRows, 256>, 256>() &&
                  split_form_matches<HalfSegmentSwizzledRows<32>, 32>() &&
                  split_form_matches<HalfSegmentSwizzledRows<96>, 96>() &&
                  split_form_matches<HalfSegmentSwizzledRows<224>, 224>(),
              "split ldmatrix addressing");
static_assert(ldmatrix_conflict_free<SwizzledRows<128>, 128>() && ldmatrix_conflict_free<SwizzledRows<192>, 192>() &&
                  ldmatrix_conflict_free<PaddedRows<96>, 96>() &&
                  ldmatrix_conflict_free<SegmentSwizzledRows<kLayoutCheckRows, 256>, 256>() &&
                  ldmatrix_conflict_free<HalfSegmentSwizzledRows<32>, 32>() &&
                  ldmatrix_conflict_free<HalfSegmentSwizzledRows<96>, 96>() &&
                  ldmatrix_conflict_free<HalfSegmentSwizzledRows<160>, 160>(),
              "ldmatrix phases without bank conflicts");
// cp.async phases: 8 consecutive 16-byte chunks of the tile in row-major order (the fixed-column loads' thread order),
// from any row's start, touch 8 different bank groups.
template <typename Layout, int kCols>
constexpr bool copy_phases_conflict_free() {
  constexpr int kBankGroups = kSegmentElems / kChunkElems;
  constexpr int kChunksPerRow = kCols / kChunkElems;
  for (int row0 = 0; row0 < kLayoutCheckRows / 2; ++row0) {
    for (int chunk0 = 0; chunk0 < kLayoutCheckRows / 2 * kChunksPerRow; chunk0 += kBankGroups) {
      unsigned groups = 0;
      for (int i = 0; i < kBankGroups; ++i) {
        const int chunk = chunk0 + i;
        const int row = row0 + chunk / kChunksPerRow, col = chunk % kChunksPerRow * kChunkElems;
        groups |= 1u << (Layout::offset(row, col) / kChunkElems % kBankGroups);
      }
      if (groups != (1u << kBankGroups) - 1) return false;
    }
  }
  return true;
}
static_assert(copy_phases_conflict_free<HalfSegmentSwizzledRows<32>, 32>() &&
                  copy_phases_conflict_free<HalfSegmentSwizzledRows<96>, 96>() &&
                  copy_phases_conflict_free<HalfSegmentSwizzledRows<160>, 160>() &&
                  copy_phases_conflict_free<HalfSegmentSwizzledRows<224>, 224>() &&
                  !copy_phases_conflict_free<PaddedRows<96>, 96>(),
              "cp.async phases without bank conflicts");
// Swizzled rows where asked for and the rows are whole segments, padded rows otherwise. Which tiles ask: forward K/V
// (fwd_swizzles_kv) and backward Q/dO (bwd_swizzles_queries), chosen per head dim from measurements.
template <bool kSwizzle, int kCols>
using TileLayout = std::conditional_t<kSwizzle && kCols % kSegmentElems == 0, SwizzledRows<kCols>, PaddedRows<kCols>>;

__device__ __forceinline__ float read_bias(const void* base, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::kFloat16: return __half2float(static_cast<const __half*>(base)[index]);
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[index]);
    case DType::kFloat32: return static_cast<const float*>(base)[index];
    case DType::kFloat64: return static_cast<float>(static_cast<const double*>(base)[index]);
  }
  return 0.f;
}

// Whether a kRows x kHeadDim tile of Layout loads in the WholeTileLoads form with kThreads threads: the layout asks
// for it and every step of the threads covers whole rows, a multiple of the layout's row period.
template <int kRows, int kHeadDim, int kThreads, typename Layout>
constexpr bool loads_whole_tiles() {
  constexpr int kChunksPerRow = kHeadDim / kChunkElems;
  return Layout::kWholeTileBranch && kThreads % kChunksPerRow == 0 && kRows % (kThreads / kChunksPerRow) == 0 &&
         (kThreads / kChunksPerRow) % Layout::kRowPeriod == 0;
}

// The WholeTileLoads form of the cp.async tile loads (load_tile_async below, bwd_common.h load_tile): each thread keeps
// one column chunk and one shared-memory base and steps down the rows; a whole tile goes without bounds.
template <int kRows, int kHeadDim, int kThreads, typename Layout, typename T>
__device__ __forceinline__ void load_tile_whole_first(T* smem, const T* gmem, int64_t row_stride, int rows_valid,
                                                      int head_dim, int tid) {
  static_assert(loads_whole_tiles<kRows, kHeadDim, kThreads, Layout>(), "whole rows per step, on the row period");
  static_assert(sizeof(T) * kChunkElems == ptx::kCpAsyncBytes, "one 16-byte copy per chunk");
  constexpr int kChunksPerRow = kHeadDim / kChunkElems;
  constexpr int kRowsPerIter = kThreads / kChunksPerRow;
  const int col = (tid % kChunksPerRow) * kChunkElems;
  const int row0 = tid / kChunksPerRow;
  T* dst = smem + Layout::offset(row0, col);
  const T* src = gmem + row0 * row_stride + col;
  const int64_t step = kRowsPerIter * row_stride;
  if (rows_valid >= kRows && head_dim >= kHeadDim) {
#pragma unroll
    for (int i = 0; i < kRows / kRowsPerIter; ++i) {
      ptx::cp_async_16(dst + i * kRowsPerIter * Layout::kStride, src, true);
      src += step;
    }
    return;
  }
  const bool col_valid = col < head_dim;
#pragma unroll
  for (int i = 0; i < kRows / kRowsPerIter; ++i) {
    const bool valid = col_valid && row0 + i * kRowsPerIter < rows_valid;
    ptx::cp_async_16(dst + i * kRowsPerIter * Layout::kStride, valid ? src : gmem, valid);
    src += step;
  }
}

// Whether load_tile_fixed_columns serves a kHeadDim tile with kThreads threads: every row's chunks divide them, or the
// layout asks for the fixed-column form (FixedColumnLoads) and one row's chunks fit.
template <int kHeadDim, int kThreads, typename Layout>
constexpr bool loads_fixed_columns() {
  constexpr int kChunksPerRow = kHeadDim / kChunkElems;
  return kThreads % kChunksPerRow == 0 || (Layout::kFixedColumnLoads && kThreads >= kChunksPerRow);
}

// The fixed-column form of the cp.async tile loads (load_tile_async below, bwd_common.h load_tile): each of the first
// kLoaders threads (all where the row's chunks divide them) keeps one column chunk and walks rows with a fixed
// pointer step, two live 64-bit values instead of one per copy (the hoisted per-copy offsets cost ~30 registers and
// spilled); the last step may hold fewer than kRowsPerIter rows. Rows past rows_valid point at gmem (a real row) and
// read nothing. kDirect: the destination as one base plus row steps (the backward's padded, direct-address tiles)
// rather than Layout::offset per copy.
template <int kRows, int kHeadDim, int kThreads, typename Layout, bool kDirect = false, typename T>
__device__ __forceinline__ void load_tile_fixed_columns(T* smem, const T* gmem, int64_t row_stride, int rows_valid,
                                                        int head_dim, int tid) {
  static_assert(loads_fixed_columns<kHeadDim, kThreads, Layout>(), "a row's chunks fit the threads");
  static_assert(sizeof(T) * kChunkElems == ptx::kCpAsyncBytes, "one 16-byte copy per chunk");
  constexpr int kChunksPerRow = kHeadDim / kChunkElems;
  constexpr int kLoaders = kThreads / kChunksPerRow * kChunksPerRow;
  constexpr int kRowsPerIter = kLoaders / kChunksPerRow;
  constexpr int kIters = (kRows + kRowsPerIter - 1) / kRowsPerIter;
  if (kLoaders == kThreads || tid < kLoaders) {
    const int col = (tid % kChunksPerRow) * kChunkElems;
    const int row0 = tid / kChunksPerRow;
    const bool col_valid = col < head_dim;
    T* const dst = smem + row0 * Layout::kStride + col;
    const T* src = gmem + row0 * row_stride + col;
    const int64_t step = kRowsPerIter * row_stride;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int row = row0 + i * kRowsPerIter;
      if (kRows % kRowsPerIter == 0 || row < kRows) {
        const bool valid = col_valid && row < rows_valid;
        if constexpr (kDirect) {
          ptx::cp_async_16(dst + i * kRowsPerIter * Layout::kStride, valid ? src : gmem, valid);
        } else {
          ptx::cp_async_16(smem + Layout::offset(row, col), valid ? src : gmem, valid);
        }
      }
      src += step;
    }
  }
}

// Chunks per column group of the grouped form: the largest power of two dividing both the row's chunks and the threads.
template <int kHeadDim, int kThreads>
constexpr int column_group_chunks() {
  constexpr int kChunksPerRow = kHeadDim / kChunkElems;
  int group = 1;
  while (kChunksPerRow % (2 * group) == 0 && kThreads % (2 * group) == 0) group *= 2;
  return group;
}

// Whether load_tile_grouped_columns serves a kRows x kHeadDim tile with kThreads threads: the layout asks for it and
// each step of the threads covers whole rows that divide the tile.
template <int kRows, int kHeadDim, int kThreads, typename Layout>
constexpr bool loads_grouped_columns() {
  constexpr int kGroup = column_group_chunks<kHeadDim, kThreads>();
  return Layout::kGroupedColumnLoads && kGroup > 1 && kRows % (kThreads / kGroup) == 0;
}

// The grouped form of the cp.async tile loads (GroupedColumnLoads): thread tid keeps chunk tid % kGroup of every
// group and walks rows tid / kGroup + i x kRowsPerIter. Rows past rows_valid and columns past head_dim point at gmem
// (a real element) and read nothing. With WholeTileLoads too, a whole tile goes without bounds.
template <int kRows, int kHeadDim, int kThreads, typename Layout, typename T>
__device__ __forceinline__ void load_tile_grouped_columns(T* smem, const T* gmem, int64_t row_stride, int rows_valid,
                                                          int head_dim, int tid) {
  static_assert(loads_grouped_columns<kRows, kHeadDim, kThreads, Layout>(), "groups that divide the threads");
  static_assert(sizeof(T) * kChunkElems == ptx::kCpAsyncBytes, "one 16-byte copy per chunk");
  constexpr int kGroup = column_group_chunks<kHeadDim, kThreads>();
  constexpr int kGroupElems = kGroup * kChunkElems;
  constexpr int kGroups = kHeadDim / kGroupElems;
  constexpr int kRowsPerIter = kThreads / kGroup;
  const int col0 = (tid % kGroup) * kChunkElems;
  const int row0 = tid / kGroup;
  const T* src = gmem + row0 * row_stride + col0;
  const int64_t step = kRowsPerIter * row_stride;
  if constexpr (Layout::kWholeTileBranch) {  // a whole tile: no bounds, no address selects
    if (rows_valid >= kRows && head_dim >= kHeadDim) {
#pragma unroll
      for (int i = 0; i < kRows / kRowsPerIter; ++i) {
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
          ptx::cp_async_16(smem + Layout::offset(row0 + i * kRowsPerIter, col0 + g * kGroupElems),
                           src + g * kGroupElems, true);
        }
        src += step;
      }
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < kRows / kRowsPerIter; ++i) {
    const int row = row0 + i * kRowsPerIter;
    const bool row_valid = row < rows_valid;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int col = col0 + g * kGroupElems;
      const bool valid = row_valid && col < head_dim;
      ptx::cp_async_16(smem + Layout::offset(row, col), valid ? src + g * kGroupElems : gmem, valid);
    }
    src += step;
  }
}

// Issues cp.async for a kRows x kHeadDim tile (laid out as Layout in shared memory). Rows at or beyond rows_valid
// and columns at or beyond head_dim are zero-filled. Requires head_dim % 8 == 0, a row stride that is a multiple
// of 8 and a 16-byte-aligned gmem (the API guarantees all three for CUDA calls).
template <int kRows, int kHeadDim, int kThreads, typename Layout = PaddedRows<kHeadDim>, typename T>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, int64_t row_stride, int rows_valid,
                                                int head_dim, int tid) {
  constexpr int kChunksPerRow = kHeadDim / kChunkElems;
  if constexpr (loads_whole_tiles<kRows, kHeadDim, kThreads, Layout>()) {
    load_tile_whole_first<kRows, kHeadDim, kThreads, Layout>(smem, gmem, row_stride, rows_valid, head_dim, tid);
  } else if constexpr (loads_grouped_columns<kRows, kHeadDim, kThreads, Layout>()) {
    load_tile_grouped_columns<kRows, kHeadDim, kThreads, Layout>(smem, gmem, row_stride, rows_valid, head_dim, tid);
  } else if constexpr (loads_fixed_columns<kHeadDim, kThreads, Layout>()) {
    load_tile_fixed_columns<kRows, kHeadDim, kThreads, Layout>(smem, gmem, row_stride, rows_valid, head_dim, tid);
  } else {
    constexpr int kChunks = kRows * kChunksPerRow;
    constexpr int kIters = (kChunks + kThreads - 1) / kThreads;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int c = tid + i * kThreads;
      if (kChunks % kThreads == 0 || c < kChunks) {
        const int row = c / kChunksPerRow;
        const int col = (c % kChunksPerRow) * kChunkElems;
        const bool valid = row < rows_valid && col < head_dim;
        const T* src = valid ? gmem + row * row_stride + col : gmem;
        ptx::cp_async_16(smem + Layout::offset(row, col), src, valid);
      }
    }
  }
}

}  // namespace flash::sm80
