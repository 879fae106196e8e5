// The CPU rotary embedding (flash_attn.layers.rotary and the kvcache's rotary_cos / rotary_sin): RotaryParams rows
// rotated in parallel over (batch, row) with at::parallel_for, in float (double for float64 inputs).
#pragma once

#include "flash_attn/rotary_params.h"

namespace flash::cpu {

void run_rotary(const RotaryParams& params);

}  // namespace flash::cpu
