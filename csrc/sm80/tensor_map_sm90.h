// Tensor maps for the TMA unit (sm90+): TensorMapArg, the form a kernel takes one in (a __grid_constant__
// parameter, so the kernel can hand its address to ptx/bulk_reduce_sm90.h), and the host encoder of a 2D fp32
// map. The driver's cuTensorMapEncodeTiled is reached through the runtime's entry-point query, so nothing links
// libcuda.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace flash::sm80 {

// CUtensorMap carries its own 128-byte alignment. `enabled` false: no map was made (below sm90, a shape outside the
// map's limits, or no driver entry point) and the kernel takes its other path.
struct TensorMapArg {
  CUtensorMap map;
  bool enabled;
};

// The version of cuTensorMapEncodeTiled this code calls (the CUDA 12.0 signature).
constexpr int kTensorMapEncodeVersion = 12000;

// Maps `rows` x `cols` fp32 at `base` (16-byte aligned; rows row_stride_bytes apart, a multiple of 16) in boxes
// of box_rows x box_cols (box_cols * 4 a multiple of 16, both at most 256), no swizzle. Returns false, leaving
// `arg` disabled, where the driver has no encoder or rejects the shape.
inline bool encode_fp32_map_2d(TensorMapArg& arg, float* base, uint64_t cols, uint64_t rows,
                               uint64_t row_stride_bytes, uint32_t box_cols, uint32_t box_rows) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, kTensorMapEncodeVersion, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();  // a failed query must not surface as the next kernel launch's error
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  arg.enabled = false;
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {row_stride_bytes};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  arg.enabled = encode(&arg.map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, base, dims, strides, box, element_strides,
                       CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  return arg.enabled;
}

}  // namespace flash::sm80
