// run_fwd<dtype, head dim, mask>: launches the sm80+ forward kernel for one call on the given stream.
// Included by the generated translation units (tools/gen_kernels.py), one instantiation per TU.
#pragma once

#include "sm80/fwd_kernel.h"

namespace flash::sm80 {

template <DType kDType, int kHeadDim, MaskKind kMask>
void run_fwd(const FwdParams& params, void* stream) {
  using T = typename Element<kDType>::type;
  constexpr FwdTileConfig kTile = fwd_tile_config(kHeadDim);
  const int64_t query_tiles = (params.shape.seqlen_q + kTile.block_m - 1) / kTile.block_m;
  if (query_tiles == 0 || params.shape.batch == 0) return;
  const dim3 grid(static_cast<unsigned>(query_tiles), static_cast<unsigned>(params.shape.nheads_q),
                  static_cast<unsigned>(params.shape.batch));
  fwd_kernel<T, kHeadDim, kMask>
      <<<grid, kTile.warps * kWarpSize, 0, static_cast<cudaStream_t>(stream)>>>(params);
}

}  // namespace flash::sm80
