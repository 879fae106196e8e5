// prepare_kernel_inputs() and the per-tensor contract actions (kernel_inputs.h). The copies and pads here are
// ordinary stream-ordered torch ops: no host synchronisation, so CUDA-graph capture still works.
#include "kernel_inputs.h"

#include <ATen/ATen.h>

#include <cstdint>

namespace flash::api {
namespace {

// The contract's numbers (params.h): 8 elements of 2 bytes = 16 bytes, the width of one vector load
// (cp.async / ldmatrix row / TMA stride granule).
constexpr int64_t kHeadDimMultiple = 8;
constexpr int64_t kStrideMultiple = 8;
constexpr uintptr_t kPointerAlignment = 16;

bool strides_qualify(const at::Tensor& t) {
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if (t.stride(d) % kStrideMultiple != 0) return false;
  }
  return t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % kPointerAlignment == 0;
}

}  // namespace

int64_t padded_head_dim(int64_t head_dim) {
  return (head_dim + kHeadDimMultiple - 1) / kHeadDimMultiple * kHeadDimMultiple;
}

InputAction input_action(const at::Tensor& t) {
  if (padded_head_dim(t.size(-1)) != t.size(-1)) return InputAction::kPad;
  return strides_qualify(t) ? InputAction::kUse : InputAction::kCopy;
}

std::string input_action_name(InputAction action) {
  switch (action) {
    case InputAction::kUse: return "use";
    case InputAction::kCopy: return "copy";
    case InputAction::kPad: return "pad";
  }
  return "unknown";
}

at::Tensor to_kernel_layout(const at::Tensor& t) {
  switch (input_action(t)) {
    case InputAction::kUse: return t;
    // clone, not contiguous(): a contiguous tensor can still start at an address that is not 16-byte aligned.
    case InputAction::kCopy: return t.clone(at::MemoryFormat::Contiguous);
    case InputAction::kPad:
      return at::constant_pad_nd(t, {0, padded_head_dim(t.size(-1)) - t.size(-1)}, 0.0).contiguous();
  }
  return t;
}

at::Tensor from_kernel_layout(const at::Tensor& t, int64_t head_dim) {
  if (t.size(-1) == head_dim) return t;
  // Contiguous so the result has the strides the fake (meta) implementation in flash_attn/ops.py promises.
  return t.narrow(-1, 0, head_dim).contiguous();
}

KernelInputs prepare_kernel_inputs(CheckedCall& call, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v) {
  KernelInputs inputs{q, k, v, q.size(-1)};
  if (!q.is_cuda()) return inputs;
  inputs.q = to_kernel_layout(q);
  inputs.k = to_kernel_layout(k);
  inputs.v = to_kernel_layout(v);
  FwdParams& p = call.params;
  p.shape.head_dim = inputs.q.size(-1);
  p.q = inputs.q.data_ptr();
  p.k = inputs.k.data_ptr();
  p.v = inputs.v.data_ptr();
  p.q_strides = strides_of(inputs.q, call.varlen);
  p.k_strides = strides_of(inputs.k, call.varlen);
  p.v_strides = strides_of(inputs.v, call.varlen);
  return inputs;
}

}  // namespace flash::api
