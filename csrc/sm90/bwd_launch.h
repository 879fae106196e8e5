// run_bwd<dtype, head dim, mask>: the Hopper backward of one call on a stream: the portable path's preprocess (delta,
// statistics blocks, zeroed dq accumulator in DqLayout::kRows), the sm90 main kernel (bwd_kernel.h: dK, dV, dQ
// accumulation), and the portable dq conversion (neither accumulator nor conversion with direct dQ). Included by the
// generated translation units of the ("sm90", "bwd") kernel-table entries; dispatch sends only the calls that
// dispatch/sm90_policy.h's sm90_bwd_declines() accepts. No allocation, no host sync: the scratch is params.workspace
// (flash_attn/bwd_workspace.h).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "sm80/bwd_convert_kernel.h"
#include "sm80/bwd_dkv_convert_kernel.h"
#include "sm80/bwd_preprocess_kernel.h"
#include "sm90/bwd_kernel.h"
#include "sm90/bwd_wide_kernel.h"
#include "sm90/fwd_launch.h"

namespace flash::sm90 {

// FLASH_ATTN_BWD_FUSED_DQ=1 runs fused dQ (bwd_tile_config.h bwd_fuses_dq) in the calls that can take it; unset or 0
// keeps the accumulator's zeroing and conversion, the default until an A/B on the H200 prices it; `descending` runs it
// with the adds in descending key-block order at every length instead of arrival order up to
// kBwdOrderedDqArrivalMaxKeyBlocks (whose spin-waits need a KV head's key blocks resident at once), to price that
// order. Read at every call, so that one process (a test, the A/B) runs every path.
// FLASH_ATTN_BWD_D_IN_KERNEL=1 likewise sums D = rowsum(dO o O) in the kernel (bwd_computes_d_in_kernel).
constexpr const char* kBwdFusedDqEnv = "FLASH_ATTN_BWD_FUSED_DQ";
constexpr const char* kBwdDInKernelEnv = "FLASH_ATTN_BWD_D_IN_KERNEL";
// The value of the switch `env`: 0 when unset, empty or "0", 1 for "1", 2 for `second` where one is given (else an
// error naming the choices, which `off`, `on` and `second_text` describe).
inline int bwd_switch_value(const char* env, const char* off, const char* on, const char* second = nullptr,
                            const char* second_text = nullptr) {
  const char* value = std::getenv(env);
  if (value == nullptr || *value == '\0' || std::string(value) == "0") return 0;
  if (std::string(value) == "1") return 1;
  if (second != nullptr && std::string(value) == second) return 2;
  throw std::invalid_argument(std::string(env) + "='" + value + "' is not a choice: use 0 (" + off + ") or 1 (" + on +
                              ")" + (second != nullptr ? std::string(" or ") + second + " (" + second_text + ")" : ""));
}
enum class BwdFusedDqSwitch { kOff, kOn, kDescending };
inline BwdFusedDqSwitch bwd_fused_dq_requested() {
  return static_cast<BwdFusedDqSwitch>(bwd_switch_value(
      kBwdFusedDqEnv, "dq accumulator zeroed and converted in their own passes",
      "fused into the Hopper backward's ordered dQ adds", "descending", "fused, adds in descending key-block order"));
}
inline bool bwd_d_in_kernel_requested() {
  return bwd_switch_value(kBwdDInKernelEnv, "D = rowsum(dO * O) in the preprocess",
                          "summed in the Hopper backward's kernel for calls of up to 1k keys at head dims up to 128") ==
         1;
}

// Launches one backward kernel with its dynamic shared memory (above 48 KB a kernel must opt in; once per kernel
// and process: the kernel is a template argument so that each has its own flag).
template <auto kKernel, int kLaunchBytes>
void launch_bwd_kernel(const dim3& grid, const BwdKernelArgs& args, cudaStream_t stream) {
  static const cudaError_t opt_in =
      cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kLaunchBytes);
  require_smem_opt_in(opt_in, kLaunchBytes, "backward");
  kKernel<<<grid, kBwdThreads, kLaunchBytes, stream>>>(args);
}

// Head-dim buckets up to kBwdMaxNarrowHeadDim run bwd_kernel at their own width; those above run bwd_wide_kernel at
// kBwdWideHeadDim (the TMA maps zero-fill the columns past the call's head dim, and no write reaches them). direct_dq:
// the narrow kernel's direct-dQ instantiation (bwd_stores_dq_directly says where one exists).
// kScoreDim: the columns the S^T and dP^T GEMMs run over (the call's bucket), kHeadDim the tiles' stored columns.
template <typename T, int kHeadDim, MaskKind kMask, bool kGeneral, BwdTileConfig kTile, int kScoreDim>
void launch_bwd(const dim3& grid, const BwdKernelArgs& args, bool direct_dq, cudaStream_t stream) {
  if constexpr (kHeadDim > kBwdMaxNarrowHeadDim) {
    using Layout = BwdWideSmemLayout<kBwdWideHeadDim, kTile.block_m, kTile.block_n, kTile.stages>;
    if constexpr (bwd_orders_dq(kHeadDim)) {
      if (args.dq_ordered) {
        launch_bwd_kernel<bwd_wide_kernel<T, kBwdWideHeadDim, kMask, kGeneral, kTile.block_m, kTile.block_n,
                                          kTile.stages, kScoreDim, true>,
                          Layout::kLaunchBytes>(grid, args, stream);
        return;
      }
    }
    launch_bwd_kernel<bwd_wide_kernel<T, kBwdWideHeadDim, kMask, kGeneral, kTile.block_m, kTile.block_n, kTile.stages,
                                      kScoreDim, false>,
                      Layout::kLaunchBytes>(grid, args, stream);
  } else {
    using Layout = BwdSmemLayout<kHeadDim, kTile.block_m, kTile.block_n, kTile.stages>;
    if constexpr (bwd_stores_dq_directly(kHeadDim, kGeneral)) {
      if (direct_dq) {
        launch_bwd_kernel<bwd_kernel<T, kHeadDim, kMask, kGeneral, kTile.block_m, kTile.block_n, kTile.stages, true,
                                     kScoreDim>,
                          Layout::kLaunchBytes>(grid, args, stream);
        return;
      }
    }
    launch_bwd_kernel<bwd_kernel<T, kHeadDim, kMask, kGeneral, kTile.block_m, kTile.block_n, kTile.stages, false,
                                 kScoreDim>,
                      Layout::kLaunchBytes>(grid, args, stream);
  }
}

// kBucket: the call's head-dim bucket; its tiles, layouts and policies are those of its storage width (fwd_storage_dim:
// the 96 bucket stores 128 columns, TMA zero-filling 96-127; the wide kernel 256 for every bucket above 128), its
// S^T / dP^T GEMMs run over kBucket's columns.
template <DType kDType, int kBucket, MaskKind kMask, BwdTileConfig kTile = bwd_tile_config(fwd_storage_dim(kBucket))>
void run_bwd(const BwdParams& params, void* stream) {
  constexpr int kHeadDim = fwd_storage_dim(kBucket);
  using T = Element<kDType>;
  const FwdParams& p = params.fwd;
  const AttentionShape& shape = p.shape;
  if (shape.batch == 0 || shape.nheads_q == 0) return;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  // The row-wise kernels are the portable path's (same workspace, same conversion, fixed accumulator layout).
  namespace rowwise = sm80::bwd;
  const unsigned heads_q = static_cast<unsigned>(shape.nheads_q);
  const unsigned batch = static_cast<unsigned>(shape.batch);
  const int64_t row_blocks = (shape.seqlen_q + rowwise::kRowwiseRows - 1) / rowwise::kRowwiseRows;
  const int64_t key_blocks = (shape.seqlen_k + kTile.block_n - 1) / kTile.block_n;
  // Every sequence's keys in one key block: dQ stored by the main kernel, no accumulator to zero or convert.
  const bool general = fwd_needs_general_kernel(p);
  const bool direct_dq = bwd_stores_dq_directly(kHeadDim, general) && key_blocks == 1;
  if (!params.block_stats) {
    throw std::invalid_argument(
        "flash_attn internal error: the Hopper backward needs BwdParams::block_stats (the statistics blocks of its "
        "workspace); the API sets it for the kernels of the sm90 table entries");
  }
  BwdKernelArgs args{};
  args.params = params;
  args.scale_log2 = static_cast<float>(p.softmax_scale * kLog2e);
  args.heads_per_kv = static_cast<int>(shape.nheads_q / shape.nheads_k);
  // dispatch/sm90_policy.h sm90_bwd_head_splits: > 1 only in calls that are not deterministic, a divisor of the group.
  const bool split_heads = params.head_splits > 1 && !params.deterministic;
  args.head_splits = split_heads ? static_cast<int>(params.head_splits) : 1;
  args.heads_per_split = args.heads_per_kv / args.head_splits;
  const MapRows rows = map_rows(shape);
  const bool encoded =
      encode_rows_map<T>(args.q_map, p.q, p.q_strides, shape.head_dim, shape.nheads_q, rows.q_rows, rows.entries,
                         kTile.block_m) &&
      encode_rows_map<T>(args.do_map, params.dout, params.dout_strides, shape.head_dim, shape.nheads_q,
                         rows.q_rows, rows.entries, kTile.block_m) &&
      encode_rows_map<T>(args.k_map, p.k, p.k_strides, shape.head_dim, shape.nheads_k, rows.k_rows, rows.entries,
                         kTile.block_n) &&
      encode_rows_map<T>(args.v_map, p.v, p.v_strides, shape.head_dim, shape.nheads_k, rows.k_rows, rows.entries,
                         kTile.block_n);
  if (!encoded) fail_tensor_maps("backward", "q, k, v, dout", shape.head_dim);
  // The dq accumulator's map for the bulk reductions (bwd_reduces_dq_in_bulk); without one (deterministic calls, a
  // row index past the kernel's int, or a map the driver refuses) the kernel reduces from registers.
  const BwdWorkspace workspace = bwd_workspace(params, DqLayout::kRows);
  // Every accumulator's rows: [dq_splits][nheads_q][dq_head_rows] (bwd_workspace.h), one per deterministic split.
  const int64_t dq_rows = params.dq_splits * shape.nheads_q * workspace.dq_head_rows;
  constexpr int64_t kMaxDqRows = int64_t{1} << 31;
  // Deterministic calls of the narrow kernel add into one accumulator in key-block order (bwd_orders_dq), which needs
  // the map: its bulk reductions are what the writer warp orders. Fused dQ (bwd_fuses_dq) runs in that order too,
  // where a CTA walks all of its KV head's query heads (no head splits) and the map exists.
  const bool fusable = bwd_fuses_dq(kHeadDim, general) && !direct_dq && key_blocks > 1 && !split_heads &&
                       params.dq_splits == 1 && workspace.dq_semaphores != nullptr &&
                       bwd_fused_dq_requested() != BwdFusedDqSwitch::kOff;
  const bool ordered = (params.deterministic && bwd_orders_dq(kHeadDim) && !direct_dq) || fusable;
  const bool bulk = !direct_dq && (ordered || (params.deterministic ? bwd_deterministic_dq_in_bulk(kHeadDim)
                                                                    : bwd_reduces_dq_in_bulk(kHeadDim)));
  if (bulk && dq_rows > 0 && dq_rows < kMaxDqRows) {
    encode_fp32_map_2d(args.dq_map, workspace.dq_accum, static_cast<uint64_t>(workspace.dq_row_stride),
                       static_cast<uint64_t>(dq_rows), static_cast<uint64_t>(workspace.dq_row_stride) * sizeof(float),
                       kDqSlotGroup, bwd_dq_rows(kHeadDim, kTile.block_m));
  }
  // Without the map a fusable call that is not deterministic goes back to the plain reductions and the conversion.
  const bool fused = fusable && args.dq_map.enabled;
  args.dq_ordered = fused || (ordered && params.deterministic);
  args.dq_fused = fused;
  // D in the kernel needs O as a TMA map like dO's.
  args.d_in_kernel = bwd_computes_d_in_kernel(kHeadDim, key_blocks) && bwd_d_in_kernel_requested() &&
                     encode_rows_map<T>(args.o_map, p.out, p.out_strides, shape.head_dim, shape.nheads_q,
                                        rows.q_rows, rows.entries, kTile.block_m);
  if (row_blocks > 0) {
    const rowwise::DqPrep prep = direct_dq ? rowwise::DqPrep::kNone
                                 : fused   ? rowwise::DqPrep::kFused
                                           : rowwise::DqPrep::kZero;
    const int box_rows = bwd_dq_rows(kHeadDim, kTile.block_m);
    if (args.d_in_kernel) {  // LSE and dlse only: a thread a row
      constexpr int64_t kRows = rowwise::preprocess_rows<true>();
      const unsigned blocks = static_cast<unsigned>((shape.seqlen_q + kRows - 1) / kRows);
      rowwise::bwd_preprocess_kernel<T, true>
          <<<dim3(blocks, heads_q, batch), rowwise::kRowwiseThreads, 0, s>>>(params, DqLayout::kRows, prep, box_rows);
    } else {
      rowwise::bwd_preprocess_kernel<T><<<dim3(static_cast<unsigned>(row_blocks), heads_q, batch),
                                          rowwise::kRowwiseThreads, 0, s>>>(params, DqLayout::kRows, prep, box_rows);
    }
  }
  if (args.dq_ordered) {
    // Arrival order (bwd_cta.h) for short sequences, whose key blocks fit on the GPU at one CTA per SM.
    int device = 0;
    cudaGetDevice(&device);
    const int64_t key_blocks = (shape.seqlen_k + kTile.block_n - 1) / kTile.block_n;
    const bool descending = fused && bwd_fused_dq_requested() == BwdFusedDqSwitch::kDescending;
    args.dq_arrival_order = kBwdOrderedDqArrivalOrder && !descending &&
                            key_blocks <= kBwdOrderedDqArrivalMaxKeyBlocks &&
                            key_blocks <= device_attributes(device).num_sms;
    args.dq_rotates = args.dq_arrival_order && kMask == MaskKind::kNone;
  }
  if (args.dq_ordered && dq_rows > 0) {
    if (!args.dq_map.enabled || workspace.dq_semaphores == nullptr || params.dq_splits != 1) {
      throw std::runtime_error(
          "flash_attn: deterministic=True on the Hopper backward needs the dq accumulator as one TMA tensor map of "
          "fewer than 2^31 rows (nheads_q x total_q = " + std::to_string(dq_rows) + " here) and a workspace with "
          "its counters; run this call with deterministic=False, or on the portable kernels (FLASH_ATTN_HOPPER=0)");
    }
    const size_t counter_bytes = static_cast<size_t>(shape.nheads_q * workspace.semaphore_head_stride) * sizeof(int);
    const cudaError_t zeroed = cudaMemsetAsync(workspace.dq_semaphores, 0, counter_bytes, s);
    if (zeroed != cudaSuccess) {
      throw std::runtime_error(std::string("flash_attn: zeroing the backward's dq counters failed: ") +
                               cudaGetErrorString(zeroed));
    }
  }
  args.num_n_blocks = static_cast<int>(key_blocks);
  if (key_blocks > 0) {
    // Deterministic without ordered dQ: one CTA per bwd_dq_accumulators_per_cta accumulators, walking key blocks x,
    // x + grid, ... (bwd_kernel.h); else one per key block (ordered: highest first, bwd_cta.h).
    constexpr int64_t kAccumulatorsPerCta = bwd_dq_accumulators_per_cta(kHeadDim);
    if (params.deterministic && !ordered && params.dq_splits % kAccumulatorsPerCta != 0) {
      throw std::invalid_argument(
          "flash_attn internal error: a deterministic Hopper backward needs dq_splits a multiple of the accumulators "
          "per CTA (dispatch/sm90_policy.h sm90_bwd_dq_splits); got " + std::to_string(params.dq_splits));
    }
    const int64_t ctas_x = params.deterministic && !ordered
                               ? std::min<int64_t>(params.dq_splits / kAccumulatorsPerCta, key_blocks)
                               : key_blocks * args.head_splits;
    if (split_heads) rowwise::zero_dkv_accumulators(params, s);
    const dim3 grid(static_cast<unsigned>(ctas_x), static_cast<unsigned>(shape.nheads_k), batch);
    if (general) {
      launch_bwd<T, kHeadDim, kMask, true, kTile, kBucket>(grid, args, direct_dq, s);
    } else {
      launch_bwd<T, kHeadDim, kMask, false, kTile, kBucket>(grid, args, direct_dq, s);
    }
  }
  if (split_heads && key_blocks > 0) rowwise::launch_dkv_convert<T>(params, s);
  if (row_blocks > 0 && !direct_dq && !fused) {
    rowwise::bwd_convert_dq_kernel<T><<<dim3(static_cast<unsigned>(row_blocks), heads_q, batch),
                                        rowwise::kRowwiseThreads, 0, s>>>(params, DqLayout::kRows);
  }
}

}  // namespace flash::sm90
