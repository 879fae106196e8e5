// Host check of which forward calls the Hopper path takes and how it splits their keys (dispatch/sm90_policy.cpp), run
// by tests/test_sm90_fwd_plan.py: KV-cache lengths served, appends in the call and packed GQA decode steps declined,
// the backward declining seqused_k, paged caches only where pages fit the key blocks, GQA packing, and
// sm90_fwd_num_splits on the H200's 132 SMs (no split once the query tiles fill the SMs; otherwise the fewest splits
// of the least waves x blocks per split; at most 128; at least four key blocks a split), and tall rows (hd 96 on
// 192-row tiles: which calls, under which switch values, and the splits and packing they plan), and calls of 2^31
// query tiles or more declined.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <initializer_list>
#include <stdexcept>

#include "dispatch/sm90_policy.h"
#include "sm90/fwd_tile_config.h"

namespace {

constexpr int kH200Sms = 132;
const int32_t kUsed[1] = {0};  // only addresses are read: the policy never dereferences device pointers
float probs_buffer[1];

flash::FwdParams call(int64_t batch, int64_t heads, int64_t seqlen_q, int64_t seqlen_k, int64_t head_dim = 128,
                      bool causal = false) {
  flash::FwdParams p;
  p.dtype = flash::DType::kBFloat16;
  p.shape.batch = batch;
  p.shape.nheads_q = heads;
  p.shape.nheads_k = heads;
  p.shape.seqlen_q = seqlen_q;
  p.shape.seqlen_k = seqlen_k;
  p.shape.head_dim = head_dim;
  p.softmax_scale = 0.088;
  p.mask.window_left = -1;
  p.mask.window_right = causal ? 0 : -1;
  const int64_t row = heads * head_dim;
  p.q_strides = flash::TensorStrides{seqlen_q * row, row, head_dim};
  p.k_strides = flash::TensorStrides{seqlen_k * row, row, head_dim};
  p.v_strides = p.k_strides;
  return p;
}

int failures = 0;
int cases = 0;

void expect_packed(const char* what, const flash::FwdParams& p, int want) {
  ++cases;
  const int got = flash::sm90_fwd_packed_heads(p);
  if (got != want) {
    ++failures;
    std::printf("FAIL %s: %d packed heads, want %d\n", what, got, want);
  }
}

// GQA: heads query heads over kv_heads KV heads, packed as the policy says (as api/fwd_cuda_plan.cpp plans a call).
flash::FwdParams gqa(int64_t batch, int64_t heads, int64_t kv_heads, int64_t seqlen_q, int64_t seqlen_k,
                     int64_t head_dim = 128) {
  flash::FwdParams p = call(batch, heads, seqlen_q, seqlen_k, head_dim);
  p.shape.nheads_k = kv_heads;
  p.sm90_packed_heads = flash::sm90_fwd_packed_heads(p);
  return p;
}

void expect_splits(const char* what, const flash::FwdParams& p, int want) {
  ++cases;
  const int got = flash::sm90_fwd_num_splits(p, kH200Sms);
  if (got != want) {
    ++failures;
    std::printf("FAIL %s: %d splits, want %d\n", what, got, want);
  }
}

// declined: null (the path serves the call) or a piece of the reason it names.
void expect_declines(const char* what, const char* declined, const char* want) {
  ++cases;
  const bool ok = want == nullptr ? declined == nullptr : declined != nullptr && std::strstr(declined, want) != nullptr;
  if (!ok) {
    ++failures;
    std::printf("FAIL %s: declined '%s', want '%s'\n", what, declined ? declined : "(served)", want ? want : "(served)");
  }
}

}  // namespace

int main() {
  // Splits. 512 tiles: none. 128 tiles of 128 key blocks: one wave either way, so none.
  expect_splits("4 x 16 heads x 4k", call(4, 16, 4096, 4096), 1);
  expect_splits("1 x 32 heads, 512 queries x 16k", call(1, 32, 512, 16384), 1);
  // 32 tiles of 256 key blocks: 4 splits (one wave of 64), where blocks alone would plan 37 (9 waves of 7 blocks: 63
  // block times) and write nine times the partials.
  expect_splits("1 x 32 heads, 128 queries x 32k", call(1, 32, 128, 32768), 4);
  expect_splits("2 x 32 heads, 128 queries x 16k", call(2, 32, 128, 16384), 2);
  // One tile over 1M keys: the most the combine kernel merges.
  expect_splits("1 x 1 head, 100 queries x 1M", call(1, 1, 100, 1 << 20), 128);
  // Four key blocks: no split of fewer than four.
  expect_splits("1 x 1 head, 100 queries x 512", call(1, 1, 100, 512), 1);
  expect_splits("1 x 1 head, 100 queries x 1024", call(1, 1, 100, 1024), 2);
  // hd 64 tiles of 192 rows: 2 x 2 heads x 1 tile over 5000 keys (40 blocks): 10 splits of 4.
  expect_splits("hd 64, 2 x 2 heads, 100 queries x 5000", call(2, 2, 100, 5000, 64), 10);
  // hd 256 blocks of 80 keys: 63 blocks, at most 15 splits; 13 splits of 5 blocks cost what 15 do, and fewer win.
  expect_splits("hd 256, 2 x 2 heads, 100 queries x 5000", call(2, 2, 100, 5000, 256), 13);
  // GQA packing: the largest power of two dividing the group and block_m, where it takes fewer tiles.
  expect_packed("32 / 8 heads, 32 queries", gqa(16, 32, 8, 32, 8192), 4);
  expect_packed("32 / 8 heads, 512 queries (no tile saved)", gqa(1, 32, 8, 512, 8192), 1);
  expect_packed("32 / 8 heads, 333 queries (3 tiles a head: 11 packed)", gqa(1, 32, 8, 333, 8192), 4);
  expect_packed("32 / 1 heads, 17 queries", gqa(1, 32, 1, 17, 8192), 32);
  expect_packed("12 / 4 heads (groups of 3)", gqa(1, 12, 4, 32, 8192), 1);
  expect_packed("24 / 4 heads (groups of 6), 32 queries", gqa(1, 24, 4, 32, 8192), 2);
  expect_packed("hd 64 (192-row tiles), 64 / 8 heads, 24 queries", gqa(1, 64, 8, 24, 8192, 64), 8);
  expect_packed("MHA", gqa(1, 32, 32, 32, 8192), 1);
  flash::FwdParams alibi = gqa(1, 32, 8, 32, 8192);
  alibi.mask.alibi_slopes = probs_buffer;
  expect_packed("ALiBi", alibi, 1);
  // Packed tiles are what the split plan counts: 16 x 8 packed tiles fill 128 of 132 SMs (no split); 1 x 8 over 32k
  // keys split.
  expect_splits("16 x 32 / 8 heads, 32 queries x 8k", gqa(16, 32, 8, 32, 8192), 1);
  expect_splits("1 x 32 / 8 heads, 32 queries x 32k", gqa(1, 32, 8, 32, 32768), 16);
  flash::FwdParams probs = call(1, 1, 100, 1 << 20);
  probs.probs = probs_buffer;
  expect_splits("returned probabilities", probs, 1);

  // What the path serves.
  flash::FwdParams used = call(4, 8, 200, 640);
  used.shape.seqused_k = kUsed;
  expect_declines("seqused_k", flash::sm90_fwd_declines(used), nullptr);
  flash::FwdParams appended = used;
  appended.shape.appended_keys = 1;
  expect_declines("appended keys", flash::sm90_fwd_declines(appended), "appended");
  flash::FwdParams packed = used;
  packed.packed_gqa_decode = true;
  packed.shape.seqlen_q = 32;
  expect_declines("packed GQA decode", flash::sm90_fwd_declines(packed), "decode");
  // Few queries (speculative decoding) take the Hopper tile where their heads pack into kSm90PackedFewQueryRows rows.
  flash::FwdParams draft = gqa(16, 64, 8, 8, 8192);
  draft.shape.seqused_k = kUsed;
  expect_declines("8 queries of 8 packed heads", flash::sm90_fwd_declines(draft), nullptr);
  draft = gqa(16, 32, 8, 2, 8192);
  expect_declines("2 queries of 4 packed heads (8 rows)", flash::sm90_fwd_declines(draft), nullptr);
  draft = gqa(16, 16, 8, 2, 8192);
  expect_declines("2 queries of 2 packed heads (4 rows)", flash::sm90_fwd_declines(draft), "decode");
  draft = gqa(16, 32, 32, 16, 8192);
  expect_declines("16 queries, MHA (unpacked)", flash::sm90_fwd_declines(draft), "decode");
  flash::FwdParams split = used;
  split.num_splits = 64;
  expect_declines("64 splits", flash::sm90_fwd_declines(split), nullptr);
  split.num_splits = 129;
  expect_declines("129 splits", flash::sm90_fwd_declines(split), "splits");
  // The tile walk's divisions (common/fast_divmod.h) hold below 2^31 tiles, bounded with 64-row tiles: 65535 x 128 x
  // 256 blocks of 64 queries is 2^31 - 2^15; twice the queries pass it.
  expect_declines("65535 x 128 heads x 16k queries", flash::sm90_fwd_declines(call(65535, 128, 16384, 16384)), nullptr);
  expect_declines("65535 x 128 heads x 32k queries", flash::sm90_fwd_declines(call(65535, 128, 32768, 16384)),
                  "2^31 query tiles");
  flash::FwdParams paged = used;
  paged.block_table = kUsed;
  paged.page_size = 16;
  paged.num_pages = 200;
  // Pages smaller than a key block: in place where pages per block x query tiles per KV head is at most 8 (here 8 x 2).
  expect_declines("pages of 16, 200 queries", flash::sm90_fwd_declines(paged), "paged");
  flash::FwdParams few = gqa(16, 32, 8, 32, 640);
  few.shape.seqused_k = kUsed;
  few.block_table = kUsed;
  few.num_pages = 200;
  few.page_size = 16;
  expect_declines("pages of 16, 32 queries of 4 packed heads", flash::sm90_fwd_declines(few), nullptr);
  few.page_size = 64;
  expect_declines("pages of 64, 32 queries of 4 packed heads", flash::sm90_fwd_declines(few), nullptr);
  few.shape.seqlen_q = 128;
  expect_declines("pages of 64, 128 queries of 4 packed heads (4 tiles)", flash::sm90_fwd_declines(few), nullptr);
  few.shape.seqlen_q = 512;
  expect_declines("pages of 64, 512 queries of 4 packed heads (16 tiles)", flash::sm90_fwd_declines(few), "paged");
  few.shape.seqlen_q = 64;
  few.page_size = 16;
  expect_declines("pages of 16, 64 queries of 4 packed heads (2 tiles)", flash::sm90_fwd_declines(few), "paged");
  paged.page_size = 128;
  expect_declines("pages of 128 (one key block)", flash::sm90_fwd_declines(paged), nullptr);
  paged.page_size = 256;
  paged.shape.seqlen_k = 768;  // a paged call's keys: its table's pages, 3 of 256 rows
  expect_declines("pages of 256", flash::sm90_fwd_declines(paged), nullptr);
  paged.page_size = 48;
  expect_declines("pages of 48", flash::sm90_fwd_declines(paged), "paged");
  paged.page_size = 8;
  expect_declines("pages of 8", flash::sm90_fwd_declines(paged), "paged");
  flash::BwdParams bwd;
  bwd.fwd = used;
  expect_declines("backward with seqused_k", flash::sm90_bwd_declines(bwd), "seqused_k");

  // Buckets (sm90_policy.h): every 32 columns, stored in whole 64-column segments. Each head dim of a bucket's range
  // maps to it.
  struct BucketCase {
    int64_t head_dim;
    int bucket;
    int stored;
  };
  for (const BucketCase& c : {BucketCase{1, 32, 64}, BucketCase{32, 32, 64}, BucketCase{33, 64, 64},
                              BucketCase{64, 64, 64}, BucketCase{65, 96, 128},
                              BucketCase{96, 96, 128}, BucketCase{97, 128, 128}, BucketCase{128, 128, 128},
                              BucketCase{129, 160, 192}, BucketCase{160, 160, 192}, BucketCase{161, 192, 192},
                              BucketCase{193, 224, 256}, BucketCase{224, 224, 256}, BucketCase{256, 256, 256}}) {
    ++cases;
    const int bucket = flash::sm90_head_dim_bucket(c.head_dim);
    const int stored = flash::sm90::fwd_storage_dim(bucket);
    if (bucket != c.bucket || stored != c.stored) {
      ++failures;
      std::printf("FAIL head dim %lld: bucket %d stored as %d, want %d / %d\n", static_cast<long long>(c.head_dim),
                  bucket, stored, c.bucket, c.stored);
    }
  }

  // Tall rows (hd 96 on 192-row tiles): by default (unset) and under FLASH_ATTN_FWD_TALL_ROWS=1, from 4096 queries, not
  // under a window nor with pages read in place; the split plan and the packing then count 192-row tiles; 0 turns
  // them off. Another value is refused.
  struct TallCase {
    const char* what;
    flash::FwdParams p;
    bool want;
  };
  flash::FwdParams window = call(1, 8, 8192, 8192, 96);
  window.mask.window_left = 256;
  flash::FwdParams tall_paged = call(1, 8, 8192, 8192, 96);
  tall_paged.block_table = kUsed;
  tall_paged.page_size = 256;
  unsetenv(flash::kFwdTallRowsEnv);
  ++cases;
  if (!flash::sm90_fwd_tall_rows(call(1, 8, 8192, 8192, 96))) {
    ++failures;
    std::printf("FAIL tall rows not taken by default\n");
  }
  setenv(flash::kFwdTallRowsEnv, "1", 1);
  for (const TallCase& c : {TallCase{"hd 96, 4096 queries", call(1, 8, 4096, 4096, 96), true},
                            TallCase{"hd 80 (the 96 bucket), causal", call(1, 8, 5000, 5000, 80, true), true},
                            TallCase{"hd 96, 4095 queries", call(1, 8, 4095, 8192, 96), false},
                            TallCase{"hd 128", call(1, 8, 8192, 8192, 128), false},
                            TallCase{"hd 64", call(1, 8, 8192, 8192, 64), false},
                            TallCase{"hd 96 window", window, false}, TallCase{"hd 96 paged", tall_paged, false}}) {
    ++cases;
    if (flash::sm90_fwd_tall_rows(c.p) != c.want) {
      ++failures;
      std::printf("FAIL tall rows, %s: want %d\n", c.what, c.want);
    }
  }
  // 1 x 1 head x 4096 queries: 22 tall tiles (32 of 128 rows) over 64k keys (586 blocks of 112, 512 of 128).
  flash::FwdParams tall = call(1, 1, 4096, 65536, 96);
  tall.sm90_tall_rows = flash::sm90_fwd_tall_rows(tall);
  flash::FwdParams flat = call(1, 1, 4096, 65536, 96);
  const int tall_splits = flash::sm90_fwd_num_splits(tall, kH200Sms);
  const int flat_splits = flash::sm90_fwd_num_splits(flat, kH200Sms);
  ++cases;
  if (!tall.sm90_tall_rows || tall_splits <= 1 || tall_splits == flat_splits) {
    ++failures;
    std::printf("FAIL tall rows' split plan: %d splits (%d on 128-row tiles)\n", tall_splits, flat_splits);
  }
  // GQA 32 / 8 at 4096 queries: 22 tall tiles a head, 86 for a group of 4 packed (88 unpacked); 128-row tiles pack
  // none (32 a head either way).
  flash::FwdParams grouped = call(1, 32, 4096, 4096, 96);
  grouped.shape.nheads_k = 8;
  grouped.sm90_tall_rows = flash::sm90_fwd_tall_rows(grouped);
  expect_packed("tall rows, 32 / 8 heads, 4096 queries", grouped, 4);
  setenv(flash::kFwdTallRowsEnv, "0", 1);
  expect_packed("128-row tiles, 32 / 8 heads, 4096 queries", gqa(1, 32, 8, 4096, 4096, 96), 1);
  ++cases;
  if (flash::sm90_fwd_tall_rows(call(1, 8, 8192, 8192, 96))) {
    ++failures;
    std::printf("FAIL tall rows under FLASH_ATTN_FWD_TALL_ROWS=0\n");
  }
  setenv(flash::kFwdTallRowsEnv, "yes", 1);
  ++cases;
  try {
    flash::sm90_fwd_tall_rows(call(1, 8, 8192, 8192, 96));
    ++failures;
    std::printf("FAIL FLASH_ATTN_FWD_TALL_ROWS=yes accepted\n");
  } catch (const std::invalid_argument&) {
  }
  unsetenv(flash::kFwdTallRowsEnv);

  std::printf("%d cases, %d failures\n", cases, failures);
  return failures == 0 ? 0 : 1;
}
