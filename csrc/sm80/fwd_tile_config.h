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
//
// Decode-shaped calls (at most kDecodeMaxRows query rows per CTA after GQA packing) take one-warp CTAs of 16
// rows: the work is memory-bound, and small CTAs let ~5 of them stream K/V on each SM at once where a 4-warp
// 128-row CTA (2 per SM) kept too few bytes in flight (0.4-0.8x FA2's decode bandwidth, docs/perf_log.md).
constexpr int kDecodeMaxRows = 16;
// Most key splits of a split-KV call (the combine kernel keeps one weight per split in shared memory).
constexpr int kMaxKeySplits = 128;

FLASH_HOST_DEVICE constexpr FwdTileConfig fwd_tile_config(int head_dim, bool general = false, bool decode = false) {
  return decode             ? FwdTileConfig{16, 64, 1}
         : head_dim <= 64   ? FwdTileConfig{128, general ? 64 : 128, 4}
         : head_dim <= 128  ? FwdTileConfig{128, 64, 4}
                            : FwdTileConfig{64, 64, 4};
}

// Whether a call takes the decode tile (fast kernel only; calls with per-element features keep the general one).
FLASH_HOST_DEVICE constexpr bool fwd_uses_decode_tile(long long seqlen_q, bool general) {
  return !general && seqlen_q <= kDecodeMaxRows;
}

}  // namespace flash::sm80
