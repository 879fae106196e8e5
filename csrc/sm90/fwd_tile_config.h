// Tile sizes of the Hopper forward kernel (fwd_kernel.h), one constexpr function per head-dim bucket: a CTA is one
// producer warpgroup (TMA) and block_m / 64 consumer warpgroups of 64 query rows (wgmma), K and V pass through rings
// of `stages` slots. Shared memory bounds block_n: Q + 2 stages x (K + V) must fit the 227 KB a block may opt into.
#pragma once

#include "flash_attn/params.h"

namespace flash::sm90 {

constexpr int kRowsPerConsumer = 64;   // wgmma M: one consumer warpgroup owns 64 query rows
constexpr int kConsumerWarpgroups = 2;  // above hd 64 (fwd_consumer_warpgroups)
constexpr int fwd_threads(int block_m) { return (block_m / kRowsPerConsumer + 1) * 128; }

// hd 64 runs three consumer warpgroups (FA3's and ThunderKittens' 192-row tile there): its softmax's exponentials
// take as long on the MUFU unit as its GEMMs on the tensor cores (HOPPER_NOTES.md section 7), so a third warp per SM
// sub-partition keeps one softmax running while the other two wait for their GEMMs. setmaxnreg then gives a consumer
// thread 160 registers (kernel_common.h consumer_registers; no spill, key loop 799 -> 838 instructions, most of them
// register moves). Measured on the H200 (bf16, 32 heads, twenty-eighth session), two -> three, ratio to cuDNN in the
// same process: 2k / 4k / 8k / 16k 0.94 / 0.91 / 0.92 / 0.95 -> 1.00 / 0.96 / 1.05 / 1.02 (16k 473 -> 502 TFLOP/s);
// causal 0.87 / 0.86 / 0.92 / 0.98 -> 0.90 / 0.87 / 0.98 / 1.06; 512 and 1k level (a 192-row tile pads 512 rows to
// 576). Beyond the table (one round, 2k / 8k, two -> three): GQA 32/8 445 / 446 -> 466 / 489, causal 362 / 423 -> 358
// / 454; softcap 301 / 311 -> 331 / 357; ALiBi 333 / 340 -> 402 / 429; but a sliding window (seqlen_k / 8 keys) 323 /
// 410 -> 316 / 418 and with causal 242 / 352 -> 214 / 356: a 192-row tile's band of keys is wider than a 128-row
// one's by the same window, so local masks keep two.
constexpr int kFwdSmallHeadDimConsumers = 3;
constexpr int fwd_consumer_warpgroups(int head_dim, MaskKind mask) {
  return head_dim <= 64 && mask != MaskKind::kLocal ? kFwdSmallHeadDimConsumers : kConsumerWarpgroups;
}

// How a consumer warpgroup orders its GEMMs and its softmax (fwd_kernel.h):
//   kSerial:   S = Q.K^T, softmax, O += P.V, one after the other; the two warpgroups overlap only each other.
//   kOverlap:  the S GEMM of key block j+1 is issued with the P.V GEMM of block j and block j+1's softmax runs while
//              P.V is on the tensor cores (FA3's intra-warpgroup overlap; one more S tile of registers).
//   kPingpong: kOverlap, and the two warpgroups take turns issuing GEMMs (named barriers), so one's softmax runs
//              under the other's GEMMs.
enum class FwdSchedule { kSerial, kOverlap, kPingpong };

// A template argument of the kernel (a structural type), so tools/sm90_fwd_check.cu can time other tiles.
struct FwdTileConfig {
  int block_m;  // query rows per CTA
  int block_n;  // keys per K/V stage (a multiple of 16: the P.V GEMM's k16 steps)
  int stages;   // K/V ring depth
  constexpr bool operator==(const FwdTileConfig&) const = default;
};

// Calls without a mask run the persistent kernel (fwd_kernel.h kPersistent: CTAs stride over the tiles, the next
// tile's loads overlap the current tile's tail), fwd_persistent_pays picking a CTA per SM or one CTA per tile. So do
// masked calls at hd 64, 128 and 192 (160 is stored as 192), the buckets where a CTA per SM paid or is being timed
// (fwd_masked_persistent_max_keys); hd 256 keeps one tile per CTA (measured below).
constexpr bool fwd_persistent(int head_dim, MaskKind mask) {
  return mask == MaskKind::kNone || head_dim == 64 || head_dim == 128 || head_dim == 192;
}

// A CTA per SM where a tile is a few key blocks, so its prologue (barrier setup, Q and first K / V loads) is exposed
// once per tile; otherwise one CTA per tile (the hardware then orders them). H200, bf16, forced Hopper forward, no
// mask, TFLOP/s one tile per CTA -> a CTA per SM (eighteenth session, median of four rounds): 512 keys hd 64 263 ->
// 344, hd 128 379 -> 440, hd 256 380 -> 417; 2k 396 -> 436, 597 -> 589, 618 -> 660. At 4k and 16k the persistent
// kernel launched one CTA per tile ran within 2 % of the one-tile kernel.
constexpr int64_t kFwdPersistentMaxKeys = 2048;

// Masked (causal) calls, best of three rounds one tile per CTA -> a CTA per SM (nineteenth session, forced Hopper,
// bf16 TFLOP/s): hd 64 512 155 -> 199, 2k 308 -> 346; hd 128 512 216 -> 242 but 2k 458 -> 426; hd 256 512 250 ->
// 204, 2k 474 -> 456 (so hd 256 keeps the one-tile kernel). At 4k / 16k one CTA per tile in the persistent kernel
// ran as the one-tile kernel (hd 128 554 / 555, hd 64 376 / 377 at 4k). With the carried tile tail
// (fwd_carries_tile_tail), hd 128 causal, 15 heads, ratio to cuDNN in the same process (twenty-eighth session): 1k
// 0.77 -> 0.81 (327 -> 340 TFLOP/s), 2k 0.87 -> 0.87. With the chunked order (fwd_masked_tiles_in_chunks), hd 128
// causal 2k one tile per CTA -> a CTA per SM 441-449 -> 479 in both rounds (thirtieth session); hd 256 with chunks
// 512 / 1k 234 / 378 -> 235 / 364-377, no gain, so it stays one tile per CTA. Windows (kLocal) keep hd 128's 1k,
// where they were measured: the 2k step was timed on causal calls only. hd 192 (and 160, stored as 192) takes hd 64's
// 2k with chunks: it carries the tile tail (fwd_carries_tile_tail) as hd 256 does not, which gave hd 192
// non-causal 512 / 1k 0.83 / 0.87 -> 0.88 / 0.93x cuDNN. Predicted causal 512 / 1k +5-10 %; measured (forty-sixth
// session, causal, medians of 2 rounds, one tile per CTA -> a CTA per SM): hd 160 512 / 1k / 2k 222 / 357 / 466 ->
// 255 / 384 / 473, hd 192 237 / 382 / 483 -> 271 / 392 / 501. hd 224 with the same (sm90-short-224) was level.
// 0: never a CTA per SM.
constexpr int64_t fwd_masked_persistent_max_keys(int head_dim, MaskKind mask) {
  if (head_dim == 128) return mask == MaskKind::kCausal ? 2048 : 1024;
  return head_dim == 64 || head_dim == 192 ? 2048 : 0;
}

// Whether persistent CTAs walk masked tiles in chunks of the head-major order (tile_order.h masked_tile_at) instead of
// longest first across every head. ncu, hd 128 causal, 16k tokens, ours / cuDNN (twenty-ninth session): 512 keys
// 131.8 / 103.1 us reading 398 / 201 MB from DRAM, 1k 194.8 / 160.7 us reading 633 / 201 MB: each head's K / V came
// from DRAM again for each of its query blocks, a round of CTAs apart; in chunks of two rounds the K / V the CTAs
// share (~17 MB at hd 128) stays in L2. Predicted causal 512 / 1k +5-15 %. Measured (thirtieth session, two rounds,
// bf16 TFLOP/s old -> chunks): hd 128 1k 344-347 -> 374-385, 512 247-249 -> 248-255, 2k (with a CTA per SM there)
// 441-449 -> 479; hd 64 512 / 1k level, 2k 363-366 -> 345-349, so hd 64 keeps the old order (its 192-row tiles give
// a CTA ~2 tiles at 2k, where the old order's tighter balance counts more than its K / V traffic). Causal only: the
// chunks' balance rests on causal tiles' weights, and windows were not timed in them.
constexpr bool fwd_masked_tiles_in_chunks(int head_dim, MaskKind mask) {
  return (head_dim == 128 || head_dim == 192) && mask == MaskKind::kCausal;
}

constexpr bool fwd_persistent_pays(int head_dim, MaskKind mask, int64_t seqlen_k) {
  return seqlen_k <= (mask != MaskKind::kNone ? fwd_masked_persistent_max_keys(head_dim, mask) : kFwdPersistentMaxKeys);
}

// Persistent CTAs that walk several tiles (a CTA per SM, fwd_persistent_pays), overlapped schedule: whether a tile's
// last P.V GEMM and its epilogue wait for the next tile's first S GEMM, so that the P.V runs on the tensor cores under
// that S GEMM and the next tile's first softmax instead of alone at the tile's end (at 512 keys, hd 128, a tile paid
// ~1.9 key blocks' time beyond its own: 444 TFLOP/s against ~650 at 16k). With kFwdDoubleQ (fwd_kernel.h
// fwd_q_stages) the next tile's Q has its own slot. Predicted +10-15 % at 512 keys; measured on the H200 (bf16,
// twenty-seventh session, docs/perf_log.md), as the ratio to cuDNN in the same process: hd 128 512 0.85 -> 0.88,
// causal 0.71 -> 0.75, 2k 0.97 -> 0.98; hd 64 512 0.88 -> 0.91, causal and 2k unchanged. Not at hd 256: the carried
// tile's state beside 128 O registers spilled (16 bytes), and its A/B there was within the noise. hd 192 (no spill;
// 10 heads, non-causal, twenty-eighth session): 512 0.83 -> 0.88, 1k 0.87 -> 0.93, 2k 0.94 -> 1.00 (617 -> 646
// TFLOP/s). One-tile launches (longer keys) run the kernel without it: carrying there measured 3-7 % slower at 8k in
// one A/B, no more than that A/B's order bias (perf log), so not taken where it cannot pay.
constexpr bool fwd_carries_tile_tail(int head_dim) { return head_dim <= 192; }

// Whether a masked key block's per-element test compares each score's compile-time column with the row's visible keys
// as a 32-bit range local to the block (block_ranges.h local_range) instead of its 64-bit absolute column with the
// key range (four ISETP a score, run on every masked block: 1 of 2.5 blocks a causal tile has at 512 keys). ptxas, hd
// 128 causal key loop: 869 -> 742 instructions (ISETP 258 -> 146), carrying 874 -> 733. Predicted: causal 512 / 1k
// +3-6 %. Measured (twenty-ninth session, two calls, 5 rounds, causal TFLOP/s off -> on): hd 128 512 250 / 251 ->
// 253 / 260, 2k 439 / 454 -> 453 / 464, 4k 553 -> 564; hd 256 512 242 / 228 -> 250 / 247; hd 64 2k 356 -> 368,
// 512 and 1k level (+-2 %, this tool's spread). tests/test_hopper_forward.py passes with it (fp16 and bf16).
constexpr bool kFwdMasksByLocalRange = true;

// Whether a causal kernel's mask tests a score's column against its row's end only: its rows see every key from 0,
// so the local range's lower bound is always 0 (one ISETP a score instead of two, as cuDNN's kernel). H200, bf16,
// three rounds against off (thirty-first session), causal TFLOP/s: hd 128 512 261 / 261, 1k 394 / 391, 2k 487 /
// 486, 8k 603 / 626 (medians 593 / 599); hd 64 512 200 / 196, 2k 369 / 357, 8k 467 / 461: level to +3 %, kept for
// the shorter masked blocks.
constexpr bool kFwdCausalMaskUpperOnly = true;
constexpr bool kFwdDoubleQ = true;

// Whether the producer loads key block i's K before block i - 1's V (the order the consumers use them: block i's S
// GEMM is issued with block i - 1's P.V), so a K waits only for the S GEMMs that free its slot, not for the P.V that
// frees the previous V's: at hd 128 causal 512 keys the wait on a tile's first K held 4.2 % of the stall samples
// (ncu, thirty-first session). H200, bf16, best of three rounds, on / off (thirty-second session; cuDNN in the same
// process): hd 128 causal 512 266 / 250, 1k 402 / 387, 2k 507 / 477; hd 64 8k 525 / 498, 2k 468 / 456, causal level;
// hd 192 4k 706 / 655 (two rounds). Together with kFwdPingpongWhenCarrying below. Not at hd 256 (80-key blocks): there
// K before V lost at non-causal 512 / 2k / 16k keys, 422 / 605 / 730 against 457 / 694 / 797 (medians 422 / 602 / 730
// against 456 / 680 / 774), won at 8k (766 / 720) and was level causal (two rounds, thirty-third session).
constexpr int kFwdKeysBeforeValuesMaxHeadDim = 192;
constexpr bool fwd_keys_before_values(int head_dim) { return head_dim <= kFwdKeysBeforeValuesMaxHeadDim; }

// How many column groups of a key block share one group of FMA-pipe exponentials (fwd_kernel.h softmax_step): 0,
// all on the MUFU unit. HOPPER_NOTES.md section 7 measured 15.8 exp/clk/SM on MUFU alone and 20.6 with one polynomial
// for three MUFU ops, so 4 was predicted to lift the exp-bound hd 64 forward 10-20 %; measured on the H200 (bf16,
// twentieth session, 4 against 0, cuDNN in brackets): 16k 431 / 464 (484), 2k 417 / 433 (466), 512 318 / 346 (390),
// causal 16k 426 / 448 (468): 4-9 % slower, as tools/sm90_fwd_check.cu had found in the sixteenth session.
constexpr int fwd_poly_exp_every(int head_dim) {
  (void)head_dim;
  return 0;
}

// The same share for the general kernels (softcap / ALiBi) alone. Softcap's tanh.approx is a second MUFU op per
// score, the MUFU-to-MMA ratio of a plain hd 64 call, and the hd 128 softcap forward runs at the plain hd 64 call's
// fraction of plain hd 128 (H200, 4k: 480 / 672 against 466 / 672, forty-first session). 0 until an A/B times it;
// predicted to lose as the hd 64 share did, since those warps are issue-bound.
constexpr int fwd_poly_exp_every_general(int head_dim) {
  (void)head_dim;
  return 0;
}

// Lazy rescaling (FlashAttention-4's rule, HOPPER_NOTES.md section 7): the online softmax keeps a row's applied max
// while a key block's max exceeds it by at most kFwdLazyRescaleLog2 in the exponent (P then up to 2^8, far inside
// fp16 / bf16 and the fp32 sums), so the row's factor is exactly 1, and a warp skips O's rescale (32 FMULs a key
// block at hd 64, 64 at hd 128) when none of its rows moved its max; the LSE and 1 / sum use the applied max.
// Predicted +2-3 % at hd 64, +3-5 % at hd 128. Measured on the H200 (fiftieth session, bf16, 16k tokens, hidden 3072,
// best of 2 rounds, TFLOP/s off -> on, 512 / 2k / 4k / 16k keys), with it in every kernel: the general kernel gains at
// hd 128, softcap 371 / 458 / 444 / 461 -> 412 / 469 / 472 / 488 (causal 240 / 404 / 410 / 468 -> 251 / 400 / 426 /
// 486; 8 KV heads alike), where the tanh beside each exponential puts the softmax on the critical path; the lean
// kernels lose at hd 128 (458 / 596 / 593 / 639 -> 467 / 573 / 562 / 612), where the MMAs bound the step and the
// compare and vote are extra; hd 64 level either way. In the general kernels alone (two more calls, 2k and 16k keys,
// each call off -> on; the spread between identical kernels in these calls is up to ±7 %): hd 128 softcap 2k 468 ->
// 457, 485 -> 463, 16k 436 -> 457, 478 -> 487, causal 16k 484 -> 519, 483 -> 516; hd 256 softcap 2k 550 -> 608, 584 ->
// 579, 16k 636 -> 647, 629 -> 667, causal 16k 615 -> 655, 597 -> 615; ALiBi level (±4 %); hd 96 loses at 512-2k
// (softcap 390 -> 379, ALiBi 484 -> 456, causal 372 -> 361). So the general kernels from hd 128 (160-224 inferred from
// 256).
constexpr int kFwdLazyRescaleMinHeadDim = 128;
constexpr bool fwd_lazy_rescale(int head_dim, bool general) {
  return general && head_dim >= kFwdLazyRescaleMinHeadDim;
}
constexpr float kFwdLazyRescaleLog2 = 8.f;

// kOverlap at every head dim. Measured on the H200 (tools/sm90_fwd_check.sh, bf16, 16k tokens per batch x heads x
// 2048 columns), serial / overlap / pingpong in TFLOP/s: hd 128 16k 585 / 698 / -, 2k 545 / 609 / 606, 512 374 / 398
// / 404; hd 64 16k 424 / 452 / 452, 512 275 / 283 / 290; hd 256 16k 691 / 734 / - (serial was never ahead).
// Sixteenth session, overlap / pingpong: hd 256 2k 653 / 661, 16k 731 / 761, causal 2k 497 / 503, 16k 744 / 750
// (pingpong ahead at all four: the candidate, not taken until timed on that bucket's softcap / ALiBi, GQA, varlen
// and 512-key calls too); hd 128 16k 652 / 674 but causal 684 / 664, 2k 604 / 600, causal 472 / 472 (mixed).
constexpr FwdSchedule fwd_schedule(int head_dim) {
  (void)head_dim;
  return FwdSchedule::kOverlap;
}

// The schedule of kernels that carry tile tails (fwd_carries_tile_tail): kPingpong where two consumers run
// (kFwdPingpongWhenCarrying). cuDNN's hd 128 causal 512-key kernel ping-pongs its two consumer warpgroups through a
// 256-thread named barrier and spends 34 % of its stall samples waiting on wgmma, ours 8 % (ncu, thirty-first
// session): predicted +5-10 % at 512-1k keys, where a tile is 1-8 key blocks and both warpgroups now run their
// softmax at the same time. H200, bf16, best of three rounds (thirty-second session), with fwd_keys_before_values /
// both off (cuDNN): hd 128 512 473 / 449 (513), causal 512 274 / 250 (329), 1k 404 / 387 (425), 2k 512 / 477 (504),
// 8k level; hd 192 causal 4k 613 / 552 (605), two rounds. Beyond the table at hd 128 (both on / off, 1k and 4k):
// GQA 16/4 causal +5-8 %, varlen documents of 512 +5-6 %, softcap / ALiBi / window -1 to +8 %.
constexpr bool kFwdPingpongWhenCarrying = true;
constexpr FwdSchedule fwd_carrying_schedule(int block_m) {
  return kFwdPingpongWhenCarrying && block_m == kConsumerWarpgroups * kRowsPerConsumer ? FwdSchedule::kPingpong
                                                                                        : FwdSchedule::kOverlap;
}

// Buckets come every 32 columns (32 ... 256); each stores its tiles in whole 64-column TMA segments (TMA zero-fills
// the rest of Q, K and V) and takes the tiles and policies of that storage width (fwd_storage_dim), while its S GEMM
// issues only the bucket's k16 steps. Until the forty-fourth session hd 65-96 ran in the hd 128 kernel, a third of
// its S and P.V work on zero columns (forty-first session's sweep, 4k, 21 heads: 475 TFLOP/s useful, cuDNN 516).
constexpr int kFwdSegmentColumns = 64;
constexpr int fwd_storage_dim(int head_dim) {
  return (head_dim + kFwdSegmentColumns - 1) / kFwdSegmentColumns * kFwdSegmentColumns;
}

// O's columns (the P.V GEMM's N; the backward's dK / dV take the same rule): the head dim, or its storage width
// where V's columns past the head dim (zeros) are multiplied too. At 96 an N = 96 wgmma reads V MN-major in 128-byte
// swizzled atoms of 64 columns, the second atom's first half only; the Hopper forward / backward tests pass on it
// (1,499 cases, bf16 build of every bucket, forty-fifth session). Measured against the storage width (A/B, best of
// 2 rounds, TFLOP/s, 1k / 4k / 16k): forward hd 32 non-causal 254 / 284 / 315 against 234 / 272 / 295, hd 160 causal
// 338 / 551 / 644 against 334 / 519 / 589, hd 224 causal 16k 740 against 616; hd 96 level (+-4 %, noise); backward
// hd 32 +4-7 %, hd 96 +1-5 %, hd 160 / 192 / 224 level (docs/perf_log.md, forty-fifth session).
constexpr bool kFwdPvPartialSegment = true;
constexpr int fwd_pv_columns(int head_dim) {
  return kFwdPvPartialSegment ? head_dim : fwd_storage_dim(head_dim);
}

// block_n (a bucket takes its storage width's, fwd_storage_dim): hd 64 and 128 take 128 keys (S = 64 accumulator
// registers per thread); hd 192 and 256 take 112 and 80, the most that fits beside a 128-row Q tile in 2 stages
// (FA3's sizes, HOPPER_NOTES.md section 1.2). 48 keys with room for a second Q slot, so that hd 224 / 256 CTAs could
// carry tiles at up to 2k keys, lost 7-32 % at 512-2k keys (H100, non-causal 1k 471-489 against 573, causal 1k 252
// against 371 TFLOP/s; fifty-fourth session).
constexpr FwdTileConfig fwd_tile_config(int head_dim, MaskKind mask = MaskKind::kNone) {
  const int block_m = kRowsPerConsumer * fwd_consumer_warpgroups(head_dim, mask);
  if (head_dim <= 128) return FwdTileConfig{block_m, 128, 2};
  if (head_dim <= 192) return FwdTileConfig{block_m, 112, 2};
  return FwdTileConfig{block_m, 80, 2};
}

// Tall rows: the hd 96 bucket (stored as 128 columns) on three consumer warpgroups, 192 query rows a tile and 112 keys
// a stage (the most that fits beside a 192-row Q tile and its carried second slot; at 128 keys four of seven kernels
// spilled 96-144 bytes, at 112 two spill 4-28), as hd 64 runs (fwd_consumer_warpgroups). A second instantiation
// beside the two-consumer tile, taken per call (FwdParams::sm90_tall_rows, dispatch/sm90_policy.cpp
// sm90_fwd_tall_rows): from kFwdTallRowsMinQueries queries, since a 192-row tile pads short sequences. Measured on
// the H200 (forty-sixth session, 70 heads, TFLOP/s, two consumers / tall / cuDNN): non-causal 1k 505 / 475 / 496, 4k
// 565 / 567 / 536, 16k 532 / 585 / 486; causal 1k 346 / 289 / 372, 4k 448 / 474 / 466, 16k 505 / 561 / 478; GQA 70/14
// 4k 532 / 610, causal 453 / 521, 16k 520 / 584, causal 521 / 584; documents of 512 at 16k 421 / 401, causal 256 /
// 204. Not for windows (a 192-row tile's band of keys is wider, as at hd 64) nor paged caches read in place (pages
// fit 128-key blocks, not 112).
constexpr FwdTileConfig kFwdTallTile{3 * kRowsPerConsumer, 112, 2};
constexpr int64_t kFwdTallRowsMinQueries = 4096;
constexpr bool fwd_has_tall_rows(int head_dim, MaskKind mask) { return head_dim == 96 && mask != MaskKind::kLocal; }

// Paged K / V caches (FwdParams::block_table) read in place: a key block's rows come by TMA from its pages, one box
// per segment from a page of whole key blocks, else one per page (fwd_kernel.h load_paged_block), instead of a
// contiguous copy of every sequence's pages per call (api/flash_api.cpp gather_pages). H200, bf16, hd 128, GQA 32/8,
// 512 queries, from CUDA graphs (thirty-ninth session), pages of 256 in place / gathered, us: 1 x 16k 225 / 255,
// 4 x 4k 240 / 274, 16 x 2k 474 / 527 (contiguous 211 / 235 / 471). Pages smaller than a key block: their page
// numbers are loaded by the producer warp's lanes together, once per key block for its K and V; a single producer
// thread loading them two at a time ran pages of 16 at 484 / 470 / 966, 1.8-1.9x the gathered copy; which calls
// take them in place is dispatch/sm90_policy.cpp's (fwd_pages_fit_call). A page must hold whole key blocks, or a key
// block whole pages of at least kFwdMinPageRows rows: each box then starts on a 1024-byte swizzle atom (8 rows of 128
// bytes), and a block has at most a warp's lanes of pages.
constexpr int kFwdMinPageRows = 16;
constexpr bool fwd_pages_fit(int head_dim, MaskKind mask, int64_t page_size) {
  const int64_t block_n = fwd_tile_config(head_dim, mask).block_n;
  return page_size > 0 &&
         (page_size % block_n == 0 || (block_n % page_size == 0 && page_size % kFwdMinPageRows == 0));
}

}  // namespace flash::sm90
