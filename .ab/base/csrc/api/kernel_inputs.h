// The CUDA kernels' input contract (see params.h) applied to torch tensors: head dims padded to a multiple of
// 8 with zeros, tensors whose strides or base address do not qualify copied contiguous, and the padded
// outputs sliced back. CPU calls take any layout with a unit last stride and skip all of this.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "input_checks.h"

namespace flash::api {

// What the contract does to one tensor: use it as it is, copy it contiguous, or zero-pad its last dimension.
enum class InputAction { kUse, kCopy, kPad };

// head_dim rounded up to the head-dim multiple of the contract.
int64_t padded_head_dim(int64_t head_dim);

// The action for a q/k/v/out/dout tensor (last dimension = head dim) under the contract.
InputAction input_action(const at::Tensor& t);
std::string input_action_name(InputAction action);

// `t` meeting the contract: itself, a contiguous copy, or a contiguous zero-padded copy.
at::Tensor to_kernel_layout(const at::Tensor& t);

// A contract-shaped output (contiguous, head dim padded) back in the caller's head dim, contiguous.
at::Tensor from_kernel_layout(const at::Tensor& t, int64_t head_dim);

// The tensors a CUDA kernel reads, kept alive for the call.
struct KernelInputs {
  at::Tensor q, k, v;
  int64_t head_dim = 0;  // the caller's head dim (outputs are sliced back to it)
};

// Applies the contract to q, k, v of a checked CUDA call and points call.params at the results (pointers,
// strides, padded head dim). For CPU calls returns the tensors as given and leaves params unchanged.
KernelInputs prepare_kernel_inputs(CheckedCall& call, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v);

}  // namespace flash::api
