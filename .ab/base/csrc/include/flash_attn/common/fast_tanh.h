// fast_tanh(): tanh for softcap in device code through the MUFU unit's tanh.approx.f32 (sm_75+): one instruction,
// relative error at most 2^-10.99 (PTX ISA), against libdevice's tanhf (a branch and about 20 instructions, two of
// them MUFU) or 1 - 2 / (2^(2x log2 e) + 1) (two MUFU ops). softcap x tanh then errs by at most |z| x 5e-4, an eighth
// of the bf16 rounding of the score z itself. Why it matters: with softcap each score already takes one MUFU exp, and
// the Hopper forward at hd 128 ran at 219 against 577 TFLOP/s without softcap on the two-MUFU form (H200, 4k tokens).
#pragma once

#if defined(__CUDACC__)
namespace flash {

__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace flash
#endif
