// launch_rotary: the CUDA rotary embedding of flash_attn.layers.rotary and of flash_attn_with_kvcache's rotary_cos /
// rotary_sin, one fused kernel (rotary_kernel.cu) for every layout RotaryParams describes (dense or varlen, offsets
// from an int or a tensor, in place or not). Called by csrc/api/rotary_api.cpp.
#pragma once

#include "flash_attn/rotary_params.h"

namespace flash::sm80 {

// Launches on `stream` (a cudaStream_t). Returns false, launching nothing, for a dtype other than fp16, bf16, fp32.
bool launch_rotary(const RotaryParams& params, void* stream);

}  // namespace flash::sm80
