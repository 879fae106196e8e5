// Shared-memory caps from the environment (FLASH_ATTN_FWD_SMEM_LIMIT, FLASH_ATTN_BWD_SMEM_LIMIT): the launchers
// then pick the tiles a GPU with that much shared memory per block would get (an A100: 166912 bytes, sm86/sm89:
// 101376), so a Hopper GPU can run and test them. Read on every call (~100 ns), so a test can set one just before
// a call. Plain C++ (no CUDA headers): the host planner and the kernel launchers share it.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "sm80/fwd_tile_config.h"

namespace flash::sm80 {

constexpr const char* kFwdSmemLimitEnv = "FLASH_ATTN_FWD_SMEM_LIMIT";
constexpr const char* kBwdSmemLimitEnv = "FLASH_ATTN_BWD_SMEM_LIMIT";

// The cap set in `env` (bytes per block), at most device_bytes; device_bytes when `env` is unset or empty. `who`
// names the caller in the error for a value that is not a positive whole number.
inline int smem_limit_from_env(const char* env, const char* who, int device_bytes) {
  const char* text = std::getenv(env);
  if (text == nullptr || *text == '\0') return device_bytes;
  char* end = nullptr;
  errno = 0;
  const long long bytes = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || errno == ERANGE || bytes <= 0) {
    throw std::runtime_error(std::string(who) + ": environment variable " + env +
                             " must be a positive whole number of bytes (shared memory per block to assume, e.g. "
                             "101376); got '" + text + "'. Set it to a number or unset it.");
  }
  return static_cast<int>(std::min<long long>(bytes, device_bytes));
}

// The forward's view of the device under kFwdSmemLimitEnv: at most the cap per block, and per SM at most the cap
// plus the driver's per-CTA reserve (as on the GPUs the cap imitates: A100 163 + 1 KB, sm86/sm89 99 + 1 KB).
inline SmemLimits fwd_smem_limits(SmemLimits device) {
  const int per_block = smem_limit_from_env(kFwdSmemLimitEnv, "flash_attn forward", device.per_block_optin);
  if (per_block == device.per_block_optin) return device;
  return SmemLimits{per_block, std::min(device.per_sm, per_block + kSmemReservedPerCta)};
}

}  // namespace flash::sm80
