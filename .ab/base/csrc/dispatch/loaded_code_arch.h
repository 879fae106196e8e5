// loaded_code(device): the architecture the extension's kernels were compiled for, as the driver loaded them on
// one device (90 for sm_90 SASS; 80 when it JIT-compiled compute_80 PTX, e.g. on sm_100 or in a PTX-only build).
// Host code gates sm90-only device code (TMA, programmatic dependent launch, bulk reductions) on this, not on the
// GPU's capability: a kernel from compute_80 PTX has none of that code even on a Hopper or Blackwell GPU.
#pragma once

namespace flash {

struct LoadedCode {
  int code_arch = 0;    // the virtual arch the code was compiled for (__CUDA_ARCH__ / 10): what device code exists
  int binary_arch = 0;  // the SASS the GPU runs: the device's own arch where the driver JIT-compiled PTX
};

// Zeros when no kernel image can be loaded on `device` (a GPU older than every compiled target).
LoadedCode loaded_code(int device);

}  // namespace flash
