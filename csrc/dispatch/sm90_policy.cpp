// hopper_switch(), sm90_fwd_declines() and sm90_bwd_declines() (sm90_policy.h), with the Hopper forward's per-call
// plan (rows, key splits, GQA packing, pages in place). Torch-free: tests/test_sm90_fwd_plan.py checks it on the CPU.
#include "sm90_policy.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>

#include "flash_attn/bwd_workspace.h"
#include "flash_attn/common/fast_divmod.h"
#include "flash_attn/common/mask.h"
#include "sm80/fwd_tile_config.h"
#include "sm90/bwd_tile_config.h"
#include "sm90/fwd_tile_config.h"

namespace flash {
namespace {

constexpr int64_t kMaxGridYZ = 65535;                 // CUDA grid y and z limits: heads and batch entries
constexpr int64_t kMaxInt32 = 2147483647;             // the kernel's row and key indices are 32-bit TMA coordinates
constexpr int64_t kMaxTmaStrideBytes = int64_t{1} << 40;  // cuTensorMapEncodeTiled's stride limit
constexpr int64_t kElementBytes = 2;

bool strides_fit(const TensorStrides& strides) {
  for (int64_t stride : {strides.batch, strides.row, strides.head}) {
    if (stride < 0 || stride * kElementBytes >= kMaxTmaStrideBytes) return false;
  }
  return true;
}

// Query tiles of block_m rows per (batch entry, KV head) with `packed` query heads of the KV head in each tile's rows.
int64_t query_tiles_per_kv_head(const AttentionShape& s, int64_t packed, int block_m) {
  const int64_t group = s.nheads_k > 0 ? s.nheads_q / s.nheads_k : 1;
  return (group / packed) * ((s.seqlen_q * packed + block_m - 1) / block_m);
}

// Pages read in place by the Hopper forward (sm90/fwd_tile_config.h fwd_pages_fit), where that beats the gathered
// copy. Pages of whole key blocks always (page 256, 512 queries, us in place / gathered: 1 x 16k 225 / 255, 16 x 2k
// 474 / 527). Smaller pages cost the producer a box per page and segment of every key block of every query tile, while
// the copy costs one pass over the cache, so they pay where pages per key block x query tiles per KV head is small.
// H200, bf16, hd 128 (128-key blocks), GQA 32/8 (4 heads packed), from CUDA graphs (fortieth session), us in place /
// gathered (that product): pages of 64 at 128 queries 1 x 32k 153 / 207, 16 x 8k 564 / 720 (8); at 512 queries
// 1 x 16k 260 / 254, 16 x 2k 559 / 532 (32); pages of 16 at 32 queries 1 x 32k 64 / 134 (8; thirty-ninth session), at
// 128 queries 1 x 32k 218 / 208, 16 x 8k 788 / 723 (32), at 512 queries 1 x 16k 391 / 259 (128). Measured at hd 128
// only; other head dims take the same rule through their block_n and block_m.
constexpr int64_t kMaxInPlacePageBoxes = 8;
bool fwd_pages_fit_call(const FwdParams& p) {
  const AttentionShape& s = p.shape;
  const int bucket = sm90_head_dim_bucket(s.head_dim);
  if (s.cu_seqlens_q != nullptr || p.page_size <= 0 || s.seqlen_k % p.page_size != 0 ||
      !sm90::fwd_pages_fit(bucket, mask_kind(p.mask), p.page_size)) {
    return false;
  }
  const sm90::FwdTileConfig tile = sm90::fwd_tile_config(bucket, mask_kind(p.mask));
  if (p.page_size >= tile.block_n) return true;
  const int64_t pages_per_block = tile.block_n / p.page_size;
  return pages_per_block * query_tiles_per_kv_head(s, sm90_fwd_packed_heads(p), tile.block_m) <= kMaxInPlacePageBoxes;
}

// The tile a planned call's Hopper forward runs: the bucket's, or tall rows where the plan chose them.
sm90::FwdTileConfig fwd_call_tile(const FwdParams& p) {
  return p.sm90_tall_rows ? sm90::kFwdTallTile
                          : sm90::fwd_tile_config(sm90_head_dim_bucket(p.shape.head_dim), mask_kind(p.mask));
}

}  // namespace

bool sm90_fwd_tall_rows(const FwdParams& p) {
  const AttentionShape& s = p.shape;
  if (!sm90::fwd_has_tall_rows(sm90_head_dim_bucket(s.head_dim), mask_kind(p.mask)) || p.block_table != nullptr ||
      s.seqlen_q < sm90::kFwdTallRowsMinQueries) {
    return false;
  }
  const char* value = std::getenv(kFwdTallRowsEnv);
  if (value == nullptr || *value == '\0' || std::string(value) == "1") return true;
  if (std::string(value) == "0") return false;
  throw std::invalid_argument(std::string(kFwdTallRowsEnv) + "='" + value +
                              "' is not a choice: use 0 (the hd 96 Hopper forward on 128-row tiles) or 1 (192-row "
                              "tiles from 4096 queries)");
}

HopperSwitch hopper_switch() {
  const char* value = std::getenv(kHopperSwitchEnv);
  if (value == nullptr || *value == '\0') return kDefaultHopperSwitch;
  const std::string text(value);
  if (text == "0" || text == "off") return HopperSwitch::kOff;
  if (text == "1" || text == "on" || text == "auto") return HopperSwitch::kAuto;
  if (text == "force") return HopperSwitch::kForce;
  throw std::invalid_argument(std::string(kHopperSwitchEnv) + "='" + text +
                              "' is not a choice: use 0 / off (portable kernels only), 1 / auto (the Hopper path "
                              "where it serves the call) or force (fail where it does not)");
}

const char* sm90_fwd_declines(const FwdParams& p) {
  const AttentionShape& s = p.shape;
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) return "dtypes other than fp16 and bf16";
  if ((s.cu_seqlens_q == nullptr) != (s.cu_seqlens_k == nullptr)) return "cu_seqlens for only one of q and k";
  // KV-cache lengths (seqused_k) are served: the kernel zeroes the V rows of a tile's last key block past a sequence's
  // used keys (sm90/fwd_kernel.h zero_value_rows_from). Pages are read in place where they fit the key blocks
  // (sm90/fwd_tile_config.h fwd_pages_fit); other paged calls reach here as a dense copy of their sequences
  // (api/flash_api.cpp gather_pages), or the portable decode kernels read them.
  if (p.block_table != nullptr && !fwd_pages_fit_call(p)) {
    return "a paged K / V cache (block_table) whose pages do not fit the key blocks";
  }
  if (s.appended_keys > 0) return "keys appended by the attention kernel (decode calls)";
  if (p.dropout.p > 0.0) return "dropout";
  if (p.mask.bias != nullptr) return "an additive attention bias (attn_mask)";
  if (!softmax_scale_folds(p.softmax_scale)) return "a softmax_scale outside (0, kMaxFoldedSoftmaxScale] (params.h)";
  if (p.num_splits > sm80::kMaxKeySplits) return "more key splits than the combine kernel merges";
  if (p.splits_meet_in_cluster || p.decode_key_warps) return "decode-shaped calls (planned for the decode tiles)";
  // Decode-shaped calls (sm80/fwd_tile_config.h kDecodeMaxRows) stay on the portable decode tiles unless their
  // query heads pack into at least kSm90PackedFewQueryRows rows (measured there); appends in the call stay on the
  // decode kernels (declined below).
  const int packed = sm90_fwd_packed_heads(p);
  const bool packed_rows_fill = packed > 1 && s.seqlen_q > 1 && s.seqlen_q * packed >= kSm90PackedFewQueryRows;
  if (s.seqlen_q <= sm80::kDecodeMaxRows && !packed_rows_fill) return "decode-shaped calls (at most 16 query rows)";
  if (p.packed_gqa_decode) return "decode-shaped calls (one query row, its GQA group packed into rows)";
  if (s.nheads_k < 1 || s.nheads_q % s.nheads_k != 0) return "query heads that are not a multiple of the KV heads";
  if (s.nheads_q > kMaxGridYZ || s.batch > kMaxGridYZ) return "more than 65535 heads or batch entries";
  if (s.seqlen_q > kMaxInt32 || s.seqlen_k > kMaxInt32 || s.total_q > kMaxInt32 || s.total_k > kMaxInt32) {
    return "more than 2^31 - 1 rows";
  }
  if (!strides_fit(p.q_strides) || !strides_fit(p.k_strides) || !strides_fit(p.v_strides)) {
    return "q, k or v strides of 2^40 bytes or more, or negative";
  }
  // The persistent kernel's tile walk divides tile indices by multiply and shift (common/fast_divmod.h), exact below
  // 2^31: bounded here with the smallest tile (one consumer's rows) and unsplit keys (splits are planned only for
  // calls of fewer tiles than SMs). In double: the product of the limits above overflows 64 bits.
  const double tiles_bound = static_cast<double>(s.batch) * static_cast<double>(s.nheads_k) *
                             static_cast<double>(query_tiles_per_kv_head(s, packed > 1 ? packed : 1,
                                                                         sm90::kRowsPerConsumer));
  if (tiles_bound >= static_cast<double>(kFastDivmodLimit)) return "2^31 query tiles or more";
  return nullptr;
}

bool sm90_fwd_pays(const FwdParams& p) {
  // Measured on the H200, bf16, Hopper / portable TFLOP/s (docs/perf_log.md, fifteenth session):
  // - head dims up to 32 pad to 64 columns: on two consumer warpgroups they lost everywhere (4k keys 225 / 238, causal
  //   198 / 214; 512 keys 153 / 177); on the 64 bucket's three (twenty-ninth session, hd 32, 64 heads) unmasked calls
  //   win at every length, 512 / 1k / 2k / 4k / 8k / 16k keys 186 / 174, 211 / 200, 247 / 221, 248 / 236, 262 / 245,
  //   265 / 251 (GQA 64/8 2k / 8k 246 / 238, 264 / 250; fp16 8k 264 / 245), while causal ones lose up to 4k (512 107 /
  //   121, 1k 141 / 163, 4k 202 / 215) and win at 8k / 16k (235 / 226, 255 / 232): unmasked calls only, as in the
  //   backward;
  // - at head dims up to 64 a tile of short keys is a few key blocks, and the portable kernel's smaller tiles win
  //   against one CTA per tile: masked 1k 236 / 265, 2k 313 / 303; non-causal 512 keys 276 / 285 too, but with a CTA
  //   per SM striding over the tiles (fwd_persistent_pays, eighteenth session) 345 / 287, 1k 403 / 312;
  // - above hd 64 it pays at every length: one key block or less (varlen documents of 128 tokens, hd 128) lost in the
  //   fifteenth session (135 / 143, causal 62 / 72) and wins since the persistent masked forward (twenty-first
  //   session sweep, forced Hopper / default: 160 / 138, causal 83 / 68; benchmarks/results/
  //   2026-12-02-h200-sweep-both-sm90-s21.json);
  // - since the 32 bucket has its own kernels (forty-fifth session: forced Hopper, 210 heads, causal 1k / 4k / 16k 147
  //   / 213 / 259 -> 165 / 241 / 303), masked hd 32 calls take it from 2k keys: the padded kernel's 4k 202 / 215 and
  //   1k 141 / 163 above, +12-17 %; measured (forty-sixth session, 210 heads, default / portable, causal): 2k 224 /
  //   201, 4k 238 / 222, 16k 306 / 241, while at 1k the portable kernel stays ahead (168 against 165).
  constexpr int64_t kHeadDim32 = 32;
  constexpr int64_t kSmallHeadDim = 64;
  constexpr int64_t kMinKeysSmallHeadDim = 512;
  constexpr int64_t kMinKeysSmallHeadDimMasked = 1025;
  constexpr int64_t kMinKeysHeadDim32Masked = 2048;
  if (p.shape.head_dim > kSmallHeadDim) return true;
  const bool masked = mask_kind(p.mask) != MaskKind::kNone;
  if (p.shape.head_dim <= kHeadDim32 && masked) return p.shape.seqlen_k >= kMinKeysHeadDim32Masked;
  return p.shape.seqlen_k >= (masked ? kMinKeysSmallHeadDimMasked : kMinKeysSmallHeadDim);
}

bool sm90_bwd_pays(const BwdParams& p) {
  // Softcap and ALiBi at every head dim (H200, bf16, hd 128, 4k, Hopper / portable TFLOP/s: 254 / 117, 250 / 124).
  // Plain calls above hd 32 (seventeenth session, bf16, 4k / 16k, causal 4k / 16k): hd 128 445 / 493, 400 / 480
  // against the portable 317 / 329, 265 / 322; hd 64 335 / 354, 297 / 353 against 286 / 306, 258 / 303; hd 96 (4k)
  // 333 against 255. hd 32 stays portable (151 against 200 before the statistics blocks' +14 %). Deterministic
  // calls alike (eighteenth session, Hopper / portable, both deterministic, 2k / 16k, causal 2k / 16k): hd 64 192 /
  // 170, 185 / 177 against 138 / 114, 121 / 112; hd 128 288 / 317, 241 / 284 against 141 / 126, 118 / 120; hd 256
  // 141 / 171, 126 / 151 against 76 / 94, 71 / 86.
  // Above hd 128 the wide kernel (bwd_wide_kernel.h; eighteenth session sweep, 4 x 4k, TFLOP/s, Hopper / portable,
  // causal after the slash): hd 160 250 / 182, 224 / 170; hd 192 265 / 199, 242 / 189; hd 224 275 / 190, 254 / 179;
  // hd 256 301 / 254, 278 / 240. Its plain calls take the same rules as the narrow kernel's.
  // hd 32 (the 64 bucket at 32 of 64 columns) since hd 64 steps over 128 query rows (twenty-eighth session, 64 heads,
  // Hopper forced / portable, 512 / 2k / 8k): 136 / 134, 203 / 188, 232 / 206; causal 71 / 81, 146 / 151, 201 / 195,
  // so unmasked calls only, until the 32 bucket got its own kernels (forty-fifth session, forced Hopper, 210 heads,
  // causal 1k / 4k / 16k 129 / 204 / 241 -> 138 / 229 / 275): masked calls from 2k keys (predicted from the padded
  // kernel's 2k 146 / 151 above, +7-14 %; measured in the forty-sixth session, 210 heads, default / portable,
  // causal: 2k 185 / 153, 4k 227 / 180, 16k 273 / 209; 1k both 119).
  if (p.fwd.softcap > 0.0 || p.fwd.mask.alibi_slopes != nullptr) return true;
  constexpr int64_t kMinPlainHeadDim = 33;
  constexpr int64_t kMinKeysMaskedHeadDim32 = 2048;
  return p.fwd.shape.head_dim >= kMinPlainHeadDim || mask_kind(p.fwd.mask) == MaskKind::kNone ||
         p.fwd.shape.seqlen_k >= kMinKeysMaskedHeadDim32;
}

int64_t sm90_bwd_head_splits(const BwdParams& p, int num_sms) {
  // A CTA sums dK and dV of its key block over every query head of its KV head, so MQA / GQA grids are small and each
  // CTA carries the group's work; causal masks give the first key blocks the most. H200, bf16, hd 128, 4 x 4k,
  // 32 query heads, causal backward (sixteenth session sweep, TFLOP/s): 32/1 (128 CTAs on 132 SMs) 151, 32/4 239,
  // 32/8 265 against 285 for 32/32; non-causal 32/1 286 against 306. Split, the CTAs add dK / dV into fp32
  // accumulators and a conversion follows. Not timed yet.
  constexpr int64_t kBwdHeadSplitMinCtasPerSm = 4;
  const AttentionShape& s = p.fwd.shape;
  if (p.deterministic || s.nheads_k < 1 || s.nheads_q % s.nheads_k != 0) return 1;
  const int64_t group = s.nheads_q / s.nheads_k;
  const int64_t block_n = sm90::bwd_tile_config(sm90::fwd_storage_dim(sm90_head_dim_bucket(s.head_dim))).block_n;
  const int64_t ctas = (s.seqlen_k + block_n - 1) / block_n * s.nheads_k * s.batch;
  int64_t splits = 1;
  while (splits < group && ctas * splits < kBwdHeadSplitMinCtasPerSm * num_sms) {
    do {
      ++splits;
    } while (group % splits != 0);
  }
  return splits;
}

int64_t sm90_bwd_dq_splits(const BwdParams& p, int num_sms) {
  // The portable path's rule (bwd_dq_splits: 2 CTAs per SM over batch x KV heads x splits) suits kernels that hold two
  // CTAs per SM; the Hopper backward holds one, so at hd 128, 1 x 16 heads x 16k it made 17 splits, 272 CTAs, three
  // waves of 8 key blocks: 24 key-block times on the busiest SM against 15.5 for the default grid (2048 CTAs), close to
  // the 0.64x measured (eighteenth session: 317 against 497 TFLOP/s). Here 8 splits, one wave of 16. Never more
  // accumulators (workspace) than the portable rule's.
  const AttentionShape& s = p.fwd.shape;
  if (!p.deterministic) return 1;
  const int bucket = sm90::fwd_storage_dim(sm90_head_dim_bucket(s.head_dim));  // the kernel's stored columns
  if (sm90::bwd_orders_dq(bucket)) return 1;  // one accumulator, added into in key-block order
  const int64_t block_n = sm90::bwd_tile_config(bucket).block_n;
  const int64_t key_blocks = std::max<int64_t>((s.seqlen_k + block_n - 1) / block_n, 1);
  const int64_t ctas = std::max<int64_t>(s.batch * s.nheads_k, 1);
  const int64_t sms = std::max(num_sms, 1);
  const int64_t most = std::min(key_blocks, bwd_dq_splits(p, num_sms));
  int64_t best = 1;
  int64_t best_cost = std::numeric_limits<int64_t>::max();
  for (int64_t splits = 1; splits <= most; ++splits) {
    const int64_t waves = (ctas * splits + sms - 1) / sms;
    const int64_t cost = waves * ((key_blocks + splits - 1) / splits);
    if (cost < best_cost) {
      best = splits;
      best_cost = cost;
    }
  }
  return best * sm90::bwd_dq_accumulators_per_cta(bucket);
}

int sm90_fwd_packed_heads(const FwdParams& p) {
  // A tile of 128 rows over 32 queries of one head is three quarters padding: its GEMMs cost what 128 rows do.
  // Packing 4 heads of a KV head into its rows does the same work in a quarter of the tiles, each reading its K / V
  // once for the four. H200, bf16, hd 128, GQA 32/8, flash_attn_with_kvcache from CUDA graphs, us packed / one head a
  // tile (cuDNN, FA2 in the same run; thirty-ninth session): 32 queries over 16 x 8k 138 / 406 (401, 773), over 1 x
  // 32k 55 / 110 (379, 136); 64 queries 232 / 405 (430, 791), 73 / 116 (384, 140); 200 queries (7 tiles for 8)
  // 745 / 880, 218 / 235. Calls it leaves alone ran level (GQA 32/8 512 / 2k keys, causal and not: within 1 %).
  const AttentionShape& s = p.shape;
  if (p.mask.alibi_slopes != nullptr || s.nheads_k < 1 || s.seqlen_q < 1) return 1;
  const int64_t group = s.nheads_q / s.nheads_k;
  const int block_m = fwd_call_tile(p).block_m;
  int64_t packed = 1;
  while (group % (2 * packed) == 0 && block_m % (2 * packed) == 0) packed *= 2;
  return query_tiles_per_kv_head(s, packed, block_m) < query_tiles_per_kv_head(s, 1, block_m)
             ? static_cast<int>(packed)
             : 1;
}

int sm90_fwd_num_splits(const FwdParams& p, int num_sms) {
  // The Hopper forward runs one CTA per SM, so a call of fewer query tiles than SMs leaves SMs idle for its whole
  // length: cut each tile's keys into splits (a CTA each), merged by the combine kernel. Cost model in key-block times
  // of the busiest SM: waves of tiles x splits over the SMs, each ceil(key_blocks / splits) long, plus one key block
  // per split call and the fp32 partials' round trip through memory; the fewest splits of the least cost. Each split
  // keeps at least kMinKeyBlocksPerSplit key blocks. H200, bf16, hd 128, GQA 32/8, flash_attn_with_kvcache from CUDA
  // graphs, us (portable path's split plan / this plan / cuDNN on the same dense keys): 512 queries over 1 x 16k (128
  // tiles: unsplit here) 422 / 213 / 210; 128 queries over 1 x 32k (32 tiles) 206 / 130 / 383, over 2 x 16k 221 / 146
  // / 197 (thirty-eighth and thirty-ninth sessions).
  constexpr int64_t kMinKeyBlocksPerSplit = 4;
  constexpr double kSplitOverheadBlocks = 1.0;
  const AttentionShape& s = p.shape;
  if (p.probs != nullptr || s.seqlen_k <= 0 || num_sms < 1) return 1;
  const sm90::FwdTileConfig tile = fwd_call_tile(p);
  const int64_t packed = p.sm90_packed_heads > 1 ? p.sm90_packed_heads : 1;
  const int64_t tiles = s.batch * s.nheads_k * query_tiles_per_kv_head(s, packed, tile.block_m);
  const int64_t key_blocks = (s.seqlen_k + tile.block_n - 1) / tile.block_n;
  if (tiles <= 0 || tiles >= num_sms) return 1;
  const int64_t most = std::min<int64_t>(key_blocks / kMinKeyBlocksPerSplit, sm80::kMaxKeySplits);
  // Each (tile, split)'s fp32 partial, written and read back by the combine kernel at DRAM bandwidth, costs ~2 /
  // block_n of a key block's GEMMs at an SM's tensor rate (128 rows x head dim x 8 bytes at ~4.8 TB/s against 128
  // rows x block_n keys x head dim x 4 flops at ~5 TFLOP/s per SM), summed over the whole grid: the combine is one
  // pass over every partial. Without this term, 128 queries over 1 x 32k keys planned 37 splits (9 waves of 7 blocks,
  // 77 MB of partials) and ran 173 us; with it 4 (one wave of 64 blocks, 8 MB): 130 us (thirty-ninth session).
  const double partial_blocks = 2.0 / tile.block_n;
  int64_t best = 1;
  double best_cost = static_cast<double>(key_blocks);  // one wave, unsplit
  for (int64_t splits = 2; splits <= most; ++splits) {
    const int64_t waves = (tiles * splits + num_sms - 1) / num_sms;
    const double cost = static_cast<double>(waves * ((key_blocks + splits - 1) / splits)) + kSplitOverheadBlocks +
                        partial_blocks * static_cast<double>(tiles * splits);
    if (cost < best_cost) {
      best = splits;
      best_cost = cost;
    }
  }
  return static_cast<int>(best);
}

int sm90_head_dim_bucket(int64_t head_dim) {
  constexpr int64_t kHalfSegment = 32;
  return static_cast<int>((head_dim + kHalfSegment - 1) / kHalfSegment * kHalfSegment);
}

const char* sm90_bwd_declines(const BwdParams& p) {
  if (const char* declined = sm90_fwd_declines(p.fwd)) return declined;
  if (p.fwd.shape.seqused_k != nullptr) return "KV-cache lengths (seqused_k): the backward takes none";
  if (p.dbias != nullptr) return "a bias gradient";
  if (p.dq_splits < 1 || (!p.deterministic && p.dq_splits != 1)) return "split dq accumulators without deterministic";
  return nullptr;
}

}  // namespace flash
