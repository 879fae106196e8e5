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

// The operand forms the attention kernels use.
enum class WgmmaForm {
  kSharedKMajor,    // a (M, K) and b (N, K) row-major, both K-major from shared memory: d = a.b^T (S = Q.K^T)
  kRegistersA,      // a (M, K) from registers in the accumulator-shaped fragment, b (K, N) row-major read MN-major:
                    // d = a.b (O += P.V)
  kSharedMnMajor,   // a (K, M) and b (K, N) row-major, both MN-major from shared memory: d = a^T.b (dQ = dS.K from
                    // the backward's dS^T tile)
};

// d (64 x 64 fp32, row-major) from 64 x 64 operands of `dtype` (kFloat16 or kBFloat16) in `form`. Returns false where
// the loaded code lacks sm_90a, launching nothing.
bool wgmma_tile(DType dtype, WgmmaForm form, const void* a, const void* b, float* d, int code_arch, void* stream);

}  // namespace flash::sm90::selftest
