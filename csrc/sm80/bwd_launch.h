// run_bwd<dtype, head dim, mask>: the sm80+ backward of one call on the given stream: preprocess (delta,
// zeroed dq accumulators), the main kernel (dK, dV, dQ accumulation), and the dq conversion. Included by the
// generated translation units (tools/gen_kernels.py), one instantiation per TU. No allocation, no host sync:
// the scratch is params.workspace (flash_attn/bwd_workspace.h), allocated by the caller. The main kernel's
// tile set (full or compact, bwd_common.h) follows the device's shared memory per block.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "dispatch/device_attributes.h"
#include "sm80/bwd_convert_kernel.h"
#include "sm80/bwd_dkv_convert_kernel.h"
#include "sm80/bwd_kernel.h"
#include "sm80/bwd_preprocess_kernel.h"
#include "sm80/smem_limit_env.h"

namespace flash::sm80 {

// The dq accumulator as a 2D map (q head x total_q rows, dq_row_stride columns) in boxes of one warp's dQ rows by
// bwd::kDqBoxColumns, for kernels that stage dQ (bwd::bwd_stages_dq) in calls that are not deterministic; disabled
// elsewhere, and where a row index would not fit the kernel's int (the bulk reduction takes 32-bit coordinates).
template <int kHeadDim, MaskKind kMask, bool kFeatures, bwd::BwdTiles kTiles, bool kScoreMods = false>
TensorMapArg dq_accumulator_map(const BwdParams& params) {
  using Smem = bwd::BwdSmem<kHeadDim, kMask, kFeatures, kTiles, kScoreMods>;
  TensorMapArg arg{};
  if constexpr (Smem::kStagesDq) {
    constexpr int64_t kMaxRows = int64_t{1} << 31;
    const BwdWorkspace ws = bwd_workspace(params, bwd::bwd_dq_layout(kHeadDim, kMask, false, kTiles));
    const int64_t rows = params.fwd.shape.nheads_q * params.total_q;
    if (params.deterministic || rows <= 0 || rows >= kMaxRows) return arg;
    constexpr int kBoxRows = Smem::kCfg.block_m / Smem::kCfg.q_warps_m;
    encode_fp32_map_2d(arg, ws.dq_accum, static_cast<uint64_t>(ws.dq_row_stride), static_cast<uint64_t>(rows),
                       static_cast<uint64_t>(ws.dq_row_stride) * sizeof(float), bwd::kDqBoxColumns, kBoxRows);
  }
  return arg;
}

// Opt-in shared memory per block of the current device (0 if it cannot be queried). Not a stream operation.
inline int device_smem_optin() {
  int device = 0;
  int bytes = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) return 0;
  return bytes;
}

// Whether the kernels run their sm90 code on the current device, which stages dQ for bulk reductions
// (bwd::bwd_stages_dq): compiled for sm90 (DeviceAttributes::code_arch; compute_80 PTX has no such code on any GPU).
// Otherwise the staging kernels reduce from registers, so they get no staging memory and need no tensor map (at hd
// 65-96, masked, the A100 thus keeps the plain full tile: 141 KB of its 163, not 165). Not a stream operation.
constexpr int kBulkReduceMinCodeArch = 90;
inline bool device_reduces_in_bulk() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  return device_attributes(device).code_arch >= kBulkReduceMinCodeArch;
}

template <typename T, int kHeadDim, MaskKind kMask, bool kFeatures, bwd::BwdTiles kTiles, bool kScoreMods = false,
          bool kSplitHeads = false>
void launch_main(const dim3& grid, const BwdParams& params, const TensorMapArg& dq_map, int smem_bytes,
                 cudaStream_t stream) {
  using Smem = bwd::BwdSmem<kHeadDim, kMask, kFeatures, kTiles, kScoreMods>;
  constexpr auto kKernel = bwd::bwd_kernel<T, kHeadDim, kMask, kFeatures, kTiles, kScoreMods, kSplitHeads>;
  // Raising the dynamic shared-memory cap is a function attribute, not a stream operation (graph-safe).
  static const cudaError_t attribute_set =
      cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  (void)attribute_set;
  kKernel<<<grid, Smem::kCfg.threads(), smem_bytes, stream>>>(params, dq_map);
}

// The shared memory per block the backward may use: the device's opt-in limit, or less under kBwdSmemLimitEnv
// (smem_limit_env.h), which lets a Hopper GPU run the tiles an A100 or an sm86/sm89 GPU would get.
inline int bwd_smem_limit() {
  return smem_limit_from_env(kBwdSmemLimitEnv, "flash_attn backward", device_smem_optin());
}

// Last resort: the compact tiles fit every sm80+ GPU (bwd::kBwdCompactSmemBudget), so this fails only for a
// smaller limit set through kBwdSmemLimitEnv (or a device that could not be queried).
inline void require_bwd_shared_memory(int needed_bytes, int available_bytes, int head_dim_bucket) {
  if (available_bytes >= needed_bytes) return;
  const char* limit = std::getenv(kBwdSmemLimitEnv);
  throw std::runtime_error(
      "flash_attn backward: the smallest CUDA backward kernel for head dims up to " +
      std::to_string(head_dim_bucket) + " needs " + std::to_string(needed_bytes) +
      " bytes of shared memory per block; " +
      (limit != nullptr && *limit != '\0'
           ? std::string("the limit is ") + std::to_string(available_bytes) + " (" + kBwdSmemLimitEnv + "=" +
                 limit + "). Raise or unset " + kBwdSmemLimitEnv + "."
           : "this GPU allows " + std::to_string(available_bytes) +
                 ". Run the backward on another GPU (sm80 or newer), or on CPU tensors."));
}

// Which main kernel a call runs within one tile set: the plain or the feature kernel (score_mods: the plain kernel's
// softcap / ALiBi instantiation; split_heads: its instantiation that splits each KV head's query heads over CTAs), the
// dq accumulator map of a plain kernel that stages dQ, its shared memory, and the dq accumulator layout it adds in (the
// preprocess zeroes and the dq conversion reads that one).
struct BwdMainChoice {
  bool plain;
  bool score_mods;
  bool split_heads;
  TensorMapArg map;
  int smem_bytes;
  DqLayout layout;
};

// The split of each KV head's query heads the main kernel runs (BwdParams::head_splits, never with deterministic).
// Fails on a split that does not divide the group: the API's rule (bwd_workspace.h bwd_head_splits) never makes one.
inline int64_t bwd_head_splits_of(const BwdParams& params) {
  if (params.head_splits <= 1 || params.deterministic) return 1;
  const AttentionShape& s = params.fwd.shape;
  if (s.nheads_k < 1 || (s.nheads_q / s.nheads_k) % params.head_splits != 0) {
    throw std::invalid_argument("flash_attn internal error: BwdParams::head_splits " +
                                std::to_string(params.head_splits) + " does not divide the query heads per KV head");
  }
  return params.head_splits;
}

// Whether a call needs the feature kernel (softcap, ALiBi, bias, dropout, a bias gradient).
inline bool bwd_call_has_features(const BwdParams& params) {
  const FwdParams& p = params.fwd;
  return p.softcap > 0.0 || p.mask.alibi_slopes != nullptr || p.mask.bias != nullptr || p.dropout.p > 0.0 ||
         params.dbias != nullptr;
}

// Whether a call with features has only softcap / ALiBi, which the plain kernel's score-mods instantiation runs where
// bwd::bwd_plain_runs_score_mods(head dim) says so.
inline bool bwd_plain_takes_features(const BwdParams& params, int head_dim_bucket) {
  const FwdParams& p = params.fwd;
  return bwd::bwd_plain_runs_score_mods(head_dim_bucket) && p.mask.bias == nullptr && !(p.dropout.p > 0.0) &&
         params.dbias == nullptr;
}

// Whether a call runs the feature kernel rather than one of the plain kernel's instantiations.
inline bool bwd_needs_feature_kernel(const BwdParams& params, int head_dim_bucket) {
  return bwd_call_has_features(params) && !bwd_plain_takes_features(params, head_dim_bucket);
}

// Whether a call runs the plain kernel's softcap / ALiBi instantiation, whose tile and tile set may differ from the
// plain one's (bwd::bwd_score_mods_take_feature_tile, bwd::bwd_score_mods_take_compact_tiles).
inline bool bwd_runs_score_mods(const BwdParams& params, int head_dim_bucket) {
  return bwd_call_has_features(params) && bwd_plain_takes_features(params, head_dim_bucket);
}

// The main kernel of one tile set for this call (bulk_device: device_reduces_in_bulk(), asked once per call by run_bwd).
template <typename T, int kHeadDim, MaskKind kMask, bwd::BwdTiles kTiles>
BwdMainChoice choose_main(const BwdParams& params, bool bulk_device) {
  const bool features = bwd_needs_feature_kernel(params, kHeadDim);
  const bool score_mods = bwd_runs_score_mods(params, kHeadDim);
  // run_bwd picks a tile set whose kernel for this call fits the device (a plain call never falls to the feature
  // kernel for shared memory).
  using PlainSmem = bwd::BwdSmem<kHeadDim, kMask, false, kTiles>;
  using ScoreModsSmem = bwd::BwdSmem<kHeadDim, kMask, false, kTiles, true>;
  using FeatureSmem = bwd::BwdSmem<kHeadDim, kMask, true, kTiles>;
  const int plain_smem = score_mods ? ScoreModsSmem::template bytes_on_device<T>(bulk_device)
                                    : PlainSmem::template bytes_on_device<T>(bulk_device);
  const int feature_smem = FeatureSmem::template bytes_on_device<T>(bulk_device);
  // A plain kernel that stages dQ on an sm90 device needs the accumulator's map in calls that are not
  // deterministic; without one (a driver without the encoder, a row count past int) the feature kernel runs the call.
  BwdMainChoice choice{!features, false, false, TensorMapArg{}, 0, DqLayout::kRows};
  const bool stages_dq = score_mods ? ScoreModsSmem::kStagesDq : PlainSmem::kStagesDq;
  if (choice.plain && stages_dq && bulk_device && !params.deterministic) {
    choice.map = score_mods ? dq_accumulator_map<kHeadDim, kMask, false, kTiles, true>(params)
                            : dq_accumulator_map<kHeadDim, kMask, false, kTiles>(params);
    choice.plain = choice.map.enabled;
  }
  choice.score_mods = choice.plain && score_mods;
  choice.split_heads = kBwdSplitsHeads && choice.plain && !choice.score_mods && bwd_head_splits_of(params) > 1;
  choice.smem_bytes = choice.plain ? plain_smem : feature_smem;
  choice.layout = bwd::bwd_dq_layout(kHeadDim, kMask, !choice.plain, kTiles);
  return choice;
}

// The chosen main kernel of one tile set, over the key blocks of its own tile (the plain and the feature kernel may
// differ: bwd_full_tile_config); the dq accumulators do not depend on it (bwd_dq_splits counts keys).
template <typename T, int kHeadDim, MaskKind kMask, bwd::BwdTiles kTiles>
void launch_main_tiles(const BwdParams& params, const BwdMainChoice& choice, cudaStream_t stream) {
  const AttentionShape& shape = params.fwd.shape;
  const int block_n = choice.plain ? bwd::bwd_tile_config(kHeadDim, false, kTiles, choice.score_mods).block_n
                                   : bwd::bwd_tile_config(kHeadDim, true, kTiles).block_n;
  const int64_t key_blocks = (shape.seqlen_k + block_n - 1) / block_n;
  if (key_blocks == 0) return;
  // Deterministic: each CTA owns one dq accumulator and walks key blocks x, x + grid, ... Otherwise one CTA per key
  // block and split of its KV head's query heads (bwd_head_splits).
  const int64_t ctas_x = params.deterministic ? std::min(params.dq_splits, key_blocks)
                                              : key_blocks * (choice.split_heads ? bwd_head_splits_of(params) : 1);
  const dim3 grid(static_cast<unsigned>(ctas_x), static_cast<unsigned>(shape.nheads_k),
                  static_cast<unsigned>(shape.batch));
  if constexpr (kTiles == bwd::BwdTiles::kFullOneStage) {
    // run_bwd takes the one-stage set only for calls of the plain kernel's instantiations.
    if (!choice.plain) {
      throw std::invalid_argument("flash_attn internal error: the one-stage backward tiles have no feature kernel");
    }
  }
  if (choice.split_heads) {
    // Instantiated only while the policy can split (bwd_workspace.h kBwdSplitsHeads).
    if constexpr (kBwdSplitsHeads) {
      launch_main<T, kHeadDim, kMask, false, kTiles, false, true>(grid, params, choice.map, choice.smem_bytes, stream);
    }
  } else if (choice.score_mods) {
    // Instantiated only where the policy can pick it (choose_main sets score_mods only then).
    if constexpr (bwd::bwd_plain_runs_score_mods(kHeadDim)) {
      launch_main<T, kHeadDim, kMask, false, kTiles, true>(grid, params, choice.map, choice.smem_bytes, stream);
    }
  } else if (choice.plain) {
    launch_main<T, kHeadDim, kMask, false, kTiles>(grid, params, choice.map, choice.smem_bytes, stream);
  } else if constexpr (kTiles != bwd::BwdTiles::kFullOneStage) {
    launch_main<T, kHeadDim, kMask, true, kTiles>(grid, params, TensorMapArg{}, choice.smem_bytes, stream);
  }
}

template <DType kDType, int kHeadDim, MaskKind kMask>
void run_bwd(const BwdParams& params, void* stream) {
  using T = typename Element<kDType>::type;
  using bwd::BwdTiles;
  const AttentionShape& shape = params.fwd.shape;
  if (shape.batch == 0 || shape.nheads_q == 0) return;
  // The full tiles run where the call's kernel fits, the compact ones elsewhere and for the softcap / ALiBi calls that
  // bwd_score_mods_take_compact_tiles names. A plain call never runs the feature kernel, even where only that one of
  // the full set fits: under an A100's limit (FLASH_ATTN_BWD_SMEM_LIMIT=166912; hd 64 / 96 plain full tiles need 215 /
  // 169 KB, the feature ones 112 / 144) the one-stage tiles ran hd 64 causal 164 / 238 / 277 TFLOP/s at 1k / 4k / 16k
  // against the feature kernel's 103 / 192 / 244, non-causal ALiBi 200-246 against 70-78, hd 96 causal softcap 154 /
  // 215 / 238 against 49 / 74 / 93; under 99 KB the compact tiles ran hd 32 ALiBi 139-170 against 42-44 (H200, bf16,
  // thirty-seventh session, docs/perf_log.md).
  // The sizes are those of the device's code (BwdSmem::bytes_on_device): below sm90 no dQ staging, so an A100 keeps
  // the plain full tile at hd 96 (141 KB).
  const bool score_mods = bwd_runs_score_mods(params, kHeadDim);
  const bool feature_kernel = bwd_needs_feature_kernel(params, kHeadDim);
  const bool bulk_device = device_reduces_in_bulk();
  const int full_smem =
      feature_kernel ? bwd::BwdSmem<kHeadDim, kMask, true, BwdTiles::kFull>::template bytes_on_device<T>(bulk_device)
      : score_mods
          ? bwd::BwdSmem<kHeadDim, kMask, false, BwdTiles::kFull, true>::template bytes_on_device<T>(bulk_device)
          : bwd::BwdSmem<kHeadDim, kMask, false, BwdTiles::kFull>::template bytes_on_device<T>(bulk_device);
  constexpr int kCompactSmem = std::max(bwd::BwdSmem<kHeadDim, kMask, false, BwdTiles::kCompact>::template bytes<T>(),
                                        bwd::BwdSmem<kHeadDim, kMask, true, BwdTiles::kCompact>::template bytes<T>());
  static_assert(kCompactSmem <= bwd::kBwdCompactSmemBudget, "compact tiles fit every sm80+ GPU");
  const int smem_limit = bwd_smem_limit();
  require_bwd_shared_memory(kCompactSmem, smem_limit, kHeadDim);
  const cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
  const unsigned heads_q = static_cast<unsigned>(shape.nheads_q);
  const unsigned batch = static_cast<unsigned>(shape.batch);
  const int64_t row_blocks = (shape.seqlen_q + bwd::kRowwiseRows - 1) / bwd::kRowwiseRows;

  const bool compact_first = score_mods && bwd::bwd_score_mods_take_compact_tiles(
                                                kHeadDim, kMask != MaskKind::kNone, params.fwd.softcap > 0.0);
  const bool prefers_one_stage =
      !feature_kernel && bwd::bwd_prefers_one_stage_tiles(kHeadDim, score_mods, params.deterministic);
  const bool full = smem_limit >= full_smem && !compact_first && !prefers_one_stage;
  // Where the full tiles do not fit, or bwd_prefers_one_stage_tiles prefers them, the plain kernel's full tiles with
  // one Q / dO stage (bwd_takes_one_stage_tiles), for calls of its instantiations, before the compact ones.
  constexpr bool kOneStage = bwd::bwd_takes_one_stage_tiles(kHeadDim);
  const int one_stage_smem =
      score_mods
          ? bwd::BwdSmem<kHeadDim, kMask, false, BwdTiles::kFullOneStage, true>::template bytes_on_device<T>(bulk_device)
          : bwd::BwdSmem<kHeadDim, kMask, false, BwdTiles::kFullOneStage>::template bytes_on_device<T>(bulk_device);
  const bool one_stage =
      kOneStage && !full && !compact_first && !feature_kernel && smem_limit >= one_stage_smem;
  BwdMainChoice choice{};
  if (full) {
    choice = choose_main<T, kHeadDim, kMask, BwdTiles::kFull>(params, bulk_device);
  } else if (one_stage) {
    if constexpr (kOneStage) choice = choose_main<T, kHeadDim, kMask, BwdTiles::kFullOneStage>(params, bulk_device);
  } else {
    choice = choose_main<T, kHeadDim, kMask, BwdTiles::kCompact>(params, bulk_device);
  }
  if (row_blocks > 0) {
    bwd::bwd_preprocess_kernel<T><<<dim3(static_cast<unsigned>(row_blocks), heads_q, batch), bwd::kRowwiseThreads,
                                    0, cuda_stream>>>(params, choice.layout, bwd::DqPrep::kZero, 0);
  }
  if (choice.split_heads) bwd::zero_dkv_accumulators(params, cuda_stream);
  if (full) {
    launch_main_tiles<T, kHeadDim, kMask, BwdTiles::kFull>(params, choice, cuda_stream);
  } else if (one_stage) {
    if constexpr (kOneStage) {
      launch_main_tiles<T, kHeadDim, kMask, BwdTiles::kFullOneStage>(params, choice, cuda_stream);
    }
  } else {
    launch_main_tiles<T, kHeadDim, kMask, BwdTiles::kCompact>(params, choice, cuda_stream);
  }
  if (choice.split_heads && shape.seqlen_k > 0) bwd::launch_dkv_convert<T>(params, cuda_stream);
  if (row_blocks > 0) {
    bwd::bwd_convert_dq_kernel<T><<<dim3(static_cast<unsigned>(row_blocks), heads_q, batch),
                                    bwd::kRowwiseThreads, 0, cuda_stream>>>(params, choice.layout);
  }
}

}  // namespace flash::sm80
