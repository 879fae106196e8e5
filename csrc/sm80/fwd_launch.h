// run_fwd<dtype, head dim, mask>: launches the sm80+ forward kernel for one call on the given stream (plus the
// split-KV combine kernel when the call was split). Included by the generated translation units
// (tools/gen_kernels.py), one instantiation per TU.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "dispatch/device_attributes.h"
#include "sm80/fwd_combine_kernel.h"
#include "sm80/fwd_kernel.h"
#include "sm80/fwd_persistent_kernel.h"
#include "sm80/smem_limit_env.h"

namespace flash::sm80 {

// Calls using any of these take the general kernel; the rest take the lean one (no per-element feature work).
inline bool fwd_needs_general_kernel(const FwdParams& p) {
  return p.softcap > 0.0 || p.mask.alibi_slopes != nullptr || p.mask.bias != nullptr || p.dropout.p > 0.0 ||
         !softmax_scale_folds(p.softmax_scale);
}

// A call of the general kernel's whose only features are softcap, ALiBi or a scale that does not fold (params.h
// softmax_scale_folds): the lean kernel's standard tile runs it where fwd_lean_runs_score_mods(head dim) says so.
inline bool fwd_lean_takes_call(const FwdParams& p, int head_dim_bucket) {
  return fwd_lean_runs_score_mods(head_dim_bucket) && p.mask.bias == nullptr && !(p.dropout.p > 0.0);
}

// Fails where even the smallest tile does not fit: only under a kFwdSmemLimitEnv below every GPU's (every sm80+
// GPU has at least the 99 KB the compact and decode-compact tiles need).
inline void require_fwd_shared_memory(int needed_bytes, int available_bytes, int head_dim_bucket) {
  if (available_bytes >= needed_bytes) return;
  const char* limit = std::getenv(kFwdSmemLimitEnv);
  throw std::runtime_error(
      "flash_attn forward: the CUDA forward kernel for head dims up to " + std::to_string(head_dim_bucket) +
      " needs " + std::to_string(needed_bytes) + " bytes of shared memory per block; " +
      (limit != nullptr && *limit != '\0'
           ? std::string("the limit is ") + std::to_string(available_bytes) + " (" + kFwdSmemLimitEnv + "=" + limit +
                 "). Raise or unset " + kFwdSmemLimitEnv + "."
           : "this GPU allows " + std::to_string(available_bytes) +
                 ". Run the forward on another GPU (sm80 or newer), or on CPU tensors."));
}

// The K and V tensor maps of the TMA kernels (fwd_persistent_loads_kv_by_tma, fwd_loads_kv_by_tma): K and V as (head
// dim, kv head, key, batch entry) in boxes of one segment x kBlockN keys, so rows past seqlen_k arrive as zeros. False
// where a map cannot be made or would not zero those rows: kernels compiled below sm90 (the GPU's `code_arch`, which is
// 80 for compute_80 PTX even on a Hopper GPU), varlen (a sequence's rows run on into the next
// one's), seqused_k (rows past the used keys hold data), or strides the encoder rejects.
constexpr int kTmaSm = 90;
template <typename T, int kHeadDim, FwdTileKind kKind = FwdTileKind::kStandard>
bool make_fwd_kv_maps(FwdKvMaps& maps, const FwdParams& params, int code_arch) {
  constexpr FwdTileConfig kTile = fwd_tile_config(kHeadDim, false, kKind);
  const AttentionShape& shape = params.shape;
  if (code_arch < kTmaSm || shape.cu_seqlens_k != nullptr || shape.seqused_k != nullptr || shape.seqlen_k < 1) {
    return false;
  }
  const CUtensorMapDataType data_type =
      std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const uint64_t dims[4] = {static_cast<uint64_t>(shape.head_dim), static_cast<uint64_t>(shape.nheads_k),
                            static_cast<uint64_t>(shape.seqlen_k), static_cast<uint64_t>(shape.batch)};
  const uint32_t box[4] = {kSegmentElems, 1, static_cast<uint32_t>(kTile.block_n), 1};
  auto encode = [&](TensorMapArg& arg, const void* base, const TensorStrides& strides) {
    const uint64_t bytes[3] = {static_cast<uint64_t>(strides.head) * sizeof(T),
                               static_cast<uint64_t>(strides.row) * sizeof(T),
                               static_cast<uint64_t>(strides.batch) * sizeof(T)};
    return encode_16bit_swizzled_map_4d(arg, base, data_type, dims, bytes, box);
  };
  return encode(maps.k, params.k, params.k_strides) && encode(maps.v, params.v, params.v_strides);
}

// Launches the persistent kernel (fwd_runs_persistent) where it applies: one key split, no varlen, at most
// fwd_persistent_max_keys keys, more work items than the SMs hold CTAs (otherwise every CTA has one item and nothing to
// prefetch), its shared memory within the limit, item indices within the kernel's 32-bit arithmetic, and with TMA
// loads its tensor maps. Returns whether it launched.
template <typename T, int kHeadDim>
bool launch_fwd_persistent(const FwdParams& params, cudaStream_t stream, SmemLimits limits,
                           const DeviceAttributes& device) {
  constexpr FwdTileConfig kTile = fwd_tile_config(kHeadDim, false, FwdTileKind::kStandard);
  constexpr int kSmemBytes = fwd_persistent_launch_smem_bytes(kHeadDim, sizeof(T));
  if (params.num_splits != 1 || params.shape.cu_seqlens_q != nullptr || kSmemBytes > limits.per_block_optin ||
      params.shape.seqlen_k > fwd_persistent_max_keys(kHeadDim)) {
    return false;
  }
  const int64_t query_tiles = (params.shape.seqlen_q + kTile.block_m - 1) / kTile.block_m;
  const int64_t items = query_tiles * params.shape.nheads_q * params.shape.batch;
  // As many CTAs as the SMs hold at once (registers: kSmRegisterWarps warps per SM; shared memory).
  const int64_t by_smem = limits.per_sm / (kSmemBytes + kSmemReservedPerCta);
  const int64_t per_sm = std::min<int64_t>(kSmRegisterWarps / kTile.warps, by_smem);
  const int64_t ctas = device.num_sms * per_sm;
  constexpr int64_t kMaxItems = int64_t{1} << 31;  // item + gridDim.x stays below 2^32
  if (ctas <= 0 || items <= ctas || items >= kMaxItems) return false;
  FwdKvMaps maps{};
  if (fwd_persistent_loads_kv_by_tma(kHeadDim) && !make_fwd_kv_maps<T, kHeadDim>(maps, params, device.code_arch)) {
    return false;
  }
  auto* kernel = fwd_persistent_kernel<T, kHeadDim>;
  static const cudaError_t opt_in =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  (void)opt_in;
  kernel<<<static_cast<unsigned>(ctas), kTile.warps * kWarpSize, kSmemBytes, stream>>>(params, maps);
  return true;
}

// The one-item kernels' grid: query tiles x heads x (batch entries x key splits).
template <int kBlockM>
dim3 fwd_grid(const FwdParams& params) {
  const int64_t query_tiles = (params.shape.seqlen_q + kBlockM - 1) / kBlockM;
  return dim3(static_cast<unsigned>(query_tiles), static_cast<unsigned>(params.shape.nheads_q),
              static_cast<unsigned>(params.shape.batch * params.num_splits));
}

// Launches the one-item kernel with K and V by TMA (fwd_loads_kv_by_tma) where its tensor maps can be made (as
// make_fwd_kv_maps) and its shared memory fits. Returns whether it launched.
template <typename T, int kHeadDim, MaskKind kMask, FwdTileKind kKind, bool kScoreMods>
bool launch_fwd_tma_kernel(const FwdParams& params, cudaStream_t stream, SmemLimits limits,
                           const DeviceAttributes& device) {
  constexpr FwdTileConfig kTile = fwd_tile_config(kHeadDim, false, kKind);
  constexpr int kSmemBytes = fwd_tma_smem_bytes(kHeadDim, kKind, sizeof(T));
  FwdKvMaps maps{};
  if (kSmemBytes > limits.per_block_optin || !make_fwd_kv_maps<T, kHeadDim, kKind>(maps, params, device.code_arch)) {
    return false;
  }
  auto* kernel = fwd_tma_kernel<T, kHeadDim, kMask, kKind, kScoreMods>;
  static const cudaError_t opt_in =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  (void)opt_in;
  const dim3 grid = fwd_grid<kTile.block_m>(params);
  kernel<<<grid, kTile.warps * kWarpSize, kSmemBytes, stream>>>(params, maps);
  return true;
}

// Programmatic dependent launches (griddep_sm90.h) need sm90 code.
constexpr int kPdlSm = 90;

// Launches `kernel` as a programmatic dependent of the kernel before it in the stream: it may start while that one
// runs and calls wait_for_primary_grid() before touching memory. cluster_z > 1: also in clusters of that many CTAs
// along z (the grid's z extent a multiple of it). A failed launch is left for the caller's cudaGetLastError check, as
// a <<<>>> launch's would be.
template <typename Kernel, typename... Args>
void launch_dependent(Kernel kernel, dim3 grid, dim3 block, int smem_bytes, cudaStream_t stream, int cluster_z,
                      const Args&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  config.stream = stream;
  cudaLaunchAttribute attributes[2]{};
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = 1;
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = 1;
  attributes[1].val.clusterDim.y = 1;
  attributes[1].val.clusterDim.z = static_cast<unsigned>(cluster_z);
  config.attrs = attributes;
  config.numAttrs = cluster_z > 1 ? 2 : 1;
  (void)cudaLaunchKernelEx(&config, kernel, args...);
}

// kPaging: K and V are a paged cache (FwdParams::block_table), read by the cp.async decode kernels only. kScoreMods:
// a softcap / ALiBi call of the lean kernel (fwd_lean_takes_call): instantiations of their own, so the plain calls'
// kernels stay as they are. Those calls take the TMA kernel where plain ones do: H200, bf16, 1k / 4k / 16k, 2 rounds,
// TMA / cp.async (thirty-fifth session): hd 128 softcap causal 235 / 296 / 328 against 212 / 260 / 280, non-causal
// 324 / 355 / 360 against 311 / 337 / 346, ALiBi causal 244 / 303 / 327 against 223 / 274 / 296; hd 64 ALiBi
// non-causal 275 / 294 / 302 against 246 / 265 / 272, softcap +1-3 %.
template <typename T, int kHeadDim, MaskKind kMask, bool kGeneral, FwdTileKind kKind,
          KvPaging kPaging = KvPaging::kNone, bool kScoreMods = false, bool kAppends = false>
void launch_fwd_kernel(const FwdParams& params, cudaStream_t stream, SmemLimits limits,
                       const DeviceAttributes& device) {
  constexpr FwdTileConfig kTile = fwd_tile_config(kHeadDim, kGeneral, kKind);
  constexpr int kSmemBytes = fwd_smem_bytes(kHeadDim, kGeneral, kKind, sizeof(T));
  require_fwd_shared_memory(kSmemBytes, limits.per_block_optin, kHeadDim);
  constexpr bool kDecode = fwd_is_decode_kind(kKind);
  constexpr bool kKeyWarps = kKind == FwdTileKind::kDecodeKeyWarps;
  const bool cluster_capable =
      kDecode && !kKeyWarps && device.code_arch >= kPdlSm && params.num_splits <= kMaxClusterSplits;
  if (params.splits_meet_in_cluster && !cluster_capable) {
    throw std::invalid_argument(
        "flash_attn forward: a split call planned to merge its splits in a cluster reached a kernel that does not "
        "(only sm90 one-warp decode tiles of at most kMaxClusterSplits splits do; dispatch/fwd_plan.cpp "
        "fwd_splits_meet_in_cluster; a flash_attn bug: please report it)");
  }
  constexpr bool kDense = kPaging == KvPaging::kNone && !kAppends;
  if constexpr (kDense && !kScoreMods && fwd_runs_persistent(kHeadDim, kGeneral, kKind, kMask != MaskKind::kNone)) {
    if (launch_fwd_persistent<T, kHeadDim>(params, stream, limits, device)) return;
  }
  if constexpr (kDense && fwd_loads_kv_by_tma(kHeadDim, kGeneral, kKind)) {
    if (launch_fwd_tma_kernel<T, kHeadDim, kMask, kKind, kScoreMods>(params, stream, limits, device)) return;
  }
  auto* kernel = fwd_kernel<T, kHeadDim, kMask, kGeneral, kKind, kPaging, kScoreMods, kAppends>;
  // Above 48 KB of dynamic shared memory a kernel must opt in; once per instantiation and process.
  static const cudaError_t opt_in =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  (void)opt_in;
  const dim3 grid = fwd_grid<kTile.block_m>(params);
  constexpr int kThreads = fwd_cta_threads(kHeadDim, kGeneral, kKind);
  if (kDecode && device.code_arch >= kPdlSm) {
    const int cluster_z = params.splits_meet_in_cluster ? params.num_splits : 1;
    launch_dependent(kernel, grid, dim3(kThreads), kSmemBytes, stream, cluster_z, params);
    return;
  }
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(params);
}

// The combine kernel of a split call. Compiled for sm90+ (DeviceAttributes::code_arch) it is a programmatic dependent
// launch: its CTAs start while the split kernel runs (the decode kernels allow it from their first instruction) and
// wait in wait_for_primary_grid() for its results, instead of being launched only after the split kernel has drained
// (fwd_combine_kernel.h).
template <typename T, int kHeadDim>
void launch_fwd_combine(const FwdParams& params, cudaStream_t stream, bool dependent_launch) {
  const int64_t rows = params.shape.batch * params.shape.nheads_q * params.shape.seqlen_q;
  const dim3 grid(static_cast<unsigned>(rows));
  if (dependent_launch) {
    launch_dependent(fwd_combine_kernel<T, kHeadDim>, grid, dim3(kCombineThreads), 0, stream, 1, params);
  } else {
    fwd_combine_kernel<T, kHeadDim><<<grid, kCombineThreads, 0, stream>>>(params);
  }
}

// A decode tile's kernel: its appends instantiation (fwd_kernel.h kAppends) for calls with flash_attn_with_kvcache's
// appended rows or rotary (FwdParams::kv_append, rotary), the plain one otherwise.
// Calls planned for the key-warps tile (FwdParams::decode_key_warps) take it in place of kDecode.
template <typename T, int kHeadDim, MaskKind kMask, FwdTileKind kKind, KvPaging kPaging>
void launch_decode_kernel(const FwdParams& params, cudaStream_t stream, SmemLimits limits,
                          const DeviceAttributes& device) {
  if constexpr (kKind == FwdTileKind::kDecode) {
    if (params.decode_key_warps) {
      launch_decode_kernel<T, kHeadDim, kMask, FwdTileKind::kDecodeKeyWarps, kPaging>(params, stream, limits, device);
      return;
    }
  } else if constexpr (kKind != FwdTileKind::kDecodeKeyWarps) {
    if (params.decode_key_warps) {
      throw std::invalid_argument(
          "flash_attn forward: a call planned for the key-warps decode tile reached the two-stage decode tile "
          "(dispatch/fwd_plan.cpp fwd_decode_takes_key_warps; a flash_attn bug: please report it)");
    }
  }
  if (params.kv_append.k != nullptr || params.rotary.cos != nullptr) {
    if constexpr (kPaging != KvPaging::kRows) {
      launch_fwd_kernel<T, kHeadDim, kMask, false, kKind, kPaging, false, true>(params, stream, limits, device);
      return;
    }
    throw std::invalid_argument(
        "flash_attn forward: an append or rotary in the decode kernel reached pages smaller than a key block, whose "
        "kernel does not take them (dispatch/fwd_plan.cpp fwd_decode_takes_append; a flash_attn bug: please report it)");
  }
  launch_fwd_kernel<T, kHeadDim, kMask, false, kKind, kPaging>(params, stream, limits, device);
}

template <DType kDType, int kHeadDim, MaskKind kMask>
void run_fwd(const FwdParams& params, void* stream_ptr) {
  using T = typename Element<kDType>::type;
  if (params.shape.seqlen_q == 0 || params.shape.batch == 0 || params.shape.nheads_q == 0) return;
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  // The compact tiles are separate instantiations only where they differ from the standard / decode ones.
  constexpr bool kHasCompact = fwd_smem_bytes(kHeadDim, false, FwdTileKind::kCompact, sizeof(T)) !=
                               fwd_smem_bytes(kHeadDim, false, FwdTileKind::kStandard, sizeof(T));
  constexpr bool kHasDecodeCompact = fwd_smem_bytes(kHeadDim, false, FwdTileKind::kDecodeCompact, sizeof(T)) !=
                                     fwd_smem_bytes(kHeadDim, false, FwdTileKind::kDecode, sizeof(T));
  int device_index = 0;
  cudaGetDevice(&device_index);
  const DeviceAttributes device = device_attributes(device_index);
  const SmemLimits limits = fwd_smem_limits(device.smem);
  if (params.block_table != nullptr) {
    // The API reads pages in place only where the lean decode tile serves the call (fwd_plan.h fwd_reads_pages) and
    // gathers them into a dense copy otherwise.
    const FwdTileKind kind = fwd_tile_kind(kHeadDim, false, params.shape.seqlen_q, params.shape.seqlen_k,
                                           kMask != MaskKind::kNone, limits);
    const bool decode_tile = kind == FwdTileKind::kDecode || kind == FwdTileKind::kDecodeCompact;
    const int block_n = fwd_tile_config(kHeadDim, false, kind).block_n;
    const bool pages_fit =
        params.page_size >= 1 && (params.page_size % block_n == 0 || block_n % params.page_size == 0);
    if (fwd_needs_general_kernel(params) || !decode_tile || !pages_fit) {
      throw std::invalid_argument(
          "flash_attn forward: a paged K / V cache (block_table) reaches the CUDA kernels only for decode-shaped "
          "calls without softcap, ALiBi, bias or dropout, with pages of whole key blocks or of a power of two rows "
          "within one; this call should have been given gathered pages (a flash_attn bug: please report it)");
    }
    const bool whole_blocks = params.page_size % block_n == 0;
    bool compact = false;
    if constexpr (kHasDecodeCompact) {
      compact = kind == FwdTileKind::kDecodeCompact;
      if (compact && whole_blocks) {
        launch_decode_kernel<T, kHeadDim, kMask, FwdTileKind::kDecodeCompact, KvPaging::kBlocks>(params, stream, limits,
                                                                                            device);
      } else if (compact) {
        launch_decode_kernel<T, kHeadDim, kMask, FwdTileKind::kDecodeCompact, KvPaging::kRows>(params, stream, limits,
                                                                                          device);
      }
    }
    if (!compact && whole_blocks) {
      launch_decode_kernel<T, kHeadDim, kMask, FwdTileKind::kDecode, KvPaging::kBlocks>(params, stream, limits, device);
    } else if (!compact) {
      launch_decode_kernel<T, kHeadDim, kMask, FwdTileKind::kDecode, KvPaging::kRows>(params, stream, limits, device);
    }
  } else if (fwd_needs_general_kernel(params) && fwd_lean_takes_call(params, kHeadDim)) {
    if constexpr (fwd_lean_runs_score_mods(kHeadDim)) {
      constexpr bool kMasked = kMask != MaskKind::kNone;
      const FwdTileKind kind = fwd_tile_kind(kHeadDim, false, params.shape.seqlen_q, params.shape.seqlen_k, kMasked,
                                             limits);
      bool compact = false;
      if constexpr (kHasCompact) {
        compact = kind == FwdTileKind::kCompact;
        if (compact) {
          launch_fwd_kernel<T, kHeadDim, kMask, false, FwdTileKind::kCompact, KvPaging::kNone, true>(params, stream,
                                                                                                    limits, device);
        }
      }
      if (!compact) {  // the decode tiles run no score mods: their calls take the standard tile, as the general's do
        launch_fwd_kernel<T, kHeadDim, kMask, false, FwdTileKind::kStandard, KvPaging::kNone, true>(params, stream,
                                                                                                   limits, device);
      }
    }
  } else if (fwd_needs_general_kernel(params)) {
    launch_fwd_kernel<T, kHeadDim, kMask, true, FwdTileKind::kStandard>(params, stream, limits, device);
  } else {
    constexpr bool kMasked = kMask != MaskKind::kNone;
    switch (fwd_tile_kind(kHeadDim, false, params.shape.seqlen_q, params.shape.seqlen_k, kMasked, limits)) {
      case FwdTileKind::kDecodeCompact:
        if constexpr (kHasDecodeCompact) {
          launch_decode_kernel<T, kHeadDim, kMask, FwdTileKind::kDecodeCompact, KvPaging::kNone>(params, stream, limits,
                                                                                            device);
          break;
        }
        [[fallthrough]];
      case FwdTileKind::kDecode:
        launch_decode_kernel<T, kHeadDim, kMask, FwdTileKind::kDecode, KvPaging::kNone>(params, stream, limits, device);
        break;
      case FwdTileKind::kCompact:
        if constexpr (kHasCompact) {
          launch_fwd_kernel<T, kHeadDim, kMask, false, FwdTileKind::kCompact>(params, stream, limits, device);
          break;
        }
        [[fallthrough]];
      case FwdTileKind::kStandard:
        launch_fwd_kernel<T, kHeadDim, kMask, false, FwdTileKind::kStandard>(params, stream, limits, device);
        break;
    }
  }
  if (params.num_splits > 1 && !params.splits_meet_in_cluster) {
    launch_fwd_combine<T, kHeadDim>(params, stream, device.code_arch >= kPdlSm);
  }
}

}  // namespace flash::sm80
