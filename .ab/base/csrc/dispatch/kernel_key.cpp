// canonical_key() and the names of the key's parts (see flash_attn/kernel_key.h): the only place a call's head dim,
// mask and window become a table key, so the registry, the launchers and the capability answers agree.
#include "flash_attn/kernel_key.h"

#include "kernels/generated/kernel_table.h"
#include "sm90_policy.h"

namespace flash {

int head_dim_bucket(int64_t head_dim) {
  for (int bucket : kHeadDimBuckets) {
    if (head_dim <= bucket) return bucket;
  }
  return 0;
}

KernelKey canonical_key(int arch, const FwdParams& params, Direction direction) {
  KernelKey key;
  key.arch = arch;
  key.dtype = params.dtype;
  // The Hopper kernels come in their own buckets (sm90_policy.h).
  constexpr int kHopperArch = 90;
  const int bucket = head_dim_bucket(params.shape.head_dim);
  key.head_dim = arch == kHopperArch && bucket > 0 ? sm90_head_dim_bucket(params.shape.head_dim) : bucket;
  key.mask = mask_kind(params.mask);
  key.direction = direction;
  return key;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return "fp16";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat32: return "fp32";
    case DType::kFloat64: return "fp64";
  }
  return "?";
}

const char* mask_name(MaskKind mask) {
  switch (mask) {
    case MaskKind::kNone: return "none";
    case MaskKind::kCausal: return "causal";
    case MaskKind::kLocal: return "local";
  }
  return "?";
}

const char* direction_name(Direction direction) {
  return direction == Direction::kForward ? "fwd" : "bwd";
}

std::string describe(const KernelKey& key) {
  return std::string(direction_name(key.direction)) + " sm" + std::to_string(key.arch) + " " +
         dtype_name(key.dtype) + " hdim" + std::to_string(key.head_dim) + " mask=" + mask_name(key.mask);
}

}  // namespace flash
