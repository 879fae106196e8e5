// KernelKey: what selects a compiled CUDA kernel (arch path, dtype, head-dim bucket, mask kind, direction),
// and canonical_key(), the one function that holds every folding rule from a call to a key (head dim
// rounded up to its bucket, window folded into a mask kind). The registry looks keys up in the table.
#pragma once

#include <cstdint>
#include <string>

#include "flash_attn/common/mask.h"
#include "flash_attn/params.h"

namespace flash {

struct KernelKey {
  int arch = 0;  // 80 for the portable sm80+ path, 90 for the Hopper path
  DType dtype = DType::kFloat16;
  int head_dim = 0;  // the bucket, not the call's head dim
  MaskKind mask = MaskKind::kNone;
  Direction direction = Direction::kForward;

  bool operator==(const KernelKey& other) const {
    return arch == other.arch && dtype == other.dtype && head_dim == other.head_dim && mask == other.mask &&
           direction == other.direction;
  }
};

// The head-dim bucket of a call: the smallest bucket >= head_dim, or 0 if head_dim exceeds every bucket.
int head_dim_bucket(int64_t head_dim);

KernelKey canonical_key(int arch, const FwdParams& params, Direction direction);

const char* dtype_name(DType dtype);
const char* mask_name(MaskKind mask);
const char* direction_name(Direction direction);
std::string describe(const KernelKey& key);

}  // namespace flash
