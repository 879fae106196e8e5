// run_fwd<dtype, head dim, mask>: launches the sm80+ forward kernel for one call on the given stream (plus the
// split-KV combine kernel when the call was split). Included by the generated translation units
// (tools/gen_kernels.py), one instantiation per TU.
#pragma once

#include "sm80/fwd_kernel.h"

namespace flash::sm80 {

// Calls using any of these take the general kernel; the rest take the lean one (no per-element feature work).
inline bool fwd_needs_general_kernel(const FwdParams& p) {
  return p.softcap > 0.0 || p.mask.alibi_slopes != nullptr || p.mask.bias != nullptr || p.dropout.p > 0.0 ||
         !(p.softmax_scale > 0.0);
}

template <typename T, int kHeadDim, MaskKind kMask, bool kGeneral, bool kDecode>
void launch_fwd_kernel(const FwdParams& params, cudaStream_t stream) {
  constexpr FwdTileConfig kTile = fwd_tile_config(kHeadDim, kGeneral, kDecode);
  constexpr int kSmemBytes = fwd_smem_bytes<kHeadDim, kGeneral, kDecode>(sizeof(T));
  auto* kernel = fwd_kernel<T, kHeadDim, kMask, kGeneral, kDecode>;
  // Above 48 KB of dynamic shared memory a kernel must opt in; once per instantiation and process.
  static const cudaError_t opt_in =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  (void)opt_in;
  const int64_t query_tiles = (params.shape.seqlen_q + kTile.block_m - 1) / kTile.block_m;
  const dim3 grid(static_cast<unsigned>(query_tiles), static_cast<unsigned>(params.shape.nheads_q),
                  static_cast<unsigned>(params.shape.batch * params.num_splits));
  kernel<<<grid, kTile.warps * kWarpSize, kSmemBytes, stream>>>(params);
}

template <DType kDType, int kHeadDim, MaskKind kMask>
void run_fwd(const FwdParams& params, void* stream_ptr) {
  using T = typename Element<kDType>::type;
  if (params.shape.seqlen_q == 0 || params.shape.batch == 0 || params.shape.nheads_q == 0) return;
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (fwd_needs_general_kernel(params)) {
    launch_fwd_kernel<T, kHeadDim, kMask, true, false>(params, stream);
  } else if (fwd_uses_decode_tile(params.shape.seqlen_q, false)) {
    launch_fwd_kernel<T, kHeadDim, kMask, false, true>(params, stream);
  } else {
    launch_fwd_kernel<T, kHeadDim, kMask, false, false>(params, stream);
  }
  if (params.num_splits > 1) {
    const int64_t rows = params.shape.batch * params.shape.nheads_q * params.shape.seqlen_q;
    fwd_combine_kernel<T, kHeadDim><<<static_cast<unsigned>(rows), kCombineThreads, 0, stream>>>(params);
  }
}

}  // namespace flash::sm80
