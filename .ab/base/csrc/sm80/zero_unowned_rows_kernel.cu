// zero_unowned_rows_kernel: blockIdx.y picks one tensor of UnownedRowsParams; its CTAs read the end of the owned rows
// and zero the bytes after them in a grid-stride loop, 16 bytes a store where the range is 16-byte aligned. Replaces
// zero-filling whole outputs whenever the host had not read cu_seqlens (a remembered check): 4 extra passes over
// out, dq, dk, dv per varlen training step.
#include "sm80/zero_unowned_rows_kernel.h"

#include <cuda_runtime.h>

namespace flash::sm80 {
namespace {

constexpr int kZeroThreads = 256;
// CTAs per tensor: each reads one int and exits when every row is owned (the common case); where rows are unowned
// (padding past the last sequence) 128 CTAs x 256 threads x 16 bytes clear 512 KB a pass.
constexpr unsigned kZeroCtasPerTensor = 128;
constexpr int64_t kVectorBytes = 16;

__global__ void __launch_bounds__(kZeroThreads) zero_unowned_rows_kernel(const UnownedRowsParams params) {
  const UnownedRows t = params.tensors[blockIdx.y];
  const int64_t end = *t.end_row;
  const int64_t owned = end < 0 ? 0 : (end < t.total_rows ? end : t.total_rows);
  int64_t begin = owned * t.row_bytes;
  const int64_t stop = t.total_rows * t.row_bytes;
  if (begin >= stop) return;
  uint8_t* bytes = static_cast<uint8_t*>(t.data);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kZeroThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kZeroThreads;
  const bool aligned = reinterpret_cast<uintptr_t>(bytes) % kVectorBytes == 0 && begin % kVectorBytes == 0;
  if (aligned) {
    const int64_t vectors = (stop - begin) / kVectorBytes;
    uint4* dst = reinterpret_cast<uint4*>(bytes + begin);
    for (int64_t i = first; i < vectors; i += stride) dst[i] = make_uint4(0, 0, 0, 0);
    begin += vectors * kVectorBytes;
  }
  for (int64_t i = begin + first; i < stop; i += stride) bytes[i] = 0;
}

}  // namespace

void launch_zero_unowned_rows(const UnownedRowsParams& params, void* stream) {
  if (params.count <= 0) return;
  const dim3 grid(kZeroCtasPerTensor, static_cast<unsigned>(params.count));
  zero_unowned_rows_kernel<<<grid, kZeroThreads, 0, static_cast<cudaStream_t>(stream)>>>(params);
}

}  // namespace flash::sm80
