// Decode packing and split-KV choice for CUDA forward calls (fwd_plan.h): pure functions of the call's shape and the
// device's SM count, so that tests/test_fwd_pages_policy.py builds and checks them on the CPU.
#include "fwd_plan.h"

#include <algorithm>

#include "flash_attn/common/mask.h"
#include "sm80/fwd_tile_config.h"

namespace flash {
namespace {

constexpr int kHeadDimGranule = 32;  // head-dim buckets are multiples of 32 (tools/kernel_matrix.py)
// Each split should cover at least this many key tiles, or its fixed cost (Q load, epilogue) dominates.
constexpr int kMinTilesPerSplit = 2;
// Split plans of at least this many splits give appended rows a split of their own (choose_fwd_num_splits).
constexpr int64_t kAppendSplitMinSplits = 8;

// With seqused_k, seqlen_k is the longest length: a single query that sees every one of seqlen_k keys also sees
// every key of a shorter sequence (its visible range only moves with the length), so the check holds per entry.
bool sees_every_key(const MaskParams& mask, int64_t seqlen_q, int64_t seqlen_k) {
  const KeyRange keys = visible_keys(mask, 0, diagonal_offset(mask, seqlen_q, seqlen_k), seqlen_k);
  return seqlen_q == 1 && keys.begin <= 0 && keys.end >= seqlen_k;
}

int head_dim_bucket(const FwdParams& p) {
  return static_cast<int>((p.shape.head_dim + kHeadDimGranule - 1) / kHeadDimGranule) * kHeadDimGranule;
}

// As sm80/fwd_launch.h fwd_needs_general_kernel (which needs CUDA headers).
bool needs_general_kernel(const FwdParams& p) {
  return p.softcap > 0.0 || p.mask.alibi_slopes != nullptr || p.mask.bias != nullptr || p.dropout.p > 0.0 ||
         !softmax_scale_folds(p.softmax_scale);
}

// How many split CTAs per SM a split-KV call plans for: the resident CTAs of its tile, but at most
// kContiguousDecodeSplitCtasPerSm for decode calls on a contiguous cache. Their cp.async rings keep enough bytes in
// flight with two one-warp CTAs per SM, and fewer splits mean a shorter combine. H200, bf16, GQA 32/8, hd 128, us
// from a CUDA graph, best of 2 interleaved rounds, 4 -> 2 CTAs per SM (twenty-second session A/B; cuDNN in the same
// run): 1 x 8k 20.7 -> 20.1 (22.3), 1 x 128k 140.1 -> 137.8 (138.0), 8 x 32k 258.5 -> 254.1 (255.2), 16 x 8k 138.7 ->
// 137.6 (135.1), 64 x 4k unchanged (no split). Paged caches keep every resident CTA: their per-page lookups need the
// latency hiding, and with two per SM page 16 went 145 -> 250 us at 16 x 8k and page 256 142 -> 206.
constexpr int kContiguousDecodeSplitCtasPerSm = 2;

// flash_attn_with_kvcache's appends written by the decode kernel itself (fwd_decode_takes_append) instead of an
// append kernel before it. H200, bf16, GQA 32/8, hd 128, us from a CUDA graph, the call with a one-token append (+
// rotary) against the same call without (twenty-fourth session): 1 x 8k 20.6 (21.7) against 20.2, 1 x 128k 136.0
// (137.1) against 135.9, 64 x 4k 251.4 (251.9) against 250.1; the append kernel cost 5-6 us (1 x 8k 25.8 against 20.1).
constexpr bool kDecodeWritesAppendedRows = true;

// Split decode calls of at most sm80::kMaxClusterSplits splits merge them in a thread-block cluster (sm90) instead of
// the combine kernel (fwd_splits_meet_in_cluster); the first architecture with clusters and distributed shared memory.
constexpr bool kSplitsMeetInCluster = true;
constexpr int kClusterCodeArch = 90;

// Decode calls whose CTAs fill more than half the SMs and at most all of them take the key-warps tile, unsplit
// (fwd_decode_takes_key_warps). H200, bf16, GQA 32/8, hd 128, us from a CUDA graph, best of 2 interleaved rounds,
// key-warps tile for every call of at most one CTA per SM against the one-warp tile (twenty-sixth session; cuDNN in
// the same run): 16 x 8k (128 CTAs, no split against 2 clustered splits) 135.6 / 137.1 (135.3), with an append and
// rotary 135.8 / 138.5; but split calls lost or tied: 1 x 8k (16 splits against 32) 21.2 / 20.2 (22.4), page 16 23.0 /
// 22.3, 8 x 32k 257.3 / 257.8, paged 8 x 32k 266.9-271.8 / 262.8-266.8, 1 x 128k 138.5 / 138.0. A 226 KB CTA leaves
// no room on its SM for the next call's programmatic-dependent CTAs, which the one-warp tile's overlap (a guess,
// not profiled).
constexpr bool kDecodeTakesKeyWarps = true;

// The tile the launcher takes for a planned call (fwd_launch.h run_fwd).
sm80::FwdTileKind planned_kind(const FwdParams& p, int bucket, bool general, sm80::SmemLimits smem) {
  if (p.decode_key_warps) return sm80::FwdTileKind::kDecodeKeyWarps;
  return sm80::fwd_tile_kind(bucket, general, p.shape.seqlen_q, p.shape.seqlen_k, mask_kind(p.mask) != MaskKind::kNone,
                             smem);
}

int split_ctas_per_sm(const FwdParams& p, int bucket, bool general, sm80::FwdTileKind kind, sm80::SmemLimits smem) {
  const int resident = sm80::fwd_ctas_per_sm(bucket, general, kind, smem);
  return sm80::fwd_is_decode_kind(kind) && p.block_table == nullptr
             ? std::min(resident, kContiguousDecodeSplitCtasPerSm)
             : resident;
}

}  // namespace

bool pack_gqa_decode(FwdParams& p) {
  AttentionShape& s = p.shape;
  const bool eligible = s.cu_seqlens_q == nullptr && s.seqlen_q == 1 && s.nheads_q > s.nheads_k &&
                        p.mask.alibi_slopes == nullptr && p.mask.bias == nullptr && p.dropout.p == 0.0 &&
                        p.probs == nullptr && p.lse_head_stride == 1 && sees_every_key(p.mask, 1, s.seqlen_k);
  if (!eligible) return false;
  const int64_t group = s.nheads_q / s.nheads_k;
  s.seqlen_q = group;
  s.nheads_q = s.nheads_k;
  p.q_strides.row = p.q_strides.head;
  p.q_strides.head *= group;
  p.out_strides.row = p.out_strides.head;
  p.out_strides.head *= group;
  p.lse_head_stride *= group;
  p.mask.window_left = kUnboundedWindow;
  p.mask.window_right = kUnboundedWindow;
  p.packed_gqa_decode = true;
  return true;
}

int choose_fwd_num_splits(const FwdParams& p, int num_sms, sm80::SmemLimits smem) {
  if (p.probs != nullptr || p.shape.seqlen_k <= 0) return 1;
  const int bucket = head_dim_bucket(p);
  const bool general = needs_general_kernel(p);
  const sm80::FwdTileKind kind = planned_kind(p, bucket, general, smem);
  const sm80::FwdTileConfig tile = sm80::fwd_tile_config(bucket, general, kind);
  const int64_t ctas = p.shape.batch * p.shape.nheads_q * ((p.shape.seqlen_q + tile.block_m - 1) / tile.block_m);
  const int64_t key_tiles = (p.shape.seqlen_k + tile.block_n - 1) / tile.block_n;
  const int64_t slots = static_cast<int64_t>(num_sms) * split_ctas_per_sm(p, bucket, general, kind, smem);
  if (ctas <= 0 || ctas * 2 > slots) return 1;
  // Planned on the longest length (seqused_k is never read on the host): a shorter sequence's splits past its
  // last key tile see no key, write lse -inf, and the combine kernel weights them 0.
  // As many splits as fit in one wave of resident CTAs (v3 rounded up, past one wave: 16 x 8k decode took 640
  // CTAs for the 528 slots it assumed), then evened out so every split gets tiles (1 x 8k: 66 wanted, 64 kept).
  const int64_t wanted = slots / ctas;
  const int64_t splits =
      std::min<int64_t>({wanted, key_tiles / (kMinTilesPerSplit * tile.key_groups), sm80::kMaxKeySplits});
  if (splits < 2) return 1;
  const int64_t tiles_per_split = (key_tiles + splits - 1) / splits;
  const int64_t evened = (key_tiles + tiles_per_split - 1) / tiles_per_split;
  // Keys appended in the same call (decode kernels writing them): their tiles take a split of their own
  // (FwdParams::appended_split), whose CTAs also write the new rows, where that adds few CTAs to the plan (and the grid
  // still fits one wave of resident CTAs). H200, GQA 32/8, hd 128, append over the plain call, us (twenty-fourth
  // session): 32 -> 33 splits (1 x 8k) +0.4, 33 -> 34 (1 x 128k) +0.1, but 2 -> 3 (16 x 8k) +7 and 4 -> 5 (8 x 32k) +15;
  // below kAppendSplitMinSplits the split CTA holding a sequence's one new row writes it (16 x 8k +2.1 us with
  // rotary, twenty-fifth session), and several new rows take the append kernel first (api/flash_api.cpp).
  const bool appends = p.shape.appended_keys > 0 && sm80::fwd_is_decode_kind(kind);
  const int64_t resident_slots = static_cast<int64_t>(num_sms) * sm80::fwd_ctas_per_sm(bucket, general, kind, smem);
  if (appends && evened >= kAppendSplitMinSplits && evened < sm80::kMaxKeySplits &&
      ctas * (evened + 1) <= resident_slots) {
    return static_cast<int>(evened + 1);
  }
  return static_cast<int>(evened);
}

bool fwd_decode_takes_key_warps(const FwdParams& p, int num_sms, sm80::SmemLimits smem) {
  const int bucket = head_dim_bucket(p);
  const sm80::FwdTileKind key_warps = sm80::FwdTileKind::kDecodeKeyWarps;
  if (!kDecodeTakesKeyWarps || needs_general_kernel(p) || p.probs != nullptr ||
      sm80::fwd_smem_bytes(bucket, false, key_warps) > smem.per_block_optin ||
      sm80::fwd_tile_kind(bucket, false, p.shape.seqlen_q, p.shape.seqlen_k, mask_kind(p.mask) != MaskKind::kNone,
                          smem) != sm80::FwdTileKind::kDecode) {
    return false;
  }
  const int block_m = sm80::fwd_tile_config(bucket, false, key_warps).block_m;
  const int64_t ctas = p.shape.batch * p.shape.nheads_q * ((p.shape.seqlen_q + block_m - 1) / block_m);
  const int64_t slots = static_cast<int64_t>(num_sms) * sm80::fwd_ctas_per_sm(bucket, false, key_warps, smem);
  return ctas <= slots && 2 * ctas > slots;  // one unsplit wave that fills most SMs (kDecodeTakesKeyWarps)
}

bool fwd_splits_meet_in_cluster(const FwdParams& p, int code_arch, sm80::SmemLimits smem) {
  if (!kSplitsMeetInCluster || code_arch < kClusterCodeArch || p.num_splits < 2 ||
      p.num_splits > sm80::kMaxClusterSplits) {
    return false;
  }
  const bool general = needs_general_kernel(p);
  const sm80::FwdTileKind kind = planned_kind(p, head_dim_bucket(p), general, smem);  // not the key-warps tile
  return !general && (kind == sm80::FwdTileKind::kDecode || kind == sm80::FwdTileKind::kDecodeCompact);
}

int requested_fwd_num_splits(const FwdParams& p, int64_t requested) {
  constexpr int64_t kMaxGridZ = 65535;  // the grid's z extent holds batch entries x splits
  if (p.probs != nullptr || p.shape.seqlen_k <= 0 || requested <= 1) return 1;
  const int64_t by_grid = p.shape.batch > 0 ? kMaxGridZ / p.shape.batch : 1;
  const int64_t splits = std::min<int64_t>({requested, sm80::kMaxKeySplits, by_grid});
  return static_cast<int>(splits < 1 ? 1 : splits);
}

bool fwd_reads_pages(FwdParams p, sm80::SmemLimits smem) {
  if (p.block_table == nullptr || p.shape.cu_seqlens_q != nullptr || p.probs != nullptr) return false;
  pack_gqa_decode(p);
  if (needs_general_kernel(p)) return false;
  const sm80::FwdTileKind kind = sm80::fwd_tile_kind(head_dim_bucket(p), false, p.shape.seqlen_q, p.shape.seqlen_k,
                                                     mask_kind(p.mask) != MaskKind::kNone, smem);
  if (kind != sm80::FwdTileKind::kDecode && kind != sm80::FwdTileKind::kDecodeCompact) return false;
  // Pages that hold whole key blocks: each block is one lookup and a dense load. H200, bf16, GQA 32/8, hd 128
  // (nineteenth session, benchmarks/bench_kvcache.py), us contiguous / page 256 in place (from a CUDA graph) /
  // gathered (eager): batch 16 x 8k 137 / 147 / 418, 64 x 4k 251 / 260 / 811. Looked up row by row with a 64-bit
  // division per chunk (page 16: a block spans two pages), the decode tile's one warp spent its time on index
  // arithmetic: 658 and 1259 us against the gather's 435 and 837.
  const int block_n = sm80::fwd_tile_config(head_dim_bucket(p), false, kind).block_n;
  if (p.page_size % block_n == 0) return true;
  // Pages smaller than a key block (a power of two dividing it: 1 ... 16, vLLM's default block is 16) are read row
  // by row with shifts and masks, a tile's pages looked up by lanes (sm80/fwd_kernel.h). Page 16 in place against
  // gathered, H200, bf16, GQA 32/8, hd 128, us from a CUDA graph: batch 16 x 8k 275 against 435, 1 x 8k 49 against 46
  // (twentieth session); with the lanes' lookups 212 and 23.6 (contiguous: 139, 20.4). Other sizes gather.
  return block_n % p.page_size == 0;
}

bool fwd_decode_takes_append(FwdParams p, sm80::SmemLimits smem) {
  if (!kDecodeWritesAppendedRows) return false;
  pack_gqa_decode(p);
  const bool general = needs_general_kernel(p);
  if (!sm80::fwd_uses_decode_tile(p.shape.seqlen_q, general) || p.shape.nheads_q != p.shape.nheads_k) return false;
  if (p.block_table == nullptr) return true;
  // Pages of whole key blocks only: compiled into the kernel that reads pages smaller than a block row by row, the
  // append's code cost that kernel's calls 10-46 % (page 16, 1 x 8k 23.0 -> 33.7 us, 8 x 32k 266 -> 280; twenty-fourth
  // session), so those calls take the append op.
  const sm80::FwdTileKind kind = sm80::fwd_tile_kind(head_dim_bucket(p), general, p.shape.seqlen_q, p.shape.seqlen_k,
                                                     mask_kind(p.mask) != MaskKind::kNone, smem);
  return p.page_size % sm80::fwd_tile_config(head_dim_bucket(p), general, kind).block_n == 0;
}

}  // namespace flash
