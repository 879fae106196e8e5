// The C++ CPU implementation of attention: the same tiled online-softmax algorithm as the GPU kernels,
// parallel over (batch, head, tile) with at::parallel_for, tile GEMMs through ATen's BLAS. Called by the
// dispatch layer with the plain params structs; never materialises a seqlen_q x seqlen_k matrix.
#pragma once

#include "flash_attn/params.h"

namespace flash::cpu {

void run_fwd(const FwdParams& params);
void run_bwd(const BwdParams& params);

}  // namespace flash::cpu
