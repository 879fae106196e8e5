// Division by a divisor fixed for a launch as one multiply and a shift (Granlund and Montgomery, 1994), for a
// persistent kernel's per-tile index arithmetic: a 64-bit `/` or `%` by a run-time value compiles to ~20 instructions
// around a float reciprocal (I2F, MUFU.RCP, F2I, R2UR in a dependent chain), and the Hopper forward's masked tile order
// ran ~8 of them per tile. Host/device, so tests/cpp/fast_divmod_check.cpp checks it against `/` on the CPU.
#pragma once

#include <cstdint>

#include "flash_attn/common/host_device.h"

namespace flash {

// Numerators below 2^31, divisors in [1, 2^31): shift = 31 + ceil(log2 divisor) and multiplier = ceil(2^shift /
// divisor) < 2^32 make floor(n * multiplier / 2^shift) = floor(n / divisor) for every such n (the rounding error n *
// (multiplier - 2^shift / divisor) / 2^shift stays below 1 / divisor because n < 2^31 <= 2^shift / divisor).
constexpr int64_t kFastDivmodLimit = int64_t{1} << 31;

struct FastDivmod {
  uint32_t divisor;
  uint32_t multiplier;
  uint32_t shift;
};

// A divisor below 1 (an empty launch's counts) is taken as 1.
FLASH_HOST_DEVICE FastDivmod make_fast_divmod(int64_t divisor) {
  if (divisor < 1) divisor = 1;
  uint32_t log2_ceil = 0;
  while ((int64_t{1} << log2_ceil) < divisor) ++log2_ceil;
  const uint32_t shift = 31 + log2_ceil;
  const uint64_t multiplier = ((uint64_t{1} << shift) + static_cast<uint64_t>(divisor) - 1) / divisor;
  return FastDivmod{static_cast<uint32_t>(divisor), static_cast<uint32_t>(multiplier), shift};
}

// n / divisor for 0 <= n < kFastDivmodLimit.
FLASH_HOST_DEVICE int64_t fast_div(int64_t n, const FastDivmod& d) {
  return static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(n)) * d.multiplier) >> d.shift);
}

// n % divisor for 0 <= n < kFastDivmodLimit, given q = fast_div(n, d).
FLASH_HOST_DEVICE int64_t fast_mod(int64_t n, int64_t q, const FastDivmod& d) {
  return n - q * static_cast<int64_t>(d.divisor);
}

}  // namespace flash
