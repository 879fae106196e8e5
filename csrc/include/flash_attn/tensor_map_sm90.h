// Tensor maps for the TMA unit (sm90+), shared by the sm80 path's Hopper code and the sm90 path: TensorMapArg, the
// form a kernel takes one in (a __grid_constant__ parameter, so the kernel can hand its address to
// ptx/bulk_reduce_sm90.h or ptx/tma_load_sm90.h), and the host encoders of a 2D fp32 map and a swizzled 4D 16-bit
// one. The driver's cuTensorMapEncodeTiled is reached through the runtime's entry-point query, so nothing links
// libcuda.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace flash {

// CUtensorMap carries its own 128-byte alignment. `enabled` false: no map was made (below sm90, a shape outside the
// map's limits, or no driver entry point) and the kernel takes its other path.
struct TensorMapArg {
  CUtensorMap map;
  bool enabled;
};

// The version of cuTensorMapEncodeTiled this code calls (the CUDA 12.0 signature).
constexpr int kTensorMapEncodeVersion = 12000;

// The driver's encoder, looked up once per process; null where the driver has none.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
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
  return encode;
}

// Runs encode() (a call of the driver's encoder) with the calling thread bound to a context. The driver's encoder
// needs a current context, which the runtime makes current lazily, at a thread's first runtime call: a thread whose
// first CUDA work is an encode failed it (torch's autograd device thread, where the Hopper backward encodes its maps
// before its first launch: the first backward calls of a process failed with "could not make TMA tensor maps",
// forty-ninth session). On a failure the runtime's current device is bound (cudaSetDevice makes its primary context
// current) and the encode tried once more.
template <typename Encode>
inline CUresult encode_in_context(Encode&& encode) {
  CUresult result = encode();
  if (result == CUDA_SUCCESS) return result;
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess && cudaSetDevice(device) == cudaSuccess) result = encode();
  (void)cudaGetLastError();  // a failed binding must not surface as the next kernel launch's error
  return result;
}

// Maps `rows` x `cols` fp32 at `base` (16-byte aligned; rows row_stride_bytes apart, a multiple of 16) in boxes
// of box_rows x box_cols (box_cols * 4 a multiple of 16, both at most 256), no swizzle. Returns false, leaving
// `arg` disabled, where the driver has no encoder or rejects the shape.
inline bool encode_fp32_map_2d(TensorMapArg& arg, float* base, uint64_t cols, uint64_t rows,
                               uint64_t row_stride_bytes, uint32_t box_cols, uint32_t box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  arg.enabled = false;
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {row_stride_bytes};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  arg.enabled = encode_in_context([&] {
                  return encode(&arg.map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, base, dims, strides, box,
                                element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
                }) == CUDA_SUCCESS;
  return arg.enabled;
}

// Maps a 16-bit (fp16 or bf16, `data_type`) tensor of four dimensions, dims[0] innermost and contiguous, at
// `base` (16-byte aligned; strides_bytes[i] between consecutive indices of dims[i + 1], multiples of 16) in boxes of
// box[0..3] elements with the 128-byte swizzle (box[0] * 2 = 128 bytes: the layout kernel_common.h
// SegmentSwizzledRows reads). Elements outside dims read as zeros. Returns false, leaving `arg` disabled, where the
// driver has no encoder or rejects the shape.
constexpr uint32_t kSwizzleSpanBytes = 128;
inline bool encode_16bit_swizzled_map_4d(TensorMapArg& arg, const void* base, CUtensorMapDataType data_type,
                                         const uint64_t (&dims)[4], const uint64_t (&strides_bytes)[3],
                                         const uint32_t (&box)[4]) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  arg.enabled = false;
  if (encode == nullptr || box[0] * 2 != kSwizzleSpanBytes) return false;
  const cuuint64_t map_dims[4] = {dims[0], dims[1], dims[2], dims[3]};
  const cuuint64_t map_strides[3] = {strides_bytes[0], strides_bytes[1], strides_bytes[2]};
  const cuuint32_t map_box[4] = {box[0], box[1], box[2], box[3]};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  arg.enabled = encode_in_context([&] {
                  return encode(&arg.map, data_type, 4, const_cast<void*>(base), map_dims, map_strides, map_box,
                                element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
                }) == CUDA_SUCCESS;
  return arg.enabled;
}

}  // namespace flash
