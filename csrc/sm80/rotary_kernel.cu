// rotary_kernel: one CTA per (sequence, row); its threads visit the row's (head, pair) items and, when out is not x,
// the columns past rotary_dim (for_each_head_item). The rule per pair is common/rotary.h's, shared with the CPU implementation.
#include "sm80/rotary_kernel.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "flash_attn/common/rotary.h"
#include "sm80/kernel_common.h"

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
  const bool rotated = rotary_position_in_table(p, position);
  const T* x = static_cast<const T*>(p.x) + x_row;
  T* out = static_cast<T*>(p.out) + out_row;
  const T* cos = static_cast<const T*>(p.cos) + (rotated ? position * p.cos_row_stride : 0);
  const T* sin = static_cast<const T*>(p.sin) + (rotated ? position * p.sin_row_stride : 0);
  const int nheads = static_cast<int>(p.nheads);
  const int pairs = static_cast<int>(p.rotary_dim / 2);
  for_each_head_item<kRotaryThreads>(nheads, pairs, [&](int h, int i) {
    const RotaryPair pair = rotary_pair(p, i);
    const T* src = x + h * p.x_strides.head;
    T* dst = out + h * p.out_strides.head;
    float x1 = to_float(src[pair.first]);
    float x2 = to_float(src[pair.second]);
    if (rotated) rotate_pair<float>(x1, x2, to_float(cos[i]), to_float(sin[i]), p.conjugate);
    dst[pair.first] = from_float<T>(x1);
    dst[pair.second] = from_float<T>(x2);
  });
  if (p.out == p.x) return;
  const int rotary_dim = static_cast<int>(p.rotary_dim);
  for_each_head_item<kRotaryThreads>(nheads, static_cast<int>(p.head_dim) - rotary_dim, [&](int h, int c) {
    out[h * p.out_strides.head + rotary_dim + c] = x[h * p.x_strides.head + rotary_dim + c];
  });
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
