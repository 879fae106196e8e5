// The order in which the Hopper forward's persistent CTAs walk masked (causal / local) tiles, host/device so that
// tests/test_sm90_tile_order.py checks on CPU that every tile is taken exactly once and that the CTAs' work evens out.
// Tiles are (query block, head-batch) pairs; CTA c of G takes linear ranks c, c + G, c + 2G, ... and a rank becomes a
// tile here.
#pragma once

#include <cstdint>

#include "flash_attn/common/fast_divmod.h"
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

// What the order divides by, fixed for a launch: each division is a multiply and a shift (common/fast_divmod.h), valid
// since the Hopper forward's plan keeps every tile count below 2^31 (dispatch/sm90_policy.cpp sm90_fwd_declines).
struct TileOrderDivisors {
  FastDivmod ctas;          // G, the launch's CTAs
  FastDivmod m_blocks;      // query blocks of a sequence
  FastDivmod head_batches;  // num_tiles / m_blocks
};
FLASH_HOST_DEVICE TileOrderDivisors make_tile_order_divisors(int64_t ctas, int64_t num_tiles, int num_m_blocks) {
  return TileOrderDivisors{make_fast_divmod(ctas), make_fast_divmod(num_m_blocks),
                           make_fast_divmod(num_tiles / (num_m_blocks > 0 ? num_m_blocks : 1))};
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
FLASH_HOST_DEVICE MaskedTile masked_tile_at(int64_t rank, int64_t num_tiles, int num_m_blocks,
                                            const TileOrderDivisors& div, bool in_chunks) {
  const int64_t ctas = div.ctas.divisor;
  const int64_t round = fast_div(rank, div.ctas);
  const int64_t round_start = round * ctas;
  if ((round & 1) == 1 && round_start + ctas <= num_tiles) {
    rank = round_start + ctas - 1 - (rank - round_start);
  }
  const int64_t m_blocks = num_m_blocks;
  MaskedTile tile;
  if (!in_chunks) {
    const int64_t m_rank = fast_div(rank, div.head_batches);
    tile.m_block = num_m_blocks - 1 - static_cast<int>(m_rank);
    tile.head_batch = fast_mod(rank, m_rank, div.head_batches);
    return tile;
  }
  // A chunk is two rounds, and a reversed rank stays in its round.
  const int64_t chunk = 2 * ctas;
  const int64_t whole_chunks = fast_div(num_tiles, div.ctas) >> 1;
  const int64_t k = round >> 1;
  const bool last = k >= whole_chunks - 1;  // the last chunk runs to the end (with fewer tiles than a chunk: all)
  const int64_t first = (last ? (whole_chunks > 1 ? whole_chunks - 1 : 0) : k) * chunk;
  const int64_t end = last ? num_tiles : first + chunk;
  const int64_t h0 = fast_div(first, div.m_blocks);
  const int64_t h1 = fast_div(end - 1, div.m_blocks);
  const int64_t top0 = m_blocks - 1 - fast_mod(first, h0, div.m_blocks);
  const int64_t bot1 = m_blocks - 1 - fast_mod(end - 1, h1, div.m_blocks);
  const int64_t j = rank - first;
  // The largest m whose tiles from m up outnumber j (chunk_tiles_from falls as m grows; at m = 0 it is end - first).
  int64_t lo = 0;
  int64_t hi = m_blocks - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
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

// How a persistent launch orders its tiles (fwd_kernel.h plan_tile): unmasked, query blocks in order; masked with a
// CTA per tile, each head's query blocks last first; masked with fewer CTAs, masked_tile_at's order, longest first
// across every head-batch or in chunks.
enum class TileWalk { kInOrder, kLastFirst, kLongestFirst, kLongestFirstInChunks };

// What a launch's tile walk divides by (fast_divmod.h): the order's, the key splits and the head groups (a packed
// tile's heads count as one group).
struct TileWalkDivisors {
  TileOrderDivisors order;
  FastDivmod splits;
  FastDivmod head_groups;
};
FLASH_HOST_DEVICE TileWalkDivisors make_tile_walk_divisors(int64_t ctas, int64_t num_tiles, int num_m_blocks,
                                                           int num_splits, int head_groups) {
  return TileWalkDivisors{make_tile_order_divisors(ctas, num_tiles, num_m_blocks), make_fast_divmod(num_splits),
                          make_fast_divmod(head_groups)};
}

struct TileCoordinates {
  int m_block;     // query block of the sequence
  int split;       // key split (0 without)
  int head_group;  // the tile's heads: head_group << pack_shift is its first
  int batch;
};

// Tile `index` of num_tiles = query blocks x key splits x head groups x batch entries (split: key splits > 1 counted
// in), query blocks fastest; exact while num_tiles < 2^31 (dispatch/sm90_policy.cpp declines larger calls).
// tests/cpp/sm90_tile_order_check.cpp compares it with `/` and `%` on random launches.
FLASH_HOST_DEVICE TileCoordinates tile_coordinates(int64_t index, int64_t num_tiles, int num_m_blocks,
                                                   const TileWalkDivisors& div, TileWalk walk, bool split) {
  TileCoordinates tile;
  int64_t split_head_batch;
  if (walk == TileWalk::kInOrder || walk == TileWalk::kLastFirst) {
    split_head_batch = fast_div(index, div.order.m_blocks);
    const int m_rank = static_cast<int>(fast_mod(index, split_head_batch, div.order.m_blocks));
    tile.m_block = walk == TileWalk::kInOrder ? m_rank : num_m_blocks - 1 - m_rank;
  } else {
    const MaskedTile masked =
        masked_tile_at(index, num_tiles, num_m_blocks, div.order, walk == TileWalk::kLongestFirstInChunks);
    tile.m_block = masked.m_block;
    split_head_batch = masked.head_batch;
  }
  int64_t head_batch = split_head_batch;
  tile.split = 0;
  if (split) {
    head_batch = fast_div(split_head_batch, div.splits);
    tile.split = static_cast<int>(fast_mod(split_head_batch, head_batch, div.splits));
  }
  const int64_t batch = fast_div(head_batch, div.head_groups);
  tile.head_group = static_cast<int>(fast_mod(head_batch, batch, div.head_groups));
  tile.batch = static_cast<int>(batch);
  return tile;
}

}  // namespace flash::sm90
