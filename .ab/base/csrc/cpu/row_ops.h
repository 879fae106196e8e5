// Vectorised float32 row primitives of the CPU path's online softmax: max, exp-and-sum, scale.
// Defined in row_ops.cpp, compiled once per x86-64 ISA level and picked at load time (target_clones),
// so one build runs at AVX-512 speed where the CPU has it and still runs on any x86-64.
#pragma once

#include <cstdint>

namespace flash::cpu {

// max(x[0..n)); -inf for n == 0 or an all -inf row.
float row_max(const float* x, int64_t n);

// x[j] = exp(x[j] - shift) in place (exactly 0 where x[j] is -inf); returns the sum of the new x.
float row_exp_sum(float* x, int64_t n, float shift);

// x[j] *= factor.
void row_scale(float* x, int64_t n, float factor);

}  // namespace flash::cpu
