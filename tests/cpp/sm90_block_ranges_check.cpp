// Brute-force check of csrc/sm90/block_ranges.h on random shapes and masks (no GPU: the helpers are host/device), run
// by tests/test_sm90_block_ranges.py. For every query tile, key block and (query block, key block) pair, compares what
// the Hopper kernels would visit or leave unmasked with every (query, key) pair's visibility under common/mask.h's
// rule, and the ordered dQ's add order (every adder of a query block a distinct place). Prints one line per failure
// and a summary; exits 1 on any failure.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

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

// The kernels' per-element masks by local ranges (local_range): a forward row's visible keys and a backward key
// row's seeing queries, each relative to a block's first column as a thread holds it (column0 = block start + its
// quad offset), must accept exactly the visible (query, key) pairs of the block's columns.
void check_local_ranges(const MaskParams& mask, int64_t sq, int64_t sk, int width, std::mt19937& random) {
  const int64_t offset = flash::diagonal_offset(mask, sq, sk);
  for (int sample = 0; sample < 40; ++sample) {
    const int64_t row = static_cast<int64_t>(random() % (sq + 64));   // rows and keys past the sequences too
    const int64_t key = static_cast<int64_t>(random() % (sk + 64));
    const int quad = 2 * static_cast<int>(random() % 4);
    const int64_t key_block0 = static_cast<int64_t>(random() % (sk / width + 2)) * width;
    const int64_t query_block0 = static_cast<int64_t>(random() % (sq / width + 2)) * width;
    // Forward: row `row` against the keys of a block (the kernel drops rows past seqlen_q at the epilogue).
    flash::KeyRange keys = flash::visible_keys(mask, row, offset, sk);
    if (keys.end > sk) keys.end = sk;
    const flash::sm90::LocalRange fwd = flash::sm90::local_range(keys.begin, keys.end, key_block0 + quad, width);
    for (int c = 0; c + quad < width; ++c) {
      const int64_t col = key_block0 + quad + c;
      if (flash::sm90::in_local_range(fwd, c) != sees(mask, row, col, offset, sk)) {
        fail("forward local range", sq, sk, mask, row, col);
      }
    }
    // Backward: key `key` against the queries of a block (rows past seqlen_q see nothing).
    const flash::sm90::QueryRows rows = flash::sm90::rows_seeing_key(mask, key, offset, sq, sk);
    const flash::sm90::LocalRange bwd = flash::sm90::local_range(rows.begin, rows.end, query_block0 + quad, width);
    for (int c = 0; c + quad < width; ++c) {
      const int64_t q = query_block0 + quad + c;
      if (flash::sm90::in_local_range(bwd, c) != (q < sq && sees(mask, q, key, offset, sk))) {
        fail("backward local range", sq, sk, mask, q, key);
      }
    }
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

// The Hopper backward's ordered dQ (sm90/bwd_ordered_dq.h): key block n waits until its query block's counter shows as
// many adds as dq_adds_before counts, then adds. Every (walked head, query block) must be walked once by each key block
// that sees it (plan_key_block, step_query_block), and its adders' counts must be exactly 0, 1, ..., adders - 1: a
// repeated count would let two adds race (no fixed order) and a missing one would leave a CTA waiting for ever.
// Arrival order only where the launcher allows it; rotated walks only without a mask (bwd_launch.h).
void check_dq_order(const MaskParams& mask, int64_t sq, int64_t sk, int block_m, int block_n, int heads,
                    bool arrival_order) {
  const int64_t offset = flash::diagonal_offset(mask, sq, sk);
  const int seq_blocks = static_cast<int>((sk + block_n - 1) / block_n);
  const bool rotates = arrival_order && flash::mask_kind(mask) == flash::MaskKind::kNone;
  const int m_blocks = static_cast<int>((sq + block_m - 1) / block_m);
  std::vector<flash::sm90::BwdBlock> blocks;
  for (int n = 0; n < seq_blocks; ++n) {
    blocks.push_back(flash::sm90::plan_key_block(mask, n, block_m, block_n, sq, sk, offset, heads, seq_blocks, rotates));
  }
  // counts[(head, m)]: the counts its adders wait for; walks[(head, m)]: how many steps reached it, per key block.
  std::vector<std::vector<int>> counts(static_cast<size_t>(heads) * (m_blocks + 1));
  for (int n = 0; n < seq_blocks; ++n) {
    const flash::sm90::BwdBlock& block = blocks[n];
    std::vector<int> walked(static_cast<size_t>(heads) * (m_blocks + 1), 0);
    for (int i = 0; i < block.steps; ++i) {
      const int head = i / block.m_count;
      const int m = flash::sm90::step_query_block(block, i);
      if (m < block.m_min || m >= block.m_min + block.m_count || m >= m_blocks) {
        fail("dq step outside its key block's query blocks", sq, sk, mask, n, m);
        continue;
      }
      ++walked[static_cast<size_t>(head) * (m_blocks + 1) + m];
      int before = 0;
      for (int other = 0; other < seq_blocks; ++other) {
        before += flash::sm90::dq_adds_before(blocks[other], other, n, head, m, i, arrival_order);
      }
      counts[static_cast<size_t>(head) * (m_blocks + 1) + m].push_back(before);
    }
    for (int head = 0; head < heads; ++head) {
      for (int m = block.m_min; m < block.m_min + block.m_count && m < m_blocks; ++m) {
        if (walked[static_cast<size_t>(head) * (m_blocks + 1) + m] != 1) {
          fail("dq query block not walked exactly once", sq, sk, mask, n, m);
        }
      }
    }
  }
  // Fused dQ (bwd_ordered_dq.h): the adders a writer counts with dq_adds_into are those that walk the query block (its
  // last adder converts the sum), and a query block that no key block walks holds only rows that see no key (the
  // preprocess writes their dq = 0; nothing else does).
  for (int m = 0; m < m_blocks; ++m) {
    int adders = 0;
    for (int n = 0; n < seq_blocks; ++n) adders += flash::sm90::dq_adds_into(blocks[n], m);
    // The closed form of the adders (descending order's counts): exactly the key blocks whose walk reaches m.
    const flash::sm90::DqAdders range = flash::sm90::dq_adders_of(mask, m, block_m, block_n, sq, sk, offset);
    for (int n = 0; n < seq_blocks; ++n) {
      if (flash::sm90::dq_adds_into(blocks[n], m) != (n >= range.first && n < range.end)) {
        fail("dq_adders_of unlike the walks", sq, sk, mask, m, n);
        break;
      }
    }
    for (int head = 0; head < heads; ++head) {
      if (static_cast<int>(counts[static_cast<size_t>(head) * (m_blocks + 1) + m].size()) != adders) {
        fail("dq adders counted unlike the walks", sq, sk, mask, m, adders);
      }
    }
    for (int64_t row = int64_t{m} * block_m; adders == 0 && row < sq && row < int64_t{m + 1} * block_m; ++row) {
      const flash::KeyRange keys = flash::visible_keys(mask, row, offset, sk);
      if (keys.end > keys.begin) fail("dq query block with a row that sees keys but no adder", sq, sk, mask, m, row);
    }
  }
  for (auto& adders : counts) {
    std::sort(adders.begin(), adders.end());
    for (size_t k = 0; k < adders.size(); ++k) {
      if (adders[k] != static_cast<int>(k)) {
        fail(arrival_order ? "dq arrival-order counts not 0 .. adders - 1" : "dq descending counts not 0 .. adders - 1",
             sq, sk, mask, static_cast<int64_t>(k), adders[k]);
        break;
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
    // The backward's blocks: 64 query rows (hd 64: 128, sm90/bwd_tile_config.h), 128 keys (narrow kernel) or 64
    // (wide), 1-3 heads of a group per walk.
    const int block_m = random() % 2 == 0 ? 64 : 128;
    check_dq_order(mask, sq, sk, block_m, random() % 2 == 0 ? 128 : 64, 1 + random() % 3, random() % 2 == 0);
    check_local_ranges(mask, sq, sk, block_ns[random() % 6], random);
    ++cases;
  }
  std::printf("%d cases, %d failures\n", cases, failures);
  return failures == 0 ? 0 : 1;
}
