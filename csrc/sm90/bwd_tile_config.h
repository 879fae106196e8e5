// Tile sizes of the Hopper backward main kernel (bwd_kernel.h): a CTA owns block_n keys of one (batch entry, KV head),
// 64 per consumer warpgroup, with dK and dV in registers, and walks the query rows that see them block_m at a time
// (Q and dO through `stages`-slot TMA rings). FA3's hd 64 / 128 shapes (HOPPER_NOTES.md 2.4): 64 x 128, 2 stages.
#pragma once

#include <cstdint>

namespace flash::sm90 {

constexpr int kBwdRowsPerConsumer = 64;  // keys per consumer warpgroup: the wgmma M of S^T, dP^T, dV, dK
constexpr int kBwdConsumerWarpgroups = 2;
constexpr int kBwdThreads = (kBwdConsumerWarpgroups + 1) * 128;

struct BwdTileConfig {
  int block_m;  // query rows per step (the N of S^T and dP^T, the M of dQ)
  int block_n;  // keys per CTA
  int stages;   // Q / dO ring depth
};

// Head dims up to 128 (bwd_kernel.h): 64 keys per consumer, dK + dV 2 x 64 x hd fp32 per warpgroup, 128 registers a
// thread at hd 128. Above (bwd_wide_kernel.h, which runs every such bucket at kBwdWideHeadDim columns): the two
// consumers share 64 keys and split the columns, dK + dV again 128 registers a thread; K, V and two stages of Q and
// dO (192 KB at hd 256) leave room for double P^T / dS^T tiles (32 KB) but not for a dQ staging tile, so dQ is added
// from registers.
constexpr int kBwdMaxNarrowHeadDim = 128;
constexpr int kBwdWideHeadDim = 256;
// hd 64 steps over 128 query rows (FA3's 128 x 128 tile there): a 64-row step has half the GEMM work of hd 128's for
// the same barriers, waits and handoffs, and ran at 0.75-0.82x of cuDNN (351 against 458 TFLOP/s at 16k) where hd 128
// ran 0.91-0.95x. A 128-row step is hd 128's GEMM work (S^T / dP^T 64 x 128 accumulators, 64 registers each) with
// twice its exponentials. Measured on the H200 (bf16, 32 heads, best of 2 rounds, twenty-eighth session), 64 -> 128
// rows, ratio to cuDNN in the same process: 512 0.77 -> 0.85, 2k 0.82 -> 0.91, 8k 0.86 -> 1.00, 16k 0.85 -> 0.99
// (381 -> 444 TFLOP/s); causal 0.71 / 0.74 / 0.83 / 0.84 -> 0.74 / 0.83 / 0.96 / 0.96; GQA 32/8 4k 0.86 -> 1.01;
// deterministic 16k 224 -> 448 (the writers no longer sum two consumers' tiles: row halves, bwd_dq_split).
constexpr int kBwdWideStepMaxHeadDim = 64;
constexpr BwdTileConfig bwd_tile_config(int head_dim) {
  if (head_dim > kBwdMaxNarrowHeadDim) return BwdTileConfig{64, kBwdRowsPerConsumer, 2};
  const int block_m = head_dim <= kBwdWideStepMaxHeadDim ? 2 * kBwdRowsPerConsumer : kBwdRowsPerConsumer;
  return BwdTileConfig{block_m, kBwdRowsPerConsumer * kBwdConsumerWarpgroups, 2};
}

// How the wide kernel's two consumers share a step: consumer 0 computes S^T / dP^T for the step's first `queries0`
// query rows and dK / dV / dQ for head-dim columns 0 .. columns0 - 1; consumer 1 the other kBlockM - queries0 rows
// and columns columns0 .. columns0 + columns1 - 1. Both wait for each other once a step (the scores barrier), so the
// step takes the longer consumer's GEMMs. Buckets 160 / 192 / 224 are stored as 256 columns; with an even split
// consumer 1 multiplied 96 / 64 / 32 zero columns in each of dV, dK and dQ. Per step at hd 192 (64 keys x 64 queries,
// MFLOP): 32 / 32 rows and 128 / 128 columns give 4.72 each; 16 / 48 rows and 128 / 64 columns 3.93 each (S^T / dP^T
// 0.79 + 3.15, 2.36 + 1.57), 17 % less on the longer consumer; at hd 160, 16 / 48 and 128 / 32: 3.80 / 2.75 against
// 4.46, 15 % less. Rows go by 16 (stmatrix.x4 stores 16 queries of P^T); at hd 224 the best split (32 / 32, 128 / 96)
// keeps the longer consumer's 4.98. Predicted hd 160 / 192 backward +8-12 %; measured (forty-sixth session, 16k
// tokens, 1k / 4k / 16k, TFLOP/s, halves -> this split): hd 160 244 / 291 / 298 -> 265 / 323 / 336, causal 185 /
// 255 / 278 -> 200 / 297 / 333; hd 192 255 / 314 / 323 -> 289 / 356 / 369, causal 201 / 275 / 311 -> 209 / 318 /
// 352; hd 224 level (+0-5 %, causal 1k 206 -> 199).
struct BwdWideSplit {
  int queries0;  // consumer 0's S^T / dP^T rows of a step; consumer 1 takes the rest of block_m
  int columns0;  // consumer 0's dK / dV / dQ columns, from column 0 (whole 64-column segments)
  int columns1;  // consumer 1's, from columns0: the bucket's columns left, a multiple of 32
};
constexpr bool kBwdWideBalancedSplit = true;
constexpr int kBwdWideHalfColumns = kBwdWideHeadDim / 2;
constexpr BwdWideSplit bwd_wide_split(int score_dim, int block_m) {
  const int columns1 = kBwdWideBalancedSplit ? score_dim - kBwdWideHalfColumns : kBwdWideHalfColumns;
  const bool shift_rows = kBwdWideBalancedSplit && columns1 <= kBwdWideHalfColumns / 2;
  return BwdWideSplit{shift_rows ? block_m / 4 : block_m / 2, kBwdWideHalfColumns, columns1};
}

// How the two consumers share dQ = dS.K of a query block (bwd_kernel.h):
//   kColumnHalves (hd 128): each computes 64 columns over all block_n keys, reading both consumers' dS^T (a named
//                  barrier between them); the reductions into the fp32 accumulator are one tile's worth.
//   kOwnKeys (64-row steps below hd 128, where a 32-column half is no whole 128-byte swizzle line): each computes all
//                  columns over its own 64 keys, no barrier, twice the reductions.
//   kRowHalves (128-row steps): each computes its 64 of the step's query rows, all columns, over all block_n keys
//                  (both consumers' dS^T, a named barrier); one tile's worth of reductions.
enum class BwdDqSplit { kColumnHalves, kOwnKeys, kRowHalves };
constexpr BwdDqSplit bwd_dq_split(int head_dim, int block_m) {
  if (block_m == 2 * kBwdRowsPerConsumer) return BwdDqSplit::kRowHalves;
  return head_dim >= 128 ? BwdDqSplit::kColumnHalves : BwdDqSplit::kOwnKeys;
}
// Rows of a consumer's dQ tile (its staging tile's, and the dq accumulator map's box rows).
constexpr int bwd_dq_rows(int head_dim, int block_m) {
  return bwd_dq_split(head_dim, block_m) == BwdDqSplit::kRowHalves ? kBwdRowsPerConsumer : block_m;
}

// Whether a consumer issues the next step's S^T GEMM as soon as this step's dV, dK and dQ GEMMs are done, before its
// dQ reductions: the tensor cores then work through the reductions (on the critical path otherwise; at hd 128 16k,
// 312 TFLOP/s, a step takes an estimated
// ~8,000 cycles for ~2,600 of GEMM work). ptxas at hd 128, bytes of spill: lean kernel 16 serial, 36 with it (in the
// prologue and epilogue, none in the step loop); with dP^T ahead as well 716, so S^T alone. The general kernels (76
// serial, 164 with S^T ahead) stay serial. Measured on the H200 against the serial order (bf16, best of 2 rounds,
// seventeenth session, docs/perf_log.md): hd 128 4k / 16k 410 / 432 against 445 / 493 TFLOP/s, causal 350 / 427
// against 400 / 480; hd 64 within 1 % non-causal, causal 251 / 296 against 297 / 353. Off.
constexpr bool bwd_prefetches_scores(int head_dim, bool general) {
  (void)head_dim;
  (void)general;
  return false;
}

// dq accumulators of a deterministic CTA (BwdParams::dq_splits counts every CTA's): the own-keys split gives each
// consumer its own, since both add into the same elements; ordered instead (consumer 0, a __threadfence, then consumer
// 1, every step), hd 64 ran at 0.48-0.76x of the default backward (eighteenth session; the grid's waves are the other
// suspect, dispatch/sm90_policy.h sm90_bwd_dq_splits). Column and row halves and the wide kernel add disjoint
// elements into one.
constexpr int bwd_dq_accumulators_per_cta(int head_dim) {
  return head_dim <= kBwdMaxNarrowHeadDim &&
                 bwd_dq_split(head_dim, bwd_tile_config(head_dim).block_m) == BwdDqSplit::kOwnKeys
             ? kBwdConsumerWarpgroups
             : 1;
}

// Whether dQ leaves a step through a shared staging tile and bulk tensor reductions (one thread issues 4 boxes of 16
// columns x block_m rows per consumer) instead of 16 `red.global.add.v4.f32` per thread. ncu at hd 128 4k (H200,
// sixteenth session): the reductions' source and address registers, reused while earlier reductions still read them,
// held ~9 % of the stall samples; cuDNN ran the same shape at 2.0x our time. Calls that are not deterministic only:
// the deterministic ones add into their own accumulators (bwd_dq_accumulators_per_cta) from registers. The wide
// kernel has no room for a staging tile (bwd_tile_config) and stages in its own column segments of the step's Q and
// dO slots instead (bwd_wide_kernel.h). Wide kernel, H200, hd 256 forced, TFLOP/s red.global -> bulk (nineteenth
// session, best of 3 rounds): 16k 321 -> 370, 4k 303 -> 340, 2k 285 -> 318, 512 220 -> 234; causal 322 -> 361,
// 279 -> 313, 251 -> 260, 155 -> 162 (cuDNN 358 / 362 / 342 / 242; causal 376 / 345 / 306 / 182).
constexpr bool bwd_reduces_dq_in_bulk(int head_dim) {
  (void)head_dim;
  return true;
}

// Whether deterministic calls reduce dQ in bulk too, each CTA (each consumer with bwd_dq_accumulators_per_cta) into
// its own accumulator's rows of the map, waiting at every key block's start for its previous block's reductions to
// complete (bulk reductions from one thread carry no order between them; with the wait, each element's adds arrive
// in key-block order). They reduce from registers now: 0.45-0.80x of the default backward (nineteenth session), whose
// bulk reductions measured +13-19 % over registers. Measured on the H200 (bf16, hd 128, best of 2 rounds, twentieth
// session, docs/perf_log.md): 16k 351 -> 330, 2k 298 -> 291, causal 311 -> 297 / 268 -> 254 TFLOP/s, 3-6 % slower. Off.
constexpr bool kBwdDeterministicDqInBulk = false;
constexpr bool bwd_deterministic_dq_in_bulk(int head_dim) {
  (void)head_dim;
  return kBwdDeterministicDqInBulk;
}

// Whether deterministic calls of the narrow kernel add dQ into the one accumulator that other calls use, in a fixed
// order, instead of into per-CTA accumulators. The per-CTA accumulators ran at 0.71x of the default backward (hd 128
// 16k 351 against 490 TFLOP/s): 8 of them per head, 8 MB each at 16k, so the 128 CTAs in flight reduce into ~1 GB
// and every reduction goes to DRAM, where the default grid's CTAs share one head's 8 MB in L2. Ordered: one CTA per
// key block, launched highest key block first; a warp of the producer warpgroup issues each step's bulk reductions
// once the step's counter (bwd_workspace.h dq_semaphores) says every higher key block that sees the query block has
// added, then advances it. Under a causal or window mask a higher key block reaches a query block at an earlier step,
// so the order follows the arrivals; without a mask every CTA reaches a query block at the same step and each waits
// for its predecessor's add once per block (kBwdOrderedDqArrivalOrder below). Predicted: 0.71 -> ~0.9x of the
// default at hd 128. Measured (H200, bf16, best of 2 rounds, twenty-third session; per-CTA accumulators -> ordered,
// default non-deterministic in brackets; the order kBwdOrderedDqArrivalOrder picks): hd 128 2k 301 -> 405 (396), 16k
// 349 -> 485 (489), causal 263 -> 332 (324), 315 -> 451 (454); hd 64 2k 162 -> 208 (325), 16k 175 -> 226 (379),
// causal 144 -> 168 (246), 170 -> 219 (359): hd 64's step is short enough that the writers (bwd_ordered_dq.h) bound
// it.
constexpr bool kBwdDeterministicDqOrdered = true;
// The same for the wide kernel (hd 129 ... 256; bwd_ordered_dq.h write_ordered_dq_wide; written in the twenty-third
// session, first run in the fifty-seventh), in an instantiation of its own (bwd_wide_kernel's kOrderedDq). Measured on
// an H100 (bf16, hidden 3072, best of 2 rounds, TFLOP/s, deterministic / default in the same process), per-CTA
// accumulators -> ordered: hd 192 1k / 4k / 16k 114 / 127 / 136 -> 218 / 254 / 322 (0.43 / 0.38 / 0.36 -> 0.84 /
// 0.80 / 0.90x of the default), causal 100 / 119 / 125 -> 174 / 260 / 324 (0.50 / 0.41 / 0.35 -> 0.87 / 0.88 / 0.93x);
// hd 256 116 / 129 / 134 -> 234 / 278 / 343 (0.44 / 0.37 / 0.36 -> 0.90 / 0.84 / 0.92x), causal 97 / 113 / 120 ->
// 184 / 283 / 335 (0.47 / 0.37 / 0.33 -> 0.88 / 0.94 / 0.92x).
constexpr bool kBwdDeterministicDqOrderedWide = true;
// Whether the order is the key blocks' arrival order (bwd_cta.h BwdKernelArgs::dq_arrival_order), with unmasked
// calls' walks rotated, for sequences of at most kBwdOrderedDqArrivalMaxKeyBlocks key blocks (and never more than the
// GPU's SMs, where waiting for a CTA launched later could deadlock). In descending order every unmasked key block
// reaches query block 0 at step 0 and each waits for the one above it: a chain as long as the sequence's key blocks,
// paid once per CTA. H200, bf16, deterministic, TFLOP/s, arrival / descending (default non-deterministic; twenty-third
// session, best of 2 rounds): hd 128 2k 405 / 357 (396), causal 332 / 329 (324); 16k 425 / 485 (489), causal 458 /
// 451 (454); hd 64 2k 208 / 190 (325), causal 168 / 170 (246); 16k 218 / 226 (379), causal 220 / 219 (359). At 2k (16
// key blocks) the chain is a large part of each CTA's life; at 16k the rotated walks lose 12 % (each CTA reads its
// own query blocks instead of sharing the head's current one in L2: not measured further).
constexpr bool kBwdOrderedDqArrivalOrder = true;
constexpr int kBwdOrderedDqArrivalMaxKeyBlocks = 16;
constexpr bool bwd_orders_dq(int head_dim) {
  return kBwdDeterministicDqOrdered && (head_dim <= kBwdMaxNarrowHeadDim || kBwdDeterministicDqOrderedWide);
}

// Whether calls whose every sequence's keys fit one key block (max_seqlen_k <= block_n: varlen batches of short
// documents, short dense sequences) store each step's dQ, complete after the step, straight into dq (bwd_direct_dq.h)
// instead of the preprocess zeroing the fp32 accumulator, the steps adding into it and the conversion kernel reading
// it back: three passes over a tensor of 4 bytes per element and one launch less. Only where one consumer owns each
// dQ element (column or row halves; own-keys dQ sums both consumers' tiles) and in the narrow kernel (the wide one
// adds dQ column segment by column segment). ncu, H200, documents of 128, hd 128, 16 heads, causal (forty-second
// session): preprocess 73 us, main kernel 258, conversion 55 (FlexAttention's whole backward: 80 + 291); with it
// (torch.profiler) preprocess 46, conversion 0, main kernel level; FlexAttention's backward 1.08-1.22x behind at
// documents of 128 (docs/perf_log.md). An instantiation of its own (bwd_kernel's kDirectDq), for calls without
// softcap / ALiBi only: with it as a branch in every kernel's step loop (hd 128 causal: 916 -> 1,120 static
// instructions) the causal standard backward measured 4-8 % below the previous session's (no A/B yet).
constexpr bool kBwdDirectDq = true;
constexpr bool bwd_stores_dq_directly(int head_dim, bool general) {
  return kBwdDirectDq && !general && head_dim <= kBwdMaxNarrowHeadDim &&
         bwd_dq_split(head_dim, bwd_tile_config(head_dim).block_m) != BwdDqSplit::kOwnKeys;
}

// Whether calls of the narrow lean kernels (hd <= 128, no softcap / ALiBi) with several key blocks fuse the dQ
// accumulator's zeroing and conversion into the ordered dQ's adds (bwd_ordered_dq.h), deterministic or not: a query
// block's first adder stores its tile into the accumulator (a TMA store, no zeroing needed), its last adder's writer
// loads the sum back into its staging tile once every add is complete and stores dq from it, scaled and rounded as
// the conversion kernel does, and the conversion kernel does not run. Both passes are over tokens x hidden whatever
// the key length: at 16k tokens x 16 heads x hd 128 the zeroing ~27 us and the conversion 55-58 us (forty-second
// session's profile), 14 % of a 512-key backward, 9 % at 1k, 5 % at 2k (18 / 13 / 8 % causal). Predicted +12-16 % at
// 512 keys, +8-10 % at 1k, less what ordering costs (0.99-1.02x of the default at hd 128, twenty-third session) and
// the staging tile held ~2 us longer by a last adder. Measured on the H200 (forty-ninth session, bf16, best of 2
// rounds, TFLOP/s main -> fused): hd 128 512 / 1k / 2k 285 / 367 / 438 -> 230 / 312 / 390, causal 175 / 260 / 347 ->
// 129 / 191 / 252; hd 64 246 / 327 / 392 -> 199 / 276 / 343: ordering alone costs 8-13 %, fusing 6-19 % more (key
// block 0 converts at every causal step). So only where FLASH_ATTN_BWD_FUSED_DQ=1 (bwd_launch.h). The general
// kernels keep the conversion: a fused writer compiled into them spilled in their step loop (forty-seventh session).
constexpr bool kBwdFusedDq = true;
constexpr bool bwd_fuses_dq(int head_dim, bool general) {
  return kBwdFusedDq && !general && head_dim <= kBwdMaxNarrowHeadDim && bwd_orders_dq(head_dim) &&
         bwd_dq_split(head_dim, bwd_tile_config(head_dim).block_m) != BwdDqSplit::kOwnKeys;
}

// Whether D = rowsum(dO o O) is summed in the main kernel instead of the preprocess: the narrow kernels (lean and
// general) load each step's O rows beside its dO, and warp kBwdDeltaWarp of the producer warpgroup
// (bwd_step_delta.h) adds the step's row sums into its statistics block before the consumers form dS^T. The
// preprocess then reads only the LSE: its O / dO pass took 46 us at 16k tokens x 16 heads x hd 128 (forty-second
// session's profile), ~8 % of a 512-key backward once fused dQ removes the zeroing and the conversion. Each key
// block recomputes the D of every query block it walks (O read again from L2 per key block, half again the Q / dO
// traffic), so only calls of at most kBwdDInKernelMaxKeyBlocks key blocks (max_seqlen_k <= 1k). Predicted +6-8 % at
// 512 keys, +3-4 % at 1k. Measured (forty-ninth session, with fused dQ, TFLOP/s fused -> fused + D): hd 128 512 / 1k
// 230 / 312 -> 171 / 208, causal 129 / 191 -> 112 / 152: one warp and one O buffer give a step's D ~2 us after the
// last, and the consumers wait for it. So only where FLASH_ATTN_BWD_D_IN_KERNEL=1 (bwd_launch.h).
constexpr bool kBwdDInKernel = true;
constexpr int kBwdDInKernelMaxKeyBlocks = 8;
constexpr bool bwd_has_delta_warp(int head_dim) { return kBwdDInKernel && head_dim <= kBwdMaxNarrowHeadDim; }
constexpr bool bwd_computes_d_in_kernel(int head_dim, int64_t key_blocks) {
  return bwd_has_delta_warp(head_dim) && key_blocks <= kBwdDInKernelMaxKeyBlocks;
}

// Whether a masked step's per-element test compares each score's compile-time query column with the queries that see
// its key row, as a 32-bit range local to the step (block_ranges.h rows_seeing_key, local_range), instead of
// recomputing each query's visible keys in 64 bits, which runs on every masked step (4 of the 10 steps of a causal
// 512-key head). ptxas, causal step loops (tools/sass_stats.py, static instructions): hd 64 2,761 -> 1,352 (spill 272
// -> 232 bytes), wide hd 256 1,657 -> 1,398. Predicted: causal 512 / 1k +5-10 %. Measured (twenty-ninth session,
// causal TFLOP/s off -> on, ratio to cuDNN): hd 64 512 124 -> 144 (0.72 -> 0.84), 1k 197 -> 223 (0.78 -> 0.88), 2k
// 263 -> 282; hd 128 512 155 -> 171, 1k 230 -> 243, 2k 315 -> 332; hd 256 +0-2 %. Non-causal rows level.
constexpr bool kBwdMasksByLocalRange = true;

}  // namespace flash::sm90
