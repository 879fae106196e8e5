// Tile shape of the sm80+ forward kernel per head-dim bucket. Plain constexpr (no CUDA headers) so the host
// dispatch (split-KV choice) and the kernel agree on it.
#pragma once

#include "flash_attn/common/host_device.h"

namespace flash::sm80 {

struct FwdTileConfig {
  int block_m;  // query rows per CTA
  int block_n;  // keys per K/V tile
  int warps;    // each warp owns block_m / warps rows, in 16-row strips
};

// Head dims <= 128: 128 query rows on 4 warps (two 16-row strips each, so every K/V fragment read from shared
// memory feeds two MMAs); 128 keys per tile up to head dim 64, 64 keys up to 128 (the S accumulators and O
// stay within 255 registers). Above 128 the O accumulator alone is head_dim/2 registers per strip: one strip
// per warp, 64 rows per CTA (FA2 uses the same 64 x 64 x 4-warp tile on H100 for head dim 256). The general
// kernel (softcap, ALiBi, bias, dropout) keeps 64-key tiles at head dim 64: with 128 it spilled 1.2 KB.
FLASH_HOST_DEVICE constexpr FwdTileConfig fwd_tile_config(int head_dim, bool general = false) {
  return head_dim <= 64 ? FwdTileConfig{128, general ? 64 : 128, 4}
                        : head_dim <= 128 ? FwdTileConfig{128, 64, 4} : FwdTileConfig{64, 64, 4};
}

}  // namespace flash::sm80
