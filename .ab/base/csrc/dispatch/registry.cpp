// The kernel table built from the generated FLASH_KERNEL_TABLE list, and lookups over it (registry.h). A key absent
// from the build is a null lookup, which the binding layer reports with missing_kernel_message (the knobs to set).
#include "registry.h"

#include <algorithm>
#include <type_traits>

#include "kernels/generated/kernel_table.h"
#include "sm90_policy.h"

namespace flash {
namespace {

constexpr int kHopperSm = 90;
constexpr int kAmpereSm = 80;

template <typename Launch>
FwdLaunch as_fwd(Launch launch, Direction direction) {
  if constexpr (std::is_same_v<Launch, FwdLaunch>) return direction == Direction::kForward ? launch : nullptr;
  return nullptr;
}
template <typename Launch>
BwdLaunch as_bwd(Launch launch, Direction direction) {
  if constexpr (std::is_same_v<Launch, BwdLaunch>) return direction == Direction::kBackward ? launch : nullptr;
  return nullptr;
}

constexpr Direction direction_of(const char* name) {
  return name[0] == 'f' ? Direction::kForward : Direction::kBackward;
}

// Whether the Hopper path may take this call (the kernel table still has to have its key).
bool hopper_path_allowed(int code_arch, const FwdParams& params, Direction direction, const BwdParams* bwd) {
  const HopperSwitch mode = hopper_switch();
  if (code_arch < kHopperSm || mode == HopperSwitch::kOff) return false;
  if (direction == Direction::kForward) {
    return sm90_fwd_declines(params) == nullptr && (mode == HopperSwitch::kForce || sm90_fwd_pays(params));
  }
  if (bwd == nullptr) return sm90_fwd_declines(params) == nullptr && mode == HopperSwitch::kForce;
  return sm90_bwd_declines(*bwd) == nullptr && (mode == HopperSwitch::kForce || sm90_bwd_pays(*bwd));
}

}  // namespace

const std::vector<KernelEntry>& kernel_table() {
#define FLASH_TABLE_ENTRY(arch_name, sm, dtype, head_dim, mask, direction, launch)                         \
  KernelEntry{KernelKey{sm, DType::dtype, head_dim, MaskKind::mask, direction_of(#direction)}, #launch,     \
              as_fwd(&launch, direction_of(#direction)), as_bwd(&launch, direction_of(#direction))},
  static const std::vector<KernelEntry> table{FLASH_KERNEL_TABLE(FLASH_TABLE_ENTRY)};
#undef FLASH_TABLE_ENTRY
  return table;
}

std::vector<int> arch_paths_for(int sm) {
  if (sm == kHopperSm) return {kHopperSm, kAmpereSm};
  if (sm >= kAmpereSm) return {kAmpereSm};
  return {};
}

const KernelEntry* find_kernel(int sm, int code_arch, const FwdParams& params, Direction direction,
                               const BwdParams* bwd) {
  for (int arch : arch_paths_for(sm)) {
    if (arch == kHopperSm && !hopper_path_allowed(code_arch, params, direction, bwd)) continue;
    const KernelKey key = canonical_key(arch, params, direction);
    for (const KernelEntry& entry : kernel_table()) {
      if (entry.key == key) return &entry;
    }
  }
  return nullptr;
}

std::string missing_kernel_message(int sm, const FwdParams& params, Direction direction) {
  std::string message = "flash_attn: no CUDA kernel for this call in this build (GPU sm" + std::to_string(sm) +
                        ", head dim " + std::to_string(params.shape.head_dim) + ", wanted: ";
  const std::vector<int> paths = arch_paths_for(sm);
  if (paths.empty()) {
    message += "a GPU of compute capability 8.0 or newer";
  } else {
    message += describe(canonical_key(paths.front(), params, direction));
  }
  message += "). Built CUDA kernels: ";
  if (kernel_table().empty()) {
    message += "none";
  } else {
    for (size_t i = 0; i < kernel_table().size(); ++i) {
      message += (i ? ", " : "") + describe(kernel_table()[i].key);
    }
  }
  message +=
      ". Rebuild with nvcc available and the build knobs covering this call (FLASH_ATTN_CUDA_ARCHS, "
      "FLASH_ATTN_HEAD_DIMS, FLASH_ATTN_DTYPES, FLASH_ATTN_MASKS, FLASH_ATTN_DIRECTIONS; see README), or run "
      "on CPU tensors.";
  return message;
}

bool cuda_supports(int sm, int code_arch, DType dtype, int64_t head_dim, bool backward) {
  FwdParams params;
  params.dtype = dtype;
  params.shape.head_dim = head_dim;
  if (head_dim < 1 || head_dim > kMaxHeadDim) return false;
  const int64_t windows[][2] = {{kUnboundedWindow, kUnboundedWindow}, {kUnboundedWindow, 0}, {1, 1}};
  for (const auto& window : windows) {
    params.mask.window_left = window[0];
    params.mask.window_right = window[1];
    if (find_kernel(sm, code_arch, params, Direction::kForward) == nullptr) return false;
    if (backward && find_kernel(sm, code_arch, params, Direction::kBackward) == nullptr) return false;
  }
  return true;
}

bool cpu_supports(DType dtype, int64_t head_dim) {
  (void)dtype;  // every DType has a CPU implementation
  return head_dim >= 1 && head_dim <= kMaxHeadDim;
}

}  // namespace flash
