// exp2_polynomial(): 2^x for the softmax's x <= 0 on the FMA pipe instead of the MUFU unit (ex2.approx), for kernels
// whose exponentials bound them (HOPPER_NOTES.md section 7: at hd 64 one exp costs as much MUFU time as the score's
// tensor work). x = i + f with i rounded to nearest by the 1.5 * 2^23 trick and f in [-0.5, 0.5]; 2^f by a cubic fitted
// for relative error (max 7.5e-5 over [-100, 0] in an fp32 emulation, against bf16's 3.9e-3), 2^i added to the
// exponent field. Below -126 it returns 0, as ex2.approx.ftz flushes.
#pragma once

#if defined(__CUDACC__)
namespace flash {

constexpr float kRoundToIntegerMagic = 12582912.f;    // 1.5 * 2^23: x + it holds round(x) in its low mantissa bits
constexpr int kRoundToIntegerMagicBits = 0x4B400000;  // its bit pattern
constexpr int kFloatMantissaBits = 23;
constexpr float kExp2LowestNormal = -126.f;
constexpr float kExp2Cubic0 = 0.9999279f;  // 2^f ~ c0 + c1 f + c2 f^2 + c3 f^3 on [-0.5, 0.5]
constexpr float kExp2Cubic1 = 0.693261f;
constexpr float kExp2Cubic2 = 0.2426137f;
constexpr float kExp2Cubic3 = 0.05517259f;

__device__ __forceinline__ float exp2_polynomial(float x) {
  const float shifted = x + kRoundToIntegerMagic;
  const int whole = __float_as_int(shifted) - kRoundToIntegerMagicBits;
  const float fraction = x - (shifted - kRoundToIntegerMagic);
  const float cubic =
      fmaf(fmaf(fmaf(kExp2Cubic3, fraction, kExp2Cubic2), fraction, kExp2Cubic1), fraction, kExp2Cubic0);
  const float result = __int_as_float(__float_as_int(cubic) + (whole << kFloatMantissaBits));
  return x < kExp2LowestNormal ? 0.f : result;
}

}  // namespace flash
#endif
