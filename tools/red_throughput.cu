// Throughput of fp32 reductions (red.global.add) into an L2-resident buffer by access pattern: the question behind
// the backward's dq accumulator layout (csrc/include/flash_attn/bwd_workspace.h DqLayout). One CTA of 8 warps per SM
// (as the hd 256 backward) adds 64 KB blocks, each warp 32 rows x 64 columns, 16 KB of blocks apart per CTA.
// Build and run on the GPU: nvcc -O3 -arch=sm_90 -o /tmp/red_throughput tools/red_throughput.cu && /tmp/red_throughput
#include <cuda_runtime.h>

#include <cstdio>

namespace {

constexpr int kRows = 64;
constexpr int kCols = 256;
constexpr int kBlocks = 256;  // 64 KB each, 16 MB in all: stays in L2
constexpr int kThreads = 256;
constexpr int kWarmupIters = 10;
constexpr int kIters = 2000;
constexpr int kPatterns = 4;

__device__ __forceinline__ void red_v4(float* p, float v) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %1, %1, %1};" ::"l"(p), "f"(v) : "memory");
}
__device__ __forceinline__ void red_scalar(float* p, float v) {
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}

// 0: 16 bytes per lane at rows g / g + 8, 4 lanes per row (kRows layout: 8 rows x 64 bytes per instruction).
// 1: 8 lanes per 128-byte line (kRowPairs layout: 4 whole lines per instruction).
// 2: scalar, one line of 32 floats per instruction (FlashAttention-2's atomicAdd).
// 3: 16 lanes per 256 bytes (2 rows x 256 bytes per instruction).
template <int kPattern>
__global__ void __launch_bounds__(kThreads, 1) add_blocks(float* buf, int iters) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row0 = (warp % 2) * 32, col0 = (warp / 2) * 64;
  const float v = 1.f;
  for (int it = 0; it < iters; ++it) {
    float* blk = buf + static_cast<size_t>((blockIdx.x + it) % kBlocks) * kRows * kCols + row0 * kCols + col0;
    if constexpr (kPattern == 0) {
#pragma unroll
      for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int r = 0; r < 4; ++r) red_v4(blk + (8 * r + g) * kCols + c * 16 + 4 * t, v);
    } else if constexpr (kPattern == 1) {
#pragma unroll
      for (int rg = 0; rg < 8; ++rg)
#pragma unroll
        for (int seg = 0; seg < 2; ++seg) red_v4(blk + (rg * 4 + lane / 8) * kCols + seg * 32 + 4 * (lane % 8), v);
    } else if constexpr (kPattern == 2) {
#pragma unroll 8
      for (int row = 0; row < 32; ++row)
#pragma unroll
        for (int seg = 0; seg < 2; ++seg) red_scalar(blk + row * kCols + seg * 32 + lane, v);
    } else {
#pragma unroll
      for (int rg = 0; rg < 16; ++rg) red_v4(blk + (rg * 2 + lane / 16) * kCols + 4 * (lane % 16), v);
    }
  }
}

template <int kPattern>
float time_ms(float* buf, int grid) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  add_blocks<kPattern><<<grid, kThreads>>>(buf, kWarmupIters);
  cudaEventRecord(start);
  add_blocks<kPattern><<<grid, kThreads>>>(buf, kIters);
  cudaEventRecord(stop);
  cudaEventSynchronize(stop);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, start, stop);
  return ms;
}

}  // namespace

int main() {
  float* buf = nullptr;
  const size_t floats = static_cast<size_t>(kBlocks) * kRows * kCols;
  if (cudaMalloc(&buf, floats * sizeof(float)) != cudaSuccess) return 1;
  cudaMemset(buf, 0, floats * sizeof(float));
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const char* names[kPatterns] = {"8 rows x 64 B, v4", "4 lines x 128 B, v4", "1 line, scalar", "2 rows x 256 B, v4"};
  for (int grid : {sms, 2 * sms}) {
    const float ms[kPatterns] = {time_ms<0>(buf, grid), time_ms<1>(buf, grid), time_ms<2>(buf, grid),
                                 time_ms<3>(buf, grid)};
    const double bytes = static_cast<double>(grid) * kIters * kRows * kCols * sizeof(float);
    for (int p = 0; p < kPatterns; ++p) {
      std::printf("grid %4d  %-20s %8.3f ms  %5.2f TB/s\n", grid, names[p], ms[p], bytes / ms[p] / 1e9);
    }
  }
  const cudaError_t err = cudaGetLastError();
  std::printf("%s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
