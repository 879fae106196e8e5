// Tile shape of the sm80+ forward kernel per head-dim bucket, its shared-memory size and how many CTAs of it
// an SM holds. Plain constexpr (no CUDA headers) so the host dispatch (split-KV choice) and the kernel agree.
#pragma once

#include "flash_attn/common/host_device.h"

namespace flash::sm80 {

// Deepest K/V ring the kernel supports (its cp.async wait counts are 2 * (kv_stages - 1) groups).
constexpr int kMaxKvStages = 3;

struct FwdTileConfig {
  int block_m;    // query rows per CTA
  int block_n;    // keys per K/V tile
  int warps;      // each warp owns block_m / warps rows, in 16-row strips
  int kv_stages;  // K/V tile buffers of each kind: tile n + kv_stages - 1 loads while tile n is used
  // Groups of `warps` warps that each run the tile on their own share of the CTA's key tiles, with their own Q, K and
  // V buffers, and merge their partial outputs in shared memory at the end (the key-warps decode tile).
  int key_groups = 1;
};

// Head dims above 128: the O accumulator alone is head_dim/2 registers per 16-row strip, so every warp owns
// one strip and each K/V fragment read from shared memory feeds only two MMAs. On the H200 at head dim 256
// (64 x 64 tiles, 4 warps, 2 CTAs per SM) shared memory was the limit: ldmatrix reads plus cp.async writes per
// warp and key tile are ~704 clocks of the SM's 128 B/clk, 79 % of the measured 892 clocks per warp-tile
// (ncu: L1/shared 77 %), and K/V streamed from L2 at ~4.8 TB/s. A 128-row CTA of 8 warps shares each K/V
// tile between twice the rows: cp.async writes per warp-tile drop from 128 to 64 clocks (-9 % shared-memory
// traffic) and the L2 stream halves. It needs the softmax to overlap P V inside each warp (V awaited before
// the softmax, fwd_waits_v_before_softmax): with V awaited after it, one CTA per SM left the tensor cores idle
// through every softmax and the 128-row tile lost (2k / 8k 264 / 271 TFLOP/s against the 64-row tile's
// 284 / 294, docs/perf_log.md "forward v4"). With it, best of three interleaved rounds on the H200 (bf16,
// docs/perf_log.md "forward: V awaited before the softmax"): 8k / 16k 308 / 307 against 294-296 / 289-296,
// causal 16k 307 against 284-287, but causal 2k 237 against 248-250, hence kWideMinKeys (now 16384, below). The
// ring variant (two K/V stages, 198 KB) measured no better (295 / 294). The general kernel (softcap, ALiBi, bias,
// dropout) always takes the 64-row tile.
enum class WideTile { k64x64Warps4, k128x64Warps8, k128x64Warps8Ring };
constexpr WideTile kWideTile = WideTile::k128x64Warps8;

// Decode-shaped calls (at most kDecodeMaxRows query rows per CTA after GQA packing) take one-warp CTAs of 16
// rows: the work is memory-bound, and small CTAs let several of them stream K/V on each SM at once where a
// 4-warp 128-row CTA (2 per SM) kept too few bytes in flight (0.4-0.8x FA2's decode bandwidth,
// docs/perf_log.md). The one-stage 64-key tile had a single 16 KB tile in flight per CTA (hd 128; 5 CTAs, 80 KB
// per SM) and paid a full memory latency twice per tile; 32-key tiles in a ring of three keep up to five tiles
// (40 KB) in flight per CTA in 57 KB of shared memory (4 CTAs, 160 KB per SM), and a short split (1 x 8k: 64
// splits of 128 keys) issues three of its four tiles in the prologue. Head dims above 128 keep two stages
// (76 KB at 256, 3 CTAs per SM).
constexpr int kDecodeMaxRows = 16;
// Most key splits of a split-KV call (the combine kernel keeps one weight per split in shared memory).
constexpr int kMaxKeySplits = 128;
// Most splits that merge in one thread-block cluster instead of the combine kernel (FwdParams::splits_meet_in_cluster).
// H200, bf16, GQA 32/8, hd 128, us from a CUDA graph, cluster / combine kernel (twenty-sixth session): 2 splits 16 x 8k
// 137.2 / 138.5, 64 x 4k 257.4 / 266.0; 4 splits 16 x 8k 163.2 / 139.7, 8 x 32k 269.5 / 256.4, page 16 at 16 x 8k
// 256.1 / 143.4; 8 splits 8 x 32k 303.8 / 258.9 (1 x 8k 35.2 / 36.3): clusters of 4 and 8 lost wherever their CTAs
// filled most of the GPU's slots.
constexpr int kMaxClusterSplits = 2;

// Which tile a call takes. kDecode: decode-shaped calls. kStandard: the tiles above, deeper K/V rings and (above head
// dim 128) the 8-warp wide tile. kCompact: the one-stage tiles (the wide hd > 128 tile needs 135 KB of shared memory
// per block at head dim 256, 198 KB as a ring, and the hd <= 128 rings 92-104 KB: H100/H200 have 227 KB per block and
// 228 KB per SM, A100 163/164 KB, sm86/sm89 99/100 KB), taken where the standard tile does not fit or would lose a CTA
// per SM, and at head dim 256 for causal/local calls with key ranges below kWideMinKeys (a CTA of the wide tile runs
// ~30 us at 512 keys and, alone on its SM, exposes its ~2 us Q/K/V prologue and epilogue, which two CTAs per SM
// overlap). With padded tiles the wide tile tied the 64-row one at 2k non-causal and lost 5 % causal. Swizzled
// (fwd_swizzles_kv), measured on the H200 (bf16, three interleaved rounds, best TFLOP/s, wide / 64-row, FA2 in the same
// call; docs/perf_log.md "wide forward tile at every length"): non-causal 512 / 2k 267 / 318 against 260 / 298 (FA2 284
// / 312), so non-causal calls take it at every length; causal 512 / 2k 186 / 262 against 206 / 271 (FA2 208 / 273), so
// causal/local calls keep the 64-row tile below kWideMinKeys. With V of the first tile in the prologue
// (fwd_prefetches_first_v) the 64-row tile also won causal 4k / 8k: 304 / 317 against the wide tile's 280 / 297 (FA2
// 286 / 292); at 16k the wide tile keeps it (334-338, FA2 297; docs/perf_log.md "sixth session").
// kDecodeCompact: the decode tile with two stages (38 KB at hd 128, as in v3), where the three-stage one would
// leave fewer than kDecodeMinCtasPerSm CTAs per SM (A100: 2, sm86/sm89: 1).
// kDecodeKeyWarps: the decode tile four times in one CTA, each warp on its own quarter of the CTA's key tiles,
// merged in shared memory (FwdParams::decode_key_warps): for unsplit decode calls that fill most SMs with one CTA
// each (dispatch/fwd_plan.h fwd_decode_takes_key_warps).
enum class FwdTileKind { kStandard, kDecode, kCompact, kDecodeCompact, kDecodeKeyWarps };
constexpr int kDecodeMinCtasPerSm = 4;
constexpr int kDecodeKeyWarps = 4;

// The decode tiles: one warp (per key group) of kDecodeMaxRows rows, 32-key tiles.
FLASH_HOST_DEVICE constexpr bool fwd_is_decode_kind(FwdTileKind kind) {
  return kind == FwdTileKind::kDecode || kind == FwdTileKind::kDecodeCompact || kind == FwdTileKind::kDecodeKeyWarps;
}
constexpr long long kWideMinKeys = 16384;
// The head dims whose causal / local calls below kWideMinKeys keys take the compact 64-row tile: 256 only. At 160-224
// the wide tile won at every length, H200, bf16, portable forward, causal, 1k / 4k / 8k TFLOP/s, compact -> wide,
// best of 2 interleaved rounds (twenty-second session A/B; FA2 in brackets): hd 160 213 / 243 / 249 -> 221 / 272 /
// 283 (194 / 231 / 239), hd 192 210 / 244 / 252 -> 238 / 295 / 308 (251 / 305 / 316), hd 224 186 / 228 / 237 -> 219
// / 266 / 280 (216 / 240 / 247).
constexpr int kShortCausalCompactAboveHeadDim = 224;

// K/V stages of the standard tiles at head dims <= 64 and 97-128. Two put V of the first tile in flight with Q
// and K and K/V two tiles ahead; measured on the H200 (bf16, docs/perf_log.md "forward v4") they were slower at
// every shape: hd 128 non-causal 512 / 2k / 8k 282 / 329 / 338 TFLOP/s against one stage's 290 / 335 / 349,
// hd 64 245 / 299 / 314 against 252 / 306 / 322. The ring's slot addressing costs more than the latency it hides.
constexpr int kStagesUpTo128 = 1;

// Whether the forward awaits V(n) right after S = Q K^T (FA2's place) rather than after the softmax. Early, no
// barrier separates the softmax from P V, so ptxas interleaves the exponentials and the O rescale with the P V
// MMAs; but V's load then has only Q K^T to hide behind. Measured on the H200 (three runs of interleaved
// rounds, bf16, docs/perf_log.md "forward: V awaited before the softmax"): head dim 64 causal +5-9 % early
// (8k 312-325 against 300-304), non-causal -3-5 % (8k 301-306 against 315-319); head dims 65-128 -3-6 % early
// at every shape; above 128 the 8-warp wide tile needs it (above). `masked`: causal or local. `tma`: K / V by TMA
// (fwd_tma_kernel): there V's wait is an mbarrier spin loop, which ptxas does not move, so waited late it splits the
// softmax from P V; at hd 64 (sm_90a, non-causal) late V also spilled: 48 bytes of stack and 26 spill instructions
// in the key loop, none early (softcap / ALiBi kernel 16 -> 4), and the P V MMAs after the last exponential 128 ->
// 14 of 128 (forty-third session; at hd 128 early V spilled instead, 8 -> 40 bytes, so it stays late there).
// Measured (forty-fourth session, 32 heads, 512 / 2k / 8k keys, early / late, FA2): 304 / 356 / 364 against 279 /
// 330 / 341 (266 / 298 / 307), softcap +2-5 %, causal level.
constexpr int kTmaEarlyVMaxHeadDim = 64;
FLASH_HOST_DEVICE constexpr bool fwd_waits_v_before_softmax(int head_dim, bool masked, bool tma) {
  return head_dim > 128 || (head_dim <= 64 && masked) || (tma && head_dim <= kTmaEarlyVMaxHeadDim);
}

// Whether S = Q K^T loads the Q and K fragments of k16 step kk + 1 before issuing the MMAs of step kk (two register
// sets) rather than leaving the order to ptxas. At head dim 256 (one 16-row strip per warp, two warps per scheduler)
// ptxas reloaded each K fragment into the register its previous MMA had just read, so every MMA waited on an
// ldmatrix issued a few instructions earlier: ncu put 35 % of the wide tile's warp samples on short-scoreboard
// stalls at 512 tokens, mostly on those MMAs (FA2: 26 %). The explicit order keeps eight MMAs between a fragment's
// load and its use at the same register count (251 against 255, no spill). At head dim 192 it spilled more (wide
// tile 20 -> 44 bytes), so it was limited to 256. Under nvcc 13.0 the same order lowers the causal hd 192 wide tile's
// spill instead (ptxas sm_90a, bf16: 44 -> 4 bytes, 11 -> 1 local loads in the key loop, P V MMAs after the last
// exponential 72 -> 34 of 192) while the unmasked one spills more (4 -> 24 bytes). ncu of the causal 4k call without
// it (H100, fifty-eighth session): 977 against FA2's 926 us at the same instruction count, short scoreboard 1.75
// warps per issue against 0.93. With it (H200, 10 heads, best / median of 2 rounds, TFLOP/s, FA2 in brackets): causal
// 1k / 4k / 16k 217 / 273 / 320 against 214 / 268 / 316 (230 / 281 / 298), medians +2 %; a window (local kernels)
// -1 % (4k 275 / 244 against 278 / 246, causal), so causal calls only (kPrefetchCausalWideHeadDim). The one-strip
// decode tiles of causal hd 192 kvcache calls take it too (ptxas: spill 28 / 68 -> 4 / 24 bytes), not timed.
// `strips`: 16-row strips per warp.
// The same pattern at head dim 96 (two strips per warp; ncu of the plain 4k call, thirty-seventh session): the S
// GEMM's MMAs read the B fragment register just reloaded (`HMMA R4, R176, R172, R4` three times in a row), short
// scoreboard 0.59-0.72 warps per issue against FA2's 0.22, IPC 1.47-1.61 against 1.95 at fewer instructions (576-612 M
// against 696 M). Taken at 96 together with the grouped loads (kGroupedColumnsHeadDim: the pair's measurement).
constexpr int kPrefetchTwoStripsHeadDim = 96;
constexpr int kPrefetchCausalWideHeadDim = 192;
FLASH_HOST_DEVICE constexpr bool fwd_prefetches_score_fragments(int head_dim, int strips, bool causal) {
  return (head_dim == 256 && strips == 1) || (causal && head_dim == kPrefetchCausalWideHeadDim && strips == 1) ||
         (head_dim == kPrefetchTwoStripsHeadDim && strips == 2);
}

// How many k16 steps ahead fwd_prefetches_score_fragments loads (a register set per step in flight). One everywhere;
// kScoreFragmentsTwoAheadHeadDim (0: none; candidate 96) takes two at that head dim (issue 22: hd 96 forward 0.91-0.97x
// FA2). tools/sass_fragment_distance.py on the sm_80 hd 96 two-strip kernels, S GEMM MMAs of 96 issued 25+
// instructions after their ldmatrix, one / two steps ahead: plain 38 / 69 (loop 916 / 928 instructions), causal 52 /
// 67 (982 / 997, one 16-byte spill gone); FA2's: 72. With it 0 the SASS is identical. Timed once (H200, bf16, 32
// heads, 1k, two rounds, TFLOP/s one / two ahead): 308 / 306, 305 / 305; causal 239 / 243, 240 / 243 (FA2 328, 260).
// Predicted +2-4 % non-causal: level, so the loads' distance no longer limits it; causal +1.4 %, within what one
// length and two rounds can tell, so it stays off until a fuller A/B.
constexpr int kScoreFragmentsTwoAheadHeadDim = 0;
FLASH_HOST_DEVICE constexpr int fwd_score_fragments_ahead(int head_dim, int strips) {
  return head_dim == kScoreFragmentsTwoAheadHeadDim && strips == 2 ? 2 : 1;
}

// Whether a one-stage kernel issues V of its first key tile in the prologue, beside Q and K, rather than after K
// landed: every later V(n) loads during S = Q K^T of tile n, but the first one's latency is the CTA's alone (512
// tokens: 8 key tiles per CTA). The first tile then waits for one group fewer (a uniform branch in the loop).
// Measured on the H200 (bf16, two interleaved rounds, best TFLOP/s, with / without, FA2 in brackets;
// docs/perf_log.md "sixth session"): the plain 4-warp 64-row tile above head dim 128 (then causal hd 256 below 4096
// keys) 512 / 1k / 2k 213 / 259 / 285 against 210 / 253 / 279 (208 / 248 / 271); but the 8-warp wide tile lost
// (non-causal 512 / 2k / 8k 266 / 308 / 320 against 273 / 321 / 335), and at head dims <= 128 the 4-warp kernels
// spill more with the branch (ptxas, non-causal: hd 64 40 / 88 -> 76 / 232 bytes, hd 128 16 / 16 -> 40 / 168).
// The general kernels (softcap, ALiBi, bias, dropout) were not measured with it and keep the old order.
constexpr int kFirstVWarps = 4;
FLASH_HOST_DEVICE constexpr bool fwd_prefetches_first_v(int head_dim, bool general, int warps, int kv_stages) {
  return !general && kv_stages == 1 && head_dim > 128 && warps == kFirstVWarps;
}

// Whether the key loop's look-ahead load of K(n - 1) (fwd_kernel.h await_v) zero-fills the one K slot past the CTA's
// first key block instead of skipping behind a branch. ncu of the hd 96 forward at 1k keys (H200, bf16, forty-third
// session): that branch sat between the softmax and P V, so ptxas issued the 96 P V MMAs back to back after every
// exponential, where FA2's kernel interleaves them; MMA instructions held 21 % of our warp samples in fixed-latency
// waits against FA2's 9 %, and the kernel took 456 against 431 us. One stage only (its slot is free by then), the
// standard tile only. Measured with the fill / without (FA2), 32 heads, TFLOP/s at 1k / 4k / 16k: 322 / 340 / 340
// against 305 / 329 / 335 (327 / 347 / 350), causal 256 / 315 / 344 against 242 / 296 / 318 (262 / 315 / 336); window
// level (benchmarks/results/2026-12-04-h200-hd96-fill-ab-s43.json). Not at hd 192: its loop already interleaves them
// (V awaited before the softmax), and the fill added spill (ptxas: 8 -> 16 bytes of stack). hd 32 (non-causal; its
// masked kernels await V before the softmax, which already puts the branch ahead of it): P V MMAs after the last
// exponential 64 -> 6 of 128, 253 -> 243 registers, no spill; 64 heads, 512 / 2k / 8k keys: 189 / 236 / 249 against
// 174 / 221 / 246 (FA2 181 / 213 / 224), causal +1-2 % (forty-fourth session).
constexpr int kFillsPastRangeHeadDim = 96;
constexpr int kFillsPastRangeSmallHeadDim = 32;
FLASH_HOST_DEVICE constexpr bool fwd_fills_past_kv_range(int head_dim, FwdTileKind kind, int kv_stages) {
  return kv_stages == 1 && kind == FwdTileKind::kStandard &&
         (head_dim == kFillsPastRangeHeadDim || head_dim == kFillsPastRangeSmallHeadDim);
}

// Whether S = Q K^T hides its K lane offset from ptxas (kernel_common.h hide_from_compiler) in the swizzled 4-warp
// tiles (two strips per warp, head dims <= 128): otherwise ptxas folds it into every fragment address, and those
// kernels spill (ptxas, non-causal standard tile: hd 64 100 / 136 -> 40 / 88 bytes, hd 128 32 / 32 -> 16 / 16).
// H200 bf16 non-causal, hidden / not (FA2): hd 128 512 / 1k / 2k / 8k 301 / 336 / 354 / 368 against 296 / 326 / 341 /
// 357 (304 / 332 / 348 / 352); hd 64 263 / 297 / 318 / 334 against 259 / 293 / 310 / 322; causal within +-1 %.
FLASH_HOST_DEVICE constexpr bool fwd_hides_key_lane_offset(int head_dim, int strips) {
  return head_dim <= 128 && strips == 2;
}

// Whether the persistent kernel loads K and V by TMA (sm90+, ptx/tma_load_sm90.h) rather than cp.async: one thread
// issues a tile's four 64-column boxes and the warps wait on an mbarrier, so the loads take no load/store-unit slots
// or address registers. Head dims that are whole 128-byte segments and whose segment-major tile (kernel_common.h
// SegmentSwizzledRows) fits the padded slot: 256 (160 is not whole segments). Without K/V loads at all (a bound,
// not a kernel) the hd 256 forward ran 6-9 % faster at 512-8k keys; with TMA, H200 bf16 non-causal, two interleaved
// rounds, best TFLOP/s, TMA persistent / cp.async persistent up to 512 keys and one-item kernel above (FA2): 512 /
// 1k / 2k / 8k / 16k 293 / 318 / 333 / 347 / 350 against 276 / 301 / 319 / 335 / 338 (284 / 308 / 321 / 328 / 324;
// docs/perf_log.md, twelfth session). Calls the TMA cannot take (no tensor map: below sm90, strides the encoder
// rejects; seqused_k, whose unused rows the zero fill would not cover) take the one-item kernel.
FLASH_HOST_DEVICE constexpr bool fwd_persistent_loads_kv_by_tma(int head_dim) { return head_dim == 256; }

// Whether the one-item kernel of the standard tile loads K and V by TMA on sm90+ (fwd_kernel.h fwd_tma_kernel), as the
// persistent kernel does at head dim 256 (above): a tile is one (hd 64, 128 keys) or two (hd 128, 64 keys) boxes of 64
// columns, laid out as SegmentSwizzledRows (at hd 64 the same offsets as SwizzledRows). Measured on the H200 (bf16, two
// interleaved rounds, best TFLOP/s, TMA / cp.async, FA2 in brackets; docs/perf_log.md, twelfth session): hd 64
// non-causal 512 / 1k / 2k / 8k 280 / 308 / 328 / 343 against 262 / 296 / 317 / 332 (263 / 289 / 300 / 309), causal
// 200 / 263 / 310 / 356 against 188 / 245 / 283 / 324; hd 128 non-causal 318 / 353 / 371 / 387 against 302 / 343 /
// 365 / 383. hd 128 masked calls since the thirty-fifth session (their hot loop 1,202 -> 1,133 instructions; 1k /
// 4k / 16k TMA / cp.async with padded tiles, 2 rounds): causal 266 / 332 / 363 against 248 / 309 / 336 (FA2 248 /
// 309 / 327), a window of seqlen / 4 non-causal 248 / 338 / 370 against 221 / 297 / 324, causal 173 / 295 / 354
// against 158 / 260 / 309. Hd 256's masked calls (the one-item wide tile; unmasked ones run persistent) were level
// at 1k / 4k and 5-6 % faster at 16k only, so they keep cp.async. The calls make_fwd_kv_maps (fwd_launch.h) turns
// down (below sm90, varlen, seqused_k) keep it too. Softcap / ALiBi calls take it as plain ones do (fwd_launch.h).
FLASH_HOST_DEVICE constexpr bool fwd_loads_kv_by_tma(int head_dim, bool general, FwdTileKind kind) {
  return !general && kind == FwdTileKind::kStandard && (head_dim == 64 || head_dim == 128);
}

// Whether non-causal calls on the standard tile run it persistent (fwd_persistent_kernel.h: the CTAs an SM holds walk
// the work items and load the next item's Q and first K during their own last key tile), for calls of at most
// fwd_persistent_max_keys keys. It needs a second Q tile (fwd_persistent_smem_bytes). Head dims where the persistent
// kernel does not spill (ptxas): 160 and 256 (the wide tile); 192 / 224 spill 40 / 72 bytes, and the 4-warp tiles
// (which already hold 2 CTAs per SM) 142 / 174 bytes at hd 64 and 92 / 96 at 128 against the one-item kernels' 40 / 88
// and 16 / 16. Measured on the H200 (hd 256 bf16, two calls of three interleaved rounds, best TFLOP/s, persistent / one
// item, FA2 in brackets; docs/perf_log.md "seventh session"): 512 keys 278 / 271 and 278 / 270 (286), 1k 302 / 303 and
// 302 / 304 (308), 2k 318 / 318 and 321 / 321, 8k 329 / 333; hence only up to 512 keys (8 key tiles per item) with
// cp.async loads; with TMA loads at every length (above).
constexpr long long kPersistentMaxKeys = 512;
constexpr long long kAnyKeyCount = 1LL << 62;
FLASH_HOST_DEVICE constexpr long long fwd_persistent_max_keys(int head_dim) {
  return fwd_persistent_loads_kv_by_tma(head_dim) ? kAnyKeyCount : kPersistentMaxKeys;
}
FLASH_HOST_DEVICE constexpr bool fwd_runs_persistent(int head_dim, bool general, FwdTileKind kind, bool masked) {
  return (head_dim == 160 || head_dim == 256) && !general && kind == FwdTileKind::kStandard && !masked &&
         kWideTile == WideTile::k128x64Warps8;
}

// Whether the K/V tiles are laid out as swizzled rows (kernel_common.h SwizzledRows; head dims that are whole 128-byte
// segments) rather than padded ones: cp.async then fills aligned segments (padded, the copies took 2.6x the ideal
// shared-memory wavefronts, ncu). Measured on the H200 (bf16, plain kernels, three interleaved rounds, best TFLOP/s,
// swizzled / padded, docs/perf_log.md "swizzled shared memory"): head dim 256, wide tile, 8k 328 / 305, causal 8k
// 301 / 271; 64-row tile causal 512 / 2k 205 / 192 and 272 / 252, but non-causal 512 / 2k 253 / 263 and 289 / 297
// (every round), so that one stays padded; decode (hd 128) +5-7 %, e.g. 8 x 32k 4.20 / 3.92 TB/s. The 4-warp tiles
// at head dims 64 and 128 gain non-causal in every round (hd 64 512 257-258 / 252, hd 128 8k 357 / 346-352) but
// lose 2-7 % causal (hd 64 causal 8k 301-302 / 318-323: the XORed ldmatrix addresses cost registers, hd 128 8 -> 32
// bytes of spill), so causal/local stays padded there. The general kernels (softcap, ALiBi, bias, dropout) were not
// measured and spill more with it (hd 256: 764 bytes against 4), so they stay padded. `masked`: causal or local.
FLASH_HOST_DEVICE constexpr bool fwd_swizzles_kv(int head_dim, bool general, FwdTileKind kind, bool masked) {
  if (general) return false;
  if (fwd_is_decode_kind(kind)) return true;
  return head_dim > 128 ? masked || kind != FwdTileKind::kCompact : !masked && kind == FwdTileKind::kStandard;
}

// How many key-tile column groups of the lean softcap / ALiBi kernel (kLeanMods) share one group of exponentials on
// the FMA pipe (flash/common/exp2_polynomial.h) instead of the MUFU unit; 0: none. Softcap's tanh.approx is a second
// MUFU op per score, and at hd 64 a score's MUFU time is already about its tensor time (HOPPER_NOTES.md section 7):
// the portable hd 64 softcap forward costs 23-30 % over the plain call (thirty-fifth session), against the 15 % bar.
// The Hopper forward's share lost 4-9 % on its plain hd 64 kernel (issue-bound warps) and was level on softcap at hd
// 128 / 256 (forty-third session). The portable hd 64 lean kernel's key loop as a softcap call without ALiBi runs it
// (SASS, sm_90a, bf16, fifty-ninth session, the untaken branches compiled out; a warp's MUFU instruction holds its
// quarter of the SM's 16 MUFU lanes 8 cycles): 1,673 instructions a step, 260 of them MUFU (2,080 cycles), against
// the plain call's 1,410 and 132: MUFU time bounds it. Every 8th / 5th / 4th column group's exponentials on the FMA
// pipe (~7.8 instructions each): 1,811 / 1,864 / 1,922 instructions, MUFU 1,952 / 1,888 / 1,824 cycles, so a step's
// bound -6 / -9 / -8 %; predicted best at 5. ALiBi adds 266 instructions a step: an ALiBi call is issue-bound (132
// MUFU), a softcap + ALiBi one nearly (~1,940 against 2,080 cycles), so only softcap calls without ALiBi take the share
// (FwdScoreParams::poly_exp). Unmasked kernels only: the share's second online_softmax instance raised the masked
// kernels' spill (ptxas, hd 64 at 5, spill stores / loads in bytes: causal cp.async 8 / 16 -> 44 / 108, TMA 16 / 24
// -> 260 / 260; unmasked cp.async 104 / 132 -> 68 / 132, TMA 12 / 20 -> 24 / 56). H100, sixtieth session, at 5 with
// the ALiBi switches below (32 heads, 1k / 4k / 16k, TFLOP/s): hd 64 softcap 252 / 264 / 267 -> 248 / 265 / 271, hd
// 128 328 / 361 / 361 -> 328 / 353 / 364: level, not the predicted +5-9 %, so 0.
constexpr int kFwdScoreModsPolyExpEvery = 0;
constexpr int kFwdScoreModsPolyMaxHeadDim = 64;
FLASH_HOST_DEVICE constexpr int fwd_score_mods_poly_exp_every(int head_dim, bool masked) {
  return head_dim <= kFwdScoreModsPolyMaxHeadDim && !masked ? kFwdScoreModsPolyExpEvery : 0;
}

// The head-dim buckets that take the two ALiBi switches below: up to hd 128. Every bucket's GPU tests passed with them
// on (hd 32 / 64 / 128 sixtieth session; 96-256 sixty-first, H100, tests/test_cuda_forward.py, test_forward.py,
// test_feature_combinations.py, test_varlen.py and the backward files: 831 passed). Timed there (best of two rounds,
// 1k / 4k / 16k, ALiBi TFLOP/s off -> on): hd 96 286 / 306 / 312 -> 286 / 309 / 315, causal 232 / 284 / 302 -> 236 /
// 291 / 305; hd 160 259 / 284 / 290 -> 252 / 277 / 285, causal -1-2 %; hd 192 non-causal -2 %, causal 223 / 278 / 301
// -> 222 / 269 / 305; hd 256 -1 to +3 %. Beyond hd 128 they stay off (hd 224 between 192 and 256, not timed).
constexpr int kFwdAlibiSwitchesMaxHeadDim = 128;
FLASH_HOST_DEVICE constexpr bool fwd_alibi_switches_take(int head_dim) {
  return head_dim <= kFwdAlibiSwitchesMaxHeadDim;
}

// Whether the lean kernel's ALiBi calls without softcap keep raw scores as plain calls do: the softmax scale rides the
// exponent's FFMA (x_scale) and the slope is divided by it, instead of one FMUL a score that turns the scores into
// log2-domain logits first (FwdScoreParams::raw_alibi; a CTA whose slope / scale is not a finite float keeps the
// logits). ALiBi costs 11-20 % over the plain call at hd 64, 1-9 % at hd 128 (README). SASS (sm_90a, bf16, hd 64 lean
// kernel, ALiBi path only): a step issues 1,808 instructions, 1,680 without the FMULs, against the plain call's
// 1,410 (the ALiBi step is issue-bound: 132 MUFU); predicted +5-7 % at hd 64. Off: SASS identical. Timed only with
// fwd_alibi_linear_tiles (below).
constexpr bool kFwdAlibiKeepsRawScores = true;
FLASH_HOST_DEVICE constexpr bool fwd_alibi_keeps_raw_scores(int head_dim) {
  return kFwdAlibiKeepsRawScores && fwd_alibi_switches_take(head_dim);
}

// Whether the lean kernel's ALiBi calls take the linear form on key tiles whose visible keys lie on one side of every
// row's diagonal (fwd_kernel.h linear_alibi_scores: every tile of a causal call, all but the diagonal's of a long
// non-causal one): an FFMA a score instead of an FADD and an FFMA, the row's part in the softmax's offset. SASS
// (sm_90a, bf16, hd 64 lean kernel, executed path of a step): ALiBi with fwd_alibi_keeps_raw_scores ~1,680 -> ~1,590
// instructions (1,808 with neither; plain 1,410), softcap + ALiBi ~1,940 -> ~1,850, softcap alone 1,673 -> ~1,725
// (row bias 0 in one softmax for all: two instances raised the TMA kernel's spill 12 / 20 -> 96 / 96 bytes). ptxas
// with it alone, spill stores / loads in bytes: unmasked TMA kernel 12 / 20 -> 40 / 40, cp.async 104 / 132 -> 110 /
// 128; causal cp.async 8 / 16 -> 32 / 56, TMA 16 / 24 unchanged. Off: SASS identical. H100, sixtieth session, with
// fwd_alibi_keeps_raw_scores (1k / 4k / 16k, TFLOP/s): hd 64 ALiBi 293 / 314 / 317 -> 295 / 322 / 324, causal 222 /
// 280 / 300 -> 236 / 303 / 323; hd 128 +2 %, causal 245 / 307 / 325 -> 259 / 318 / 345.
constexpr bool kFwdAlibiLinearTiles = true;
FLASH_HOST_DEVICE constexpr bool fwd_alibi_linear_tiles(int head_dim) {
  return kFwdAlibiLinearTiles && fwd_alibi_switches_take(head_dim);
}

// Whether the Q, K and V loads branch on whole tiles (kernel_common.h WholeTileLoads): 3 instructions per 16-byte
// copy instead of 6 in the SASS, and ptxas allocates the rest of the loop differently. Measured on the H200 (bf16,
// interleaved rounds, best TFLOP/s, with / without, FA2 in brackets; docs/perf_log.md "ninth session"): head dim 128
// non-causal 512 / 1k / 2k / 8k / 16k 303 / 343 / 368 / 383 / 383 against 301 / 337 / 354 / 369 / 370 (302 / 334 /
// 342 / 359 / 358), the same gain in an earlier call; causal 1-2 % slower (2k 287 against 290). With K and V only
// (Q's loads as before) hd 128 non-causal was 1.5-3 % slower. Head dims 64 and 256 lost or tied (hd 256 causal 2k
// 275 against 287, hd 64 causal 16k 314 against 323) in one call of two rounds.
constexpr int kFwdWholeTilesHeadDim = 128;
FLASH_HOST_DEVICE constexpr bool fwd_branches_whole_tiles(int head_dim, bool general, FwdTileKind kind, bool masked) {
  return head_dim == kFwdWholeTilesHeadDim && !general && kind == FwdTileKind::kStandard && !masked;
}

// Whether the Q, K and V loads keep one column chunk per thread on the largest multiple of the row's chunks
// (kernel_common.h FixedColumnLoads) where those chunks do not divide the threads. ptxas (sm_90a, bf16): every hd 96
// standard kernel and most hd 160-224 kernels spill nothing with it (hd 96 causal 92 / 112 bytes -> 0). Measured on
// the H200 (bf16, portable forward, 2 interleaved rounds, best TFLOP/s at 1k / 4k / 16k, with / without, FA2 in
// brackets; docs/perf_log.md "thirty-fourth session"): hd 96 causal 239 / 296 / 316 against 219 / 278 / 301 (262 /
// 317 / 337), softcap 262 / 284 / 288 against 251 / 275 / 279, causal docs of 512 168 against 155, but non-causal
// 292 / 314 / 319 against 293 / 323 / 328; hd 224 non-causal 269 / 290 / 295 against 259 / 279 / 285 (235 / 243 /
// 245), causal level. It lost at hd 160 (7-8 %), at hd 192 non-causal (3-4 %) and was level at hd 192 causal and in
// hd 96 decode, so those keep the generic form; hd 96 / 224 with the general kernel were not timed.
constexpr int kFixedColumnsMaskedHeadDim = 96;
constexpr int kFixedColumnsUnmaskedHeadDim = 224;
FLASH_HOST_DEVICE constexpr bool fwd_loads_fixed_columns(int head_dim, bool general, FwdTileKind kind, bool masked,
                                                         bool lean_mods) {
  if (general || fwd_is_decode_kind(kind)) return false;
  if (head_dim == kFixedColumnsMaskedHeadDim) return masked || lean_mods;
  return head_dim == kFixedColumnsUnmaskedHeadDim && !masked && !lean_mods;
}

// Whether the Q, K and V loads split each row's chunks into groups that divide the threads (kernel_common.h
// GroupedColumnLoads; before the fixed-column form where both apply): at hd 96 every thread issues 6 copies of a
// 64-row tile from one pointer, as FA2's loads do. A SASS liveness count of the plain hd 96 key loop
// (tools/sass_liveness.py, thirty-sixth session) found 36 loop-invariant registers there against FA2's 11, most of
// them per-copy load offsets and predicates, and 25 spilled values; its loop issues 7-8 integer instructions per
// copy. Taken at 96 together with kPrefetchTwoStripsHeadDim (fortieth session, H200 bf16, hd 96, medians of 2-3
// rounds, TFLOP/s tree / both, FA2 in brackets): 32 heads non-causal 512 259 / 270 (298), 1k 294 / 304 (322), 2k
// 310 / 314, 8k 320 / 322, causal 512-8k within -1 to +1 %; softcap +0.4-2.6 %; GQA 32/8 non-causal 1k 297 / 309, 4k
// 321 / 327, ALiBi +1-2 %, window -1 %; under an A100's 163 KB of shared memory 1k 294 / 304. The grouped loads alone
// were within +-1 % (thirty-seventh session and this one), so most of the gain is the prefetch's.
constexpr int kGroupedColumnsHeadDim = 96;
FLASH_HOST_DEVICE constexpr bool fwd_loads_grouped_columns(int head_dim, bool general, FwdTileKind kind) {
  return !general && !fwd_is_decode_kind(kind) && head_dim == kGroupedColumnsHeadDim;
}

// Whether the hd 96 forward's K / V tiles are unpadded rows swizzled within 64-byte half segments (kernel_common.h
// HalfSegmentSwizzledRows) instead of rows padded to 104 columns, whose cp.async copies conflict: the hd 96 backward's
// padded Q / dO copies took 3.0x the ideal wavefronts, and swizzled it gained 1-5 % (forty-fourth session). ptxas
// (sm_90a, bf16, fifty-first session), padded -> swizzled: non-causal key loop 920 -> 932 instructions, 0 -> 24 bytes
// of stack and 5 spill instructions in the loop; causal 987 -> 1,001, 16 -> 24 bytes, 3 -> 4; the softcap / ALiBi
// lean kernel spilled 48 bytes, so it keeps padded rows. Measured on the H200 (fifty-sixth session, bf16, 32 heads,
// two interleaved rounds, best TFLOP/s, swizzled / padded): non-causal 1k / 4k / 16k 339 / 325, 355 / 331, 352 / 331
// (FA2 327 / 350 / 340); causal 246 / 260, 310 / 324, 328 / 327: masked calls keep padded rows.
constexpr int kFwdHalfSegmentSwizzleHeadDim = 96;
FLASH_HOST_DEVICE constexpr bool fwd_swizzles_half_segments(int head_dim, bool general, FwdTileKind kind,
                                                            bool lean_mods, bool paged, bool masked) {
  return head_dim == kFwdHalfSegmentSwizzleHeadDim && !general && !lean_mods && !paged && !masked &&
         kind == FwdTileKind::kStandard;
}

// The general kernel takes 32-key tiles at head dims 192 and 224: with 64 keys ptxas spilled 304 / 328 bytes (hd 192)
// and 520 / 580 (hd 224), with 32 none and 32 / 32 (O alone is 96 / 112 registers there). Head dims 160 (56 bytes) and
// 256 (none) keep 64 keys, which halve the K/V tiles' barriers per key. Not yet timed.
constexpr int kGeneralNarrowKeysMinHeadDim = 161;
constexpr int kGeneralNarrowKeysMaxHeadDim = 224;
FLASH_HOST_DEVICE constexpr FwdTileConfig fwd_wide_tile_config(int head_dim, bool general, FwdTileKind kind) {
  const bool narrow_keys =
      general && head_dim >= kGeneralNarrowKeysMinHeadDim && head_dim <= kGeneralNarrowKeysMaxHeadDim;
  return narrow_keys ? FwdTileConfig{64, 32, 4, 1}
         : general || kind == FwdTileKind::kCompact || kWideTile == WideTile::k64x64Warps4 ? FwdTileConfig{64, 64, 4, 1}
         : kWideTile == WideTile::k128x64Warps8 ? FwdTileConfig{128, 64, 8, 1}
                                                : FwdTileConfig{128, 64, 8, 2};
}

// Head dims <= 128: 128 query rows on 4 warps (two 16-row strips each, so every K/V fragment read from shared
// memory feeds two MMAs); 128 keys per tile up to head dim 64, 64 keys up to 128 (the S accumulators and O
// stay within 255 registers). The general kernel (softcap, ALiBi, bias, dropout) keeps one stage and 64-key
// tiles at head dim 64: with 128 it spilled 1.2 KB. Above head dim 64 it takes 8 warps of one strip: with two strips
// it spilled 520 bytes a thread at hd 128 (softcap and ALiBi ran at 125-129 against 369 TFLOP/s without them, H200,
// 4k) and 228 at hd 96; with one none at hd 128 (247 registers). Not yet timed. The plain hd 65-96 tile keeps two
// strips although its key loop spills (25 local loads a key block): on 8 warps of one strip (no spill) it ran at
// 0.62-0.73x FA2 against 0.84-0.96x (H200, bf16, 1k-16k, thirty-third session).
FLASH_HOST_DEVICE constexpr FwdTileConfig fwd_tile_config(int head_dim, bool general = false,
                                                          FwdTileKind kind = FwdTileKind::kStandard) {
  const int stages = general || kind == FwdTileKind::kCompact ? 1 : kStagesUpTo128;
  return kind == FwdTileKind::kDecode          ? FwdTileConfig{16, 32, 1, head_dim <= 128 ? 3 : 2}
         : kind == FwdTileKind::kDecodeCompact ? FwdTileConfig{16, 32, 1, 2}
         : kind == FwdTileKind::kDecodeKeyWarps ? FwdTileConfig{16, 32, 1, head_dim <= 128 ? 3 : 2, kDecodeKeyWarps}
         : head_dim <= 64             ? FwdTileConfig{128, general ? 64 : 128, 4, stages}
         : head_dim <= 96             ? FwdTileConfig{128, 64, general ? 8 : 4, 1}
         : head_dim <= 128            ? FwdTileConfig{128, 64, general ? 8 : 4, stages}
                                      : fwd_wide_tile_config(head_dim, general, kind);
}

// Whether a lean kernel's instantiation (the standard and compact cp.async tiles) runs softcap and ALiBi calls (no
// bias, no dropout), each feature one uniform branch per tile, instead of the general kernel: that one takes 8 warps of one
// 16-row strip at head dims 65-128 (every K / V fragment read from shared memory feeds one MMA, not two) and one CTA
// per SM, and ran softcap / ALiBi at 132 TFLOP/s against the lean kernel's 383 (H200, hd 128 4k, sixteenth
// session); two K / V stages did not lift it (twentieth session). Lean against general, H200, bf16, portable path,
// best of 2 interleaved rounds, 2k / 8k TFLOP/s (twenty-first session): softcap hd 128 204 / 211 -> 308 / 322 (the
// same call without softcap: 369 / 382), causal 179 / 201 -> 243 / 276; hd 64 +12-17 %; hd 256 +6-11 %; ALiBi hd 128
// 220 / 226 -> 328 / 343, hd 64 +4-14 %, hd 256 +8-13 %.
constexpr bool kLeanRunsScoreMods = true;
FLASH_HOST_DEVICE constexpr bool fwd_lean_runs_score_mods(int head_dim) {
  (void)head_dim;
  return kLeanRunsScoreMods;
}

// Whether a call takes the decode tile (fast kernel only; calls with per-element features keep the general one).
FLASH_HOST_DEVICE constexpr bool fwd_uses_decode_tile(long long seqlen_q, bool general) {
  return !general && seqlen_q <= kDecodeMaxRows;
}

// Padding of each shared-memory row in elements (kernel_common.h kSmemRowPad, restated here without CUDA headers).
constexpr int kFwdSmemRowPad = 8;
constexpr int kFwdWarpSize = 32;
constexpr int kFwdElementBytes = 2;  // fp16 / bf16

// Dynamic shared memory of one key group of a CTA: Q, then kv_stages K tiles, then kv_stages V tiles.
FLASH_HOST_DEVICE constexpr int fwd_group_smem_bytes(int head_dim, bool general, FwdTileKind kind,
                                                     int element_bytes = kFwdElementBytes) {
  const FwdTileConfig tile = fwd_tile_config(head_dim, general, kind);
  return (tile.block_m + 2 * tile.kv_stages * tile.block_n) * (head_dim + kFwdSmemRowPad) * element_bytes;
}

// Dynamic shared memory of one CTA: its key groups' buffers one after another.
FLASH_HOST_DEVICE constexpr int fwd_smem_bytes(int head_dim, bool general, FwdTileKind kind,
                                               int element_bytes = kFwdElementBytes) {
  return fwd_tile_config(head_dim, general, kind).key_groups *
         fwd_group_smem_bytes(head_dim, general, kind, element_bytes);
}

// Threads of one CTA.
FLASH_HOST_DEVICE constexpr int fwd_cta_threads(int head_dim, bool general, FwdTileKind kind) {
  const FwdTileConfig tile = fwd_tile_config(head_dim, general, kind);
  return tile.warps * tile.key_groups * kFwdWarpSize;
}

// The persistent wide kernel's shared memory: the standard tile's and a second Q tile (203 KB at head dim 256).
FLASH_HOST_DEVICE constexpr int fwd_persistent_smem_bytes(int head_dim, int element_bytes = kFwdElementBytes) {
  const FwdTileConfig tile = fwd_tile_config(head_dim, false, FwdTileKind::kStandard);
  return fwd_smem_bytes(head_dim, false, FwdTileKind::kStandard, element_bytes) +
         tile.block_m * (head_dim + kFwdSmemRowPad) * element_bytes;
}

// Alignment of the TMA boxes in shared memory (the 128-byte swizzle's address pattern repeats every 1024 bytes).
constexpr int kTmaBoxAlign = 1024;
// Shared memory the persistent kernel asks for: its tiles, and with TMA the slack to align them and two mbarriers.
constexpr int kTmaBarrierBytes = 2 * 8;
FLASH_HOST_DEVICE constexpr int fwd_persistent_launch_smem_bytes(int head_dim, int element_bytes = kFwdElementBytes) {
  return fwd_persistent_smem_bytes(head_dim, element_bytes) +
         (fwd_persistent_loads_kv_by_tma(head_dim) ? kTmaBoxAlign + kTmaBarrierBytes : 0);
}

// Shared memory the one-item kernel asks for with TMA loads: its tiles, the slack to align them and two mbarriers.
FLASH_HOST_DEVICE constexpr int fwd_tma_smem_bytes(int head_dim, FwdTileKind kind,
                                                   int element_bytes = kFwdElementBytes) {
  return fwd_smem_bytes(head_dim, false, kind, element_bytes) + kTmaBoxAlign + kTmaBarrierBytes;
}

// Shared memory of the device: what one block may opt into and what one SM holds
// (cudaDevAttrMaxSharedMemoryPerBlockOptin / cudaDevAttrMaxSharedMemoryPerMultiprocessor).
struct SmemLimits {
  int per_block_optin;
  int per_sm;
};

// Resident CTAs per SM with the kernel at (up to) 255 registers per thread: registers allow kSmRegisterWarps
// warps; the driver reserves kSmemReservedPerCta of shared memory per CTA.
constexpr int kSmRegisterWarps = 8;
constexpr int kSmemReservedPerCta = 1024;
FLASH_HOST_DEVICE constexpr int fwd_ctas_per_sm_by_registers(int head_dim, bool general, FwdTileKind kind) {
  const FwdTileConfig tile = fwd_tile_config(head_dim, general, kind);
  return kSmRegisterWarps / (tile.warps * tile.key_groups);
}
FLASH_HOST_DEVICE constexpr int fwd_ctas_per_sm(int head_dim, bool general, FwdTileKind kind, SmemLimits limits) {
  const int by_registers = fwd_ctas_per_sm_by_registers(head_dim, general, kind);
  const int by_smem = limits.per_sm / (fwd_smem_bytes(head_dim, general, kind) + kSmemReservedPerCta);
  const int ctas = by_registers < by_smem ? by_registers : by_smem;
  return ctas > 0 ? ctas : 1;
}

// The tile a call takes on a device with the given shared memory (the host split-KV planner and the launcher
// both ask this, so they agree).
// seqlen_k: the call's (maximum) key length; masked: causal or local.
FLASH_HOST_DEVICE constexpr FwdTileKind fwd_tile_kind(int head_dim, bool general, long long seqlen_q,
                                                     long long seqlen_k, bool masked, SmemLimits limits) {
  const FwdTileKind standard = FwdTileKind::kStandard;
  const bool standard_fits = fwd_smem_bytes(head_dim, general, standard) <= limits.per_block_optin &&
                             fwd_ctas_per_sm(head_dim, general, standard, limits) ==
                                 fwd_ctas_per_sm_by_registers(head_dim, general, standard);
  const bool short_wide = head_dim > kShortCausalCompactAboveHeadDim && masked && seqlen_k < kWideMinKeys;
  const bool decode_fits = fwd_ctas_per_sm(head_dim, general, FwdTileKind::kDecode, limits) >= kDecodeMinCtasPerSm;
  return fwd_uses_decode_tile(seqlen_q, general) ? (decode_fits ? FwdTileKind::kDecode : FwdTileKind::kDecodeCompact)
         : standard_fits && !short_wide          ? standard
                                                 : FwdTileKind::kCompact;
}

}  // namespace flash::sm80
