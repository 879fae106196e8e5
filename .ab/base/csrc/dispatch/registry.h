// The kernel registry: the table of compiled CUDA kernels (generated from tools/kernel_matrix.py), lookup by
// KernelKey, and the capability answers flash_attn.built_kernels() / is_supported() give. No torch here.
#pragma once

#include <string>
#include <vector>

#include "flash_attn/kernel_key.h"
#include "flash_attn/params.h"

namespace flash {

using FwdLaunch = void (*)(const FwdParams&, void* stream);
using BwdLaunch = void (*)(const BwdParams&, void* stream);

struct KernelEntry {
  KernelKey key;
  const char* name;
  FwdLaunch fwd;  // set for forward kernels
  BwdLaunch bwd;  // set for backward kernels
};

const std::vector<KernelEntry>& kernel_table();

// The arch paths a GPU of compute capability `sm` (e.g. 90) can run, fastest first.
std::vector<int> arch_paths_for(int sm);

// The fastest built kernel for this call on a GPU of capability `sm` whose loaded code was compiled for `code_arch`
// (DeviceAttributes::code_arch), or null. The Hopper path is a candidate only where FLASH_ATTN_HOPPER allows it, the
// loaded code has its instructions (code_arch >= 90) and sm90_fwd_declines() / sm90_bwd_declines() accept the call
// (backward: `bwd` is the call; without it, capability queries, the forward part of the rules decides).
const KernelEntry* find_kernel(int sm, int code_arch, const FwdParams& params, Direction direction,
                               const BwdParams* bwd = nullptr);

// "no CUDA kernel for ..." with the key, what is built, and how to build more.
std::string missing_kernel_message(int sm, const FwdParams& params, Direction direction);

// Whether every mask kind is built for (sm, dtype, head_dim): forward, and backward too if asked.
bool cuda_supports(int sm, int code_arch, DType dtype, int64_t head_dim, bool backward);

// Head dims and dtypes the CPU implementation takes.
constexpr int64_t kMaxHeadDim = 256;
bool cpu_supports(DType dtype, int64_t head_dim);

}  // namespace flash
