// Named numeric constants shared by every backend (CPU, sm80, sm90), so that log2(e) and ln(2) have one spelling
// each and no kernel carries a bare literal for them.
#pragma once

namespace flash {

constexpr double kLog2e = 1.4426950408889634;  // log2(e): exp(x) == exp2(x * kLog2e)
constexpr double kLn2 = 0.6931471805599453;    // ln(2)

}  // namespace flash
