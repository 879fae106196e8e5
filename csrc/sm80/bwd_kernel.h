// Main kernel of the sm80+ backward (FA2-style): one CTA per (key block, kv head, batch entry). K_j and V_j
// are staged in shared memory once; the CTA walks every (q head of the group, query block) that can see the
// key block, with Q_i / dO_i staged by cp.async (two stages where the tile allows). Per block: S^T = K Q^T, P,
// dP^T = V dO^T, dS = P (dP - D) in registers; P and dS to shared memory; dV += P^T dO, dK += dS^T Q
// (registers, written once at the end, so GQA sums over the group in a fixed order; or, with the group's query heads
// split over CTAs, added into fp32 accumulators that a conversion pass turns into dk, dv); dQ_i += dS K into fp32
// global accumulators (atomics, or per-CTA accumulators with plain read-add-write when deterministic).
#pragma once

#include <cmath>
#include <type_traits>

#include "flash_attn/bwd_workspace.h"
#include "flash_attn/common/fast_tanh.h"
#include "flash_attn/common/math.h"
#include "flash_attn/common/philox.h"
#include "flash_attn/ptx/bulk_reduce_sm90.h"
#include "flash_attn/ptx/red_sm90.h"
#include "flash_attn/ptx/stmatrix_sm90.h"
#include "sm80/bwd_common.h"
#include "flash_attn/tensor_map_sm90.h"

namespace flash::sm80::bwd {

// Windows are clamped to this so int32 index math cannot overflow (any larger window sees everything).
constexpr int64_t kWindowClamp = int64_t{1} << 30;
// An unbounded window side in the relative masking (kBwdMasksByRelativeOffsets): past any key - query offset
// within a block.
constexpr int kUnboundedRelativeOffset = 1 << 30;

// Whether every (batch, row, head) of a tensor starts 16-byte aligned (so its rows can go through cp.async).
template <typename T>
__device__ __forceinline__ bool vector_tensor(const void* base, const TensorStrides& st, int64_t head_dim) {
  constexpr int kWidth = kVectorBytes / sizeof(T);
  return head_dim % kWidth == 0 && st.batch % kWidth == 0 && st.row % kWidth == 0 && st.head % kWidth == 0 &&
         reinterpret_cast<uintptr_t>(base) % kVectorBytes == 0;
}

// dq reductions. The accumulator interleaves each 16-column group (flash/bwd_workspace.h, dq_slot): lane t's
// columns 2t, 2t+1 of both n8 MMA tiles of a pair sit in slots 4t..4t+3, so on sm90 a lane adds its four
// values of a row with one `red.global.add.v4.f32` straight from its accumulators. The first version kept the
// natural column order and swapped halves between lanes t and t^1 first: 2 shuffles and 4 selects per
// fragment, 48 of ~1,100 instructions per hd 128 query block (SASS). Below sm90 (no vector reduction) each value
// goes by a scalar atomic, to the same slots.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kVectorDqReduction = true;
#else
constexpr bool kVectorDqReduction = false;
#endif

// Adds rows g (row_ok) and g + 8 (row8_ok) of the tile pair (lo, hi) at dst: this lane's slot 4t of row g.
// kAllRows: the caller knows both rows exist (every query block but a sequence's last), so the sm90
// reductions go unpredicated.
template <bool kAllRows>
__device__ __forceinline__ void add_dq_pair(float* dst, int64_t row_stride, const ptx::MmaC& lo, const ptx::MmaC& hi,
                                            bool row_ok, bool row8_ok) {
  float* dst8 = dst + 8 * row_stride;
  if constexpr (kVectorDqReduction && kAllRows) {
    ptx::red_add_v4_f32(dst, lo.reg[0], lo.reg[1], hi.reg[0], hi.reg[1]);
    ptx::red_add_v4_f32(dst8, lo.reg[2], lo.reg[3], hi.reg[2], hi.reg[3]);
  } else if constexpr (kVectorDqReduction) {
    ptx::red_add_v4_f32(dst, lo.reg[0], lo.reg[1], hi.reg[0], hi.reg[1], row_ok);
    ptx::red_add_v4_f32(dst8, lo.reg[2], lo.reg[3], hi.reg[2], hi.reg[3], row8_ok);
  } else {
    if (kAllRows || row_ok) {
      atomicAdd(dst, lo.reg[0]);
      atomicAdd(dst + 1, lo.reg[1]);
      atomicAdd(dst + 2, hi.reg[0]);
      atomicAdd(dst + 3, hi.reg[1]);
    }
    if (kAllRows || row8_ok) {
      atomicAdd(dst8, lo.reg[2]);
      atomicAdd(dst8 + 1, lo.reg[3]);
      atomicAdd(dst8 + 2, hi.reg[2]);
      atomicAdd(dst8 + 3, hi.reg[3]);
    }
  }
}

// Adds two consecutive fp32 values of a split dK / dV accumulator (8-byte aligned): one vector reduction on sm90,
// two scalar atomics below.
__device__ __forceinline__ void add_dkv_pair(float* dst, float x, float y) {
  if constexpr (kVectorDqReduction) {
    ptx::red_add_v2_f32(dst, x, y);
  } else {
    atomicAdd(dst, x);
    atomicAdd(dst + 1, y);
  }
}

// Columns of one dQ bulk-reduction box (bwd_stages_dq): one slot group of the accumulator, 64 bytes per row, so the
// two rows that one 8-lane phase of a 16-byte shared store covers fill all 32 banks.
constexpr int kDqBoxColumns = kDqSlotGroup;

template <int kHeadDim, MaskKind kMask, bool kFeatures, BwdTiles kTiles, bool kScoreMods = false>
struct BwdSmem {
  static constexpr BwdTileConfig kCfg = bwd_tile_config(kHeadDim, kFeatures, kTiles, kScoreMods);
  static constexpr int kStrideD = kHeadDim + kSmemRowPad;      // rows of Q, dO, K, V tiles
  static constexpr int kStrideM = kCfg.block_m + kSmemRowPad;  // rows of the P^T, dS^T tiles ([key][query])
  static constexpr int kKeyTile = kCfg.block_n * kStrideD;
  static constexpr int kQueryTile = kCfg.block_m * kStrideD;
  static constexpr int kScoreTile = kCfg.block_n * kStrideM;
  // The dQ staging tile (bwd_stages_dq): kBlockM x kHeadDim fp32 after the other tiles, at a kSmemAlign boundary (the
  // TMA unit reads unswizzled boxes from 128-byte-aligned addresses), then one staged row index per warp.
  static constexpr bool kStagesDq = bwd_stages_dq(kHeadDim, kMask, kFeatures, kTiles);
  static constexpr int kDqStageFloats = kStagesDq ? kCfg.block_m * kHeadDim : 0;
  template <typename T>
  static constexpr int dq_stage_offset() {
    return (bwd_smem_bytes(kCfg, kHeadDim, static_cast<int>(sizeof(T))) + kSmemAlign - 1) / kSmemAlign * kSmemAlign;
  }
  // With the staging: what the kernel needs where it runs its sm90 code.
  template <typename T>
  static constexpr int bytes() {
    return kStagesDq ? dq_stage_offset<T>() + kDqStageFloats * static_cast<int>(sizeof(float)) +
                           kCfg.warps * static_cast<int>(sizeof(int))
                     : unstaged_bytes<T>();
  }
  // Without it: enough below sm90, where the kernel reduces dQ from registers and never touches the staging.
  template <typename T>
  static constexpr int unstaged_bytes() {
    return bwd_smem_bytes(kCfg, kHeadDim, static_cast<int>(sizeof(T)));
  }
  template <typename T>
  static int bytes_on_device(bool bulk_device) {
    return bulk_device ? bytes<T>() : unstaged_bytes<T>();
  }
};

// kFeatures: softcap, ALiBi, bias, dropout or dbias may be on. The plain instantiation drops their code:
// measured with ptxas on hd128 causal, the general code path spills 292 bytes, the plain one 74.
// kTiles: the tile set (bwd_common.h); the launcher picks the one the device's shared memory allows.
// kScoreMods: the plain instantiation that also runs softcap and ALiBi (bwd_plain_runs_score_mods): the plain tiles,
// no bias, dropout or dbias code. kSplitHeads: the plain instantiation whose CTAs take a share of their KV head's
// query heads (BwdParams::head_splits); an instantiation of its own because the runtime split cost the plain kernels
// up to 300 bytes of spill (ptxas, hd 128 / 256), the same code with the split folded away.
// dq_map: the dq accumulator's tensor map, for kernels that stage dQ (bwd_stages_dq) in calls that are not
// deterministic. Compiled for sm90 those kernels add dQ only through it (the launcher runs the feature kernel where
// it has no map); every other kernel, and every kernel below sm90, reduces from registers.
template <typename T, int kHeadDim, MaskKind kMask, bool kFeatures, BwdTiles kTiles, bool kScoreMods = false,
          bool kSplitHeads = false>
__global__ void __launch_bounds__(BwdSmem<kHeadDim, kMask, kFeatures, kTiles, kScoreMods>::kCfg.threads(), 1)
    bwd_kernel(const BwdParams bp, const __grid_constant__ TensorMapArg dq_map) {
  static_assert(!(kFeatures && kScoreMods), "the score-mods instantiation is a plain one");
  static_assert(!(kSplitHeads && (kFeatures || kScoreMods)), "the split-heads instantiation is a plain one");
  using Smem = BwdSmem<kHeadDim, kMask, kFeatures, kTiles, kScoreMods>;
  constexpr BwdTileConfig kCfg = Smem::kCfg;
  constexpr int kWarps = kCfg.warps;
  constexpr int kThreads = kCfg.threads();
  constexpr bool kDoubleBuffer = kCfg.q_buffers == 2;
  constexpr int kBlockM = kCfg.block_m;
  constexpr int kBlockN = kCfg.block_n;
  constexpr int kStrideM = Smem::kStrideM;
  // Q and dO load every iteration: swizzled rows where that measured faster (bwd_swizzles_queries). K and V load
  // once per key block and keep padded rows, as do P^T and dS^T, which the threads store from registers. Kernels
  // that swizzle address their padded tiles in the split form too, the others in the direct form: the split form
  // cost the padded hd 128 kernel 110 bytes of spill (ptxas), and each form is the one measured for its kernel.
  // Where the Q/dO lane offsets are hidden from ptxas (bwd_hides_query_lane_offsets) the padded tiles keep the
  // direct form too, as measured.
  constexpr bool kSwizzleQueries = bwd_swizzles_queries(kHeadDim, kFeatures, kTiles) && kHeadDim % kSegmentElems == 0;
  constexpr bool kHideOffsets = kSwizzleQueries && bwd_hides_query_lane_offsets(kHeadDim);
  // Their loads branch on whole tiles where that measured faster (bwd_branches_whole_tiles).
  // Head dims of odd half segments (bwd_swizzles_half_segments) swizzle within half segments; the other tiles keep
  // the padded kernel's layouts and address forms.
  constexpr bool kHalfSegmentQueries = bwd_swizzles_half_segments(kHeadDim, kFeatures, kTiles);
  using QueryTiles = std::conditional_t<
      kHideOffsets, OpaqueLaneOffset<SwizzledRows<kHeadDim>>,
      std::conditional_t<kHalfSegmentQueries, GroupedColumnLoads<HalfSegmentSwizzledRows<kHeadDim>>,
                         TileLayout<kSwizzleQueries, kHeadDim>>>;
  using KeyTiles = PaddedRows<kHeadDim, kSwizzleQueries && !kHideOffsets>;
  constexpr bool kWholeTiles = bwd_branches_whole_tiles(kHeadDim, kFeatures, kTiles);
  using QueryLayout = std::conditional_t<kWholeTiles, WholeTileLoads<QueryTiles>, QueryTiles>;
  using KeyLayout = std::conditional_t<kWholeTiles, WholeTileLoads<KeyTiles>, KeyTiles>;
  using ScoreLayout = PaddedRows<kBlockM, kSwizzleQueries && !kHideOffsets>;
  // S^T / dP^T warp tiles: kSKeys x kSQueries.
  constexpr int kSWarpsN = kCfg.s_warps_n;
  constexpr int kSWarpsM = kWarps / kSWarpsN;
  constexpr int kSKeys = kBlockN / kSWarpsN;
  constexpr int kSQueries = kBlockM / kSWarpsM;
  constexpr int kSMT = kSKeys / kMmaM;
  constexpr int kSNT = kSQueries / kMmaN;
  // dK / dV warp tiles: kKVKeys x kKVDims.
  constexpr int kKVWarpsN = kCfg.kv_warps_n;
  constexpr int kKVWarpsD = kWarps / kKVWarpsN;
  constexpr int kKVKeys = kBlockN / kKVWarpsN;
  constexpr int kKVDims = kHeadDim / kKVWarpsD;
  constexpr int kKVMT = kKVKeys / kMmaM;
  constexpr int kKVNT = kKVDims / kMmaN;
  // dQ warp tiles: kQRows x kQDims, accumulated kQChunk n8 tiles at a time (at most 32 accumulator
  // registers live next to dK and dV).
  constexpr int kQWarpsM = kCfg.q_warps_m;
  constexpr int kQWarpsD = kWarps / kQWarpsM;
  constexpr int kQRows = kBlockM / kQWarpsM;
  constexpr int kQMT = kQRows / kMmaM;
  constexpr int kQDims = kHeadDim / kQWarpsD;
  constexpr int kQNT = kQDims / kMmaN;
  constexpr int kQMaxChunk = 8 / kQMT;
  constexpr int kQChunk = kQNT <= kQMaxChunk ? kQNT
                          : (kQNT % kQMaxChunk == 0 ? kQMaxChunk : (kQNT % 4 == 0 && kQMaxChunk >= 4 ? 4 : 2));
  static_assert(kSMT >= 1 && kSNT % 2 == 0 && kKVMT >= 1 && kKVNT % 2 == 0 && kQMT >= 1 && kQNT % kQChunk == 0 &&
                    kQChunk % 2 == 0 && kHeadDim % kMmaK == 0,
                "tile shape");
  static_assert(kSWarpsN * kSWarpsM == kWarps && kKVWarpsN * kKVWarpsD == kWarps && kQWarpsM * kQWarpsD == kWarps &&
                    kSKeys * kSWarpsN == kBlockN && kSQueries * kSWarpsM == kBlockM &&
                    kKVKeys * kKVWarpsN == kBlockN && kKVDims * kKVWarpsD == kHeadDim &&
                    kQRows * kQWarpsM == kBlockM && kQDims * kQWarpsD == kHeadDim,
                "warp grids cover their GEMM outputs exactly");
  // add_dq_pair writes 16-column slot groups of the dq accumulator (dq_slot): every warp's first column and
  // every chunk's must start a group.
  static_assert(kQDims % kDqSlotGroup == 0 && (kQChunk * kMmaN) % kDqSlotGroup == 0, "dq columns on slot groups");
  static_assert(kCfg.q_buffers == 1 || kCfg.q_buffers == 2, "one or two Q/dO stages");
  static_assert(!Smem::kStagesDq || (Smem::kDqStageFloats == kWarps * kQRows * kQDims && kQDims % kDqBoxColumns == 0),
                "the dQ staging holds every warp's boxes");
  static_assert(!Smem::kStagesDq || kCfg.q_buffers == 2, "the dQ boxes are issued after the next block's prefetch");
  static_assert(2 * kBlockM <= kThreads && kBlockM % kWarpSize == 0,
                "stage() fetches lse and delta with one thread per row each, whole warps each");

  extern __shared__ __align__(kSmemAlign) unsigned char smem_raw[];
  T* s_k = reinterpret_cast<T*>(smem_raw);
  T* s_v = s_k + Smem::kKeyTile;
  T* s_q = s_v + Smem::kKeyTile;                        // [q_buffers][kQueryTile]
  T* s_do = s_q + kCfg.q_buffers * Smem::kQueryTile;    // [q_buffers][kQueryTile]
  T* s_p = s_do + kCfg.q_buffers * Smem::kQueryTile;    // P^T (dropout applied) [key][query]
  T* s_ds = s_p + Smem::kScoreTile;                     // dS^T [key][query]
  float* s_lse = reinterpret_cast<float*>(s_ds + Smem::kScoreTile);  // [q_buffers][kBlockM], natural log
  float* s_delta = s_lse + kCfg.q_buffers * kBlockM;                  // [q_buffers][kBlockM]

  const FwdParams& p = bp.fwd;
  const AttentionShape& shape = p.shape;
  const int b = blockIdx.z;
  const int hk = blockIdx.y;
  const SeqInfo si = seq_info(shape, b);
  const int seqlen_q = si.seqlen_q;
  const int seqlen_k = si.seqlen_k;
  const int n_blocks = (seqlen_k + kBlockN - 1) / kBlockN;
  // kSplitHeads (BwdParams::head_splits, bwd_workspace.h bwd_head_splits; the launcher never splits deterministic
  // calls): CTA x takes the query heads (x % head_splits) * heads_per_split ... of its KV head's group for key block
  // x / head_splits (the splits of a key block are neighbours, so they meet its K / V in L2) and adds dK, dV into the
  // workspace's fp32 accumulators.
  const int head_splits = kSplitHeads ? static_cast<int>(bp.head_splits) : 1;
  if (static_cast<int>(blockIdx.x) / head_splits >= n_blocks) return;

  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int g = lane / 4;
  const int t = lane % 4;
  // This warp's dQ staging (bwd_stages_dq): kQDims / kDqBoxColumns boxes of kQRows x kDqBoxColumns fp32, dense.
  constexpr bool kBulkDq = Smem::kStagesDq && kVectorDqReduction && ptx::kHasBulkReduce;
  // The dq accumulator's layout (bwd_dq_layout); the launcher passes the same to the dq conversion.
  constexpr DqLayout kDqLayout = bwd_dq_layout(kHeadDim, kMask, kFeatures, kTiles);
  constexpr int64_t kDqGroupStep = dq_group_step(kDqLayout);
  static_assert(!kBulkDq || kDqLayout == DqLayout::kRows, "the bulk reductions address plain rows");
  constexpr int kDqBoxes = kQDims / kDqBoxColumns;
  constexpr int kDqBoxFloats = kQRows * kDqBoxColumns;
  float* const s_dq_all = reinterpret_cast<float*>(smem_raw + Smem::template dq_stage_offset<T>());
  float* s_dq = s_dq_all + warp * kDqBoxes * kDqBoxFloats;
  int* s_dq_rows = reinterpret_cast<int*>(s_dq_all + Smem::kDqStageFloats);  // [kWarps], lane 0 of each warp only
  const bool bulk_dq = kBulkDq && !bp.deterministic;  // the launcher passes a map whenever this holds
  const int group = static_cast<int>(shape.nheads_q / shape.nheads_k);
  const int64_t head_dim = shape.head_dim;
  const int offset = p.mask.bottom_right ? seqlen_k - seqlen_q : 0;
  const bool left_bounded = p.mask.window_left != kUnboundedWindow;
  const bool right_bounded = p.mask.window_right != kUnboundedWindow;
  const int window_left = static_cast<int>(p.mask.window_left < kWindowClamp ? p.mask.window_left : kWindowClamp);
  const int window_right = static_cast<int>(p.mask.window_right < kWindowClamp ? p.mask.window_right : kWindowClamp);

  const float scale = static_cast<float>(p.softmax_scale);
  const float scale_log2 = static_cast<float>(p.softmax_scale * kLog2e);
  const float softcap = static_cast<float>(p.softcap);
  constexpr bool kModScores = kFeatures || kScoreMods;
  const bool has_softcap = kModScores && p.softcap > 0.0;
  const float scale_over_cap = has_softcap ? static_cast<float>(p.softmax_scale / p.softcap) : 0.f;
  const bool has_alibi = kModScores && p.mask.alibi_slopes != nullptr;
  const bool has_bias = kFeatures && p.mask.bias != nullptr;
  const bool write_dbias = kFeatures && bp.dbias != nullptr;
  const bool plain_scores = !has_softcap && !has_alibi && !has_bias;
  const bool dropout = kFeatures && p.dropout.p > 0.0;
  const uint64_t seed = dropout ? static_cast<uint64_t>(p.dropout.rng_state[0]) : 0;
  const uint64_t rng_offset = dropout ? static_cast<uint64_t>(p.dropout.rng_state[1]) : 0;
  const uint64_t keep_threshold = dropout_keep_threshold(p.dropout.p);
  const float inv_keep = dropout ? static_cast<float>(1.0 / (1.0 - p.dropout.p)) : 1.f;

  const bool vector_q = vector_tensor<T>(p.q, p.q_strides, head_dim);
  const bool vector_k = vector_tensor<T>(p.k, p.k_strides, head_dim);
  const bool vector_v = vector_tensor<T>(p.v, p.v_strides, head_dim);
  const bool vector_do = vector_tensor<T>(bp.dout, bp.dout_strides, head_dim);
  const bool pair_dk = vector_tensor<T>(bp.dk, bp.dk_strides, head_dim);
  const bool pair_dv = vector_tensor<T>(bp.dv, bp.dv_strides, head_dim);

  const BwdWorkspace ws = bwd_workspace(bp, kDqLayout);
  const int64_t split = bp.deterministic ? blockIdx.x : 0;
  const float* lse_base = static_cast<const float*>(p.lse) + b * p.lse_batch_stride + si.q_row0;

  // Warp tile origins.
  const int s_key0 = (warp % kSWarpsN) * kSKeys;
  const int s_query0 = (warp / kSWarpsN) * kSQueries;
  const int kv_key0 = (warp % kKVWarpsN) * kKVKeys;
  const int kv_dim0 = (warp / kKVWarpsN) * kKVDims;
  const int q_row0 = (warp % kQWarpsM) * kQRows;
  const int q_dim0 = (warp / kQWarpsM) * kQDims;
  // Lane 0 adds this warp's staged boxes, if any, at the accumulator row it noted in s_dq_rows (of the 2D map: q head x
  // total_q rows; the launcher keeps them within int). Every lane fenced its stores for the TMA unit, and a barrier
  // or __syncwarp followed. The row waits in shared memory rather than in a register: kept live across a block, it
  // raised the spill from 10 / 8 to 44 / 60 bytes (hd 64, ptxas).
  auto issue_staged_dq = [&] {
    if (lane == 0) {
      const int row = s_dq_rows[warp];
      if (row >= 0) {
#pragma unroll
        for (int box = 0; box < kDqBoxes; ++box) {
          ptx::bulk_reduce_add_2d(&dq_map.map, s_dq + box * kDqBoxFloats, q_dim0 + box * kDqBoxColumns, row);
        }
        ptx::bulk_commit_group();
        s_dq_rows[warp] = -1;
      }
    }
  };

  for (int n_block = blockIdx.x / head_splits; n_block < n_blocks; n_block += gridDim.x / head_splits) {
    const int n0 = n_block * kBlockN;
    const int n_end = min(n0 + kBlockN, seqlen_k);
    // Query rows that see any key of [n0, n_end): i + offset + right >= n0 and i + offset - left < n_end.
    int row_lo = 0, row_hi = seqlen_q;
    if (right_bounded) row_lo = max(0, n0 - offset - window_right);
    if (left_bounded) row_hi = min(seqlen_q, n_end - offset + window_left);
    const int m_first = row_lo / kBlockM;
    const int m_count = row_hi > row_lo ? (row_hi + kBlockM - 1) / kBlockM - m_first : 0;
    const int heads_per_split = group / head_splits;
    const int iterations = m_count * heads_per_split;

    const T* k_tile = static_cast<const T*>(p.k) + b * p.k_strides.batch + (si.k_row0 + n0) * p.k_strides.row +
                      hk * p.k_strides.head;
    const T* v_tile = static_cast<const T*>(p.v) + b * p.v_strides.batch + (si.k_row0 + n0) * p.v_strides.row +
                      hk * p.v_strides.head;

    // Where the query block m0 of q head h starts in Q, dO, lse and delta. The loop below advances these by one
    // block within a head and calls this only when the head changes: recomputing all four per block cost ~40
    // 64-bit multiply-adds per iteration (SASS, hd 128).
    struct StageSource {
      const T* q;
      const T* dout;
      const float* lse;
      const float* delta;
    };
    auto source_at = [&](int h, int m0) {
      const int64_t row = si.q_row0 + m0;
      return StageSource{static_cast<const T*>(p.q) + b * p.q_strides.batch + row * p.q_strides.row +
                             h * p.q_strides.head,
                         static_cast<const T*>(bp.dout) + b * bp.dout_strides.batch + row * bp.dout_strides.row +
                             h * bp.dout_strides.head,
                         lse_base + h * p.lse_head_stride + m0,
                         ws.delta + h * ws.delta_head_stride + si.global_q_row0 + m0};
    };
    const int64_t q_block_step = kBlockM * p.q_strides.row;
    const int64_t do_block_step = kBlockM * bp.dout_strides.row;

    // Stages the query block at src (first row m0) into buffer buf: Q, dO, lse and delta, all by cp.async (the
    // caller commits). lse and delta of rows past the end are zero-filled: such rows only occur in blocks that
    // are not `full` below, where the visibility test zeroes P (the first version loaded lse and delta with
    // plain loads whose global latency stalled warps 0-1 at the top of every query block).
    auto stage = [&](const StageSource& src, int m0, int buf) {
      load_tile<T, kBlockM, kHeadDim, kThreads, QueryLayout>(s_q + buf * Smem::kQueryTile, src.q, p.q_strides.row,
                                                seqlen_q - m0, static_cast<int>(head_dim), vector_q, tid);
      load_tile<T, kBlockM, kHeadDim, kThreads, QueryLayout>(s_do + buf * Smem::kQueryTile, src.dout,
                                                bp.dout_strides.row, seqlen_q - m0, static_cast<int>(head_dim),
                                                vector_do, tid);
      // Threads [0, kBlockM) fetch lse, [kBlockM, 2 kBlockM) delta: whole warps each.
      if (tid < 2 * kBlockM) {
        const bool is_lse = tid < kBlockM;
        const int r = tid % kBlockM;
        const bool valid = m0 + r < seqlen_q;
        const float* row_src = (is_lse ? src.lse : src.delta) + r;
        float* dst = (is_lse ? s_lse : s_delta) + buf * kBlockM + r;
        ptx::cp_async_4(dst, valid ? row_src : lse_base, valid);
      }
    };

    __syncthreads();  // the previous key block's readers of s_k / s_v are done
    load_tile<T, kBlockN, kHeadDim, kThreads, KeyLayout>(s_k, k_tile, p.k_strides.row, seqlen_k - n0,
                                              static_cast<int>(head_dim), vector_k, tid);
    load_tile<T, kBlockN, kHeadDim, kThreads, KeyLayout>(s_v, v_tile, p.v_strides.row, seqlen_k - n0,
                                              static_cast<int>(head_dim), vector_v, tid);
    // Head and query block of the current iteration, advanced incrementally (query blocks inner).
    int cur_h = hk * group + static_cast<int>(blockIdx.x) % head_splits * heads_per_split;
    int cur_m_block = m_first;
    StageSource next_src = source_at(cur_h, m_first * kBlockM);
    if (iterations > 0) stage(next_src, m_first * kBlockM, 0);
    ptx::cp_async_commit();

    ptx::MmaC acc_dk[kKVMT][kKVNT];
    if (kBulkDq && bulk_dq && lane == 0) s_dq_rows[warp] = -1;  // nothing staged yet
    ptx::MmaC acc_dv[kKVMT][kKVNT];

    for (int it = 0; it < iterations; ++it) {
      const int buf = kDoubleBuffer ? it & 1 : 0;
      const int h = cur_h;
      const int m0 = cur_m_block * kBlockM;
      // The walk wraps from the last query block to m_first of the next head. (Walking each key block from a different
      // first block gained 2 % at hd 256 non-causal while dQ's reductions filled half lines, and lost 2-3 % with whole
      // lines: docs/perf_log.md "sixth session", "eleventh session".)
      const bool wraps = cur_m_block + 1 == m_first + m_count;
      const int next_m_block = wraps ? m_first : cur_m_block + 1;
      const int next_h = wraps ? cur_h + 1 : cur_h;
      cur_h = next_h;
      cur_m_block = next_m_block;
      if (wraps) {
        next_src = source_at(next_h, m_first * kBlockM);
      } else {
        next_src.q += q_block_step;
        next_src.dout += do_block_step;
        next_src.lse += kBlockM;
        next_src.delta += kBlockM;
      }
      const T* cur_q = s_q + buf * Smem::kQueryTile;
      const T* cur_do = s_do + buf * Smem::kQueryTile;
      const float* cur_lse = s_lse + buf * kBlockM;
      const float* cur_delta = s_delta + buf * kBlockM;
      ptx::cp_async_wait<0>();
      __syncthreads();  // this block's tiles are in; every warp is done with the previous block

      // ---- S^T = K Q^T and dP^T = V dO^T (keys x queries) ----
      ptx::MmaC acc_s[kSMT][kSNT];
      ptx::MmaC acc_dp[kSMT][kSNT];
#pragma unroll
      for (int kk = 0; kk < kHeadDim / kMmaK; ++kk) {
        ptx::MmaA a[kSMT];
#pragma unroll
        for (int mt = 0; mt < kSMT; ++mt) a[mt] = load_a<KeyLayout>(s_k, s_key0 + mt * kMmaM, kk * kMmaK, lane);
#pragma unroll
        for (int np = 0; np < kSNT / 2; ++np) {
          ptx::MmaB bq[2];
          load_b_pair<QueryLayout>(bq, cur_q, s_query0 + np * 2 * kMmaN, kk * kMmaK, lane);
#pragma unroll
          for (int mt = 0; mt < kSMT; ++mt) {
            ptx::mma_m16n8k16(acc_s[mt][2 * np], a[mt], bq[0], T{});
            ptx::mma_m16n8k16(acc_s[mt][2 * np + 1], a[mt], bq[1], T{});
          }
        }
      }
      // Prefetch the next block into the other buffer (its readers finished before the barrier above). Issued
      // after the S^T MMAs, not before: its address math then overlaps MMAs in flight instead of delaying the
      // first one after the barrier. With one buffer it waits for the dK/dV GEMMs below.
      if constexpr (kDoubleBuffer) {
        if (it + 1 < iterations) stage(next_src, next_m_block * kBlockM, buf ^ 1);
        ptx::cp_async_commit();
      }
      // The previous block's dQ boxes go to the TMA unit here, after this block's prefetch: ptxas tracks bulk groups
      // on the scoreboard of the cp.async groups (SB0: UTMACMDFLUSH's read barrier, LDGDEPBAR's write barrier in
      // the SASS control bits), so issued at the end of the previous block they would hold up the cp.async wait
      // before this block's first barrier until the unit had read them.
      if (kBulkDq && bulk_dq) issue_staged_dq();
#pragma unroll
      for (int kk = 0; kk < kHeadDim / kMmaK; ++kk) {
        ptx::MmaA a[kSMT];
#pragma unroll
        for (int mt = 0; mt < kSMT; ++mt) a[mt] = load_a<KeyLayout>(s_v, s_key0 + mt * kMmaM, kk * kMmaK, lane);
#pragma unroll
        for (int np = 0; np < kSNT / 2; ++np) {
          ptx::MmaB bo[2];
          load_b_pair<QueryLayout>(bo, cur_do, s_query0 + np * 2 * kMmaN, kk * kMmaK, lane);
#pragma unroll
          for (int mt = 0; mt < kSMT; ++mt) {
            ptx::mma_m16n8k16(acc_dp[mt][2 * np], a[mt], bo[0], T{});
            ptx::mma_m16n8k16(acc_dp[mt][2 * np + 1], a[mt], bo[1], T{});
          }
        }
      }

      // ---- P, dS elementwise (masking only where the block is not fully visible) ----
      bool full = m0 + kBlockM <= seqlen_q && n0 + kBlockN <= seqlen_k;
      if (kMask != MaskKind::kNone) {
        if (left_bounded) full = full && m0 + kBlockM - 1 + offset - window_left <= n0;
        if (right_bounded) full = full && m0 + offset + window_right + 1 >= n0 + kBlockN;
      }
      // Whether score (mt, nt, e) at key, query of a block that is not `full` is visible. With
      // kBwdMasksByRelativeOffsets against this thread's first score's key - query and the sequences' ends, so
      // that a score compares its compile-time offsets with per-block limits; otherwise from its key and query.
      const int rel_q0 = m0 + s_query0 + 2 * t;
      const int rel_k0 = n0 + s_key0 + g;
      const int rel_lo = left_bounded ? rel_q0 + offset - window_left - rel_k0 : -kUnboundedRelativeOffset;
      const int rel_hi = right_bounded ? rel_q0 + offset + window_right - rel_k0 : kUnboundedRelativeOffset;
      const int rel_q_limit = seqlen_q - rel_q0;
      const int rel_k_limit = seqlen_k - rel_k0;
      auto visible_at = [&](int mt, int nt, int e, int key, int query) {
        if constexpr (kBwdMasksByRelativeOffsets) {
          const int dk = mt * kMmaM + 8 * (e / 2);
          const int dq = nt * kMmaN + (e % 2);
          bool visible = dq < rel_q_limit && dk < rel_k_limit;
          if constexpr (kMask != MaskKind::kNone) visible = visible && dk - dq >= rel_lo && dk - dq <= rel_hi;
          return visible;
        } else {
          bool visible = query < seqlen_q && key < seqlen_k;
          if (kMask != MaskKind::kNone) {
            if (left_bounded) visible = visible && key >= query + offset - window_left;
            if (right_bounded) visible = visible && key <= query + offset + window_right;
          }
          return visible;
        }
      };
      if (full && plain_scores && !dropout && !write_dbias) {
        // Interior block without score modifiers, lse and D by pairs: P = exp2(S * scale * log2e - lse * log2e),
        // dS = P (dP - D).
#pragma unroll
        for (int nt = 0; nt < kSNT; ++nt) {
          const int query_local = s_query0 + nt * kMmaN + 2 * t;
          const float2 lse2 = *reinterpret_cast<const float2*>(cur_lse + query_local);
          const float2 delta2 = *reinterpret_cast<const float2*>(cur_delta + query_local);
#pragma unroll
          for (int mt = 0; mt < kSMT; ++mt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float lse_e = (e % 2 == 0 ? lse2.x : lse2.y) * static_cast<float>(kLog2e);
              const float delta_e = e % 2 == 0 ? delta2.x : delta2.y;
              const float prob = exp2f(fmaf(acc_s[mt][nt].reg[e], scale_log2, -lse_e));
              acc_s[mt][nt].reg[e] = prob;
              acc_dp[mt][nt].reg[e] = prob * (acc_dp[mt][nt].reg[e] - delta_e);
            }
          }
        }
      } else if (kScoreMods) {
        // The score-mods instantiation (softcap and / or ALiBi, no bias, dropout or dbias): one straight-line pass with
        // softcap and one without, chosen once per block, in the log2 domain (log2 e folded into the constants); ALiBi
        // in both, without a branch (slope 0 when absent), its distance from one conversion of the thread's base and
        // compile-time offsets. The general code below tests each feature per score and converts each score's
        // distance (hd 128 loop 2,079 instructions against 1,698 / 1,640 for one pass); H200, bf16, 4k, passes /
        // general (TFLOP/s, thirty-third session): hd 128 softcap 278 / 235, ALiBi 294 / 236 (plain 314), causal 230 /
        // 200, 242 / 201 (plain 265); hd 64 softcap 198 / 144, ALiBi 236 / 144 (plain 285); hd 256 level to +10 %.
        const float slope_log2 =
            has_alibi ? p.mask.alibi_slopes[b * p.mask.alibi_batch_stride + h] * static_cast<float>(kLog2e) : 0.f;
        const float cap_log2 = softcap * static_cast<float>(kLog2e);
        // |query + offset - key| = |distance0 + (nt * 8 + e % 2) - (mt * 16 + 8 * (e / 2))|: exact in fp32 below 2^24.
        const float distance0 = static_cast<float>(m0 + s_query0 + 2 * t + offset - n0 - s_key0 - g);
        auto mods_pass = [&](auto softcap_on) {
          constexpr bool kSoftcap = decltype(softcap_on)::value;
          // kBwdSoftcapTanhFirst: th = tanh(s / cap) in place of s, dP - D times tanh's derivative in place of dP;
          // the element loop below then reads th as its score and scales the folded dP by P alone.
          constexpr bool kTanhFirst = kSoftcap && kBwdSoftcapTanhFirst;
          // kBwdScoreModsFoldLse: -lse log2(e) rides the first FFMA of the exponent instead of an FADD before exp2.
          constexpr bool kFoldLse = kBwdScoreModsFoldLse;
          if constexpr (kTanhFirst) {
#pragma unroll
            for (int mt = 0; mt < kSMT; ++mt) {
#pragma unroll
              for (int nt = 0; nt < kSNT; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                  const float th = fast_tanh(acc_s[mt][nt].reg[e] * scale_over_cap);
                  const float delta = cur_delta[s_query0 + nt * kMmaN + 2 * t + (e % 2)];
                  acc_s[mt][nt].reg[e] = th;
                  acc_dp[mt][nt].reg[e] = (acc_dp[mt][nt].reg[e] - delta) * (1.f - th * th);
                }
              }
            }
          }
#pragma unroll
          for (int mt = 0; mt < kSMT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < kSNT; ++nt) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int key_local = s_key0 + mt * kMmaM + g + 8 * (e / 2);
                const int query_local = s_query0 + nt * kMmaN + 2 * t + (e % 2);
                const float s = acc_s[mt][nt].reg[e];
                float th = 0.f;
                auto lse_log2 = [&] { return cur_lse[query_local] * static_cast<float>(kLog2e); };
                float z_log2;
                if constexpr (kTanhFirst) {
                  z_log2 = kFoldLse ? fmaf(cap_log2, s, -lse_log2()) : cap_log2 * s;
                } else if constexpr (kSoftcap) {
                  th = fast_tanh(s * scale_over_cap);
                  z_log2 = kFoldLse ? fmaf(cap_log2, th, -lse_log2()) : cap_log2 * th;
                } else {
                  z_log2 = kFoldLse ? fmaf(s, scale_log2, -lse_log2()) : s * scale_log2;
                }
                const float step = static_cast<float>(nt * kMmaN + e % 2 - mt * kMmaM - 8 * (e / 2));
                z_log2 = fmaf(-slope_log2, fabsf(distance0 + step), z_log2);
                float prob = exp2f(kFoldLse ? z_log2 : z_log2 - lse_log2());
                if (!full) prob = visible_at(mt, nt, e, n0 + key_local, m0 + query_local) ? prob : 0.f;
                acc_s[mt][nt].reg[e] = prob;
                if constexpr (kTanhFirst) {
                  acc_dp[mt][nt].reg[e] *= prob;
                } else {
                  const float dz = prob * (acc_dp[mt][nt].reg[e] - cur_delta[query_local]);
                  acc_dp[mt][nt].reg[e] = kSoftcap ? dz * (1.f - th * th) : dz;
                }
              }
            }
          }
        };
        if (has_softcap) {
          mods_pass(std::true_type{});
        } else {
          mods_pass(std::false_type{});
        }
      } else {
        const float alibi_slope = has_alibi ? p.mask.alibi_slopes[b * p.mask.alibi_batch_stride + h] : 0.f;
        const int64_t batch_head = static_cast<int64_t>(b) * shape.nheads_q + h;
#pragma unroll
        for (int mt = 0; mt < kSMT; ++mt) {
#pragma unroll
          for (int nt = 0; nt < kSNT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int key_local = s_key0 + mt * kMmaM + g + 8 * (e / 2);
              const int query_local = s_query0 + nt * kMmaN + 2 * t + (e % 2);
              const int key = n0 + key_local;
              const int query = m0 + query_local;
              const float s = acc_s[mt][nt].reg[e];
              float th = 0.f;
              float prob;
              if (plain_scores) {
                prob = exp2f(fmaf(s, scale_log2, -cur_lse[query_local] * static_cast<float>(kLog2e)));
              } else {
                float z;
                if (has_softcap) {
                  th = fast_tanh(s * scale_over_cap);
                  z = softcap * th;
                } else {
                  z = s * scale;
                }
                if (has_alibi) z -= alibi_slope * static_cast<float>(abs(query + offset - key));
                if (has_bias && query < seqlen_q && key < seqlen_k) {
                  const ScoreStrides& bs = p.mask.bias_strides;
                  z += read_bias(p.mask.bias, p.mask.bias_dtype,
                                 b * bs.batch + h * bs.head + query * bs.row + key * bs.col);
                }
                prob = exp2f(fmaf(z, static_cast<float>(kLog2e), -cur_lse[query_local] * static_cast<float>(kLog2e)));
              }
              if (!full) prob = visible_at(mt, nt, e, key, query) ? prob : 0.f;
              float dp = acc_dp[mt][nt].reg[e];
              float prob_used = prob;
              if (dropout) {
                const PhiloxBlock words = dropout_words(seed, rng_offset, batch_head, query, key / kPhiloxWordsPerCall);
                const bool keep = words.word[key % kPhiloxWordsPerCall] < keep_threshold;
                prob_used = keep ? prob * inv_keep : 0.f;
                dp = keep ? dp * inv_keep : 0.f;
              }
              const float dz = prob * (dp - cur_delta[query_local]);
              if (write_dbias && query < seqlen_q && key < seqlen_k) {
                const ScoreStrides& ds = bp.dbias_strides;
                static_cast<float*>(bp.dbias)[b * ds.batch + h * ds.head + query * ds.row + key * ds.col] = dz;
              }
              acc_s[mt][nt].reg[e] = prob_used;
              acc_dp[mt][nt].reg[e] = has_softcap ? dz * (1.f - th * th) : dz;
            }
          }
        }
      }
      if constexpr (ptx::kHasStmatrix && bwd_stores_scores_with_stmatrix(kHeadDim, kMask)) {
        // sm90: one stmatrix.x4 per pair of n8 tiles and operand (matrices: rows 0-7 / 8-15 of tile nt, then of
        // nt + 1), a quarter of the 32-bit stores (where: bwd_common.h).
        const int matrix = lane / 8;
        const int row_in_tile = (matrix % 2) * 8 + lane % 8;
#pragma unroll
        for (int mt = 0; mt < kSMT; ++mt) {
#pragma unroll
          for (int np = 0; np < kSNT / 2; ++np) {
            const int offset = (s_key0 + mt * kMmaM + row_in_tile) * kStrideM + s_query0 + (2 * np + matrix / 2) * kMmaN;
            const ptx::MmaC& p0 = acc_s[mt][2 * np];
            const ptx::MmaC& p1 = acc_s[mt][2 * np + 1];
            const ptx::MmaC& d0 = acc_dp[mt][2 * np];
            const ptx::MmaC& d1 = acc_dp[mt][2 * np + 1];
            ptx::stmatrix_x4(s_p + offset, pack_float2<T>(p0.reg[0], p0.reg[1]), pack_float2<T>(p0.reg[2], p0.reg[3]),
                             pack_float2<T>(p1.reg[0], p1.reg[1]), pack_float2<T>(p1.reg[2], p1.reg[3]));
            ptx::stmatrix_x4(s_ds + offset, pack_float2<T>(d0.reg[0], d0.reg[1]), pack_float2<T>(d0.reg[2], d0.reg[3]),
                             pack_float2<T>(d1.reg[0], d1.reg[1]), pack_float2<T>(d1.reg[2], d1.reg[3]));
          }
        }
      } else {
#pragma unroll
        for (int mt = 0; mt < kSMT; ++mt) {
#pragma unroll
          for (int nt = 0; nt < kSNT; ++nt) {
            const int key_local = s_key0 + mt * kMmaM + g;
            const int query_local = s_query0 + nt * kMmaN + 2 * t;
            uint32_t* p_lo = reinterpret_cast<uint32_t*>(s_p + key_local * kStrideM + query_local);
            uint32_t* p_hi = reinterpret_cast<uint32_t*>(s_p + (key_local + 8) * kStrideM + query_local);
            uint32_t* ds_lo = reinterpret_cast<uint32_t*>(s_ds + key_local * kStrideM + query_local);
            uint32_t* ds_hi = reinterpret_cast<uint32_t*>(s_ds + (key_local + 8) * kStrideM + query_local);
            *p_lo = pack_float2<T>(acc_s[mt][nt].reg[0], acc_s[mt][nt].reg[1]);
            *p_hi = pack_float2<T>(acc_s[mt][nt].reg[2], acc_s[mt][nt].reg[3]);
            *ds_lo = pack_float2<T>(acc_dp[mt][nt].reg[0], acc_dp[mt][nt].reg[1]);
            *ds_hi = pack_float2<T>(acc_dp[mt][nt].reg[2], acc_dp[mt][nt].reg[3]);
          }
        }
      }
      __syncthreads();  // P^T and dS^T complete

      // ---- dV += P^T dO, dK += dS^T Q (keys x head dim) ----
#pragma unroll
      for (int kk = 0; kk < kBlockM / kMmaK; ++kk) {
        ptx::MmaA a_p[kKVMT], a_ds[kKVMT];
#pragma unroll
        for (int mt = 0; mt < kKVMT; ++mt) {
          a_p[mt] = load_a<ScoreLayout>(s_p, kv_key0 + mt * kMmaM, kk * kMmaK, lane);
          a_ds[mt] = load_a<ScoreLayout>(s_ds, kv_key0 + mt * kMmaM, kk * kMmaK, lane);
        }
#pragma unroll
        for (int np = 0; np < kKVNT / 2; ++np) {
          ptx::MmaB bo[2], bq[2];
          load_b_pair_trans<QueryLayout>(bo, cur_do, kv_dim0 + np * 2 * kMmaN, kk * kMmaK, lane);
          load_b_pair_trans<QueryLayout>(bq, cur_q, kv_dim0 + np * 2 * kMmaN, kk * kMmaK, lane);
#pragma unroll
          for (int mt = 0; mt < kKVMT; ++mt) {
            ptx::mma_m16n8k16(acc_dv[mt][2 * np], a_p[mt], bo[0], T{});
            ptx::mma_m16n8k16(acc_dv[mt][2 * np + 1], a_p[mt], bo[1], T{});
            ptx::mma_m16n8k16(acc_dk[mt][2 * np], a_ds[mt], bq[0], T{});
            ptx::mma_m16n8k16(acc_dk[mt][2 * np + 1], a_ds[mt], bq[1], T{});
          }
        }
      }

      if constexpr (!kDoubleBuffer) {
        // The dK/dV GEMMs were the last readers of Q, dO (and the elementwise pass of lse, delta): once every
        // warp is past them, the next block loads into the same buffer while dQ below reads only dS^T and K.
        __syncthreads();
        if (it + 1 < iterations) stage(next_src, next_m_block * kBlockM, 0);
        ptx::cp_async_commit();
      }

      // ---- dQ_i += dS K (queries x head dim), into the fp32 accumulator of this split ----
      // kRows: from the warp's first row; kRowPairs: from the head's first, as a row's place in its pair depends on its
      // parity. (The kRows form is the one measured before the row pairs; a shared form raised the spill of the causal
      // hd 128 kernel from 20 / 40 to 48 / 64 bytes, ptxas, and cost it 2-4 %.)
      const int64_t dq_warp_row = si.global_q_row0 + m0 + q_row0;
      float* dq_acc = ws.dq_accum + split * ws.dq_split_stride + h * ws.dq_head_stride +
                      (kDqLayout == DqLayout::kRows ? dq_warp_row * ws.dq_row_stride : 0);
      if (kBulkDq && bulk_dq) {
        // The previous block's boxes have left the staging (issued after this block's S^T GEMM; the wait also covers
        // this block's prefetch, on the same scoreboard, which has had the dP^T and dK / dV GEMMs to land).
        if (lane == 0) ptx::bulk_wait_group_read<0>();
        __syncwarp();
      }
#pragma unroll
      for (int c0 = 0; c0 < kQNT; c0 += kQChunk) {
        ptx::MmaC acc_q[kQMT][kQChunk];
#pragma unroll
        for (int kk = 0; kk < kBlockN / kMmaK; ++kk) {
          ptx::MmaA a[kQMT];
#pragma unroll
          for (int mt = 0; mt < kQMT; ++mt) {
            a[mt] = load_a_trans<ScoreLayout>(s_ds, q_row0 + mt * kMmaM, kk * kMmaK, lane);
          }
#pragma unroll
          for (int np = 0; np < kQChunk / 2; ++np) {
            ptx::MmaB bk[2];
            load_b_pair_trans<KeyLayout>(bk, s_k, q_dim0 + (c0 + 2 * np) * kMmaN, kk * kMmaK, lane);
#pragma unroll
            for (int mt = 0; mt < kQMT; ++mt) {
              ptx::mma_m16n8k16(acc_q[mt][2 * np], a[mt], bk[0], T{});
              ptx::mma_m16n8k16(acc_q[mt][2 * np + 1], a[mt], bk[1], T{});
            }
          }
        }
        // This lane's slot 4t of row g in the first tile pair of the chunk (address and row checks once
        // per chunk, after the MMAs so they hold no registers during them). Rows g + 8 and g + 16 lie 8 and 16 rows
        // on in either layout.
        float* dq_lane_acc =
            kDqLayout == DqLayout::kRows
                ? dq_acc + g * ws.dq_row_stride + q_dim0 + c0 * kMmaN + 4 * t
                : dq_acc + dq_offset(kDqLayout, dq_warp_row + g, q_dim0 + c0 * kMmaN, ws.dq_row_stride) + 4 * t;
        if (bp.deterministic) {
          // This CTA is the only writer of its accumulator, and each element always has the same thread.
#pragma unroll
          for (int mt = 0; mt < kQMT; ++mt) {
#pragma unroll
            for (int np = 0; np < kQChunk / 2; ++np) {
              const ptx::MmaC& lo = acc_q[mt][2 * np];
              const ptx::MmaC& hi = acc_q[mt][2 * np + 1];
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                if (m0 + q_row0 + mt * kMmaM + g + 8 * r >= seqlen_q) continue;
                float4* dst = reinterpret_cast<float4*>(dq_lane_acc + (mt * kMmaM + 8 * r) * ws.dq_row_stride +
                                                        np * kDqGroupStep);
                float4 sum = *dst;
                sum.x += lo.reg[2 * r];
                sum.y += lo.reg[2 * r + 1];
                sum.z += hi.reg[2 * r];
                sum.w += hi.reg[2 * r + 1];
                *dst = sum;
              }
            }
          }
        } else if constexpr (kBulkDq) {
          // Into this warp's staging boxes in the accumulator's slot order: pair c0 / 2 + np is box c0 / 2 + np,
          // lane t's four values of a row at slot 4t. Rows past seqlen_q hold exact zeros (P, hence dS, is zero
          // there) and add nothing where they land.
#pragma unroll
          for (int mt = 0; mt < kQMT; ++mt) {
#pragma unroll
            for (int np = 0; np < kQChunk / 2; ++np) {
              const ptx::MmaC& lo = acc_q[mt][2 * np];
              const ptx::MmaC& hi = acc_q[mt][2 * np + 1];
              float* box = s_dq + (c0 / 2 + np) * kDqBoxFloats + (mt * kMmaM + g) * kDqBoxColumns + 4 * t;
              *reinterpret_cast<float4*>(box) = make_float4(lo.reg[0], lo.reg[1], hi.reg[0], hi.reg[1]);
              *reinterpret_cast<float4*>(box + 8 * kDqBoxColumns) =
                  make_float4(lo.reg[2], lo.reg[3], hi.reg[2], hi.reg[3]);
            }
          }
        } else {
          auto reduce = [&](auto all_rows) {
#pragma unroll
            for (int mt = 0; mt < kQMT; ++mt) {
              const int row = m0 + q_row0 + mt * kMmaM + g;
              float* dst = dq_lane_acc + mt * kMmaM * ws.dq_row_stride;
#pragma unroll
              for (int np = 0; np < kQChunk / 2; ++np) {
                add_dq_pair<decltype(all_rows)::value>(dst + np * kDqGroupStep, ws.dq_row_stride, acc_q[mt][2 * np],
                                                       acc_q[mt][2 * np + 1], row < seqlen_q, row + 8 < seqlen_q);
              }
            }
          };
          if (m0 + kBlockM <= seqlen_q) {
            reduce(std::true_type{});
          } else {
            reduce(std::false_type{});
          }
        }
      }
      if (kBulkDq && bulk_dq) {
        // Every lane's stores visible to the TMA unit; the next block issues them (above), the last block below.
        ptx::fence_proxy_async_shared();
        if (lane == 0) s_dq_rows[warp] = static_cast<int>(h * bp.total_q + si.global_q_row0 + m0 + q_row0);
      }
    }
    if (kBulkDq && bulk_dq) {
      __syncwarp();
      issue_staged_dq();
    }

    ptx::cp_async_wait<0>();  // nothing may still be writing s_k / s_v when the next key block reloads them
    // The TMA unit must have read the last boxes before the CTA's shared memory goes away.
    if (kBulkDq && bulk_dq && lane == 0) ptx::bulk_wait_group_read<0>();

    // ---- dK = scale * dS^T Q, dV: this key block's rows of the kv head ----
    if constexpr (kSplitHeads) {
      // Accumulator rows: the packed key row (varlen) or batch entry * seqlen_k + key, then the KV head
      // (bwd_dkv_convert_kernel.h reads them back). The workspace is looked up here again, from the parameters,
      // rather than kept live through the loop (ptxas: the plain hd 128 kernel spilled 290 bytes with it live).
      // The key-row loop is written out here and in the direct store below: one visitor lambda for both changed the
      // SASS of the validated plain kernels (hd 128 causal 5,152 -> 5,240 lines, sm_90a).
      const BwdWorkspace dkv_ws = bwd_workspace(bp, DqLayout::kRows);
      const int64_t row_step = shape.nheads_k * dkv_ws.dkv_row_stride;
      const int64_t first_row =
          (shape.cu_seqlens_k != nullptr ? si.k_row0 : static_cast<int64_t>(b) * shape.seqlen_k) + n0 + kv_key0 + g;
      const int64_t thread_offset = (first_row * shape.nheads_k + hk) * dkv_ws.dkv_row_stride + kv_dim0 + 2 * t;
      float* dk_acc = dkv_ws.dk_accum + thread_offset;
      float* dv_acc = dkv_ws.dv_accum + thread_offset;
#pragma unroll
      for (int mt = 0; mt < kKVMT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int key_local = kv_key0 + mt * kMmaM + g + 8 * r;
          if (n0 + key_local >= seqlen_k) continue;
          const int64_t row_offset = (mt * kMmaM + 8 * r) * row_step;
#pragma unroll
          for (int nt = 0; nt < kKVNT; ++nt) {
            if (kv_dim0 + nt * kMmaN + 2 * t >= head_dim) continue;
            add_dkv_pair(dk_acc + row_offset + nt * kMmaN, acc_dk[mt][nt].reg[2 * r] * scale,
                         acc_dk[mt][nt].reg[2 * r + 1] * scale);
            add_dkv_pair(dv_acc + row_offset + nt * kMmaN, acc_dv[mt][nt].reg[2 * r], acc_dv[mt][nt].reg[2 * r + 1]);
          }
        }
      }
      continue;
    }
    T* dk = static_cast<T*>(bp.dk) + b * bp.dk_strides.batch + (si.k_row0 + n0) * bp.dk_strides.row +
            hk * bp.dk_strides.head;
    T* dv = static_cast<T*>(bp.dv) + b * bp.dv_strides.batch + (si.k_row0 + n0) * bp.dv_strides.row +
            hk * bp.dv_strides.head;
    if constexpr (bwd_stages_dkv(kHeadDim, kMask != MaskKind::kNone)) {
      // Staged (bwd_stages_dkv): dK then dV as row-major tiles of Smem::kStrideD elements from the start of shared
      // memory, then whole rows out in 16-byte chunks. The next key block's first barrier keeps its loads off these
      // tiles until every thread has stored its chunks.
      if (vector_rows(dk, bp.dk_strides.row, head_dim) && vector_rows(dv, bp.dv_strides.row, head_dim)) {
        constexpr int kStride = Smem::kStrideD;
        constexpr int kWidth = kVectorBytes / static_cast<int>(sizeof(T));
        constexpr int kRowChunks = kHeadDim / kWidth;
        static_assert(2 * kBlockN * kStride * static_cast<int>(sizeof(T)) <= Smem::template unstaged_bytes<T>() &&
                          (kStride * static_cast<int>(sizeof(T))) % kVectorBytes == 0 && kHeadDim % kWidth == 0,
                      "the dK and dV tiles fit the kernel's shared memory in 16-byte rows");
        T* s_dk = reinterpret_cast<T*>(smem_raw);
        T* s_dv = s_dk + kBlockN * kStride;
        __syncthreads();  // every warp's last GEMMs and the TMA unit's reads of the dQ boxes are done
#pragma unroll
        for (int mt = 0; mt < kKVMT; ++mt) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int key_local = kv_key0 + mt * kMmaM + g + 8 * r;
#pragma unroll
            for (int nt = 0; nt < kKVNT; ++nt) {
              const int col = kv_dim0 + nt * kMmaN + 2 * t;
              *reinterpret_cast<uint32_t*>(s_dk + key_local * kStride + col) =
                  pack_float2<T>(acc_dk[mt][nt].reg[2 * r] * scale, acc_dk[mt][nt].reg[2 * r + 1] * scale);
              *reinterpret_cast<uint32_t*>(s_dv + key_local * kStride + col) =
                  pack_float2<T>(acc_dv[mt][nt].reg[2 * r], acc_dv[mt][nt].reg[2 * r + 1]);
            }
          }
        }
        __syncthreads();
        const int rows = min(kBlockN, seqlen_k - n0);
        for (int i = tid; i < 2 * kBlockN * kRowChunks; i += kThreads) {
          const bool value_tile = i >= kBlockN * kRowChunks;
          const int item = value_tile ? i - kBlockN * kRowChunks : i;
          const int row = item / kRowChunks;
          const int column = (item % kRowChunks) * kWidth;
          if (row >= rows || column >= head_dim) continue;
          const uint4 chunk = *reinterpret_cast<const uint4*>((value_tile ? s_dv : s_dk) + row * kStride + column);
          T* dst = value_tile ? dv + row * bp.dv_strides.row : dk + row * bp.dk_strides.row;
          *reinterpret_cast<uint4*>(dst + column) = chunk;
        }
        continue;
      }
    }
#pragma unroll
    for (int mt = 0; mt < kKVMT; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int key_local = kv_key0 + mt * kMmaM + g + 8 * r;
        if (n0 + key_local >= seqlen_k) continue;
        T* dk_row = dk + key_local * bp.dk_strides.row;
        T* dv_row = dv + key_local * bp.dv_strides.row;
#pragma unroll
        for (int nt = 0; nt < kKVNT; ++nt) {
          const int col = kv_dim0 + nt * kMmaN + 2 * t;
          const float k0 = acc_dk[mt][nt].reg[2 * r] * scale, k1 = acc_dk[mt][nt].reg[2 * r + 1] * scale;
          const float v0 = acc_dv[mt][nt].reg[2 * r], v1 = acc_dv[mt][nt].reg[2 * r + 1];
          if (pair_dk && col < head_dim) {
            *reinterpret_cast<uint32_t*>(dk_row + col) = pack_float2<T>(k0, k1);
          } else if (!pair_dk) {
            if (col < head_dim) dk_row[col] = from_float<T>(k0);
            if (col + 1 < head_dim) dk_row[col + 1] = from_float<T>(k1);
          }
          if (pair_dv && col < head_dim) {
            *reinterpret_cast<uint32_t*>(dv_row + col) = pack_float2<T>(v0, v1);
          } else if (!pair_dv) {
            if (col < head_dim) dv_row[col] = from_float<T>(v0);
            if (col + 1 < head_dim) dv_row[col + 1] = from_float<T>(v1);
          }
        }
      }
    }
  }
}

}  // namespace flash::sm80::bwd
