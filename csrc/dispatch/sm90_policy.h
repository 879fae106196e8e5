// Which calls the Hopper path (csrc/sm90/) takes: sm90_fwd_declines() / sm90_bwd_declines() name why a call stays on
// the portable path, and hopper_switch() reads FLASH_ATTN_HOPPER, which turns the path off, on where it serves the
// call, or forces it (a call it cannot serve then fails instead of falling back: for tests and benchmarks).
#pragma once

#include "flash_attn/params.h"

namespace flash {

enum class HopperSwitch { kOff, kAuto, kForce };

constexpr const char* kHopperSwitchEnv = "FLASH_ATTN_HOPPER";
// The loaded code's architecture (DeviceAttributes::code_arch) at which the Hopper kernels exist: sm_90a builds.
constexpr int kHopperCodeArch = 90;
// Unset FLASH_ATTN_HOPPER means this: the Hopper path where it serves the call. Its tests passed on the H200 (fifteenth
// session: tests/test_hopper_*.py under force, the whole suite under 1).
constexpr HopperSwitch kDefaultHopperSwitch = HopperSwitch::kAuto;

// FLASH_ATTN_HOPPER: "0" / "off" -> kOff, "1" / "auto" / "on" -> kAuto, "force" -> kForce, unset or empty ->
// kDefaultHopperSwitch. Read on every call (tests flip it in-process); any other value fails naming the choices.
HopperSwitch hopper_switch();

// Null when the Hopper forward serves this call (fp16 / bf16, dense or varlen, KV-cache lengths (seqused_k), softcap
// and ALiBi, returned probabilities: a separate kernel recomputes them from q, k and the LSE; no dropout, bias, pages
// read in place or decode shapes; key splits up to sm80::kMaxKeySplits; sizes and strides its TMA maps and grid can
// express); otherwise what it lacks, for FLASH_ATTN_HOPPER=force errors. The head-dim bucket is the kernel table's
// concern.
const char* sm90_fwd_declines(const FwdParams& p);

// The same for the backward (the forward's limits, and no bias gradient yet).
const char* sm90_bwd_declines(const BwdParams& p);

// Whether FLASH_ATTN_HOPPER=1 (the default) hands a call the Hopper path serves to it rather than to the portable
// kernels: false where the portable kernel was measured faster (forward: head dims up to 32, short keys; backward: plain
// calls at head dims up to 32). Force ignores them.
bool sm90_fwd_pays(const FwdParams& p);
bool sm90_bwd_pays(const BwdParams& p);

// How many CTAs per key block share a KV head's query heads in the Hopper backward (BwdParams::head_splits): 1 for
// deterministic calls and where the grid already has enough CTAs, else the smallest divisor of the group that gives
// the grid kBwdHeadSplitMinCtasPerSm CTAs per SM (or the whole group). num_sms: the device's SM count.
int64_t sm90_bwd_head_splits(const BwdParams& p, int num_sms);

// How many dq accumulators a deterministic call on the Hopper backward uses (BwdParams::dq_splits; 1 otherwise): CTA x
// of a (batch entry, KV head) walks key blocks x, x + splits, ... into its own accumulators (sm90/bwd_tile_config.h
// bwd_dq_accumulators_per_cta), one CTA per SM resident. The fewest CTA splits that minimise the busiest SM's key
// blocks, ceil(batch kv_heads splits / num_sms) waves of ceil(key_blocks / splits) each, times the accumulators per
// CTA.
int64_t sm90_bwd_dq_splits(const BwdParams& p, int num_sms);

// Query heads of one KV head that share a Hopper forward tile's rows (FwdParams::sm90_packed_heads): the largest power
// of two dividing both the heads per KV head and the tile's rows, where that takes fewer tiles than a head per tile
// (query rows short of a tile: speculative decoding, short chunked prefill); 1 (none) with ALiBi, whose slopes are per
// head, or when nothing is saved. Measured in sm90_policy.cpp.
int sm90_fwd_packed_heads(const FwdParams& p);

// Whether a Hopper forward call runs on tall rows (FwdParams::sm90_tall_rows; sm90/fwd_tile_config.h kFwdTallTile: hd
// 96 on 192-row tiles from kFwdTallRowsMinQueries queries, no window, no pages read in place). Unset or 1: tall rows;
// FLASH_ATTN_FWD_TALL_ROWS=0 keeps such calls on 128-row tiles (for A/Bs). Set by the plan before the packing and the
// key splits, which take its tile.
constexpr const char* kFwdTallRowsEnv = "FLASH_ATTN_FWD_TALL_ROWS";
bool sm90_fwd_tall_rows(const FwdParams& p);

// Calls of 2-16 query rows (speculative decoding with few draft tokens) whose query heads pack (sm90_fwd_packed_heads
// > 1) into at least this many tile rows take the Hopper forward instead of the portable decode kernels. H200, bf16,
// hd 128, GQA 32/8 (4 heads packed), from CUDA graphs, us Hopper / decode kernels (fortieth session): 2 queries (8 rows)
// 16 x 8k 137 / 235, 1 x 32k 52 / 116; 4 queries 137 / 236, 52 / 117; 16 queries 140 / 237, 53 / 120 (cuDNN 403, 383);
// over pages of 16, 4 queries 205 / 473, 60 / 128. Unpacked (MHA) calls of 8-16 queries were level (hd 128, 32
// heads, eager, 16 x 8k 497 / 493, 1 x 32k 141 / 138), so they keep the decode kernels.
constexpr int64_t kSm90PackedFewQueryRows = 8;

// Key splits of a call the Hopper forward takes (FwdParams::num_splits, merged by the combine kernel): 1 unless its
// query tiles (packed as FwdParams::sm90_packed_heads says) leave SMs idle and its keys are long enough to share (the
// cost model is in sm90_policy.cpp).
int sm90_fwd_num_splits(const FwdParams& p, int num_sms);

// The head-dim bucket whose Hopper kernels serve a call: the portable path's (32, 64, 96, ..., 256). A bucket that is
// no whole number of 64-column TMA segments stores the next one's columns (TMA zero-fills the rest) and runs its score
// GEMMs over its own (sm90/fwd_tile_config.h fwd_storage_dim); tile and workspace policies take the stored width.
// Measured before the 32 / 96 / 160 / 224 buckets existed (H200, bf16, 4k, Hopper / portable TFLOP/s, in the next
// whole-segment kernel): hd 96 448 / 303, causal 406 / 258; hd 160 525 / 260; hd 224 547 / 256; masked calls up to
// hd 32 lost, padded to 64 (sm90_fwd_pays).
int sm90_head_dim_bucket(int64_t head_dim);

}  // namespace flash
