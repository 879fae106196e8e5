// launch_probs: writes the optional attention-probabilities output of a CUDA forward call (FwdParams::probs)
// after the forward kernel has written lse on the same stream. Called by csrc/api/flash_api.cpp when
// return_attn_probs=True; a debugging/testing output, computed by a plain (slow) kernel in probs_kernel.cu.
#pragma once

#include "flash_attn/params.h"

namespace flash::sm80 {

// Largest head dim the probabilities kernel stages in shared memory (the largest CUDA kernel bucket).
constexpr int kProbsMaxHeadDim = 256;

// Launches the kernel on `stream` (a cudaStream_t). Returns false, launching nothing, when params.dtype is
// not fp16/bf16 or the head dim exceeds kProbsMaxHeadDim.
bool launch_probs(const FwdParams& params, void* stream);

}  // namespace flash::sm80
