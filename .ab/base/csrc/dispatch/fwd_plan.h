// Host-side planning of a CUDA forward call before its kernel is picked: folding the query heads of a GQA group
// into rows for single-token decode, and choosing how many key splits (split-KV) fill the GPU. No torch here;
// csrc/api allocates the split scratch the plan asks for.
#pragma once

#include <cstdint>

#include "flash_attn/params.h"
#include "sm80/fwd_tile_config.h"

namespace flash {

// Single-query GQA/MQA calls with no per-head or per-position feature: view q (b, 1, hq, d) as (b, g, hk, d) so
// one CTA serves the g query heads sharing a K/V head (K/V read once instead of g times). Rewrites shapes,
// strides and the mask of `p` in place; returns whether it did.
bool pack_gqa_decode(FwdParams& p);

// Key splits for a forward call: 1 unless the (batch x heads x query tiles) grid leaves the GPU's
// num_sms SMs mostly idle and the key range is long enough to share. smem (the device's shared-memory limits)
// decides which tile the launcher will take and how many of its CTAs an SM holds (sm80::fwd_tile_kind).
int choose_fwd_num_splits(const FwdParams& p, int num_sms, sm80::SmemLimits smem);

// Whether a decode call takes the key-warps decode tile (FwdParams::decode_key_warps; sm80/fwd_tile_config.h
// kDecodeKeyWarps): lean decode-tile calls whose CTAs, one per sequence, kv head and query tile, fill more than half
// of one wave of it on num_sms SMs and at most all of it (so they run unsplit), where its shared memory fits. `p`
// packed; set before choose_fwd_num_splits.
bool fwd_decode_takes_key_warps(const FwdParams& p, int num_sms, sm80::SmemLimits smem);

// Whether a planned split call (num_splits set) merges its splits in one thread-block cluster per sequence and kv head
// (FwdParams::splits_meet_in_cluster) instead of through split_out / split_lse and the combine kernel: sm90 code
// (code_arch, DeviceAttributes), decode tiles, 2 ... sm80::kMaxClusterSplits splits. `p` packed as the launch sees it.
bool fwd_splits_meet_in_cluster(const FwdParams& p, int code_arch, sm80::SmemLimits smem);

// A caller's num_splits (flash_attn_with_kvcache's, Dao's semantics: 0 lets choose_fwd_num_splits decide): honoured up
// to sm80::kMaxKeySplits and to what the grid's z extent (batch entries x splits) holds; 1 where the call cannot be
// split (returned probabilities, no keys). Splits past a sequence's last key tile see no key and weigh nothing in the
// combine.
int requested_fwd_num_splits(const FwdParams& p, int64_t requested);

// Whether a call over a paged K / V cache (FwdParams::block_table, page_size) reads the pages in place: the lean
// decode tiles do where a page holds whole key blocks (sm80/fwd_kernel.h kPaged); every other call reads dense K / V,
// so the API gathers the pages first. `p` as checked: decode packing is applied to a copy here, as the launch will.
bool fwd_reads_pages(FwdParams p, sm80::SmemLimits smem);

// Whether the portable launcher gives the call one of its decode tiles (sm80/fwd_launch.h run_fwd) with one CTA per
// sequence, kv head and split (GQA packed, or as many query heads as kv heads): the calls whose kernels write
// flash_attn_with_kvcache's appended rows themselves (FwdParams::kv_append, rotary). `p` as checked, packed on a
// copy here as the launch will; paged calls only where a page holds whole key blocks.
bool fwd_decode_takes_append(FwdParams p, sm80::SmemLimits smem);

}  // namespace flash
