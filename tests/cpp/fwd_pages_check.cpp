// Host check of the CUDA forward's plan for decode calls (dispatch/fwd_plan.cpp), run by tests/test_fwd_pages_policy.py:
// which paged calls read pages in place (fwd_reads_pages: lean decode calls with pages of whole 32-key blocks or of a
// power of two within one), the split counts (choose_fwd_num_splits, with appended keys too), which appends the decode
// kernels write (fwd_decode_takes_append), which splits meet in a cluster (fwd_splits_meet_in_cluster) and which calls
// take the key-warps decode tile (fwd_decode_takes_key_warps).
#include <cstdint>
#include <cstdio>
#include <initializer_list>

#include "dispatch/fwd_plan.h"

namespace {

// The H200's shared memory: 227 KB per block (opt-in), 228 KB per SM.
constexpr flash::sm80::SmemLimits kH200{232448, 233472};
const int32_t kTable[1] = {0};  // only its address is read: the plan never dereferences device pointers

flash::FwdParams decode_call(int64_t nheads_q, int64_t nheads_k, int64_t seqlen_q, int page_size) {
  flash::FwdParams p;
  p.dtype = flash::DType::kBFloat16;
  p.shape.batch = 4;
  p.shape.nheads_q = nheads_q;
  p.shape.nheads_k = nheads_k;
  p.shape.seqlen_q = seqlen_q;
  p.shape.seqlen_k = 8192;
  p.shape.head_dim = 128;
  p.softmax_scale = 0.088;
  p.lse_head_stride = seqlen_q;  // the dense lse (batch, nheads, seqlen_q)
  p.mask.window_left = -1;
  p.mask.window_right = -1;
  p.block_table = kTable;
  p.page_size = page_size;
  return p;
}

int failures = 0;
int cases = 0;

// One yes / no policy answer `got` for call p against the expected one.
void expect_answer(const char* what, const flash::FwdParams& p, bool got, bool want) {
  ++cases;
  if (got != want) {
    ++failures;
    std::printf("FAIL %s: page_size %d, heads %ld/%ld, seqlen_q %ld: want %d\n", what, p.page_size,
                long(p.shape.nheads_q), long(p.shape.nheads_k), long(p.shape.seqlen_q), int(want));
  }
}

// Whether the decode kernels read a call's pages in place (fwd_reads_pages).
void expect(const char* what, const flash::FwdParams& p, bool want) {
  expect_answer(what, p, flash::fwd_reads_pages(p, kH200), want);
}

// The split count choose_fwd_num_splits plans for a GQA 32/8 decode call (packed as the CUDA plan packs it) on the
// H200's 132 SMs: contiguous caches at two CTAs per SM, paged ones at every resident CTA (four decode CTAs).
// appended: keys appended in the call (AttentionShape::appended_keys), whose rows get a split of their own where the
// plan has at least 8 splits.
// key_warps: planned for the key-warps decode tile (FwdParams::decode_key_warps), one CTA per SM.
constexpr int kH200Sms = 132;
void expect_splits(const char* what, int64_t batch, int64_t seqlen_k, bool paged, int want, int64_t appended = 0,
                   bool key_warps = false) {
  ++cases;
  flash::FwdParams p = decode_call(32, 8, 1, 16);
  p.shape.batch = batch;
  p.shape.seqlen_k = seqlen_k;
  p.shape.appended_keys = appended;
  if (!paged) p.block_table = nullptr;
  flash::pack_gqa_decode(p);
  p.decode_key_warps = key_warps;
  const int got = flash::choose_fwd_num_splits(p, kH200Sms, kH200);
  if (got != want) {
    ++failures;
    std::printf("FAIL %s: batch %ld, keys %ld, paged %d: %d splits, want %d\n", what, long(batch), long(seqlen_k),
                int(paged), got, want);
  }
}

// Whether the decode kernels write a call's appended rows themselves (fwd_decode_takes_append).
void expect_append(const char* what, const flash::FwdParams& p, bool want) {
  expect_answer(what, p, flash::fwd_decode_takes_append(p, kH200), want);
}

// Whether a GQA 32/8 decode call of `batch` sequences takes the key-warps decode tile (fwd_decode_takes_key_warps).
void expect_key_warps(const char* what, flash::FwdParams p, int64_t batch, bool want) {
  p.shape.batch = batch;
  flash::pack_gqa_decode(p);
  expect_answer(what, p, flash::fwd_decode_takes_key_warps(p, kH200Sms, kH200), want);
}

// Whether a planned decode call merges its splits in a cluster (fwd_splits_meet_in_cluster) on code of `code_arch`.
void expect_cluster(const char* what, flash::FwdParams p, int num_splits, int code_arch, bool want) {
  flash::pack_gqa_decode(p);
  p.num_splits = num_splits;
  expect_answer(what, p, flash::fwd_splits_meet_in_cluster(p, code_arch, kH200), want);
}

}  // namespace

int main() {
  // 1 x 8k: 256 key tiles of 32 over 8 packed CTAs; 33 wanted at two per SM (32 after evening out), 66 at four (64).
  expect_splits("1 x 8k contiguous", 1, 8192, false, 32);
  expect_splits("1 x 8k paged", 1, 8192, true, 64);
  expect_splits("16 x 8k contiguous", 16, 8192, false, 2);
  expect_splits("16 x 8k paged", 16, 8192, true, 4);
  expect_splits("64 x 4k: 512 CTAs, no split", 64, 4096, false, 1);
  expect_splits("1 x 8k contiguous, one key appended: its own split", 1, 8192, false, 33, 1);
  expect_splits("1 x 128k contiguous, one key appended: its own split", 1, 131072, false, 34, 1);
  expect_splits("16 x 8k contiguous, one key appended: 2 splits, none more", 16, 8192, false, 2, 1);
  expect_splits("8 x 32k contiguous, one key appended: 4 splits, none more", 8, 32768, false, 4, 1);
  expect_splits("64 x 4k, one key appended: no split", 64, 4096, false, 1, 1);
  flash::FwdParams dense = decode_call(32, 8, 1, 16);
  dense.block_table = nullptr;
  // The key-warps tile: one 4-warp CTA per SM (226 KB at hd 128) for unsplit calls of 67-132 CTAs; its split plans
  // (num_splits asked for) give each warp at least 2 tiles.
  expect_key_warps("1 x 8k: 8 CTAs, split: the one-warp tile", dense, 1, false);
  expect_key_warps("8 x 32k: 64 CTAs, split: the one-warp tile", dense, 8, false);
  expect_key_warps("9 x 8k: 72 CTAs, unsplit", dense, 9, true);
  expect_key_warps("16 x 8k: 128 CTAs", dense, 16, true);
  expect_key_warps("17 x 8k: 136 CTAs, past one wave", dense, 17, false);
  expect_key_warps("64 x 4k: 512 CTAs, the one-warp tile", dense, 64, false);
  expect_key_warps("paged 16 x 8k", decode_call(32, 8, 1, 256), 16, true);
  flash::FwdParams capped_call = dense;
  capped_call.softcap = 30.0;
  expect_key_warps("softcap: the general kernel", capped_call, 16, false);
  flash::FwdParams wide = dense;
  wide.shape.head_dim = 256;
  expect_key_warps("hd 256: four groups do not fit", wide, 16, false);
  expect_splits("1 x 8k, key warps: 132 / 8 CTAs", 1, 8192, false, 16, 0, true);
  expect_splits("16 x 8k, key warps: no split", 16, 8192, false, 1, 0, true);
  expect_splits("8 x 32k, key warps: 2 splits", 8, 32768, false, 2, 0, true);
  expect_splits("1 x 128k, key warps", 1, 131072, false, 16, 0, true);
  expect_splits("1 x 8k, key warps, one key appended: no slot for a split of its own", 1, 8192, false, 16, 1, true);
  expect_append("GQA decode, contiguous: the kernel writes the new rows", dense, true);
  expect_append("GQA decode, pages of 256", decode_call(32, 8, 1, 256), true);
  expect_append("GQA decode, pages of 16: the append op", decode_call(32, 8, 1, 16), false);
  expect_append("MHA decode, pages of 32", decode_call(8, 8, 1, 32), true);
  flash::FwdParams window = decode_call(32, 8, 1, 256);
  window.mask.window_left = 100;  // not packed: four CTAs share a kv head
  expect_append("GQA decode with a window", window, false);
  flash::FwdParams capped = decode_call(32, 8, 1, 256);
  capped.softcap = 30.0;
  expect_append("softcap: the general kernel", capped, false);
  expect_cluster("GQA decode, sm90, 2 splits: they meet in a cluster", dense, 2, 90, true);
  expect_cluster("paged GQA decode, sm90, 2 splits", decode_call(32, 8, 1, 16), 2, 90, true);
  expect_cluster("GQA decode, sm80 code: the combine kernel", dense, 2, 80, false);
  expect_cluster("softcap: the general kernel's splits take the combine kernel", capped, 2, 90, false);
  expect_cluster("prefill chunk: the standard tile", decode_call(8, 8, 64, 256), 2, 90, false);
  flash::FwdParams key_warps = dense;
  key_warps.decode_key_warps = true;
  expect_cluster("key-warps tile: the combine kernel", key_warps, 2, 90, false);
  for (int splits : {1, 3, 4, 8, 32}) {
    expect_cluster("1 or more than 2 splits: no cluster", dense, splits, 90, false);
  }
  for (int page_size : {32, 64, 96, 256, 4096}) {
    expect("GQA decode, whole-block pages", decode_call(32, 8, 1, page_size), true);
    expect("MHA decode, whole-block pages", decode_call(8, 8, 1, page_size), true);
    expect("speculative 4-token step", decode_call(16, 4, 4, page_size), true);
    expect("MQA 32/1: 32 packed rows, the standard tile", decode_call(32, 1, 1, page_size), false);
    expect("prefill chunk", decode_call(8, 8, 64, page_size), false);
    flash::FwdParams softcap = decode_call(32, 8, 1, page_size);
    softcap.softcap = 30.0;
    expect("softcap: the general kernel", softcap, false);
    flash::FwdParams no_table = decode_call(32, 8, 1, page_size);
    no_table.block_table = nullptr;
    expect("no block table", no_table, false);
    flash::FwdParams probs = decode_call(32, 8, 1, page_size);
    int probs_buffer = 0;
    probs.probs = &probs_buffer;
    expect("returned probabilities", probs, false);
  }
  for (int page_size : {1, 2, 16}) {
    expect("pages of a power of two rows within a block", decode_call(32, 8, 1, page_size), true);
  }
  for (int page_size : {5, 7, 31, 48, 100}) {
    expect("pages that do not divide a block or hold whole blocks", decode_call(32, 8, 1, page_size), false);
  }
  std::printf("%d cases, %d failures\n", cases, failures);
  return failures == 0 ? 0 : 1;
}
