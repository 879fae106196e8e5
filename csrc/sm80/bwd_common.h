// Shared pieces of the sm80+ backward kernels: per-sequence geometry, the tile configuration per head-dim
// bucket, warp-level ldmatrix fragment loaders for the four operand layouts the five backward GEMMs need, and
// the global -> shared tile loader (cp.async when aligned, element-wise otherwise). Element types, conversions
// and the mma constants are the forward's (kernel_common.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "flash_attn/bwd_workspace.h"
#include "flash_attn/common/seqlen.h"
#include "flash_attn/params.h"
#include "flash_attn/ptx/cp_async_sm80.h"
#include "flash_attn/ptx/ldmatrix_sm80.h"
#include "flash_attn/ptx/mma_sm80.h"
#include "sm80/kernel_common.h"

namespace flash::sm80::bwd {

constexpr int kVectorBytes = 16;  // one cp.async / one uint4

// Tiles of the main backward kernel. A key block of kBlockN rows is held in shared memory while query blocks
// of kBlockM rows stream through. The warp grids below split each GEMM's output: S^T/dP^T (keys x queries),
// dK/dV (keys x head dim) and dQ (queries x head dim). dK and dV stay in registers, which caps the keys x
// head dim per warp; the warp grids keep each warp's tile as square as the registers allow, which minimises
// the shared-memory bytes read per MMA (e.g. dQ at head dim 128: 32 x 32 per warp reads 16 KB per block,
// 16 x 64 would read 20 KB).
struct BwdTileConfig {
  int block_m;
  int block_n;
  int s_warps_n;   // S^T, dP^T: warps along keys; the rest along queries
  int kv_warps_n;  // dK, dV: warps along keys; the rest along head dim
  int q_warps_m;   // dQ: warps along queries; the rest along head dim
  int warps;
  int q_buffers;  // Q / dO / lse / delta stages: 2 prefetch the next block during this one's S^T GEMM
  __host__ __device__ constexpr int threads() const { return warps * kWarpSize; }
};

// Which set of tiles a kernel instantiation uses. kFull: sized for Hopper's 227 KB of shared memory per block
// (A100 allows 163 KB, sm86/sm89 99 KB). kFullOneStage: the plain kernel's full tiles with one Q / dO stage, for GPUs
// where the full tile does not fit but this does (bwd_takes_one_stage_tiles). kCompact: every bucket within
// kBwdCompactSmemBudget, for any sm80+.
enum class BwdTiles { kFull, kCompact, kFullOneStage };

// Whether a tile set takes the full tiles' shapes and layouts (kFull, kFullOneStage).
__host__ __device__ constexpr bool bwd_full_shapes(BwdTiles tiles) {
  return tiles == BwdTiles::kFull || tiles == BwdTiles::kFullOneStage;
}

// sm86/sm89 allow 99 KB (101376 bytes) of dynamic shared memory per block; the compact tiles keep 1 KB of it
// spare.
constexpr int kBwdCompactSmemBudget = 99 * 1024 - 1024;

// 8 warps; sizes as FA2 on A100/H100 (64 x 128 up to head dim 128, 64 x 64 above). dK and dV in registers
// cap kBlockN * kHeadDim at 16K. At head dim <= 64 the plain kernel (no softcap, ALiBi, bias, dropout,
// dbias) takes 128-row query blocks as FA2 does on H100: per query it then issues ~18 % fewer ldmatrix,
// ~10 % fewer other instructions and half the barriers (SASS, hd 64); the feature kernel keeps 64 rows (128
// rows spilled 694 bytes there). Both use the same key block, so the grid is the same.
constexpr int kFullWarps = 8;
constexpr int kTwoStages = 2;
__host__ __device__ constexpr BwdTileConfig bwd_full_tile_config(int head_dim, bool features) {
  // Four warps along the head dim need head_dim / 4 to be a whole number of n16 fragment pairs.
  const bool split_dim_4 = head_dim % 64 == 0;
  if (head_dim <= 64) {
    return features ? BwdTileConfig{64, 128, 4, 4, 4, kFullWarps, kTwoStages}
                    : BwdTileConfig{128, 128, 4, 4, 4, kFullWarps, kTwoStages};
  }
  if (head_dim <= 128) {
    // The feature kernel at hd 128 takes 32 x 64 tiles: at 64 x 128 (dK and dV of 128 keys in registers
    // beside S^T, dP^T and the softcap / ALiBi / dropout state) it spilled 570 / 1568 bytes and ran softcap and ALiBi at
    // 115 against 317 TFLOP/s without them (H200, 4k); at 32 x 64 it spills 38 / 36. Hd 96 (46 / 80 bytes) keeps its
    // tile. Not yet timed; the compact tiles ran the plain hd 128 backward at 179 (docs/perf_log.md, second session).
    if (features && split_dim_4) return BwdTileConfig{32, 64, 4, 2, 2, kFullWarps, kTwoStages};
    return split_dim_4 ? BwdTileConfig{64, 128, 4, 4, 2, kFullWarps, kTwoStages}
                       : BwdTileConfig{64, 128, 4, 4, 4, kFullWarps, kTwoStages};
  }
  return split_dim_4 ? BwdTileConfig{64, 64, 4, 2, 2, kFullWarps, kTwoStages}
                     : BwdTileConfig{64, 64, 4, 4, 4, kFullWarps, kTwoStages};
}

// Whether the Q/dO tiles (loaded every iteration) are laid out as swizzled rows (kernel_common.h SwizzledRows)
// rather than padded ones. Measured on the H200 (bf16, plain kernels with the full tiles, three interleaved rounds,
// best TFLOP/s, swizzled / padded, docs/perf_log.md "swizzled shared memory"): head dim 256 2k / 8k 225 / 218 and
// 242 / 235, causal 194 / 186 and 237 / 228; head dim 64 2k / 8k 253 / 244 and 273 / 267. Head dim 128 first lost
// 2-7 % (causal 8k 269 / 280): its kernel spilled 56 bytes with the XORed addresses (0 padded), 7 local loads per
// iteration; with bwd_hides_query_lane_offsets it won (below). The feature kernels and the compact tiles were not
// measured (the feature kernels spill more with it, hd 256: 202 bytes against 54), so they stay padded.
__host__ __device__ constexpr bool bwd_swizzles_queries(int head_dim, bool features, BwdTiles tiles) {
  return !features && bwd_full_shapes(tiles);
}

// Whether the direct dK / dV epilogue (no head splits) goes through shared memory: each warp writes its scaled,
// converted fragments into row-major tiles over the CTA's tiles, free once the key block is done, and the CTA stores
// whole rows in 16-byte chunks, as FlashAttention-2 does. ncu, hd 96 plain backward at 1k (forty-fourth session): our
// epilogue ran 1,472 instructions a warp against FA2's 818 (48 four-byte STG with per-element bounds, 167 ISETP, 80
// BRA), ~4 % of the call at 1k, a quarter of that at 4k. Measured on the H200 (fifty-sixth session, bf16, 32 heads,
// two interleaved rounds, best TFLOP/s, staged / direct): 1k / 4k / 16k 243 / 236, 286 / 281, 298 / 292, causal
// 173 / 169, 252 / 250, 297 / 291 (FA2 227 / 285 / 304, causal 154 / 233 / 268). Key blocks cut by the sequence end
// (rows past it not stored), hd 72, GQA / MQA and varlen: test_cuda_backward.py -k portable_hd96, 36 passed on an H100
// with it on (fp16 and bf16, fifty-seventh session).
// kBwdStagedDkvMaskedHeadDim: that bucket's causal and window kernels stage theirs too. Its direct epilogue stores
// 4-byte pairs, 8 rows x 16 bytes a warp instruction (half of each 32-byte sector), and its share of a CTA grows as the
// CTA's steps shrink (2 steps a key block for causal documents of 128 tokens, 10 for a 1k window of 256). ptxas,
// sm_90a, bf16: step loops the same; spill outside them rises (hd 128 plain full tiles 10 / 8 -> 44 / 76 bytes, causal
// 14 / 24 -> 44 / 64). H100, sixty-first session, staged at hd 32 / 64 / 128 for every mask against direct, 16 heads
// at hd 128, best of two rounds, TFLOP/s: hd 128 causal documents of 128 / 512 43 / 128 -> 44 / 135, window 1k / 4k /
// 16k 171 / 262 / 309 -> 178 / 266 / 313, causal 112 / 219 / 291 -> 115 / 224 / 292, causal plain 186 / 268 / 326 ->
// 192 / 268 / 322; but the non-causal plain kernel lost (1k / 4k / 16k 248 / 319 / 337 -> 230 / 309 / 333; its
// documents of 128 / 512 gained 89 / 203 -> 94 / 209), so masked kernels only. hd 64 level (+-1 %, under the A100 limit
// +1-3 %), hd 32 lost 2-5 % on causal and window calls: direct.
constexpr bool kBwdStagedDkv = true;
constexpr int kBwdStagedDkvHeadDim = 96;
constexpr int kBwdStagedDkvMaskedHeadDim = 128;
__host__ __device__ constexpr bool bwd_stages_dkv(int head_dim, bool masked) {
  return kBwdStagedDkv && (head_dim == kBwdStagedDkvHeadDim || (masked && head_dim == kBwdStagedDkvMaskedHeadDim));
}

// Whether the Q/dO tiles of a head dim of an odd number of 64-byte half segments (96 / 160 / 224: no whole segments,
// so bwd_swizzles_queries leaves them padded) are laid out as kernel_common.h HalfSegmentSwizzledRows and loaded in
// column groups of 4 chunks (one row per thread, 3 copies at hd 96). ncu, hd 96 plain backward at 1k (forty-fourth
// session): 1.31 ms against FA2's 1.20; shared-memory wavefronts 210 M against 181 M, 19 M of them the padded rows'
// conflicting Q / dO copies (3.0x ideal), and MIO stalls 10.0 % of our warp samples against 4.4 %. Measured (32
// heads, two interleaved rounds, best TFLOP/s, swizzled / padded; FA2): 1k / 4k / 16k 235 / 279 / 292 against 233 /
// 274 / 290 (226 / 285 / 300), causal 172 / 245 / 289 against 169 / 235 / 274 (154 / 231 / 266); documents of 512
// level (benchmarks/results/2026-12-04-h200-hd96-bwd-swizzle-ab-s44.json). kBwdHalfSegmentSwizzleSmallHeadDim (0: off;
// candidate 32, one half segment a row, padded to 80 bytes now): ncu of the plain hd 32 4k call (H100, fifty-eighth
// session) counted 48 shared-memory wavefronts a warp and step for the Q / dO / lse / delta copies against 17.5 ideal,
// 30 of the step's 528 (FA2 450), and mio_throttle held 27.6 % of our warp samples (FA2 5.2 %; 6.68 against 6.29 ms).
// With 32 the kernel compiles without spill, its step loop 1,527 -> 1,500 instructions (sm_90a). H100, sixtieth
// session, with the other backward switches of this file on (64 heads, 1k / 4k / 16k, TFLOP/s; FA2): 167 / 204 / 216
// -> 170 / 208 / 219 (172 / 212 / 224), causal 119 / 178 / 211 -> 126 / 186 / 216 (118 / 179 / 205).
constexpr int kBwdHalfSegmentSwizzleHeadDim = 96;
constexpr int kBwdHalfSegmentSwizzleSmallHeadDim = 32;
__host__ __device__ constexpr bool bwd_swizzles_half_segments(int head_dim, bool features, BwdTiles tiles) {
  return (head_dim == kBwdHalfSegmentSwizzleHeadDim || head_dim == kBwdHalfSegmentSwizzleSmallHeadDim) &&
         bwd_swizzles_queries(head_dim, features, tiles);
}

// Whether a swizzling kernel hides its Q/dO lane offsets from ptxas (kernel_common.h OpaqueLaneOffset) and addresses
// its padded tiles (K, V, P^T, dS^T) in the direct form. At head dim 128 the direct form cut the spill from 56 / 76
// to 52 / 72 bytes and the hidden offsets to 28 / 44 (ptxas, plain non-causal); measured on the H200 (bf16, three
// interleaved rounds, best TFLOP/s, against the padded kernel; docs/perf_log.md "backward: swizzled Q/dO at head
// dim 128"): 2k / 8k 290 / 319 against 278 / 301, causal 231 / 286 against 228 / 282 (FA2 268 / 306 and 220 / 284
// in the same call). At head dim 256 it spills more (18 / 16 -> 28 / 48 bytes) yet measured faster at all six
// shapes (against the split form: 2k / 8k 227 / 247 against 225 / 241, causal 196 / 240 against 192 / 236; FA2
// 230 / 258 and 190 / 241). At head dim 64 it was within +-1 % (causal 8k 259 against 262), so 64 keeps the split
// form.
__host__ __device__ constexpr bool bwd_hides_query_lane_offsets(int head_dim) {
  return head_dim == 128 || head_dim == 256;
}

// Whether the main kernel stores P^T and dS^T with stmatrix (sm90 only) rather than 32-bit stores. ncu at hd 64 (8k)
// put the MIO-throttle stall at 1.02 cycles per issued instruction against FA2's 0.30; these stores were 64 of the
// loop's shared-memory ops. Measured on the H200 (bf16, interleaved rounds, best TFLOP/s, stmatrix / 32-bit):
// third session, non-causal hd 64 8k / 16k 268 / 271 against 261 / 265 and hd 128 +1-2 %, hd 256 -1-2 %; then causal
// hd 64 lost (8k 250 against 257). Sixth session (docs/perf_log.md), after the swizzled Q/dO and the hidden lane
// offsets: causal now gains at every head dim (2k / 8k / 16k, hd 64 209 / 264 / 282 against 207 / 261 / 280, hd
// 128 233 / 284 / 314 against 231 / 283 / 309, hd 256 200 / 245 / 253 against 196 / 241 / 250), non-causal hd 256
// still loses (229 / 248 / 252 against 232 / 251 / 253). Local (windowed) calls share the causal kernel.
constexpr int kStmatrixMaxNonCausalHeadDim = 128;
__host__ __device__ constexpr bool bwd_stores_scores_with_stmatrix(int head_dim, MaskKind mask) {
  return mask != MaskKind::kNone || head_dim <= kStmatrixMaxNonCausalHeadDim;
}

// Whether the main kernel stages each warp's dQ tile in shared memory and adds it to the fp32 accumulator with bulk
// tensor reductions (sm90: one TMA operation per 16-column box, ptx/bulk_reduce_sm90.h) rather than with one
// red.global.add.v4.f32 per lane, row and column pair from registers. Needs kBlockM x kHeadDim fp32 of shared memory
// (32 KB at hd 64 and 128), which only the plain full tiles up to hd 128 have spare. Measured on the H200 (bf16, best
// TFLOP/s, staged / registers, docs/perf_log.md "eighth session"): hd 64 non-causal 2k / 8k / 16k 267 / 295 / 300
// against 250 / 273 / 280, causal 215 / 278 / 301 against 210 / 263 / 282; hd 128 causal 8k / 16k 292 / 323 against
// 284 / 309, but non-causal 287 / 314 / 320 against 289 / 319 / 324, so hd 128 stages only masked calls.
// Since the register reductions fill whole lines (bwd_dq_layout, eleventh session; three variants, two rounds, FA2 in
// brackets): hd 32 gains from registers, non-causal 2k / 8k / 16k 188 / 207 / 211 against staged 181 / 199 / 202
// (196 / 216 / 222), causal 153 / 195 / 207 against 149 / 190 / 200 (156 / 194 / 203), so it no longer stages; hd
// 64 still loses from registers (non-causal 8k / 16k 285 / 287 against 297 / 303, causal 272 / 292 against 281 /
// 305). Deterministic calls keep their read-add-write.
constexpr int kStagedDqMinHeadDim = 33;
constexpr int kStagedDqMaxHeadDim = 128;
constexpr int kStagedDqMaxNonCausalHeadDim = 64;
__host__ __device__ constexpr bool bwd_stages_dq(int head_dim, MaskKind mask, bool features, BwdTiles tiles) {
  return !features && tiles == BwdTiles::kFull && head_dim >= kStagedDqMinHeadDim && head_dim <= kStagedDqMaxHeadDim &&
         (mask != MaskKind::kNone || head_dim <= kStagedDqMaxNonCausalHeadDim);
}

// Which dq accumulator layout (flash/bwd_workspace.h DqLayout) the main kernel adds to. With row pairs a warp's 16-byte
// reductions over 8 rows fill four whole 128-byte lines rather than eight halves. On the H200 (microbenchmark, 132
// CTAs of 8 warps adding 64 KB blocks into an L2-resident buffer, docs/perf_log.md "eleventh session") whole lines
// sustained 3.98 TB/s against 3.35 for halves (FA2's scalar atomics, a line per instruction: 3.95), and the hd 256
// backward without its dQ reductions ran 1.25x faster (16k 323 against 253 TFLOP/s). The kernels that stage dQ for
// bulk tensor reductions keep plain rows, which their 2D tensor map addresses.
__host__ __device__ constexpr DqLayout bwd_dq_layout(int head_dim, MaskKind mask, bool features, BwdTiles tiles) {
  return bwd_stages_dq(head_dim, mask, features, tiles) ? DqLayout::kRows : DqLayout::kRowPairs;
}

// Whether the main kernel's Q/dO and K/V loads branch on whole tiles (kernel_common.h WholeTileLoads): per query block
// the prefetch then issues 3 instructions per 16-byte copy instead of 6-9 (SASS, hd 256: ~85 of ~1,110 per warp and
// block), but ptxas allocates the rest of the loop differently. Measured on the H200 (bf16, two interleaved rounds,
// best TFLOP/s, with / without, FA2 in brackets; docs/perf_log.md "ninth session"): hd 64 non-causal 512 / 2k / 16k
// 191 / 270 / 302 against 193 / 266 / 301 (171 / 248 / 287), causal 122 / 221 / 305 against 115 / 216 / 302; hd 128
// non-causal 201 / 273 / 306 against 214 / 290 / 324; hd 256 non-causal 175 / 227 / 247 against 178 / 232 / 254.
// Hence head dim 64 only (hd 32 not measured), plain full tiles.
constexpr int kBwdWholeTilesHeadDim = 64;
__host__ __device__ constexpr bool bwd_branches_whole_tiles(int head_dim, bool features, BwdTiles tiles) {
  return head_dim == kBwdWholeTilesHeadDim && !features && tiles == BwdTiles::kFull;
}

// Shared memory of the main kernel with tile `cfg`: K, V, q_buffers x (Q, dO) rows of head_dim + pad
// elements, P^T and dS^T ([key][query], padded), then q_buffers x (lse, delta) in fp32.
__host__ __device__ constexpr int bwd_smem_bytes(const BwdTileConfig& cfg, int head_dim, int element_bytes) {
  const int stride_d = head_dim + kSmemRowPad;
  const int stride_m = cfg.block_m + kSmemRowPad;
  const int elements = 2 * cfg.block_n * stride_d + 2 * cfg.q_buffers * cfg.block_m * stride_d +
                       2 * cfg.block_n * stride_m;
  return elements * element_bytes + 2 * cfg.q_buffers * cfg.block_m * static_cast<int>(sizeof(float));
}

// Within kBwdCompactSmemBudget; queries x keys, shared-memory bytes per block (bf16/fp16; the plain and the
// feature kernel share the tile):
//   hd  32: 64 x 128, 8 warps, 78848                   hd 160: 32 x 32, 4 warps, 70144
//   hd  64: 64 x 128, 8 warps, one Q/dO stage, 92672   hd 192: 32 x 32, 4 warps, 82432
//   hd  96: 64 x 64,  8 warps, 99328                   hd 224: 32 x 32, 4 warps, 94720
//   hd 128: 64 x 64,  8 warps, one Q/dO stage, 88576   hd 256: 32 x 32, 4 warps, one Q/dO stage, 72960
// Above head dim 128 the dK/dV warp tile needs 16 keys and an even number of n8 tiles of the head dim per
// warp (160 = 2 x 80, 224 = 2 x 112), and dQ's column split must stay on 16-column groups: with 8 warps that
// takes 64 x 64 blocks, which need 104448 bytes (hd 160) even with one Q/dO stage; 4 warps at 32 x 32 fit.
// Two stages are used wherever they fit; at hd 256 two stages of 32 rows need 107008 bytes, so the next
// block is staged after the dK/dV GEMMs, its last readers. FA2 on sm86 uses 8 warps at 64 x 64 (hd 128) and
// 64 x 32 (hd 256), with fewer buffers than ours (no dO double buffer, V in registers at hd 256).
// At hd 64 / 128 the larger tile with one stage beat the smaller with two (64 x 64 and 32 x 64 until the thirty-fifth
// session): their key loop's inner query-block loop issued 9.0 / 7.6 instructions per MMA, the larger 6.3 / 5.9.
// H200 under FLASH_ATTN_BWD_SMEM_LIMIT=101376, bf16, 1k / 4k / 16k, best of 2 rounds, TFLOP/s, new against old:
// hd 64 211 / 245 / 258 against 156 / 174 / 181, causal 157 / 221 / 250 against 126 / 164 / 179; hd 128 179 / 201 /
// 208 against 167 / 186 / 191, causal 147 / 191 / 210 against 138 / 177 / 190 (FA2 at its H200 tiles: hd 64 216 /
// 269 / 288, hd 128 229 / 291 / 309). Softcap, ALiBi and window calls gained alike (4k: hd 64 +27-40 %, hd 128 +2-9 %).
constexpr int kCompactWideWarps = 8;    // head dim <= 128
constexpr int kCompactNarrowWarps = 4;  // head dim > 128
constexpr int kCompactElementBytes = 2;  // fp16 / bf16
__host__ __device__ constexpr BwdTileConfig bwd_compact_tile_config(int head_dim) {
  const bool split_dim_4 = head_dim % 64 == 0;
  BwdTileConfig cfg{};
  if (head_dim <= 64) {
    cfg = BwdTileConfig{64, 128, 4, 4, 4, kCompactWideWarps, kTwoStages};
  } else if (head_dim <= 96) {
    cfg = BwdTileConfig{64, 64, 4, 4, 4, kCompactWideWarps, kTwoStages};
  } else if (head_dim <= 128) {
    cfg = BwdTileConfig{64, 64, 4, 4, 2, kCompactWideWarps, kTwoStages};
  } else {
    cfg = split_dim_4 ? BwdTileConfig{32, 32, 2, 1, 1, kCompactNarrowWarps, kTwoStages}
                      : BwdTileConfig{32, 32, 2, 2, 2, kCompactNarrowWarps, kTwoStages};
  }
  if (bwd_smem_bytes(cfg, head_dim, kCompactElementBytes) > kBwdCompactSmemBudget) cfg.q_buffers = 1;
  return cfg;
}

__host__ __device__ constexpr BwdTileConfig bwd_one_stage_tile_config(int head_dim, bool features) {
  BwdTileConfig cfg = bwd_full_tile_config(head_dim, features);
  cfg.q_buffers = 1;
  return cfg;
}

// Up to which head dim the plain kernel's softcap / ALiBi instantiation (score_mods; bwd_plain_runs_score_mods) takes
// the feature kernel's full tile rather than the plain one; 0: none. At hd <= 64 that is 64 x 128 against 128 x 128.
// ptxas (sm_90a, bf16, hd 64 non-causal, spill stores / loads in bytes): full tiles 226 / 280 -> 0 / 0, one-stage
// tiles 178 / 264 -> 0 / 0 (the plain instantiation at 128 rows: 14 / 24). Timed at 64 (thirty-sixth session, H200,
// 1k / 4k / 16k TFLOP/s against the 128-row tile): causal softcap / ALiBi +8-15 %, non-causal ALiBi 186 / 215 / 223
// against 192 / 236 / 249; the compact tile set beat it on every row, so hd 64 takes that instead
// (bwd_score_mods_take_compact_tiles) and this stays off.
constexpr int kBwdScoreModsFeatureTileMaxHeadDim = 0;
__host__ __device__ constexpr bool bwd_score_mods_take_feature_tile(int head_dim) {
  return head_dim <= kBwdScoreModsFeatureTileMaxHeadDim;
}

// Whether a softcap / ALiBi call (the plain kernel's score_mods instantiation) runs the compact tile set even where
// the full one fits: at hd 64 the compact 64 x 128 tile with one Q / dO stage, padded Q / dO and dQ reduced from
// registers, against the full set's 128 x 128 (which spills 226 / 280 bytes with the score mods). H200, bf16, 32 heads,
// two interleaved rounds, best TFLOP/s, 1k / 4k / 16k, compact against full (docs/perf_log.md, thirty-sixth session):
// softcap 184 / 210 / 217 against 169 / 199 / 208, causal 134 / 183 / 204 against 113 / 161 / 184; ALiBi causal 138 /
// 189 / 213 against 120 / 173 / 197, but non-causal ALiBi 199 / 230 / 238 against 194 / 236 / 249, so it keeps the
// full set. The full set's 64 x 128 feature tile (bwd_score_mods_take_feature_tile) lost to the compact one on every
// row. hd 128's compact tile (64 x 64) lost 17-35 %; hd 32 was not measured. kBwdSoftcapTakesCompact (softcap calls)
// and kBwdScoreModsMaskedTakesCompact (causal / window calls): with kBwdSoftcapTanhFirst (below) the full set's
// softcap kernel spills 52 / 80 bytes instead of 226 / 280, as little as ALiBi's (24 / 44), which wins there; with
// kBwdScoreModsFoldLse and kBwdMasksByRelativeOffsets too the causal one spills 36 / 56 (338 / 312 without
// them). Both false: every hd 64 softcap / ALiBi call on the full set where it fits. H100, sixtieth session, with
// those switches on, against the compact tiles without them (1k / 4k / 16k, TFLOP/s): softcap 183 / 214 / 221 -> 203
// / 246 / 261, causal 133 / 182 / 209 -> 147 / 210 / 250; ALiBi 190 / 237 / 253 -> 213 / 268 / 286, causal 138 / 186
// / 217 -> 153 / 224 / 269; the plain call 231 / 284 / 303, causal 172 / 258 / 312.
constexpr int kBwdScoreModsCompactHeadDim = 64;
constexpr bool kBwdSoftcapTakesCompact = false;
constexpr bool kBwdScoreModsMaskedTakesCompact = false;
__host__ __device__ constexpr bool bwd_score_mods_take_compact_tiles(int head_dim, bool masked, bool softcap) {
  return head_dim == kBwdScoreModsCompactHeadDim &&
         ((masked && kBwdScoreModsMaskedTakesCompact) || (softcap && kBwdSoftcapTakesCompact));
}

// The three score-pass switches below apply at every head-dim bucket. hd 96 / 160 / 192 / 224 / 256 kept the previous
// forms until the sixty-first session, whose GPU tests ran them both ways (H100, tests/test_cuda_backward.py,
// test_backward.py, test_feature_combinations.py, test_varlen.py and the forward files: 831 passed each). A/B there
// (best of two rounds, 1k / 4k / 16k, TFLOP/s main -> all three on): causal softcap hd 256 157 / 216 / 247 -> 173 / 234
// / 262, hd 192 +2-3 %, causal ALiBi hd 256 +7-11 %, hd 192 +3-4 %; non-causal softcap / ALiBi hd 96-256 +0-2 %; plain
// and window rows level (hd 96 windows -2-3 %, within the two rounds' noise); hd 224 tested, not timed.

// Whether the score-mods kernel's softcap pass first replaces every score by th = tanh(s / cap) in place and folds
// tanh's derivative into dP - D, then exponentiates (two passes over the tile), rather than taking th, the
// exponential and the derivative element by element. In the latter th lives until its derivative, after the batch of
// exponentials ptxas issues together: 64 more live registers in a 128 x 128 tile. ptxas (sm_90a, bf16, score-mods
// kernel, spill stores / loads in bytes, element by element -> tanh first): hd 64 full tiles 226 / 280 -> 52 / 80
// (step-loop spill instructions 82 -> 8), causal 338 / 312 -> 170 / 212, compact causal 12 / 12 -> 0; hd 128 50 / 72
// -> 32 / 48, causal 74 / 136 -> 66 / 104; hd 32 36 / 56 -> 10 / 8; hd 96 / 256 unchanged. Timed only with the
// other switches of this file (H100, sixtieth session, 1k / 4k / 16k): softcap hd 128 +3-4 %, causal +5-11 %; hd 32
// -1-2 %, causal +9-11 %; hd 64 on the full tiles +11-20 % (bwd_score_mods_take_compact_tiles).
constexpr bool kBwdSoftcapTanhFirst = true;

// The tile of one instantiation: the plain kernel (features false), its softcap / ALiBi instantiation (score_mods) or
// the feature kernel (features), in the set `tiles`.
__host__ __device__ constexpr BwdTileConfig bwd_tile_config(int head_dim, bool features, BwdTiles tiles,
                                                            bool score_mods = false) {
  const bool feature_tile = features || (score_mods && bwd_score_mods_take_feature_tile(head_dim));
  return tiles == BwdTiles::kFull           ? bwd_full_tile_config(head_dim, feature_tile)
         : tiles == BwdTiles::kFullOneStage ? bwd_one_stage_tile_config(head_dim, feature_tile)
                                            : bwd_compact_tile_config(head_dim);
}

// Whether a GPU whose shared memory holds the plain kernel's full tile with one Q / dO stage but not with two runs
// that (kFullOneStage) rather than the compact tiles. On an A100 (163 KB per block) the plain full tile needs 173 KB
// at hd 128 (one stage: 138 KB), 172 / 196 / 221 KB at hd 192 / 224 / 256 (120 / 137 / 150 KB); with the compact
// tiles the portable backward ran 0.64x (hd 128, 186 against 315 TFLOP/s at full tiles) and 0.75-0.8x at hd 192-256
// (H200 under FLASH_ATTN_BWD_SMEM_LIMIT=166912, twenty-first session). Plain and softcap / ALiBi calls only (the
// feature kernel keeps its tiles). Under that limit, 4k, TFLOP/s compact -> one stage (FA2 at its own H200 tiles):
// hd 128 185 -> 302 (290), causal 175 -> 268 (255); hd 256 208 -> 249 (246), causal 193 -> 233 (217); hd 64 (full
// tiles fit) unchanged (twenty-second session A/B).
constexpr bool kBwdOneStageTiles = true;
__host__ __device__ constexpr bool bwd_takes_one_stage_tiles(int head_dim) {
  (void)head_dim;
  return kBwdOneStageTiles;
}

// Whether a call of the plain kernel runs its one-stage full tiles (one Q / dO stage: 120 KB at hd 192 instead of
// 172) even where the two-stage ones fit: hd 192's plain calls that are not deterministic. H100, bf16, 20 heads,
// best of two interleaved rounds, TFLOP/s at 1k / 4k, two-stage -> one-stage (FA2's varlen kernels in the same
// processes), sixty-third session: plain 213 / 252 -> 221 / 261 (228 / 265), causal 169 / 233 -> 170 / 239 (186 /
// 253), window 160 / 229 -> 163 / 234, causal window 112 / 197 -> 115 / 202; deterministic 70 / 75 -> 68 / 74 and
// causal 63 / 71 -> 62 / 68, so those keep two stages. Softcap / ALiBi (kBwdScoreModsOneStagePreferred) mixed:
// non-causal +1-2 %, causal level to -2 %. The sixty-second session's 16k: plain 236 -> 237, causal 258 -> 264.
constexpr int kBwdOneStagePreferredHeadDim = 192;
constexpr bool kBwdOneStagePreferred = true;
constexpr bool kBwdScoreModsOneStagePreferred = false;
__host__ __device__ constexpr bool bwd_prefers_one_stage_tiles(int head_dim, bool score_mods, bool deterministic) {
  return bwd_takes_one_stage_tiles(head_dim) && head_dim == kBwdOneStagePreferredHeadDim && !deterministic &&
         (score_mods ? kBwdScoreModsOneStagePreferred : kBwdOneStagePreferred);
}

// Whether the score-mods kernel's exponent takes -lse log2(e) in its first FFMA (z = s scale log2(e) - lse log2(e),
// then ALiBi's FFMA, then exp2) instead of an FADD after ALiBi: one instruction a score less, as the plain pass has
// (one FFMA before exp2). An ALiBi score now costs an FMUL, an FADD for its distance, an FFMA and the FADD this removes
// (plain: one FFMA); ALiBi costs 17-18 % over the plain call at hd 64 non-causal, 10-26 % causal (README). SASS
// (sm_90a, bf16, hd 64 score-mods kernel's step loop, both passes): compact tiles 1,574 -> 1,526 instructions, causal
// 2,068 -> 2,020; full tiles with kBwdSoftcapTanhFirst too 3,119 -> 2,918 (spill instructions 82 -> 5). Off: SASS
// identical. Timed only with the other switches of this file (H100, sixtieth session, 1k / 4k / 16k): ALiBi hd 128
// +2-3 %, causal +8-11 %; hd 32 +3 %, causal +13-15 %.
constexpr bool kBwdScoreModsFoldLse = true;

// Whether a block that is not fully visible masks its scores by relative offsets: per block and thread the limits of
// key - query (the window) and of the rows and columns left in either sequence, per score a compare of its
// compile-time offsets with them, instead of its key and query and the window's bounds. SASS (sm_90a, bf16, plain hd
// 128 kernel's step loop, masked and unmasked paths together): window / causal kernel 1,807 -> 1,581 instructions
// (the unmasked kernel's 1,511 -> 1,501: masking's share 296 -> 80), spill 40 / 64 -> 14 / 24 bytes. A window of
// seqlen / 4 masks ~60 % of a 1k backward's steps and ~18 % at 4k (docs/perf_log.md, fifty-ninth session). H100,
// sixtieth session, with the other switches of this file (1k / 4k / 16k, TFLOP/s against main's shared form): causal
// hd 64 143 / 223 / 276 -> 172 / 258 / 312 (FA2 151 / 233 / 277), hd 32 +2-6 %, hd 128 +1 %; window of seqlen / 4
// hd 64 +12-23 %, causal +11-28 %, hd 32 +4-12 %, hd 128 -2 to +5 % (level).
constexpr bool kBwdMasksByRelativeOffsets = true;

// Whether softcap / ALiBi calls (no bias, dropout or dbias) run in an instantiation of the plain kernel (its tiles,
// swizzled Q / dO, staged dQ; the scores' transform one uniform branch per block) instead of the feature kernel, whose
// tiles leave room for the bias, dropout and dbias state (hd 128: 32 x 64 against the plain 64 x 128). The element
// loop keeps tanh's value only until its derivative is taken, so the plain tiles' registers hold. The feature kernel
// ran softcap / ALiBi at 117 / 124 TFLOP/s against the plain call's 314 (H200, hd 128, 4k, sixteenth session); the
// forward's counterpart (fwd_lean_runs_score_mods) gained 1.1-1.5x. ptxas (sm_90a, bf16, full tiles, spill stores /
// loads in bytes, plain -> score mods): hd 64 14 / 24 -> 246 / 288 (its 128-row tile; the feature kernel's 64-row one
// spills 0), hd 128 10 / 8 -> 62 / 84 (causal 20 / 40 -> 82 / 160), hd 256 10 / 8 -> 4 / 4. Measured on the H200
// (bf16, 4k, portable backward, best of 2 interleaved rounds, TFLOP/s, score mods / feature kernel, the plain call
// in brackets; docs/perf_log.md "twenty-first session"): softcap hd 64 144 / 76 (289), causal 138 / 61 (258); hd 128
// 234 / 115 (310), causal 200 / 103 (269); hd 256 229 / 149 (254), causal 210 / 138 (240); ALiBi within 1 % of
// softcap. The spills at hd 64 did not stop it from winning 1.9-2.3x.
constexpr bool kBwdPlainRunsScoreMods = true;

__host__ __device__ constexpr bool bwd_plain_runs_score_mods(int head_dim) {
  (void)head_dim;
  return kBwdPlainRunsScoreMods;
}

// Where one batch entry's rows start and how long its sequences are (varlen: from cu_seqlens, clamped by varlen_rows).
struct SeqInfo {
  int64_t q_row0;
  int64_t k_row0;
  int seqlen_q;
  int seqlen_k;
  int64_t global_q_row0;  // first row of this sequence in the workspace (b * seqlen_q dense, cu_q[b] varlen)
};

__device__ __forceinline__ SeqInfo seq_info(const AttentionShape& shape, int b) {
  SeqInfo info;
  if (shape.cu_seqlens_q != nullptr) {
    const SequenceRows q_rows = varlen_rows(shape.cu_seqlens_q, b, shape.total_q, shape.seqlen_q);
    const SequenceRows k_rows = varlen_rows(shape.cu_seqlens_k, b, shape.total_k, shape.seqlen_k);
    info.q_row0 = q_rows.row0;
    info.k_row0 = k_rows.row0;
    info.seqlen_q = static_cast<int>(q_rows.length);
    info.seqlen_k = static_cast<int>(k_rows.length);
    info.global_q_row0 = info.q_row0;
  } else {
    info.q_row0 = 0;
    info.k_row0 = 0;
    info.seqlen_q = static_cast<int>(shape.seqlen_q);
    info.seqlen_k = static_cast<int>(shape.seqlen_k);
    info.global_q_row0 = static_cast<int64_t>(b) * shape.seqlen_q;
  }
  return info;
}

// ---- fragment loaders (see ldmatrix_sm80.h / mma_sm80.h for the register layouts) ----
// `tile` points at element (0, 0) of a shared tile stored row-major in `Layout` (kernel_common.h: PaddedRows or
// SwizzledRows). The 8 rows of each 8x8 matrix are 8 consecutive rows from a multiple of 8, so either layout
// serves every ldmatrix phase without bank conflicts.

// A (16 x 16) at (row0, k0) of a tile stored [row][k].
template <typename Layout, typename T>
__device__ __forceinline__ ptx::MmaA load_a(const T* tile, int row0, int k0, int lane) {
  ptx::MmaA a;
  if constexpr (Layout::kSplitAddress) {
    ptx::ldmatrix_x4(a.reg, tile + Layout::ldmatrix_offset(Layout::lane_offset(lane % 16, (lane / 16) * 8), row0, k0));
  } else {
    ptx::ldmatrix_x4(a.reg, tile + (row0 + lane % 16) * Layout::kStride + k0 + (lane / 16) * 8);
  }
  return a;
}

// A (16 x 16) at (row0, k0) of the transpose of a tile stored [k][row].
template <typename Layout, typename T>
__device__ __forceinline__ ptx::MmaA load_a_trans(const T* tile, int row0, int k0, int lane) {
  ptx::MmaA a;
  const int matrix = lane / 8;
  if constexpr (Layout::kSplitAddress) {
    const int lane_offset = Layout::lane_offset(lane % 8 + (matrix / 2) * 8, (matrix % 2) * 8);
    ptx::ldmatrix_x4_trans(a.reg, tile + Layout::ldmatrix_offset(lane_offset, k0, row0));
  } else {
    ptx::ldmatrix_x4_trans(a.reg,
                           tile + (k0 + lane % 8 + (matrix / 2) * 8) * Layout::kStride + row0 + (matrix % 2) * 8);
  }
  return a;
}

// B fragments of two n8 tiles (n0..n0+15) x k16 (k0..) of a tile stored [n][k].
template <typename Layout, typename T>
__device__ __forceinline__ void load_b_pair(ptx::MmaB (&b)[2], const T* tile, int n0, int k0, int lane) {
  const int matrix = lane / 8;
  uint32_t reg[4];
  if constexpr (Layout::kSplitAddress) {
    int lane_offset = Layout::lane_offset((matrix / 2) * 8 + lane % 8, (matrix % 2) * 8);
    if constexpr (Layout::kOpaqueLaneOffset) hide_from_compiler(lane_offset);
    ptx::ldmatrix_x4(reg, tile + Layout::ldmatrix_offset(lane_offset, n0, k0));
  } else {
    ptx::ldmatrix_x4(reg, tile + (n0 + (matrix / 2) * 8 + lane % 8) * Layout::kStride + k0 + (matrix % 2) * 8);
  }
  b[0].reg[0] = reg[0];
  b[0].reg[1] = reg[1];
  b[1].reg[0] = reg[2];
  b[1].reg[1] = reg[3];
}

// B fragments of two n8 tiles (n0..n0+15) x k16 (k0..) of a tile stored [k][n].
template <typename Layout, typename T>
__device__ __forceinline__ void load_b_pair_trans(ptx::MmaB (&b)[2], const T* tile, int n0, int k0, int lane) {
  const int matrix = lane / 8;
  uint32_t reg[4];
  if constexpr (Layout::kSplitAddress) {
    int lane_offset = Layout::lane_offset((matrix % 2) * 8 + lane % 8, (matrix / 2) * 8);
    if constexpr (Layout::kOpaqueLaneOffset) hide_from_compiler(lane_offset);
    ptx::ldmatrix_x4_trans(reg, tile + Layout::ldmatrix_offset(lane_offset, k0, n0));
  } else {
    ptx::ldmatrix_x4_trans(reg, tile + (k0 + (matrix % 2) * 8 + lane % 8) * Layout::kStride + n0 + (matrix / 2) * 8);
  }
  b[0].reg[0] = reg[0];
  b[0].reg[1] = reg[1];
  b[1].reg[0] = reg[2];
  b[1].reg[1] = reg[3];
}

// ---- global -> shared tiles ----

// Whether a (rows, head) tensor can be staged with 16-byte copies: head dim a multiple of 8 elements, rows
// 16-byte aligned.
template <typename T>
__device__ __forceinline__ bool vector_rows(const T* base, int64_t row_stride, int64_t head_dim) {
  constexpr int kWidth = kVectorBytes / sizeof(T);
  return head_dim % kWidth == 0 && row_stride % kWidth == 0 && reinterpret_cast<uintptr_t>(base) % kVectorBytes == 0;
}

// Element-wise staging for tensors whose rows are not 16-byte aligned. Out of line: the slow path should
// not cost the main loop registers.
template <typename T, int kThreads>
__device__ __noinline__ void load_tile_scalar(T* dst, int dst_stride, const T* src, int64_t src_stride, int rows,
                                              int cols, int valid_rows, int head_dim, int tid) {
  const T zero = from_float<T>(0.f);
  for (int idx = tid; idx < rows * cols; idx += kThreads) {
    const int r = idx / cols;
    const int c = idx % cols;
    dst[r * dst_stride + c] = r < valid_rows && c < head_dim ? src[r * src_stride + c] : zero;
  }
}

// The same into a tile of any layout (the split-address kernels' form).
template <typename T, int kThreads, typename Layout>
__device__ __noinline__ void load_tile_scalar_laid_out(T* dst, const T* src, int64_t src_stride, int rows, int cols,
                                                       int valid_rows, int head_dim, int tid) {
  const T zero = from_float<T>(0.f);
  for (int idx = tid; idx < rows * cols; idx += kThreads) {
    const int r = idx / cols;
    const int c = idx % cols;
    dst[Layout::offset(r, c - c % kChunkElems) + c % kChunkElems] =
        r < valid_rows && c < head_dim ? src[r * src_stride + c] : zero;
  }
}

// Rows [0, kRows) x columns [0, kHeadDim) of `src` (row stride src_stride) into `dst` (laid out as Layout);
// rows >= valid_rows and columns >= head_dim become 0. cp.async when `vector` (caller commits and waits),
// plain loads otherwise; the CTA's kThreads threads share the copies. The chunk loop has a compile-time trip
// count: the first version looped `idx < kRows * kChunksPerRow` from `tid`, which ptxas could not unroll
// without a generic remainder loop (~280 instructions per 64 x 128 tile in the SASS, executed by every warp
// before the first MMA of each query block); now it is ~5 instructions per 16-byte copy.
template <typename T, int kRows, int kHeadDim, int kThreads, typename Layout>
__device__ __forceinline__ void load_tile(T* dst, const T* src, int64_t src_stride, int valid_rows, int head_dim,
                                          bool vector, int tid) {
  constexpr int kWidth = kVectorBytes / sizeof(T);
  constexpr int kChunksPerRow = kHeadDim / kWidth;
  constexpr int kChunks = kRows * kChunksPerRow;
  if (!vector) {
    if constexpr (Layout::kSplitAddress) {
      load_tile_scalar_laid_out<T, kThreads, Layout>(dst, src, src_stride, kRows, kHeadDim, valid_rows, head_dim, tid);
    } else {
      load_tile_scalar<T, kThreads>(dst, Layout::kStride, src, src_stride, kRows, kHeadDim, valid_rows, head_dim, tid);
    }
    return;
  }
  if constexpr (loads_whole_tiles<kRows, kHeadDim, kThreads, Layout>()) {
    load_tile_whole_first<kRows, kHeadDim, kThreads, Layout>(dst, src, src_stride, valid_rows, head_dim, tid);
  } else if constexpr (loads_grouped_columns<kRows, kHeadDim, kThreads, Layout>()) {
    load_tile_grouped_columns<kRows, kHeadDim, kThreads, Layout>(dst, src, src_stride, valid_rows, head_dim, tid);
  } else if constexpr (kThreads >= kChunksPerRow) {
    // Where the row's chunks do not divide the threads (hd 96 / 160 / 192 / 224: 12 / 20 / 24 / 28 chunks) too: the
    // rolled per-chunk loop this replaced there ran 37 instructions per copy, 6 passes each for Q and dO at hd 192,
    // 37 % of the kernel's executed instructions (ncu, 4k; docs/perf_log.md, thirty-fourth session).
    load_tile_fixed_columns<kRows, kHeadDim, kThreads, FixedColumnLoads<Layout>, !Layout::kSplitAddress>(
        dst, src, src_stride, valid_rows, head_dim, tid);
  } else {
    // Fewer threads than a row's chunks: index per chunk, not unrolled (unrolled, the hd 224 kernel spilled 192
    // bytes instead of 14).
#pragma unroll 1
    for (int pass = 0; pass < (kChunks + kThreads - 1) / kThreads; ++pass) {
      const int idx = tid + pass * kThreads;
      if (kChunks % kThreads != 0 && idx >= kChunks) break;
      const int r = idx / kChunksPerRow;
      const int c = (idx % kChunksPerRow) * kWidth;
      const bool valid = r < valid_rows && c < head_dim;
      ptx::cp_async_16(dst + Layout::offset(r, c), valid ? src + r * src_stride + c : src, valid);
    }
  }
}

}  // namespace flash::sm80::bwd
