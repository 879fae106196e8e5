// fast_tanh(): tanh for softcap in device code as 1 - 2 / (2^(2x log2 e) + 1), through ex2.approx and a fast
// reciprocal (two MUFU ops, a clamp and three FMA-pipe ops; absolute error about 2e-7, so softcap x tanh stays within
// fp32 rounding of the exact value) instead of libdevice's tanhf (a branch and about 20 instructions). The clamp at
// |x| <= 15 keeps 2^(2x log2 e) finite and normal (tanh(15) rounds to 1 in fp32).
#pragma once

#include "flash_attn/common/math.h"

#if defined(__CUDACC__)
namespace flash {

constexpr float kTanhClamp = 15.f;

__device__ __forceinline__ float fast_tanh(float x) {
  const float clamped = fminf(fmaxf(x, -kTanhClamp), kTanhClamp);
  const float e = exp2f(clamped * static_cast<float>(2.0 * kLog2e));
  return 1.f - __fdividef(2.f, e + 1.f);
}

}  // namespace flash
#endif
