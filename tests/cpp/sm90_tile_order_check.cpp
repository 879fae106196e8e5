// Check of csrc/sm90/tile_order.h on random launches (no GPU: the order is host/device), run by
// tests/test_sm90_tile_order.py. For each (CTAs, query blocks, head-batches) and both orders: every rank maps to a
// distinct tile in range; CTA c's work (its ranks c, c + G, ..., each tile weighing its causal key blocks, m + 1) is
// within one longest tile (or 1 %) of the mean; and in chunks, each chunk's tiles come from a run of head-batches
// no longer than its tiles spread over whole head-batches, plus one. Prints one line per failure and a summary;
// exits 1 on any failure.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "sm90/tile_order.h"

namespace {

int failures = 0;

void fail(const char* what, int64_t ctas, int m_blocks, int64_t head_batches, bool chunks, int64_t value) {
  if (++failures <= 20) {
    std::printf("FAIL %s: ctas %ld m_blocks %d head_batches %ld chunks %d (%ld)\n", what, long(ctas), m_blocks,
                long(head_batches), int(chunks), long(value));
  }
}

void check(int64_t ctas, int m_blocks, int64_t head_batches, bool chunks) {
  const int64_t tiles = m_blocks * head_batches;
  std::vector<char> seen(tiles, 0);
  std::vector<int64_t> work(ctas, 0);
  int64_t total = 0;
  for (int64_t rank = 0; rank < tiles; ++rank) {
    const flash::sm90::MaskedTile t = flash::sm90::masked_tile_at(rank, ctas, tiles, m_blocks, chunks);
    if (t.m_block < 0 || t.m_block >= m_blocks || t.head_batch < 0 || t.head_batch >= head_batches) {
      fail("tile out of range", ctas, m_blocks, head_batches, chunks, rank);
      return;
    }
    const int64_t flat = t.head_batch * m_blocks + t.m_block;
    if (seen[flat]++) fail("tile taken twice", ctas, m_blocks, head_batches, chunks, rank);
    work[rank % ctas] += t.m_block + 1;
    total += t.m_block + 1;
  }
  // The busiest CTA: at most one longest tile (m_blocks key blocks, plus the rounding of the mean) or 1 % above the
  // mean (chunks of a few tiles that straddle two head-batches pair unevenly: 0.3 % at 6 CTAs, 23 query blocks).
  constexpr int64_t kSlackPercent = 1;
  for (int64_t c = 0; c < ctas; ++c) {
    const int64_t slack_sum = std::max<int64_t>((m_blocks + 1) * ctas, total * kSlackPercent / 100);
    if (work[c] * ctas > total + slack_sum) fail("CTA over the mean", ctas, m_blocks, head_batches, chunks, c);
  }
  if (!chunks) return;
  // Locality: the tiles of ranks [2kG, 2(k+1)G) (two rounds; the last chunk up to four) come from a run of
  // head-batches no longer than those tiles spread over whole head-batches, plus the two partial ends.
  const int64_t chunk = 2 * ctas;
  for (int64_t first = 0; first < tiles; first += chunk) {
    int64_t lo = head_batches;
    int64_t hi = -1;
    const bool last_chunk = tiles / chunk <= 1 || first / chunk >= tiles / chunk - 1;
    const int64_t end = last_chunk ? tiles : first + chunk;
    for (int64_t rank = first; rank < end; ++rank) {
      const flash::sm90::MaskedTile t = flash::sm90::masked_tile_at(rank, ctas, tiles, m_blocks, chunks);
      lo = t.head_batch < lo ? t.head_batch : lo;
      hi = t.head_batch > hi ? t.head_batch : hi;
    }
    if (hi - lo + 1 > (end - first + m_blocks - 1) / m_blocks + 1) {
      fail("chunk spread", ctas, m_blocks, head_batches, chunks, first);
    }
    if (last_chunk) break;
  }
}

}  // namespace

int main() {
  std::mt19937_64 rng(29);
  int cases = 0;
  const int64_t fixed[][3] = {{132, 4, 512}, {132, 8, 256}, {132, 16, 128}, {132, 11, 97}, {100, 8, 33}, {132, 8, 32}};
  for (const auto& f : fixed) {
    for (bool chunks : {false, true}) check(f[0], static_cast<int>(f[1]), f[2], chunks), ++cases;
  }
  while (cases < 600) {
    const int64_t ctas = 2 + static_cast<int64_t>(rng() % 140);
    const int m_blocks = 1 + static_cast<int>(rng() % 40);
    const int64_t head_batches = 1 + static_cast<int64_t>(rng() % 300);
    if (m_blocks * head_batches <= ctas) continue;  // a CTA per tile: the kernel takes the one-tile order
    for (bool chunks : {false, true}) check(ctas, m_blocks, head_batches, chunks), ++cases;
  }
  std::printf("%d cases, %d failures\n", cases, failures);
  return failures ? 1 : 0;
}
