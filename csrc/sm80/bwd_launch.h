// run_bwd<dtype, head dim, mask>: the sm80+ backward of one call on the given stream: preprocess (delta,
// zeroed dq accumulators), the main kernel (dK, dV, dQ accumulation), and the dq conversion. Included by the
// generated translation units (tools/gen_kernels.py), one instantiation per TU. No allocation, no host sync:
// the scratch is params.workspace (flash_attn/bwd_workspace.h), allocated by the caller.
#pragma once

#include <algorithm>
#include <stdexcept>
#include <string>

#include "sm80/bwd_convert_kernel.h"
#include "sm80/bwd_kernel.h"
#include "sm80/bwd_preprocess_kernel.h"

namespace flash::sm80 {

template <auto kKernel, int kHeadDim, bool kFeatures, typename T>
void launch_main(const dim3& grid, const BwdParams& params, cudaStream_t stream) {
  constexpr int kSmemBytes = bwd::BwdSmem<kHeadDim, kFeatures>::template bytes<T>();
  // Raising the dynamic shared-memory cap is a function attribute, not a stream operation (graph-safe).
  static const cudaError_t attribute_set =
      cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  (void)attribute_set;
  kKernel<<<grid, bwd::kBwdThreads, kSmemBytes, stream>>>(params);
}

// Opt-in shared memory per block of the current device (0 if it cannot be queried). Not a stream operation.
inline int device_smem_optin() {
  int device = 0;
  int bytes = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) return 0;
  return bytes;
}

// The main kernel's tiles are sized for Hopper's 227 KB of shared memory per block (hd 128: 173 KB, hd 256:
// 217 KB); A100 allows 163 KB and sm86/sm89 99 KB. Until smaller tiles exist for those GPUs, a call that does
// not fit fails here with a message instead of as a failed launch.
inline void require_bwd_shared_memory(int needed_bytes, int head_dim_bucket) {
  const int available = device_smem_optin();
  if (available >= needed_bytes) return;
  throw std::runtime_error(
      "flash_attn backward: the CUDA backward kernel for head dims up to " + std::to_string(head_dim_bucket) +
      " needs " + std::to_string(needed_bytes) + " bytes of shared memory per block; this GPU allows " +
      std::to_string(available) + ". Backward tiles for GPUs with less shared memory than Hopper are not built "
      "yet: use a smaller head dim, or run the backward on CPU tensors.");
}

template <DType kDType, int kHeadDim, MaskKind kMask>
void run_bwd(const BwdParams& params, void* stream) {
  using T = typename Element<kDType>::type;
  const AttentionShape& shape = params.fwd.shape;
  if (shape.batch == 0 || shape.nheads_q == 0) return;
  // The feature kernel's tile is the smaller where the two differ; the plain one falls back to it below.
  require_bwd_shared_memory(std::min(bwd::BwdSmem<kHeadDim, false>::template bytes<T>(),
                                     bwd::BwdSmem<kHeadDim, true>::template bytes<T>()),
                            kHeadDim);
  const cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
  const unsigned heads_q = static_cast<unsigned>(shape.nheads_q);
  const unsigned batch = static_cast<unsigned>(shape.batch);
  const int64_t row_blocks = (shape.seqlen_q + bwd::kRowwiseRows - 1) / bwd::kRowwiseRows;

  if (row_blocks > 0) {
    bwd::bwd_preprocess_kernel<T><<<dim3(static_cast<unsigned>(row_blocks), heads_q, batch), bwd::kBwdThreads, 0,
                                    cuda_stream>>>(params);
  }
  // The grid depends only on the key block, which the plain and the feature kernel share.
  constexpr bwd::BwdTileConfig kTile = bwd::bwd_tile_config(kHeadDim, false);
  static_assert(kTile.block_n == bwd::bwd_tile_config(kHeadDim, true).block_n, "one grid for both kernels");
  const int64_t key_blocks = (shape.seqlen_k + kTile.block_n - 1) / kTile.block_n;
  if (key_blocks > 0) {
    // Deterministic: each CTA owns one dq accumulator and walks key blocks x, x + grid, ...
    const int64_t ctas_x = params.deterministic ? std::min(params.dq_splits, key_blocks) : key_blocks;
    const dim3 grid(static_cast<unsigned>(ctas_x), static_cast<unsigned>(shape.nheads_k), batch);
    const FwdParams& p = params.fwd;
    const bool features = p.softcap > 0.0 || p.mask.alibi_slopes != nullptr || p.mask.bias != nullptr ||
                          p.dropout.p > 0.0 || params.dbias != nullptr;
    // Where the plain kernel needs more shared memory than the feature kernel (128-row blocks at head dim
    // <= 64: 178 KB, above the 163 KB of an A100), devices without it run the feature kernel, which is also
    // correct for plain calls.
    constexpr int kPlainSmem = bwd::BwdSmem<kHeadDim, false>::template bytes<T>();
    constexpr int kFeatureSmem = bwd::BwdSmem<kHeadDim, true>::template bytes<T>();
    const bool plain_fits = kPlainSmem <= kFeatureSmem || kPlainSmem <= device_smem_optin();
    if (features || !plain_fits) {
      launch_main<bwd::bwd_kernel<T, kHeadDim, kMask, true>, kHeadDim, true, T>(grid, params, cuda_stream);
    } else {
      launch_main<bwd::bwd_kernel<T, kHeadDim, kMask, false>, kHeadDim, false, T>(grid, params, cuda_stream);
    }
  }
  if (row_blocks > 0) {
    bwd::bwd_convert_dq_kernel<T><<<dim3(static_cast<unsigned>(row_blocks), heads_q, batch), bwd::kBwdThreads, 0,
                                    cuda_stream>>>(params);
  }
}

}  // namespace flash::sm80
