// run_fwd<dtype, head dim, mask>: launches the Hopper forward kernel (fwd_kernel.h) for one call on a stream: tensor
// maps for Q, K and V, the shared-memory opt-in, one CTA per (query tile, key split, head, batch entry) or a CTA per
// SM walking them, and the combine kernel after a split call. Included by the
// generated translation units of the ("sm90", "fwd") kernel-table entries; dispatch sends only the calls that
// dispatch/sm90_policy.h accepts.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "dispatch/device_attributes.h"
#include "flash_attn/common/math.h"
#include "flash_attn/tensor_map_sm90.h"
#include "sm80/fwd_combine_kernel.h"
#include "sm90/fwd_kernel.h"

namespace flash::sm90 {

template <DType kDType>
using Element = std::conditional_t<kDType == DType::kFloat16, __half, __nv_bfloat16>;

// (head dim, head, row, batch) map of a (batch, rows, heads, head_dim) 16-bit tensor in boxes of 64 columns x
// box_rows rows of box_heads heads (in shared memory row by row, each row's heads in turn: a packed GQA tile's rows);
// rows and columns past the tensor read as zeros.
template <typename T>
bool encode_rows_map(CUtensorMap& map, const void* base, const TensorStrides& strides, int64_t head_dim,
                     int64_t heads, int64_t rows, int64_t batch, int box_rows, int box_heads = 1) {
  TensorMapArg arg{};
  const CUtensorMapDataType type =
      std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const uint64_t dims[4] = {static_cast<uint64_t>(head_dim), static_cast<uint64_t>(heads),
                            static_cast<uint64_t>(rows), static_cast<uint64_t>(batch)};
  // One batch entry (varlen: batch stride 0) still needs a stride the encoder accepts: the rows' extent.
  const int64_t batch_stride = batch > 1 ? strides.batch : rows * strides.row;
  const uint64_t bytes[3] = {static_cast<uint64_t>(strides.head) * sizeof(T),
                             static_cast<uint64_t>(strides.row) * sizeof(T),
                             static_cast<uint64_t>(batch_stride) * sizeof(T)};
  const uint32_t box[4] = {kSegmentElems, static_cast<uint32_t>(box_heads), static_cast<uint32_t>(box_rows), 1};
  if (!encode_16bit_swizzled_map_4d(arg, base, type, dims, bytes, box)) return false;
  map = arg.map;
  return true;
}

// kSchedule: the policy's (fwd_schedule) unless a caller compares schedules (tools/sm90_fwd_check.cu).
// The rows the tensor maps span: a varlen tensor is one (total rows, heads, head dim) entry, a dense one has its
// batch entries.
struct MapRows {
  int64_t q_rows;
  int64_t k_rows;
  int64_t entries;
};
inline MapRows map_rows(const AttentionShape& shape) {
  const bool varlen = shape.cu_seqlens_q != nullptr;
  return MapRows{varlen ? shape.total_q : shape.seqlen_q, varlen ? shape.total_k : shape.seqlen_k,
                 varlen ? 1 : shape.batch};
}

// The failures of a Hopper launch's host steps, as errors that say what to do. `path`: "forward" or "backward".
[[noreturn]] inline void fail_tensor_maps(const char* path, const char* operands, int64_t head_dim) {
  throw std::runtime_error(std::string("flash_attn ") + path + " (Hopper path): the driver could not make TMA " +
                           "tensor maps for " + operands + " (head_dim=" + std::to_string(head_dim) +
                           "); strides must be multiples of 16 bytes below 2^40. Pass contiguous tensors, or set "
                           "FLASH_ATTN_HOPPER=0 to use the portable kernels.");
}
inline void require_smem_opt_in(cudaError_t status, int bytes, const char* path) {
  if (status == cudaSuccess) return;
  throw std::runtime_error(std::string("flash_attn ") + path + " (Hopper path): shared-memory opt-in of " +
                           std::to_string(bytes) + " bytes failed: " + cudaGetErrorString(status));
}

constexpr int64_t kMaxGridX = 2147483647;  // CUDA's grid x limit; the persistent kernel strides over tiles past it

// Calls with softcap or ALiBi take the general kernel (transform_scores); the rest the lean one.
inline bool fwd_needs_general_kernel(const FwdParams& p) {
  return p.softcap > 0.0 || p.mask.alibi_slopes != nullptr;
}

// One kernel instantiation's launch: the shared-memory opt-in (once per instantiation and process), then `ctas` CTAs
// (persistent kernels) or the (query block, head, batch entry) grid.
template <typename T, int kHeadDim, MaskKind kMask, FwdSchedule kSchedule, bool kGeneral, FwdTileConfig kTile,
          bool kPersistent, int kPolyEvery, bool kCarry, bool kSplit>
void launch_fwd_kernel(FwdKernelArgs& args, int64_t ctas, cudaStream_t stream) {
  constexpr int kStorageDim = fwd_storage_dim(kHeadDim);
  using Layout = FwdSmemLayout<kStorageDim, kTile.block_m, kTile.block_n, kTile.stages,
                               fwd_q_stages<kStorageDim, kTile.block_m, kTile.block_n, kTile.stages, kCarry>()>;
  auto kernel = fwd_kernel<T, kHeadDim, kMask, kSchedule, kGeneral, kTile.block_m, kTile.block_n, kTile.stages,
                           kPersistent, kPolyEvery, kCarry, kSplit>;
  constexpr int kThreads = fwd_threads(kTile.block_m);
  // Above 48 KB of dynamic shared memory a kernel must opt in.
  static const cudaError_t opt_in =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Layout::kLaunchBytes);
  require_smem_opt_in(opt_in, Layout::kLaunchBytes, "forward");
  if constexpr (kPersistent) {
    args.walk.order.ctas = make_fast_divmod(ctas);
    kernel<<<static_cast<unsigned>(ctas), kThreads, Layout::kLaunchBytes, stream>>>(args);
  } else {
    const AttentionShape& shape = args.params.shape;
    const dim3 grid(static_cast<unsigned>(args.num_m_blocks * args.num_splits), static_cast<unsigned>(args.tile_heads),
                    static_cast<unsigned>(shape.batch));
    kernel<<<grid, kThreads, Layout::kLaunchBytes, stream>>>(args);
  }
}

template <typename T, int kHeadDim, MaskKind kMask, FwdSchedule kSchedule, bool kGeneral, FwdTileConfig kTile,
          bool kPersistent, int kPolyEvery>
void launch_fwd(FwdKernelArgs& args, cudaStream_t stream) {
  if (args.num_splits > 1) {  // a CTA per (tile, split): split calls are planned for few tiles (sm90_fwd_num_splits)
    launch_fwd_kernel<T, kHeadDim, kMask, kSchedule, kGeneral, kTile, kPersistent, kPolyEvery, false, true>(
        args, args.num_tiles, stream);
    return;
  }
  if constexpr (kPersistent) {
    // A CTA per SM (each holds a whole SM's shared memory) striding over the tiles, or one CTA per tile
    // (fwd_persistent_pays). CTAs that walk several tiles carry each tile's tail into the next
    // (fwd_carries_tile_tail); one tile per CTA has nothing to carry into and takes the kernel without it.
    int device = 0;
    cudaGetDevice(&device);
    const int64_t sms = device_attributes(device).num_sms;
    constexpr int kStorageDim = fwd_storage_dim(kHeadDim);
    const int64_t max_ctas = fwd_persistent_pays(kStorageDim, kMask, args.params.shape.seqlen_k) ? sms : kMaxGridX;
    const int64_t ctas = args.num_tiles < max_ctas ? args.num_tiles : max_ctas;
    constexpr bool kCanCarry = fwd_carries_tile_tail(kStorageDim) && kSchedule == FwdSchedule::kOverlap;
    if (kCanCarry && ctas < args.num_tiles) {
      constexpr FwdSchedule kCarrying = fwd_carrying_schedule(kTile.block_m);
      launch_fwd_kernel<T, kHeadDim, kMask, kCarrying, kGeneral, kTile, true, kPolyEvery, kCanCarry, false>(args, ctas,
                                                                                                          stream);
    } else {
      launch_fwd_kernel<T, kHeadDim, kMask, kSchedule, kGeneral, kTile, true, kPolyEvery, false, false>(args, ctas,
                                                                                                       stream);
    }
  } else {
    launch_fwd_kernel<T, kHeadDim, kMask, kSchedule, kGeneral, kTile, false, kPolyEvery, false, false>(args, 0, stream);
  }
}

// A split call's merge: the portable path's combine kernel (one CTA per query row) over the partials, whose rows are
// the head dim rounded up to kSplitRowGranule floats: the bucket's width, since buckets are 32 columns wide
// (dispatch/sm90_policy.h sm90_head_dim_bucket).
template <typename T, int kHeadDim>
void launch_split_combine(const FwdParams& params, cudaStream_t stream) {
  static_assert(kHeadDim % kSplitRowGranule == 0, "partial rows of whole granules");
  if ((params.shape.head_dim + kSplitRowGranule - 1) / kSplitRowGranule * kSplitRowGranule != kHeadDim) {
    throw std::invalid_argument("flash_attn internal error: a split Hopper forward of head_dim=" +
                                std::to_string(params.shape.head_dim) + " ran in the " + std::to_string(kHeadDim) +
                                " bucket, whose partial rows are " + std::to_string(kHeadDim) + " wide");
  }
  const dim3 grid(static_cast<unsigned>(params.shape.batch * params.shape.nheads_q * params.shape.seqlen_q));
  sm80::fwd_combine_kernel<T, kHeadDim><<<grid, sm80::kCombineThreads, 0, stream>>>(params);
}

// kSchedule, kTile, kPersistent and kPolyEvery (lean kernels) / kPolyEveryGeneral (softcap / ALiBi kernels): the
// policies' (fwd_schedule, fwd_tile_config, fwd_persistent, fwd_poly_exp_every{,_general}) unless a caller compares
// others (tools/sm90_fwd_check.cu), at the head dim's storage bucket (fwd_storage_dim: hd 96 takes hd 128's), but
// the tile at the bucket's own head dim, as dispatch/sm90_policy.cpp plans the grid with it (today both give the
// same tile: fwd_tile_config's thresholds fall on whole segments).
template <DType kDType, int kHeadDim, MaskKind kMask, FwdSchedule kSchedule = fwd_schedule(fwd_storage_dim(kHeadDim)),
          FwdTileConfig kTile = fwd_tile_config(kHeadDim, kMask),
          bool kPersistent = fwd_persistent(fwd_storage_dim(kHeadDim), kMask),
          int kPolyEvery = fwd_poly_exp_every(fwd_storage_dim(kHeadDim)),
          int kPolyEveryGeneral = fwd_poly_exp_every_general(fwd_storage_dim(kHeadDim))>
void run_fwd(const FwdParams& params, void* stream) {
  // Tall rows (fwd_tile_config.h kFwdTallTile) where the plan chose them, as the second instantiation of the bucket's
  // policy tile.
  constexpr bool kPolicyTile = kTile == fwd_tile_config(kHeadDim, kMask);
  if constexpr (fwd_has_tall_rows(kHeadDim, kMask) && kPolicyTile) {
    if (params.sm90_tall_rows) {
      run_fwd<kDType, kHeadDim, kMask, kSchedule, kFwdTallTile, kPersistent, kPolyEvery, kPolyEveryGeneral>(params,
                                                                                                           stream);
      return;
    }
  }
  if (params.sm90_tall_rows && !(fwd_has_tall_rows(kHeadDim, kMask) && kPolicyTile) && kTile != kFwdTallTile) {
    throw std::invalid_argument("flash_attn internal error: the plan chose tall rows (FwdParams::sm90_tall_rows) for "
                                "head_dim=" + std::to_string(params.shape.head_dim) +
                                ", whose Hopper forward kernel has none");
  }
  using T = Element<kDType>;
  const AttentionShape& shape = params.shape;
  const bool general = fwd_needs_general_kernel(params);
  FwdKernelArgs args{};
  args.params = params;
  // The exponent's scale (fwd_kernel.h ScoreTransform): softcap's tanh values are scaled by softcap, scores by
  // softmax_scale.
  args.scale_log2 =
      static_cast<float>((general && params.softcap > 0.0 ? params.softcap : params.softmax_scale) * kLog2e);
  args.heads_per_kv = static_cast<int>(shape.nheads_q / shape.nheads_k);
  // GQA packing (dispatch/sm90_policy.h sm90_fwd_packed_heads: a power of two dividing the heads per KV head and
  // block_m): a tile's rows are block_m / packed queries of `packed` heads, so a sequence has seqlen_q * packed rows.
  const int packed = params.sm90_packed_heads > 1 ? params.sm90_packed_heads : 1;
  while ((1 << args.pack_shift) < packed) ++args.pack_shift;
  args.tile_heads = static_cast<int>(shape.nheads_q >> args.pack_shift);
  args.num_m_blocks = static_cast<int>((shape.seqlen_q * packed + kTile.block_m - 1) / kTile.block_m);
  args.num_splits = params.num_splits > 1 ? params.num_splits : 1;
  args.num_tiles = static_cast<int64_t>(args.num_m_blocks) * args.num_splits * args.tile_heads * shape.batch;
  if (args.num_tiles >= kFastDivmodLimit) {
    throw std::invalid_argument("flash_attn internal error: a Hopper forward of " + std::to_string(args.num_tiles) +
                                " query tiles reached the kernel, whose tile walk divides below 2^31 (the plan "
                                "declines such calls: dispatch/sm90_policy.cpp sm90_fwd_declines)");
  }
  // One CTA per tile until a launch of fewer CTAs remakes the order's (launch_fwd_kernel).
  args.walk = make_tile_walk_divisors(args.num_tiles, args.num_tiles, args.num_m_blocks, args.num_splits,
                                      args.tile_heads);
  // Varlen tensors: one map over every row, the sequence's first row added to the row coordinate (rows past a
  // sequence belong to the next one: masked keys, dropped query rows).
  // Paged caches: K / V maps over the page pool, a box per key block or per page (fwd_pages_fit).
  const MapRows rows = map_rows(shape);
  const bool paged = params.block_table != nullptr;
  const int64_t kv_rows = paged ? params.page_size : rows.k_rows;
  const int64_t kv_entries = paged ? params.num_pages : rows.entries;
  const int kv_box_rows = paged && params.page_size < kTile.block_n ? params.page_size : kTile.block_n;
  const bool encoded =
      encode_rows_map<T>(args.q_map, params.q, params.q_strides, shape.head_dim, shape.nheads_q, rows.q_rows,
                         rows.entries, kTile.block_m / packed, packed) &&
      encode_rows_map<T>(args.k_map, params.k, params.k_strides, shape.head_dim, shape.nheads_k, kv_rows, kv_entries,
                         kv_box_rows) &&
      encode_rows_map<T>(args.v_map, params.v, params.v_strides, shape.head_dim, shape.nheads_k, kv_rows, kv_entries,
                         kv_box_rows);
  if (!encoded) fail_tensor_maps("forward", "q, k, v", shape.head_dim);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (general) {
    launch_fwd<T, kHeadDim, kMask, kSchedule, true, kTile, kPersistent, kPolyEveryGeneral>(args, s);
  } else {
    launch_fwd<T, kHeadDim, kMask, kSchedule, false, kTile, kPersistent, kPolyEvery>(args, s);
  }
  if (args.num_splits > 1) launch_split_combine<T, kHeadDim>(params, s);
}

}  // namespace flash::sm90
