// run_rotary (rotary_cpu.h): one (sequence, row) per parallel_for index; every head of the row, each rotary pair by
// the rule in common/rotary.h, columns past rotary_dim copied when out is not x.
#include "rotary_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "flash_attn/common/rotary.h"

namespace flash::cpu {
namespace {

// Rows per parallel_for task: small rows (a few heads x 64 columns) are cheap, so tasks take many.
constexpr int64_t kRowsPerTask = 16;

template <typename T>
void rotate_rows(const RotaryParams& p) {
  using A = RotaryAcc<T>;
  const T* x = static_cast<const T*>(p.x);
  T* out = static_cast<T*>(p.out);
  const T* cos = static_cast<const T*>(p.cos);
  const T* sin = static_cast<const T*>(p.sin);
  const int64_t pairs = p.rotary_dim / 2;
  at::parallel_for(0, p.batch * p.seqlen, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / p.seqlen, row = index % p.seqlen;
      const int64_t x_row = rotary_row_offset(p, p.x_strides, b, row);
      if (x_row < 0) continue;
      const int64_t out_row = rotary_row_offset(p, p.out_strides, b, row);
      const int64_t position = rotary_position(p, b, row);
      const bool rotated = rotary_position_in_table(p, position);
      for (int64_t h = 0; h < p.nheads; ++h) {
        const T* src = x + x_row + h * p.x_strides.head;
        T* dst = out + out_row + h * p.out_strides.head;
        for (int64_t i = 0; i < pairs; ++i) {
          const RotaryPair pair = rotary_pair(p, i);
          A x1 = static_cast<A>(src[pair.first]);
          A x2 = static_cast<A>(src[pair.second]);
          if (rotated) {
            rotate_pair<A>(x1, x2, static_cast<A>(cos[position * p.cos_row_stride + i]),
                           static_cast<A>(sin[position * p.sin_row_stride + i]), p.conjugate);
          }
          dst[pair.first] = static_cast<T>(x1);
          dst[pair.second] = static_cast<T>(x2);
        }
        if (dst != src) {
          for (int64_t d = p.rotary_dim; d < p.head_dim; ++d) dst[d] = src[d];
        }
      }
    }
  });
}

}  // namespace

void run_rotary(const RotaryParams& params) {
  switch (params.dtype) {
    case DType::kFloat16: rotate_rows<at::Half>(params); break;
    case DType::kBFloat16: rotate_rows<at::BFloat16>(params); break;
    case DType::kFloat32: rotate_rows<float>(params); break;
    case DType::kFloat64: rotate_rows<double>(params); break;
  }
}

}  // namespace flash::cpu
