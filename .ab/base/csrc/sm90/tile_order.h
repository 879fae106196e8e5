// The order in which the Hopper forward's persistent CTAs walk masked (causal / local) tiles, host/device so that
// tests/test_sm90_tile_order.py checks on CPU that every tile is taken exactly once and that the CTAs' work evens out.
// Tiles are (query block, head-batch) pairs; CTA c of G takes linear ranks c, c + G, c + 2G, ... and a rank becomes a
// tile here.
#pragma once

#include <cstdint>

#include "flash_attn/common/host_device.h"

namespace flash::sm90 {

struct MaskedTile {
  int m_block;         // query block of the sequence
  int64_t head_batch;  // head + nheads * batch
};

// Tiles of a chunk of the head-major order (head-batch, then query blocks from the last down) whose query block is m or
// above: the chunk holds head-batches [h0, h1], the first from query block top0 down, the last from the top down to
// bot1.
FLASH_HOST_DEVICE int64_t chunk_tiles_from(int64_t m, int64_t m_blocks, int64_t h0, int64_t h1, int64_t top0,
                                           int64_t bot1) {
  const int64_t above_top0 = m_blocks - (m > top0 + 1 ? m : top0 + 1);
  const int64_t below_bot1 = (m_blocks < bot1 ? m_blocks : bot1) - m;
  return (m_blocks - m) * (h1 - h0 + 1) - (above_top0 > 0 ? above_top0 : 0) - (below_bot1 > 0 ? below_bot1 : 0);
}

// Rank -> tile. Odd whole rounds of G ranks run reversed, so a CTA's heavy tile of one round pairs with a light one of
// the next (a last, partial round keeps the plain order and every rank is still taken once).
// in_chunks false: longest first across every head-batch (query blocks from the last down); each head's K / V is then
// read once per query block, a round apart.
// in_chunks true (fwd_tile_config.h fwd_masked_tiles_in_chunks): the head-major order cut into chunks of two rounds (2G
// tiles; the last chunk also takes the remainder), each chunk's tiles longest first. The CTAs of two rounds then share
// the K / V of about 2G / num_m_blocks head-batches (~17 MB at hd 128), which stay in L2 for all their query blocks,
// and the pairing still evens out the work: a chunk's weights fall from its first rank to its last, and the remainder's
// lightest tiles run last (on 300 random launches the busiest CTA was within 0.43 of a longest tile of the order
// above).
FLASH_HOST_DEVICE MaskedTile masked_tile_at(int64_t rank, int64_t ctas, int64_t num_tiles, int num_m_blocks,
                                            bool in_chunks) {
  const int64_t round_start = rank / ctas * ctas;
  if ((rank / ctas) % 2 == 1 && round_start + ctas <= num_tiles) {
    rank = round_start + ctas - 1 - (rank - round_start);
  }
  const int64_t m_blocks = num_m_blocks;
  MaskedTile tile;
  if (!in_chunks) {
    const int64_t head_batches = num_tiles / m_blocks;
    tile.m_block = num_m_blocks - 1 - static_cast<int>(rank / head_batches);
    tile.head_batch = rank % head_batches;
    return tile;
  }
  const int64_t chunk = 2 * ctas;
  const int64_t whole_chunks = num_tiles / chunk;
  const int64_t k = rank / chunk;
  const bool last = k >= whole_chunks - 1;  // the last chunk runs to the end (with fewer tiles than a chunk: all)
  const int64_t first = (last ? (whole_chunks > 1 ? whole_chunks - 1 : 0) : k) * chunk;
  const int64_t end = last ? num_tiles : first + chunk;
  const int64_t h0 = first / m_blocks;
  const int64_t h1 = (end - 1) / m_blocks;
  const int64_t top0 = m_blocks - 1 - first % m_blocks;
  const int64_t bot1 = m_blocks - 1 - (end - 1) % m_blocks;
  const int64_t j = rank - first;
  // The largest m whose tiles from m up outnumber j (chunk_tiles_from falls as m grows; at m = 0 it is end - first).
  int64_t lo = 0;
  int64_t hi = m_blocks - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (chunk_tiles_from(mid, m_blocks, h0, h1, top0, bot1) > j) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t before = lo + 1 < m_blocks ? chunk_tiles_from(lo + 1, m_blocks, h0, h1, top0, bot1) : 0;
  tile.m_block = static_cast<int>(lo);
  tile.head_batch = h0 + (lo > top0 ? 1 : 0) + (j - before);
  return tile;
}

}  // namespace flash::sm90
