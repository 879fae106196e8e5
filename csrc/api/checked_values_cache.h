// Value checks of small index tensors on a CUDA device (cu_seqlens, cache_seqlens, cache_batch_idx) at most once per
// tensor version: values_to_check() copies a tensor to the host (one synchronisation) unless the same tensor object,
// unmodified since, already passed the same requirement. Hugging Face passes one cu_seqlens tensor to every layer, so
// a 32-layer step synchronises once. Skipped under CUDA-graph capture and with FLASH_ATTN_CHECK_DEVICE_VALUES=0: the
// kernels clamp every value they read, so unchecked values can give wrong results but never touch other memory.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>

namespace flash::api {

// What a check depended on besides the values (which argument, the rows of the indexed tensor, a maximum): a tensor
// that passed under one requirement is checked again under another.
using Requirement = std::array<int64_t, 3>;

// Distinct first entries of Requirement per checked argument.
enum class CheckedArgument : int64_t { kCuSeqlensQ, kCuSeqlensK, kIndexRange, kRotaryCuSeqlens };

// The outcome of a remembered check: the last value (cu_seqlens[-1] says whether rows past it exist).
struct CheckedValues {
  int64_t last_value = 0;
};

// A CPU tensor (int32 or int64, contiguous) of `t`'s values for the caller to check, or nullopt when the check is
// skipped: remembered (`remembered` is then set), disabled, or impossible now (the current stream is capturing).
std::optional<at::Tensor> values_to_check(const at::Tensor& t, const Requirement& requirement,
                                          std::optional<CheckedValues>& remembered);

// Records that `t`, as it is now, passed `requirement`.
void remember_checked(const at::Tensor& t, const Requirement& requirement, CheckedValues values);

// Environment variable that turns the CUDA value checks off ("0"); read on every call.
constexpr const char* kCheckDeviceValuesEnv = "FLASH_ATTN_CHECK_DEVICE_VALUES";

}  // namespace flash::api
