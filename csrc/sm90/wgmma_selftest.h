// Host launcher of the one-tile self test of the wgmma wrappers (ptx/wgmma_sm90_generated.h, ptx/warpgroup_sm90.h),
// test-only: called through torch.ops.flash_attn._ptx_selftest("wgmma_ss" / "wgmma_rs") by tests/test_ptx_wrappers.py.
// One warpgroup stores the operands into 128-byte-swizzled shared tiles (the layout TMA writes), runs four k16 steps
// through descriptors, and writes the fp32 accumulators back by the documented fragment layout. No torch types here.
#pragma once

#include "flash_attn/params.h"

namespace flash::sm90::selftest {

constexpr int kWgmmaM = 64;  // one warpgroup's rows
constexpr int kWgmmaN = 64;
constexpr int kWgmmaK = 64;  // four k16 steps: one 128-byte swizzled line per row

// d (64 x 64 fp32, row-major) = a (64 x 64, row-major: K-major) times b, with `dtype` kFloat16 or kBFloat16 operands.
// a_in_registers false: both operands from shared memory, b given as (N, K) row-major (K-major) and d = a.b^T.
// a_in_registers true: a from registers in the accumulator-shaped fragment (as P in the forward), b given as (K, N)
// row-major and read MN-major (the transpose bit, as V), d = a.b. Returns false where the loaded code lacks sm_90a,
// launching nothing.
bool wgmma_tile(DType dtype, bool a_in_registers, const void* a, const void* b, float* d, int code_arch, void* stream);

}  // namespace flash::sm90::selftest
