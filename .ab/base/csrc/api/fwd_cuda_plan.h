// Prepares a CUDA forward call's params after the checks: GQA decode packing and split-KV scratch
// (csrc/dispatch/fwd_plan.h decides; this file allocates through torch's caching allocator, so no host sync).
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "flash_attn/params.h"

namespace flash::api {

// Rewrites `p` for the kernel launch; `scratch` keeps the split buffers alive until the launch is queued.
// requested_splits: a caller's num_splits (0: the heuristic's choice).
void plan_cuda_fwd(FwdParams& p, const at::Tensor& q, std::vector<at::Tensor>& scratch, int64_t requested_splits);

// Whether the CUDA kernels read a paged call's pages in place on q's device (dispatch/fwd_plan.h fwd_reads_pages);
// false without CUDA.
bool cuda_fwd_reads_pages(const FwdParams& p, const at::Tensor& q);

// Whether the decode kernels on q's device write a call's appended rows themselves (dispatch/fwd_plan.h
// fwd_decode_takes_append); false without CUDA.
bool cuda_fwd_takes_append(const FwdParams& p, const at::Tensor& q);

}  // namespace flash::api
