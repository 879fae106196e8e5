// Check of csrc/include/flash_attn/common/fast_divmod.h against `/` and `%` on the CPU (the helper is host/device),
// run by tests/test_fast_divmod.py: every divisor up to 4096, powers of two and their neighbours up to 2^31 - 1, and
// random divisors, each with the numerators around its multiples, around 2^31 - 1, and random ones below 2^31.
// Prints one line per failure (the first 20) and a summary; exits 1 on any failure.
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "flash_attn/common/fast_divmod.h"

namespace {

int failures = 0;
int64_t checked = 0;

void check_one(int64_t n, int64_t d, const flash::FastDivmod& f) {
  ++checked;
  const int64_t q = flash::fast_div(n, f);
  const int64_t r = flash::fast_mod(n, q, f);
  if (q != n / d || r != n % d) {
    if (++failures <= 20) {
      std::printf("FAIL n %lld d %lld: %lld r %lld, expected %lld r %lld\n", static_cast<long long>(n),
                  static_cast<long long>(d), static_cast<long long>(q), static_cast<long long>(r),
                  static_cast<long long>(n / d), static_cast<long long>(n % d));
    }
  }
}

void check_divisor(int64_t d, std::mt19937_64& rng) {
  const flash::FastDivmod f = flash::make_fast_divmod(d);
  const int64_t limit = flash::kFastDivmodLimit;
  std::vector<int64_t> numerators = {0, 1, 2, d - 1, d, d + 1, 2 * d - 1, 2 * d, limit - 1, limit - 2,
                                     (limit - 1) / d * d, (limit - 1) / d * d - 1};
  for (int i = 0; i < 64; ++i) numerators.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(limit)));
  for (int i = 0; i < 16; ++i) {
    const int64_t multiple = static_cast<int64_t>(rng() % static_cast<uint64_t>((limit - 1) / d + 1)) * d;
    numerators.push_back(multiple);
    numerators.push_back(multiple - 1);
    numerators.push_back(multiple + d - 1);
  }
  for (int64_t n : numerators) {
    if (n >= 0 && n < limit) check_one(n, d, f);
  }
}

}  // namespace

int main() {
  std::mt19937_64 rng(31);
  int divisors = 0;
  for (int64_t d = 1; d <= 4096; ++d, ++divisors) check_divisor(d, rng);
  for (int shift = 12; shift < 31; ++shift) {
    for (int64_t d : {(int64_t{1} << shift) - 1, int64_t{1} << shift, (int64_t{1} << shift) + 1}) {
      check_divisor(d, rng);
      ++divisors;
    }
  }
  check_divisor(flash::kFastDivmodLimit - 1, rng);
  ++divisors;
  for (int i = 0; i < 2000; ++i, ++divisors) {
    check_divisor(1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(flash::kFastDivmodLimit - 1)), rng);
  }
  // Every numerator below 2^20 for a few divisors of each size.
  for (int64_t d : {int64_t{1}, int64_t{3}, int64_t{7}, int64_t{132}, int64_t{641}, int64_t{65535}, int64_t{1000003}}) {
    const flash::FastDivmod f = flash::make_fast_divmod(d);
    for (int64_t n = 0; n < (int64_t{1} << 20); ++n) check_one(n, d, f);
  }
  std::printf("%d divisors, %lld numerators, %d failures\n", divisors, static_cast<long long>(checked), failures);
  return failures ? 1 : 0;
}
