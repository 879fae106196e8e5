// Named numeric constants shared by every backend.
#pragma once

namespace flash {

constexpr double kLog2e = 1.4426950408889634;  // log2(e): exp(x) == exp2(x * kLog2e)
constexpr double kLn2 = 0.6931471805599453;    // ln(2)

}  // namespace flash
