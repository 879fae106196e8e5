// One-warp, one-tile kernels that exercise each inline-PTX wrapper of include/flash_attn/ptx/ and write out
// exactly what the lanes got (declared in ptx_selftest.h). Test-only: they check the documented fragment
// layouts against tests/test_ptx_wrappers.py, so a wrapper or a layout comment that is wrong fails there
// rather than deep inside an attention kernel.
#include "sm80/ptx_selftest.h"

#include "dispatch/device_attributes.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "flash_attn/ptx/bulk_reduce_sm90.h"
#include "flash_attn/ptx/bulk_store_sm90.h"
#include "flash_attn/ptx/cluster_sm90.h"
#include "flash_attn/ptx/cp_async_sm80.h"
#include "flash_attn/ptx/griddep_sm90.h"
#include "flash_attn/ptx/ldmatrix_sm80.h"
#include "flash_attn/ptx/mma_sm80.h"
#include "flash_attn/ptx/red_sm90.h"
#include "flash_attn/ptx/stmatrix_sm90.h"
#include "flash_attn/ptx/tma_load_sm90.h"
#include "sm80/fwd_tile_config.h"
#include "sm80/kernel_common.h"
#include "flash_attn/tensor_map_sm90.h"

namespace flash::sm80::selftest {
namespace {

// Shared-memory tiles are padded by 8 16-bit elements per row (as the attention kernels do), so the test
// also proves that ldmatrix takes per-lane row addresses rather than assuming a dense 8x8 block.
constexpr int kSmemRowPad = 8;
// Shared memory is filled with this word before cp.async runs, so a missing zero-fill cannot pass as zeros.
constexpr uint32_t kSmemFillWord = 0xA5A5A5A5u;

__device__ __forceinline__ uint32_t load_pair(const uint16_t* row_major, int cols, int row, int col) {
  const uint32_t low = row_major[row * cols + col];
  const uint32_t high = row_major[row * cols + col + 1];
  return low | (high << 16);
}

// Fragments built straight from global memory by the layout of mma_sm80.h (g = lane / 4, t = lane % 4).
template <typename T>
__global__ void mma_kernel(const uint16_t* a, const uint16_t* b_nk, const float* c, float* d) {
  const int lane = threadIdx.x;
  const int g = lane / 4;
  const int t = lane % 4;
  ptx::MmaA a_frag;
  a_frag.reg[0] = load_pair(a, kTileCols, g, 2 * t);
  a_frag.reg[1] = load_pair(a, kTileCols, g + 8, 2 * t);
  a_frag.reg[2] = load_pair(a, kTileCols, g, 2 * t + 8);
  a_frag.reg[3] = load_pair(a, kTileCols, g + 8, 2 * t + 8);
  // b (k x n) element (k, n) is b_nk[n][k]: the pair k = 2t, 2t + 1 of column n = g is contiguous in b_nk.
  ptx::MmaB b_frag;
  b_frag.reg[0] = load_pair(b_nk, kTileCols, g, 2 * t);
  b_frag.reg[1] = load_pair(b_nk, kTileCols, g, 2 * t + 8);
  ptx::MmaC acc;
  acc.reg[0] = c[g * kMmaCols + 2 * t];
  acc.reg[1] = c[g * kMmaCols + 2 * t + 1];
  acc.reg[2] = c[(g + 8) * kMmaCols + 2 * t];
  acc.reg[3] = c[(g + 8) * kMmaCols + 2 * t + 1];
  ptx::mma_m16n8k16(acc, a_frag, b_frag, T{});
  d[g * kMmaCols + 2 * t] = acc.reg[0];
  d[g * kMmaCols + 2 * t + 1] = acc.reg[1];
  d[(g + 8) * kMmaCols + 2 * t] = acc.reg[2];
  d[(g + 8) * kMmaCols + 2 * t + 1] = acc.reg[3];
}

template <typename T>
__global__ void pack2_kernel(const T* values, uint32_t* packed) {
  const int lane = threadIdx.x;
  packed[lane] = ptx::pack2(values[2 * lane], values[2 * lane + 1]);
}

// Copies a rows x cols tile into padded shared memory, one warp.
template <int kRows, int kCols>
__device__ __forceinline__ void stage_tile(const uint16_t* tile, uint16_t (&smem)[kRows][kCols + kSmemRowPad]) {
  for (int i = threadIdx.x; i < kRows * kCols; i += kWarpLanes) smem[i / kCols][i % kCols] = tile[i];
  __syncwarp();
}

__global__ void ldmatrix_x2_trans_kernel(const uint16_t* tile, uint32_t* regs) {
  __shared__ __align__(16) uint16_t smem[kTileRows][kMmaCols + kSmemRowPad];
  stage_tile<kTileRows, kMmaCols>(tile, smem);
  const int lane = threadIdx.x;
  // Lanes 16-31 are ignored by .x2; they pass a valid address anyway.
  const ptx::MmaB frag = ptx::ldmatrix_x2_trans(&smem[lane % kTileRows][0]);
  regs[lane * 2] = frag.reg[0];
  regs[lane * 2 + 1] = frag.reg[1];
}

template <bool kTransposed>
__global__ void ldmatrix_x4_kernel(const uint16_t* tile, uint32_t* regs) {
  __shared__ __align__(16) uint16_t smem[kTileRows][kTileCols + kSmemRowPad];
  stage_tile<kTileRows, kTileCols>(tile, smem);
  const int lane = threadIdx.x;
  const uint16_t* row_address = &smem[lane % kTileRows][(lane / kTileRows) * kMmaCols];
  uint32_t reg[4];
  if constexpr (kTransposed) {
    ptx::ldmatrix_x4_trans(reg, row_address);
  } else {
    ptx::ldmatrix_x4(reg, row_address);
  }
  for (int i = 0; i < 4; ++i) regs[lane * 4 + i] = reg[i];
}

__global__ void cp_async_kernel(const int32_t* src, const int32_t* valid, int32_t* dst) {
  __shared__ __align__(16) uint32_t smem[kCpAsyncChunks * kCpAsyncChunkWords];
  const int lane = threadIdx.x;
  for (int i = lane; i < kCpAsyncChunks * kCpAsyncChunkWords; i += kWarpLanes) smem[i] = kSmemFillWord;
  __syncwarp();
  for (int group = 0; group < 2; ++group) {
    const int chunk = group * kWarpLanes + lane;
    ptx::cp_async_16(&smem[chunk * kCpAsyncChunkWords], src + chunk * kCpAsyncChunkWords, valid[chunk] != 0);
    ptx::cp_async_commit();
  }
  // Each lane reads a chunk another lane copied, so the waits must cover the copies, not just the issuing lane.
  const int reader_chunk = (lane + 1) % kWarpLanes;
  ptx::cp_async_wait<1>();
  __syncwarp();
  for (int w = 0; w < kCpAsyncChunkWords; ++w) {
    dst[reader_chunk * kCpAsyncChunkWords + w] = static_cast<int32_t>(smem[reader_chunk * kCpAsyncChunkWords + w]);
  }
  ptx::cp_async_wait<0>();
  __syncwarp();
  const int second = kWarpLanes + reader_chunk;
  for (int w = 0; w < kCpAsyncChunkWords; ++w) {
    dst[second * kCpAsyncChunkWords + w] = static_cast<int32_t>(smem[second * kCpAsyncChunkWords + w]);
  }
}

__global__ void cp_async_4_kernel(const int32_t* words, const int32_t* valid, int32_t* dst) {
  __shared__ uint32_t smem[kWarpLanes];
  const int lane = threadIdx.x;
  smem[lane] = kSmemFillWord;
  __syncwarp();
  ptx::cp_async_4(&smem[lane], words + lane, valid[lane] != 0);
  ptx::cp_async_commit();
  ptx::cp_async_wait<0>();
  __syncwarp();
  const int reader = (lane + 1) % kWarpLanes;
  dst[reader] = static_cast<int32_t>(smem[reader]);
}

__global__ void red_add_v4_kernel(float* dst, const float* added, const float* extra, const int32_t* valid) {
  const int lane = threadIdx.x;
  float* row = dst + lane * kRedFloats;
  const float* a = added + lane * kRedFloats;
  const float* e = extra + lane * kRedFloats;
  ptx::red_add_v4_f32(row, a[0], a[1], a[2], a[3]);
  ptx::red_add_v4_f32(row, e[0], e[1], e[2], e[3], valid[lane] != 0);
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t ns = 0;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(ns));
  return ns;
}

// The primary allows its dependent launch at once, then spins until the dependent has started (it sets `started`
// before it waits) or kGriddepTimeoutNs have passed, records which in `saw_started`, and writes the words. The
// dependent copies the words and the record after wait_for_primary_grid(). A spin for the dependent rather than a
// fixed time: with other processes on the GPU (pytest-xdist), a context switch can outlast any fixed spin.
__global__ void griddep_primary_kernel(const int32_t* words, int32_t* data, const int32_t* started,
                                       int32_t* saw_started) {
  const int lane = threadIdx.x;
  ptx::allow_dependent_launch();
  const uint64_t start = global_timer_ns();
  const volatile int32_t* flag = started;
  while (*flag == 0 && global_timer_ns() - start < kGriddepTimeoutNs) {
  }
  if (lane == 0) *saw_started = *flag;
  data[lane] = words[lane];
}

__global__ void griddep_dependent_kernel(const int32_t* data, int32_t* started, const int32_t* saw_started,
                                         int32_t* dst) {
  const int lane = threadIdx.x;
  if (lane == 0) atomicExch(started, 1);
  ptx::wait_for_primary_grid();
  dst[lane] = data[lane];
  if (lane == 0) dst[kWarpLanes] = *saw_started;
}

// The box goes through shared memory (128-byte aligned, as the TMA unit needs) and one lane issues the reduction;
// the full wait makes its global writes done before the kernel ends.
__global__ void bulk_reduce_kernel(const __grid_constant__ TensorMapArg map, const float* box, int col, int row) {
  __shared__ __align__(128) float tile[kBulkBoxRows * kBulkBoxCols];
  const int lane = threadIdx.x;
  for (int i = lane; i < kBulkBoxRows * kBulkBoxCols; i += kWarpLanes) tile[i] = box[i];
  ptx::fence_proxy_async_shared();
  __syncwarp();
  // Code compiled below sm90 has no bulk reduction: dst then stays as it was and the test fails on its values.
  if constexpr (ptx::kHasBulkReduce) {
    if (lane == 0) {
      ptx::bulk_reduce_add_2d(&map.map, tile, col, row);
      ptx::bulk_commit_group();
      ptx::bulk_wait_group<0>();
    }
  }
}

// A box of src goes into shared memory by tma_load_2d (zeros past src's rows and columns) and out into dst by
// bulk_store_2d (rows past dst's end not written); the full wait makes the store done before the kernel ends.
__global__ void bulk_copy_2d_kernel(const __grid_constant__ TensorMapArg src_map,
                                    const __grid_constant__ TensorMapArg dst_map, const int32_t* where) {
  __shared__ __align__(128) float tile[kBulkBoxRows * kBulkBoxCols];
  __shared__ __align__(8) uint64_t barrier;
  const int lane = threadIdx.x;
  for (int i = lane; i < kBulkBoxRows * kBulkBoxCols; i += kWarpLanes) tile[i] = -1.f;
  ptx::fence_proxy_async_shared();
  if (lane == 0) {
    ptx::mbarrier_init(&barrier, 1);
    ptx::fence_barrier_init();
  }
  __syncwarp();
  // Code compiled below sm90 has neither copy: dst then stays as it was and the test fails on its values.
  if constexpr (ptx::kHasTmaLoad) {
    if (lane == 0) {
      ptx::mbarrier_arrive_expect_tx(&barrier, kBulkBoxRows * kBulkBoxCols * sizeof(float));
      ptx::tma_load_2d(tile, &src_map.map, &barrier, where[0], where[1]);
      ptx::mbarrier_wait_parity(&barrier, 0);
      ptx::bulk_store_2d(&dst_map.map, tile, where[2], where[3]);
      ptx::bulk_commit_group();
      ptx::bulk_wait_group<0>();
    }
  }
}

// Both boxes land in the same tile through the same barrier: the second wait needs the barrier's second phase, and
// the tile must hold the second box only (the zero fill of its out-of-range rows and columns included).
__global__ void tma_load_kernel(const __grid_constant__ TensorMapArg map, const int32_t* where, uint16_t* dst) {
  using Layout = SegmentSwizzledRows<kTmaBoxRows, kTmaBoxCols>;
  constexpr int kElems = kTmaBoxRows * kTmaBoxCols;
  __shared__ __align__(kTmaBoxAlign) uint16_t tile[kElems];
  __shared__ __align__(8) uint64_t full;
  const int lane = threadIdx.x;
  for (int i = lane; i < kElems; i += kWarpLanes) tile[i] = static_cast<uint16_t>(kSmemFillWord);
  if (lane == 0) {
    ptx::prefetch_tensor_map(&map.map);  // the attention kernels' start: the loads below must not depend on it
    ptx::mbarrier_init(&full, 1);
    ptx::fence_barrier_init();
  }
  __syncwarp();
  // Code compiled below sm90 has no TMA: dst then keeps the fill pattern and the test fails on its values.
  if constexpr (ptx::kHasTmaLoad) {
    for (int load = 0; load < kTmaLoads; ++load) {
      const int32_t* c = where + 4 * load;
      if (lane == 0) {
        ptx::mbarrier_arrive_expect_tx(&full, kElems * sizeof(uint16_t));
        ptx::tma_load_4d(tile, &map.map, &full, c[0], c[1], c[2], c[3]);
      }
      ptx::mbarrier_wait_parity(&full, static_cast<uint32_t>(load % 2));
      for (int i = lane; i < kElems; i += kWarpLanes) {
        dst[load * kElems + i] = tile[Layout::offset(i / kTmaBoxCols, i % kTmaBoxCols)];
      }
      __syncwarp();
    }
  }
}

// The same addressing as ldmatrix_x4_kernel, storing instead: the tile read back must hold each lane's
// registers where the fragment layout puts them, and the pre-filled pattern nowhere.
__global__ void stmatrix_x4_kernel(const uint32_t* regs, uint16_t* tile) {
  __shared__ __align__(16) uint16_t smem[kTileRows][kTileCols + kSmemRowPad];
  const int lane = threadIdx.x;
  for (int i = lane; i < kTileRows * (kTileCols + kSmemRowPad); i += kWarpLanes) {
    smem[i / (kTileCols + kSmemRowPad)][i % (kTileCols + kSmemRowPad)] = static_cast<uint16_t>(kSmemFillWord);
  }
  __syncwarp();
  const uint32_t* r = regs + lane * 4;
  // Code compiled below sm90 (e.g. sm_80 PTX JIT-compiled on a Hopper GPU) has no stmatrix: the tile then keeps
  // the fill pattern and the test fails on its values instead of trapping.
  if constexpr (ptx::kHasStmatrix) {
    ptx::stmatrix_x4(&smem[lane % kTileRows][(lane / kTileRows) * kMmaCols], r[0], r[1], r[2], r[3]);
  }
  __syncwarp();
  for (int i = lane; i < kTileRows * kTileCols; i += kWarpLanes) tile[i] = smem[i / kTileCols][i % kTileCols];
}

__global__ void cluster_exchange_kernel(const float* values, float* dst) {
  __shared__ __align__(16) float staged[kWarpLanes * kClusterVec];
  const int lane = threadIdx.x;
  const int z = blockIdx.z;
  for (int i = lane; i < kWarpLanes * kClusterVec; i += kWarpLanes) {
    staged[i] = values[z * kWarpLanes * kClusterVec + i];
  }
  ptx::cluster_sync();
  const uint32_t rank = ptx::cluster_cta_rank();
  const uint32_t neighbour = (rank + 1) % kClusterCtas;
  const uint32_t at = ptx::smem_address(staged + lane * kClusterVec);
  const float word = ptx::ld_shared_cluster_f32(ptx::map_shared_to_rank(at, neighbour));
  const float4 vec = ptx::ld_shared_cluster_v4_f32(ptx::map_shared_to_rank(at, neighbour));
  ptx::cluster_sync();
  float* out = dst + (z * kWarpLanes + lane) * (2 + kClusterVec);
  out[0] = static_cast<float>(rank);
  out[1] = word;
  out[2] = vec.x;
  out[3] = vec.y;
  out[4] = vec.z;
  out[5] = vec.w;
}

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

// Whether this extension's kernels carry their sm90 code on the current device (DeviceAttributes::code_arch): not
// on GPUs before Hopper, and not where the driver runs them from compute_80 PTX.
constexpr int kHopperCodeArch = 90;
bool runs_sm90_code() {
  int device = 0;
  return cudaGetDevice(&device) == cudaSuccess && device_attributes(device).code_arch >= kHopperCodeArch;
}

}  // namespace

bool mma_m16n8k16(DType dtype, const void* a, const void* b_nk, const float* c, float* d, void* stream) {
  const auto* a16 = static_cast<const uint16_t*>(a);
  const auto* b16 = static_cast<const uint16_t*>(b_nk);
  switch (dtype) {
    case DType::kFloat16: mma_kernel<__half><<<1, kWarpLanes, 0, as_stream(stream)>>>(a16, b16, c, d); return true;
    case DType::kBFloat16:
      mma_kernel<__nv_bfloat16><<<1, kWarpLanes, 0, as_stream(stream)>>>(a16, b16, c, d);
      return true;
    default: return false;
  }
}

bool pack2(DType dtype, const void* values, uint32_t* packed, void* stream) {
  switch (dtype) {
    case DType::kFloat16:
      pack2_kernel<<<1, kWarpLanes, 0, as_stream(stream)>>>(static_cast<const __half*>(values), packed);
      return true;
    case DType::kBFloat16:
      pack2_kernel<<<1, kWarpLanes, 0, as_stream(stream)>>>(static_cast<const __nv_bfloat16*>(values), packed);
      return true;
    default: return false;
  }
}

void ldmatrix_x2_trans(const uint16_t* tile, uint32_t* regs, void* stream) {
  ldmatrix_x2_trans_kernel<<<1, kWarpLanes, 0, as_stream(stream)>>>(tile, regs);
}

void ldmatrix_x4(const uint16_t* tile, uint32_t* regs, bool transposed, void* stream) {
  if (transposed) {
    ldmatrix_x4_kernel<true><<<1, kWarpLanes, 0, as_stream(stream)>>>(tile, regs);
  } else {
    ldmatrix_x4_kernel<false><<<1, kWarpLanes, 0, as_stream(stream)>>>(tile, regs);
  }
}

void cp_async_16(const int32_t* src, const int32_t* valid, int32_t* dst, void* stream) {
  cp_async_kernel<<<1, kWarpLanes, 0, as_stream(stream)>>>(src, valid, dst);
}

void cp_async_4(const int32_t* words, const int32_t* valid, int32_t* dst, void* stream) {
  cp_async_4_kernel<<<1, kWarpLanes, 0, as_stream(stream)>>>(words, valid, dst);
}

bool red_add_v4_f32(float* dst, const float* added, const float* extra, const int32_t* valid, void* stream) {
  if (!runs_sm90_code()) return false;
  red_add_v4_kernel<<<1, kWarpLanes, 0, as_stream(stream)>>>(dst, added, extra, valid);
  return true;
}

bool bulk_reduce_add_2d(float* dst, const float* box, int col, int row, void* stream) {
  if (!runs_sm90_code()) return false;
  TensorMapArg map{};
  if (!encode_fp32_map_2d(map, dst, kBulkCols, kBulkRows, kBulkCols * sizeof(float), kBulkBoxCols, kBulkBoxRows)) {
    return false;
  }
  bulk_reduce_kernel<<<1, kWarpLanes, 0, as_stream(stream)>>>(map, box, col, row);
  return true;
}

bool bulk_copy_2d(const float* src, float* dst, const int32_t* where, void* stream) {
  if (!runs_sm90_code()) return false;
  TensorMapArg src_map{};
  TensorMapArg dst_map{};
  // The source map is only read (the encoder takes a mutable base).
  float* src_base = const_cast<float*>(src);
  if (!encode_fp32_map_2d(src_map, src_base, kBulkCols, kBulkRows, kBulkCols * sizeof(float), kBulkBoxCols,
                          kBulkBoxRows) ||
      !encode_fp32_map_2d(dst_map, dst, kBulkCols, kBulkRows, kBulkCols * sizeof(float), kBulkBoxCols, kBulkBoxRows)) {
    return false;
  }
  bulk_copy_2d_kernel<<<1, kWarpLanes, 0, as_stream(stream)>>>(src_map, dst_map, where);
  return true;
}

bool tma_load_4d(const uint16_t* src, const int32_t* where, uint16_t* dst, void* stream) {
  if (!runs_sm90_code()) return false;
  TensorMapArg map{};
  constexpr uint64_t kElemBytes = sizeof(uint16_t);
  const uint64_t dims[4] = {kTmaCols, kTmaHeads, kTmaRows, kTmaBatch};
  const uint64_t strides[3] = {kTmaCols * kElemBytes, kTmaHeads * kTmaCols * kElemBytes,
                               kTmaRows * kTmaHeads * kTmaCols * kElemBytes};
  const uint32_t box[4] = {kTmaBoxCols, 1, kTmaBoxRows, 1};
  if (!encode_16bit_swizzled_map_4d(map, src, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, dims, strides, box)) return false;
  tma_load_kernel<<<1, kWarpLanes, 0, as_stream(stream)>>>(map, where, dst);
  return true;
}

bool stmatrix_x4(const uint32_t* regs, uint16_t* tile, void* stream) {
  if (!runs_sm90_code()) return false;
  stmatrix_x4_kernel<<<1, kWarpLanes, 0, as_stream(stream)>>>(regs, tile);
  return true;
}

bool griddep(const int32_t* words, int32_t* scratch, int32_t* dst, void* stream) {
  if (!runs_sm90_code()) return false;
  int32_t* data = scratch;
  int32_t* started = scratch + kWarpLanes;
  int32_t* saw_started = started + 1;
  griddep_primary_kernel<<<1, kWarpLanes, 0, as_stream(stream)>>>(words, data, started, saw_started);
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(1);
  config.blockDim = dim3(kWarpLanes);
  config.stream = as_stream(stream);
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  const int32_t* const_data = data;
  const int32_t* const_saw = saw_started;
  return cudaLaunchKernelEx(&config, griddep_dependent_kernel, const_data, started, const_saw, dst) == cudaSuccess;
}

bool cluster_exchange(const float* values, float* dst, void* stream) {
  if (!runs_sm90_code()) return false;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(1, 1, kClusterCtas);
  config.blockDim = dim3(kWarpLanes);
  config.stream = as_stream(stream);
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = 1;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = kClusterCtas;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, cluster_exchange_kernel, values, dst) == cudaSuccess;
}

}  // namespace flash::sm80::selftest
