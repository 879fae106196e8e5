// Value checks of small index tensors on a CUDA device (cu_seqlens, cache_seqlens, cache_batch_idx) at most once per
// tensor version: values_to_check() copies a tensor to the host (one synchronisation) unless the same tensor object,
// unmodified since, already passed the same requirement (Hugging Face passes one cu_seqlens to every layer: one
// synchronisation per 32-layer step). Writes that bypass the version counter (Triton or raw CUDA kernels) go unseen.
// No check under CUDA-graph capture or with FLASH_ATTN_CHECK_DEVICE_VALUES=0; the kernels clamp every value they read,
// so unchecked values can give wrong results but never touch other memory.
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

// A contiguous CPU tensor of `t`'s values for the caller to check, or nullopt when the check is skipped: remembered,
// disabled, or impossible now (the current stream is capturing).
std::optional<at::Tensor> values_to_check(const at::Tensor& t, const Requirement& requirement);

// Whether `t`, as it is now, passed `requirement` in an earlier call (never for CPU tensors, checked every call).
bool remembered_check(const at::Tensor& t, const Requirement& requirement);

// Records that `t`, as it is now, passed `requirement`.
void remember_checked(const at::Tensor& t, const Requirement& requirement);

// Environment variable that turns the CUDA value checks off ("0"); read on every call.
constexpr const char* kCheckDeviceValuesEnv = "FLASH_ATTN_CHECK_DEVICE_VALUES";

}  // namespace flash::api
