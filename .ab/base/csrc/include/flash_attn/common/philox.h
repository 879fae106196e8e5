// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3") and the dropout keep rule
// built on it. Every backend uses this, so the backward regenerates the forward's mask from (seed, offset)
// alone and a seed reproduces bit for bit. Element (b, h, i, j) of the score matrix draws word j % 4 of
// philox(counter = {j / 4, i, b * nheads_q + h, offset}, key = seed).
#pragma once

#include <cstdint>

#include "flash_attn/common/host_device.h"

namespace flash {

constexpr uint32_t kPhiloxMul0 = 0xD2511F53u;
constexpr uint32_t kPhiloxMul1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxWeyl0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxWeyl1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;
// Each Philox call yields this many 32-bit words: one per consecutive key column.
constexpr int kPhiloxWordsPerCall = 4;

struct PhiloxBlock {
  uint32_t word[kPhiloxWordsPerCall];
};

FLASH_HOST_DEVICE PhiloxBlock philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                            uint32_t k1) {
  for (int round = 0; round < kPhiloxRounds; ++round) {
    if (round > 0) {
      k0 += kPhiloxWeyl0;
      k1 += kPhiloxWeyl1;
    }
    const uint64_t prod0 = static_cast<uint64_t>(kPhiloxMul0) * c0;
    const uint64_t prod1 = static_cast<uint64_t>(kPhiloxMul1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(prod0 >> 32), lo0 = static_cast<uint32_t>(prod0);
    const uint32_t hi1 = static_cast<uint32_t>(prod1 >> 32), lo1 = static_cast<uint32_t>(prod1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  return PhiloxBlock{{c0, c1, c2, c3}};
}

// The random words for 4 consecutive key columns starting at col4 * 4 of row `row` of (batch, head).
FLASH_HOST_DEVICE PhiloxBlock dropout_words(uint64_t seed, uint64_t offset, int64_t batch_head, int64_t row,
                                            int64_t col4) {
  return philox4x32_10(static_cast<uint32_t>(col4), static_cast<uint32_t>(row), static_cast<uint32_t>(batch_head),
                       static_cast<uint32_t>(offset), static_cast<uint32_t>(seed),
                       static_cast<uint32_t>(seed >> 32));
}

// An element is kept iff its word < threshold = floor((1 - p) * 2^32); 64-bit so p -> 0 cannot overflow.
FLASH_HOST_DEVICE uint64_t dropout_keep_threshold(double p) {
  constexpr double kTwoPow32 = 4294967296.0;
  return static_cast<uint64_t>((1.0 - p) * kTwoPow32);
}

}  // namespace flash
