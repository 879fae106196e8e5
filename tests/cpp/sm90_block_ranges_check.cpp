// Brute-force check of csrc/sm90/block_ranges.h on random shapes and masks (no GPU: the helpers are host/device), run
// by tests/test_sm90_block_ranges.py. For every query tile, key block and (query block, key block) pair, compares what
// the Hopper kernels would visit or leave unmasked with every (query, key) pair's visibility under common/mask.h's
// rule. Prints one line per failure and a summary; exits 1 on any failure.
#include <cstdint>
#include <cstdio>
#include <random>

#include "flash_attn/bwd_workspace.h"
#include "sm90/block_ranges.h"

namespace {

using flash::KeyRange;
using flash::MaskParams;

bool sees(const MaskParams& mask, int64_t row, int64_t key, int64_t offset, int64_t seqlen_k) {
  const KeyRange keys = flash::visible_keys(mask, row, offset, seqlen_k);
  return key >= 0 && key < seqlen_k && key >= keys.begin && key < keys.end;
}

int failures = 0;

void fail(const char* what, int64_t sq, int64_t sk, const MaskParams& m, int64_t a, int64_t b) {
  if (++failures <= 20) {
    std::printf("FAIL %s: seqlen_q %ld seqlen_k %ld window (%ld, %ld) bottom_right %d at %ld, %ld\n", what, long(sq),
                long(sk), long(m.window_left), long(m.window_right), int(m.bottom_right), long(a), long(b));
  }
}

void check(const MaskParams& mask, int64_t sq, int64_t sk, int block_m, int block_n) {
  const int64_t offset = flash::diagonal_offset(mask, sq, sk);
  const bool masked_kind = flash::mask_kind(mask) != flash::MaskKind::kNone;
  // Forward: each query tile's key blocks cover every key its rows see; its whole blocks need no mask.
  for (int64_t row0 = 0; row0 < sq; row0 += block_m) {
    const flash::sm90::KeyBlocks blocks =
        flash::sm90::key_blocks_of_rows(mask, row0, block_m, sq, sk, offset, block_n);
    for (int64_t row = row0; row < row0 + block_m && row < sq; ++row) {
      for (int64_t key = 0; key < sk; ++key) {
        const int64_t n = key / block_n;
        if (sees(mask, row, key, offset, sk) && (n < blocks.n_min || n >= blocks.n_max)) {
          fail("fwd key outside [n_min, n_max)", sq, sk, mask, row, key);
        }
      }
      for (int64_t n = blocks.full_lo; n < blocks.full_hi; ++n) {
        for (int64_t key = n * block_n; key < (n + 1) * block_n; ++key) {
          if (!sees(mask, row, key, offset, sk)) fail("fwd unmasked block hides a masked key", sq, sk, mask, row, key);
        }
      }
    }
  }
  // Backward: each key block's query rows cover every row that sees one of its keys; unmasked pairs see everything.
  for (int64_t key0 = 0; key0 < sk; key0 += block_n) {
    const int64_t key1 = key0 + block_n < sk ? key0 + block_n : sk;
    const flash::sm90::QueryRows rows = flash::sm90::rows_seeing_keys(mask, key0, key1, offset, sq);
    for (int64_t row = 0; row < sq; ++row) {
      for (int64_t key = key0; key < key1; ++key) {
        if (sees(mask, row, key, offset, sk) && (row < rows.begin || row >= rows.end)) {
          fail("bwd row outside rows_seeing_keys", sq, sk, mask, row, key);
        }
      }
    }
    for (int64_t q0 = 0; q0 < sq; q0 += 64) {
      if (flash::sm90::block_pair_needs_mask(mask, masked_kind, q0, 64, key0, block_n, sq, sk, offset)) continue;
      for (int64_t row = q0; row < q0 + 64; ++row) {
        for (int64_t key = key0; key < key0 + block_n; ++key) {
          if (!sees(mask, row, key, offset, sk)) fail("bwd unmasked pair hides a masked key", sq, sk, mask, row, key);
        }
      }
    }
  }
}

// The Hopper backward adds a thread's dQ columns 8j + 2 (lane % 4) + e of j = 2g, 2g + 1 (e = 0, 1) with one 16-byte
// reduction at slots 4 (lane % 4) .. + 3 of slot group g (bwd_kernel.h): they must be the slots dq_slot() assigns
// those columns, in that order, or the dq conversion reads them back into the wrong columns.
void check_dq_slots() {
  for (int quad = 0; quad < 4; ++quad) {
    const int columns[4] = {2 * quad, 2 * quad + 1, 8 + 2 * quad, 8 + 2 * quad + 1};
    for (int v = 0; v < 4; ++v) {
      if (flash::dq_slot(columns[v]) != 4 * quad + v) {
        ++failures;
        std::printf("FAIL dq slot of column %d is %d, the reduction writes %d\n", columns[v],
                    flash::dq_slot(columns[v]), 4 * quad + v);
      }
    }
  }
}

}  // namespace

int main() {
  check_dq_slots();
  std::mt19937 random(20261201);
  const int block_ns[] = {64, 80, 112, 128, 176, 192};
  int cases = 0;
  for (int trial = 0; trial < 600; ++trial) {
    const int64_t sq = 1 + random() % 700;
    const int64_t sk = 1 + random() % 700;
    MaskParams mask;
    mask.bottom_right = random() % 4 != 0;
    switch (random() % 4) {
      case 0: break;  // no mask
      case 1: mask.window_right = 0; break;  // causal
      default:
        mask.window_left = random() % 3 == 0 ? flash::kUnboundedWindow : static_cast<int64_t>(random() % 400);
        mask.window_right = random() % 3 == 0 ? flash::kUnboundedWindow : static_cast<int64_t>(random() % 400);
    }
    check(mask, sq, sk, 128, block_ns[random() % 6]);
    ++cases;
  }
  std::printf("%d cases, %d failures\n", cases, failures);
  return failures == 0 ? 0 : 1;
}
