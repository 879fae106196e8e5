// rotary_kernel: one CTA per (sequence, row) rotates the row's heads and, when out is not x, copies the columns past
// rotary_dim (rotate_rows.h: 16-byte vectors where the row allows them). The rule per pair is common/rotary.h's, shared
// with the CPU implementation.
#include "sm80/rotary_kernel.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "flash_attn/common/rotary.h"
#include "sm80/kernel_common.h"
#include "sm80/rotate_rows.h"

namespace flash::sm80 {
namespace {

constexpr int kRotaryThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kRotaryThreads) rotary_kernel(const RotaryParams p) {
  const int64_t b = blockIdx.x / p.seqlen;
  const int64_t row = blockIdx.x % p.seqlen;
  const int64_t x_row = rotary_row_offset(p, p.x_strides, b, row);
  if (x_row < 0) return;
  const int64_t out_row = rotary_row_offset(p, p.out_strides, b, row);
  const int64_t position = rotary_position(p, b, row);
  HeadRow<T> heads;
  heads.src = static_cast<const T*>(p.x) + x_row;
  heads.dst = static_cast<T*>(p.out) + out_row;
  heads.src_head = p.x_strides.head;
  heads.dst_head = p.out_strides.head;
  heads.nheads = static_cast<int>(p.nheads);
  heads.rotary_dim = static_cast<int>(p.rotary_dim);
  heads.copy_rest = p.out != p.x;
  if (rotary_position_in_table(p, position)) {
    heads.cos = static_cast<const T*>(p.cos) + position * p.cos_row_stride;
    heads.sin = static_cast<const T*>(p.sin) + position * p.sin_row_stride;
  }
  rotate_rows<kRotaryThreads>(heads, HeadRow<T>{}, static_cast<int>(p.head_dim), p.interleaved, p.conjugate);
}

template <typename T>
void launch(const RotaryParams& params, cudaStream_t stream) {
  const int64_t rows = params.batch * params.seqlen;
  if (rows == 0 || params.nheads == 0) return;
  rotary_kernel<T><<<static_cast<unsigned>(rows), kRotaryThreads, 0, stream>>>(params);
}

}  // namespace

bool launch_rotary(const RotaryParams& params, void* stream) {
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  switch (params.dtype) {
    case DType::kFloat16: launch<__half>(params, cuda_stream); return true;
    case DType::kBFloat16: launch<__nv_bfloat16>(params, cuda_stream); return true;
    case DType::kFloat32: launch<float>(params, cuda_stream); return true;
    default: return false;
  }
}

}  // namespace flash::sm80
