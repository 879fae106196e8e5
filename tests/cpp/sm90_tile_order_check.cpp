// Check of csrc/sm90/tile_order.h on random launches (no GPU: the order is host/device), run by
// tests/test_sm90_tile_order.py. For each (CTAs, query blocks, head-batches) and both orders: every rank maps to a
// distinct tile in range; CTA c's work (its ranks c, c + G, ..., each tile weighing its causal key blocks, m + 1) is
// within one longest tile (or 1 %) of the mean; and in chunks, each chunk's tiles come from a run of head-batches
// no longer than its tiles spread over whole head-batches, plus one. And tile_coordinates (multiplies and shifts)
// against the walk's `/` and `%` form, on every index of small launches and on samples of launches near 2^31 tiles.
// Prints one line per failure and a summary; exits 1 on any failure.
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
  const flash::sm90::TileOrderDivisors div = flash::sm90::make_tile_order_divisors(ctas, tiles, m_blocks);
  for (int64_t rank = 0; rank < tiles; ++rank) {
    const flash::sm90::MaskedTile t = flash::sm90::masked_tile_at(rank, tiles, m_blocks, div, chunks);
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
      const flash::sm90::MaskedTile t = flash::sm90::masked_tile_at(rank, tiles, m_blocks, div, chunks);
      lo = t.head_batch < lo ? t.head_batch : lo;
      hi = t.head_batch > hi ? t.head_batch : hi;
    }
    if (hi - lo + 1 > (end - first + m_blocks - 1) / m_blocks + 1) {
      fail("chunk spread", ctas, m_blocks, head_batches, chunks, first);
    }
    if (last_chunk) break;
  }
}


// The walk as it was written before its divisions became multiplies and shifts (`/` and `%` on 64-bit values): the
// reference tile_coordinates must reproduce exactly.
flash::sm90::MaskedTile reference_masked_tile_at(int64_t rank, int64_t ctas, int64_t num_tiles, int num_m_blocks,
                                                 bool in_chunks) {
  const int64_t round_start = rank / ctas * ctas;
  if ((rank / ctas) % 2 == 1 && round_start + ctas <= num_tiles) rank = round_start + ctas - 1 - (rank - round_start);
  const int64_t m_blocks = num_m_blocks;
  flash::sm90::MaskedTile tile;
  if (!in_chunks) {
    const int64_t head_batches = num_tiles / m_blocks;
    tile.m_block = num_m_blocks - 1 - static_cast<int>(rank / head_batches);
    tile.head_batch = rank % head_batches;
    return tile;
  }
  const int64_t chunk = 2 * ctas;
  const int64_t whole_chunks = num_tiles / chunk;
  const int64_t k = rank / chunk;
  const bool last = k >= whole_chunks - 1;
  const int64_t first = (last ? (whole_chunks > 1 ? whole_chunks - 1 : 0) : k) * chunk;
  const int64_t end = last ? num_tiles : first + chunk;
  const int64_t h0 = first / m_blocks;
  const int64_t h1 = (end - 1) / m_blocks;
  const int64_t top0 = m_blocks - 1 - first % m_blocks;
  const int64_t bot1 = m_blocks - 1 - (end - 1) % m_blocks;
  const int64_t j = rank - first;
  int64_t lo = 0;
  int64_t hi = m_blocks - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (flash::sm90::chunk_tiles_from(mid, m_blocks, h0, h1, top0, bot1) > j) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t before = lo + 1 < m_blocks ? flash::sm90::chunk_tiles_from(lo + 1, m_blocks, h0, h1, top0, bot1) : 0;
  tile.m_block = static_cast<int>(lo);
  tile.head_batch = h0 + (lo > top0 ? 1 : 0) + (j - before);
  return tile;
}

int coordinate_cases = 0;

// tile_coordinates against the reference for `indices` (every index of a small launch, a sample of a large one).
void check_coordinates(int64_t ctas, int m_blocks, int splits, int head_groups, int64_t batch,
                       const std::vector<int64_t>& indices) {
  using flash::sm90::TileWalk;
  ++coordinate_cases;
  const int64_t tiles = int64_t{m_blocks} * splits * head_groups * batch;
  const flash::sm90::TileWalkDivisors div =
      flash::sm90::make_tile_walk_divisors(ctas, tiles, m_blocks, splits, head_groups);
  for (TileWalk walk : {TileWalk::kInOrder, TileWalk::kLastFirst, TileWalk::kLongestFirst,
                        TileWalk::kLongestFirstInChunks}) {
    for (int64_t index : indices) {
      const flash::sm90::TileCoordinates got =
          flash::sm90::tile_coordinates(index, tiles, m_blocks, div, walk, splits > 1);
      int64_t m_block;
      int64_t split_head_batch;
      if (walk == TileWalk::kInOrder || walk == TileWalk::kLastFirst) {
        m_block = walk == TileWalk::kInOrder ? index % m_blocks : m_blocks - 1 - index % m_blocks;
        split_head_batch = index / m_blocks;
      } else {
        const flash::sm90::MaskedTile t =
            reference_masked_tile_at(index, ctas, tiles, m_blocks, walk == TileWalk::kLongestFirstInChunks);
        m_block = t.m_block;
        split_head_batch = t.head_batch;
      }
      const int64_t split = splits > 1 ? split_head_batch % splits : 0;
      const int64_t head_batch = splits > 1 ? split_head_batch / splits : split_head_batch;
      if (got.m_block != m_block || got.split != split || got.head_group != head_batch % head_groups ||
          got.batch != head_batch / head_groups) {
        fail("coordinates differ from / and %", ctas, m_blocks, head_groups * batch, static_cast<int>(walk), index);
        return;
      }
    }
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
  // tile_coordinates: every index of 300 small launches, and 20,000 random indices of launches near 2^31 tiles.
  for (int i = 0; i < 300; ++i) {
    const int64_t ctas = 1 + static_cast<int64_t>(rng() % 140);
    const int m_blocks = 1 + static_cast<int>(rng() % 40);
    const int splits = rng() % 2 ? 1 : 2 + static_cast<int>(rng() % 7);
    const int head_groups = 1 + static_cast<int>(rng() % 48);
    const int64_t batch = 1 + static_cast<int64_t>(rng() % 9);
    std::vector<int64_t> all(static_cast<size_t>(int64_t{m_blocks} * splits * head_groups * batch));
    for (size_t k = 0; k < all.size(); ++k) all[k] = static_cast<int64_t>(k);
    check_coordinates(ctas, m_blocks, splits, head_groups, batch, all);
  }
  const int64_t large[][5] = {{132, 512, 1, 128, 32767}, {132, 4096, 1, 64, 8191}, {264, 33, 3, 127, 170000},
                              {1, 256, 1, 128, 65535}, {131, 1, 1, 65535, 32767}};
  for (const auto& l : large) {
    const int64_t tiles = l[1] * l[2] * l[3] * l[4];
    if (tiles >= flash::kFastDivmodLimit) fail("large launch past 2^31 tiles", l[0], int(l[1]), l[3] * l[4], 0, tiles);
    std::vector<int64_t> sample = {0, 1, tiles - 1, tiles - 2, tiles / 2};
    for (int k = 0; k < 4000; ++k) sample.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(tiles)));
    check_coordinates(l[0], static_cast<int>(l[1]), static_cast<int>(l[2]), static_cast<int>(l[3]), l[4], sample);
  }
  std::printf("%d coordinate launches, ", coordinate_cases);
  std::printf("%d cases, %d failures\n", cases, failures);
  return failures ? 1 : 0;
}
