// Host check of the CUDA backward's scratch layout (flash_attn/bwd_workspace.h) and of the Hopper backward's head
// splits (dispatch/sm90_policy.cpp sm90_bwd_head_splits), run by tests/test_bwd_workspace.py on random shapes: the
// split count divides the query-head group, reaches the grid target with the smallest such divisor (or is the whole
// group), and is 1 in deterministic calls; the delta, dq, dK, dV and statistics regions of the layout the sm90
// kernels use lie inside bwd_workspace_bytes() without overlapping, the last element the split epilogue adds and the
// conversion reads is inside its accumulator, and every query block of every sequence has a statistics block of its
// own inside the region; the Hopper dq split count is the fewest that minimise the busiest SM's work; the portable
// backward's head splits (bwd_head_splits) divide the group and are 1 when deterministic or switched off; the regions
// after the dq accumulators sit at the same offsets whichever dq layout the kernel was given. Prints one line per
// failure and a summary; exits 1 on any failure.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "dispatch/sm90_policy.h"
#include "flash_attn/bwd_workspace.h"
#include "sm90/bwd_tile_config.h"
#include "sm90/fwd_tile_config.h"

namespace {

int failures = 0;

void fail(const char* what, const flash::BwdParams& p, int64_t a, int64_t b) {
  if (++failures <= 20) {
    const flash::AttentionShape& s = p.fwd.shape;
    std::printf("FAIL %s: batch %ld heads %ld/%ld seqlen %ld/%ld hd %ld varlen %d deterministic %d splits %ld "
                "(%ld, %ld)\n",
                what, long(s.batch), long(s.nheads_q), long(s.nheads_k), long(s.seqlen_q), long(s.seqlen_k),
                long(s.head_dim), int(s.cu_seqlens_q != nullptr), int(p.deterministic), long(p.head_splits), long(a),
                long(b));
  }
}

// The policy's target, restated: CTAs per SM the split grid should reach (sm90_policy.cpp kBwdHeadSplitMinCtasPerSm).
constexpr int64_t kTargetCtasPerSm = 4;

void check_splits(const flash::BwdParams& p, int num_sms) {
  const flash::AttentionShape& s = p.fwd.shape;
  const int64_t group = s.nheads_q / s.nheads_k;
  const int64_t splits = p.head_splits;
  if (splits < 1 || group % splits != 0) fail("splits do not divide the group", p, splits, group);
  if (p.deterministic && splits != 1) fail("a deterministic call split", p, splits, 1);
  if (p.deterministic) return;
  // The kernel's stored columns (the 96 bucket stores 128).
  const int64_t block_n =
      flash::sm90::bwd_tile_config(flash::sm90::fwd_storage_dim(flash::sm90_head_dim_bucket(s.head_dim))).block_n;
  const int64_t ctas = (s.seqlen_k + block_n - 1) / block_n * s.nheads_k * s.batch;
  if (splits < group && ctas * splits < kTargetCtasPerSm * num_sms) fail("stopped below the target", p, ctas, splits);
  for (int64_t d = 1; d < splits; ++d) {
    if (group % d == 0 && ctas * d >= kTargetCtasPerSm * num_sms) {
      fail("a smaller divisor reaches the target", p, d, splits);
    }
  }
}

// The Hopper backward's dq accumulators (sm90_bwd_dq_splits): 1 unless deterministic; otherwise a whole number of
// CTAs' (two per CTA in the hd 64 bucket's kernel), whose CTA splits are no more than the portable rule's count or the
// key blocks, and the fewest that minimise the busiest SM's key blocks (one CTA per SM resident: waves of batch x KV
// heads x splits CTAs, each walking ceil(key blocks / splits)).
void check_dq_splits(const flash::BwdParams& p, int num_sms) {
  const flash::AttentionShape& s = p.fwd.shape;
  const int64_t accumulators = flash::sm90_bwd_dq_splits(p, num_sms);
  if (!p.deterministic) {
    if (accumulators != 1) fail("dq splits without deterministic", p, accumulators, 1);
    return;
  }
  const int bucket = flash::sm90::fwd_storage_dim(flash::sm90_head_dim_bucket(s.head_dim));
  // The narrow kernel's ordered dQ: one accumulator, added into in key-block order.
  if (flash::sm90::bwd_orders_dq(bucket)) {
    if (accumulators != 1) fail("dq splits with ordered dQ", p, accumulators, 1);
    return;
  }
  // The own-keys kernel (hd 64 bucket) gives each of its two consumers an accumulator; the others one per CTA.
  const int64_t per_cta = bucket <= 64 ? 2 : 1;
  if (accumulators % per_cta != 0) fail("dq accumulators not whole CTAs'", p, accumulators, per_cta);
  const int64_t splits = accumulators / per_cta;
  const int64_t block_n = flash::sm90::bwd_tile_config(bucket).block_n;
  const int64_t key_blocks = std::max<int64_t>((s.seqlen_k + block_n - 1) / block_n, 1);
  const int64_t cap = std::min(key_blocks, flash::bwd_dq_splits(p, num_sms));
  if (splits < 1 || splits > cap) fail("dq splits outside [1, cap]", p, splits, cap);
  const int64_t ctas = s.batch * s.nheads_k;
  auto busiest = [&](int64_t n) { return (ctas * n + num_sms - 1) / num_sms * ((key_blocks + n - 1) / n); };
  for (int64_t n = 1; n <= cap; ++n) {
    if (busiest(n) < busiest(splits)) fail("dq splits with a busier SM than another count", p, splits, n);
    if (n < splits && busiest(n) == busiest(splits)) fail("fewer dq splits do as well", p, splits, n);
  }
}

// Sequence b's statistics blocks (bwd_stats_block0 on, one per kBwdStatsRows rows of its length rounded up to
// kBwdStatsSequenceRows: what a 128-row query block's bulk copy reads, bwd_kernel.h) stay inside a head's
// stats_head_stride and after the previous sequence's.
void check_stat_blocks(const flash::BwdParams& p, const flash::BwdWorkspace& w, const std::vector<int64_t>& lengths) {
  const int64_t block_floats = 2 * flash::kBwdStatsRows;
  int64_t row0 = 0;
  int64_t next_free = 0;  // the first block the next sequence may use
  for (size_t b = 0; b < lengths.size(); ++b) {
    const int64_t blocks = flash::bwd_stats_padded_rows(lengths[b]) / flash::kBwdStatsRows;
    const int64_t first = flash::bwd_stats_block0(row0, static_cast<int64_t>(b));
    if (blocks > 0 && first < next_free) fail("statistics blocks of two sequences overlap", p, first, next_free);
    if ((first + blocks) * block_floats > w.stats_head_stride) {
      fail("statistics block past the head's", p, (first + blocks) * block_floats, w.stats_head_stride);
    }
    if (blocks > 0) next_free = first + blocks;
    row0 += lengths[b];
  }
}

void check_layout(flash::BwdParams p, const std::vector<int64_t>& lengths) {
  const flash::AttentionShape& s = p.fwd.shape;
  const int64_t floats = flash::bwd_workspace_bytes(p) / static_cast<int64_t>(sizeof(float));
  // Offsets only: a stand-in base address (the layout never dereferences it), since real scratch would reach GBs.
  float* const base = reinterpret_cast<float*>(uintptr_t{1} << 20);
  p.workspace = base;
  const flash::BwdWorkspace w = flash::bwd_workspace(p, flash::DqLayout::kRows);
  // The portable kernels pass either layout; the dK / dV conversion and the Hopper kernels pass kRows.
  const flash::BwdWorkspace pairs = flash::bwd_workspace(p, flash::DqLayout::kRowPairs);
  if (pairs.dk_accum != w.dk_accum || pairs.dv_accum != w.dv_accum || pairs.stats != w.stats) {
    fail("the regions after dq move with the dq layout", p, pairs.dk_accum - w.dk_accum, pairs.stats - w.stats);
  }
  const int64_t pairs_dq_end = (pairs.dq_accum - base) + p.dq_splits * pairs.dq_split_stride;
  if (pairs_dq_end > floats) fail("row-pair dq past the workspace", p, pairs_dq_end, floats);
  if (p.head_splits > 1 && pairs_dq_end > w.dk_accum - base) {
    fail("row-pair dq overlaps dK", p, pairs_dq_end, w.dk_accum - base);
  }
  const int64_t delta_end = (w.delta - base) + s.nheads_q * w.delta_head_stride;
  const int64_t dq_begin = w.dq_accum - base;
  const int64_t dq_end = dq_begin + p.dq_splits * w.dq_split_stride;
  if (dq_begin < delta_end) fail("dq overlaps delta", p, dq_begin, delta_end);
  if (dq_end > floats) fail("dq past the workspace", p, dq_end, floats);
  if (p.block_stats) {
    const int64_t stats_begin = w.stats - base;
    const int64_t stats_end = stats_begin + s.nheads_q * w.stats_head_stride;
    const int64_t before = p.head_splits > 1 ? (w.dv_accum - base) + w.dkv_floats : dq_end;
    if (stats_begin < before) fail("statistics overlap the accumulators", p, stats_begin, before);
    if (stats_end > floats) fail("statistics past the workspace", p, stats_end, floats);
    if (stats_begin % 4 != 0 || w.stats_head_stride % 4 != 0) fail("bulk copies misaligned", p, stats_begin, 0);
    check_stat_blocks(p, w, lengths);
    // The ordered dQ's counters (deterministic or fused dQ): one per statistics block, after the statistics.
    const int64_t counters_begin = reinterpret_cast<float*>(w.dq_semaphores) - base;
    const int64_t counters = s.nheads_q * w.semaphore_head_stride;
    if (w.dq_semaphores == nullptr || w.semaphore_head_stride * 2 * flash::kBwdStatsRows != w.stats_head_stride) {
      fail("a counter per statistics block", p, w.semaphore_head_stride, w.stats_head_stride);
    }
    if (counters_begin < stats_end) fail("counters overlap the statistics", p, counters_begin, stats_end);
    if (counters_begin + counters > floats) fail("counters past the workspace", p, counters_begin + counters, floats);
  } else if (w.stats != nullptr || w.stats_head_stride != 0 || w.dq_semaphores != nullptr) {
    fail("statistics blocks or counters without block_stats", p, 0, 0);
  }
  if (p.head_splits <= 1) {
    if (w.dk_accum != nullptr || w.dv_accum != nullptr || w.dkv_floats != 0) {
      fail("dK / dV accumulators without splits", p, 0, 0);
    }
    return;
  }
  const int64_t dk_begin = w.dk_accum - base;
  const int64_t dv_begin = w.dv_accum - base;
  if (dk_begin < dq_end) fail("dK accumulator overlaps dq", p, dk_begin, dq_end);
  if (dv_begin < dk_begin + w.dkv_floats) fail("dV accumulator overlaps dK", p, dv_begin, dk_begin + w.dkv_floats);
  if (dv_begin + w.dkv_floats > floats) fail("dV accumulator past the workspace", p, dv_begin + w.dkv_floats, floats);
  if (dk_begin % 2 != 0 || dv_begin % 2 != 0 || w.dkv_row_stride % 2 != 0) {
    fail("8-byte reductions misaligned", p, dk_begin, dv_begin);
  }
  // The split epilogue adds (row * nheads_k + kv head) * dkv_row_stride + col for col < head_dim; the conversion reads
  // the same elements.
  const int64_t last = ((s.total_k - 1) * s.nheads_k + s.nheads_k - 1) * w.dkv_row_stride + s.head_dim - 1;
  if (last >= w.dkv_floats) fail("last dK / dV element outside its accumulator", p, last, w.dkv_floats);
  if (w.dkv_row_stride < s.head_dim) {
    fail("accumulator rows narrower than the head dim", p, w.dkv_row_stride, s.head_dim);
  }
}

}  // namespace

int main() {
  std::mt19937 random(20261201);
  const int sm_counts[] = {132, 114, 78};
  const int64_t groups[] = {1, 2, 3, 4, 6, 8, 16, 32};
  int cases = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    flash::BwdParams p;
    flash::AttentionShape& s = p.fwd.shape;
    s.batch = 1 + random() % 8;
    s.nheads_k = 1 + random() % 8;
    s.nheads_q = s.nheads_k * groups[random() % 8];
    s.head_dim = 8 * (1 + random() % 32);
    s.seqlen_q = 1 + random() % 20000;
    s.seqlen_k = 1 + random() % 20000;
    const bool varlen = random() % 3 == 0;
    // Varlen: the packed rows are at most batch x the longest sequence (the pointer only marks the call as varlen).
    static const int32_t kMarker = 0;
    s.cu_seqlens_q = varlen ? &kMarker : nullptr;
    s.cu_seqlens_k = varlen ? &kMarker : nullptr;
    s.total_q = varlen ? 1 + random() % (s.batch * s.seqlen_q) : s.batch * s.seqlen_q;
    s.total_k = varlen ? 1 + random() % (s.batch * s.seqlen_k) : s.batch * s.seqlen_k;
    p.total_q = s.total_q;
    // The sequences' lengths: dense, batch x seqlen_q; varlen, a random split of total_q (empty ones included).
    std::vector<int64_t> lengths(s.batch, s.seqlen_q);
    if (varlen) {
      std::vector<int64_t> cuts{0, s.total_q};
      for (int64_t b = 1; b < s.batch; ++b) cuts.push_back(random() % (s.total_q + 1));
      std::sort(cuts.begin(), cuts.end());
      for (int64_t b = 0; b < s.batch; ++b) lengths[b] = cuts[b + 1] - cuts[b];
    }
    p.block_stats = random() % 2 == 0;
    p.deterministic = random() % 4 == 0;
    if (random() % 2 == 0) p.fwd.mask.window_right = 0;  // causal
    const int num_sms = sm_counts[random() % 3];
    // The Hopper entries (block_stats) take their own dq split count, the portable ones the shared rule.
    p.dq_splits = p.block_stats ? flash::sm90_bwd_dq_splits(p, num_sms) : flash::bwd_dq_splits(p, num_sms);
    // The portable rule (bwd_head_splits): a divisor of the group, 1 when deterministic or switched off.
    const int64_t portable_splits = flash::bwd_head_splits(p, num_sms);
    const int64_t group = s.nheads_q / s.nheads_k;
    if (portable_splits < 1 || group % portable_splits != 0) fail("portable splits", p, portable_splits, group);
    if ((p.deterministic || !flash::kBwdSplitsHeads) && portable_splits != 1) {
      fail("portable splits when deterministic or off", p, portable_splits, 1);
    }
    // Unmasked calls split only while the split grid fits in one wave of num_sms CTAs.
    const int64_t key_ctas = (s.seqlen_k + flash::kBwdHeadSplitKeysPerCta - 1) / flash::kBwdHeadSplitKeysPerCta *
                             s.nheads_k * s.batch;
    if (flash::mask_kind(p.fwd.mask) == flash::MaskKind::kNone && portable_splits > 1 &&
        key_ctas * portable_splits > num_sms) {
      fail("unmasked portable splits past one wave", p, key_ctas * portable_splits, num_sms);
    }
    p.head_splits = p.block_stats ? flash::sm90_bwd_head_splits(p, num_sms) : portable_splits;
    if (p.block_stats) check_splits(p, num_sms);
    check_dq_splits(p, num_sms);
    check_layout(p, lengths);
    ++cases;
  }
  // The case the rule was made for (docs/perf_log.md, eighteenth session): hd 128, 1 x 16 heads, 16k keys, 132 SMs:
  // 8 splits, one wave of 16 key blocks (the portable rule's 17 made three waves of 8).
  {
    flash::BwdParams p;
    flash::AttentionShape& s = p.fwd.shape;
    s.batch = 1;
    s.nheads_q = s.nheads_k = 16;
    s.head_dim = 128;
    s.seqlen_q = s.seqlen_k = s.total_q = s.total_k = 16384;
    p.deterministic = true;
    const int64_t splits = flash::sm90_bwd_dq_splits(p, 132);
    const int64_t expected = flash::sm90::bwd_orders_dq(128) ? 1 : 8;
    if (splits != expected) fail("hd 128 16k dq splits", p, splits, expected);
    s.head_dim = 64;  // own-keys: 4 CTA splits (one wave of 32 key blocks at 32 heads) of 2 accumulators
    s.nheads_q = s.nheads_k = 32;
    const int64_t own_keys = flash::sm90_bwd_dq_splits(p, 132);
    const int64_t expected_own = flash::sm90::bwd_orders_dq(64) ? 1 : 8;
    if (own_keys != expected_own) fail("hd 64 16k dq accumulators", p, own_keys, expected_own);
  }
  // The portable head splits at the shapes they were measured on (docs/perf_log.md, twenty-second, sixty-second and
  // sixty-third sessions): hd 128, 32 query heads, 132 SMs. At 4 x 4k causal calls split to 8 CTAs per SM: MQA's 128
  // key-block CTAs 16 ways, GQA 32/8's 1,024 two ways; MQA non-causal: 128 CTAs already fill the one wave (two ways
  // ran 328 -> 314 TFLOP/s). At 16 x 1k the target is 4 CTAs per SM: GQA 32/8 causal's 1,024 CTAs stay whole.
  if (flash::kBwdSplitsHeads) {
    flash::BwdParams p;
    flash::AttentionShape& s = p.fwd.shape;
    s.batch = 4;
    s.nheads_q = 32;
    s.nheads_k = 1;
    s.head_dim = 128;
    s.seqlen_q = s.seqlen_k = 4096;
    s.total_q = s.total_k = 4 * 4096;
    p.fwd.mask.window_right = 0;
    const int64_t mqa_causal = flash::bwd_head_splits(p, 132);
    if (mqa_causal != 16) fail("MQA causal head splits", p, mqa_causal, 16);
    p.fwd.mask.window_right = flash::kUnboundedWindow;
    const int64_t mqa = flash::bwd_head_splits(p, 132);
    if (mqa != 1) fail("MQA non-causal head splits", p, mqa, 1);
    s.nheads_k = 8;
    p.fwd.mask.window_right = 0;
    const int64_t gqa = flash::bwd_head_splits(p, 132);
    if (gqa != 2) fail("GQA 32/8 causal head splits", p, gqa, 2);
    // The 8-per-SM target is for causal masks up to hd 128 (sixty-third session): a window and hd 256 keep 4, which
    // the 1,024 key-block CTAs already reach.
    p.fwd.mask.window_left = 512;
    const int64_t gqa_window = flash::bwd_head_splits(p, 132);
    if (gqa_window != 1) fail("GQA 32/8 causal window head splits", p, gqa_window, 1);
    p.fwd.mask.window_left = flash::kUnboundedWindow;
    s.head_dim = 256;
    const int64_t gqa_hd256 = flash::bwd_head_splits(p, 132);
    if (gqa_hd256 != 1) fail("GQA 32/8 causal hd 256 head splits", p, gqa_hd256, 1);
    s.head_dim = 128;
    s.batch = 16;
    s.seqlen_q = s.seqlen_k = 1024;
    const int64_t gqa_short = flash::bwd_head_splits(p, 132);
    if (gqa_short != 1) fail("GQA 32/8 causal 1k head splits", p, gqa_short, 1);
  }
  std::printf("%d cases, %d failures\n", cases, failures);
  return failures == 0 ? 0 : 1;
}
