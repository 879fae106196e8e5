// Vectorised float32 row primitives (see row_ops.h). exp uses its own polynomial so the compiler can
// vectorise it: relative error <= 2e-7 over the float range, below the bf16/fp16 rounding of the inputs and
// of the same order as float32 rounding of the scores.
#include "row_ops.h"

#include <cmath>
#include <cstring>
#include <limits>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define FLASH_CPU_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FLASH_CPU_MULTIVERSION
#endif

namespace flash::cpu {
namespace {

constexpr float kLog2eF = 1.44269504088896341f;
// Below this exp(x) underflows float32 (smallest normal 2^-126); the result is flushed to 0.
constexpr float kExpUnderflow = -87.0f;
// Above this exp(x) overflows float32; scores are shifted by the row max, so only 0 is reached in practice.
constexpr float kExpOverflow = 88.0f;
constexpr int kFloatExponentBias = 127;
constexpr int kFloatMantissaBits = 23;
// Taylor coefficients ln(2)^k / k! of 2^f = e^(f ln 2), f in [-0.5, 0.5]; degree 6 keeps the error < 2e-7.
constexpr float kExp2Coeff[] = {1.0f,
                                0.693147180559945f,
                                0.240226506959101f,
                                0.0555041086648216f,
                                0.00961812910762848f,
                                0.00133335581464284f,
                                0.000154035303933816f};

inline float exp_poly(float x) {
  const float low_clamped = x > kExpUnderflow ? x : kExpUnderflow;
  const float clamped = low_clamped < kExpOverflow ? low_clamped : kExpOverflow;
  const float t = clamped * kLog2eF;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = kExp2Coeff[6];
  p = p * f + kExp2Coeff[5];
  p = p * f + kExp2Coeff[4];
  p = p * f + kExp2Coeff[3];
  p = p * f + kExp2Coeff[2];
  p = p * f + kExp2Coeff[1];
  p = p * f + kExp2Coeff[0];
  const int32_t bits = (static_cast<int32_t>(n) + kFloatExponentBias) << kFloatMantissaBits;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x < kExpUnderflow ? 0.0f : p * two_n;
}

}  // namespace

FLASH_CPU_MULTIVERSION float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

FLASH_CPU_MULTIVERSION float row_exp_sum(float* x, int64_t n, float shift) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float e = exp_poly(x[j] - shift);
    x[j] = e;
    sum += e;
  }
  return sum;
}

FLASH_CPU_MULTIVERSION void row_scale(float* x, int64_t n, float factor) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) x[j] *= factor;
}

}  // namespace flash::cpu
