// FLASH_HOST_DEVICE: marks the framework-free helpers under common/ that both the C++ CPU path and the
// CUDA kernels call. Plain inline when compiled by a host compiler.
#pragma once

#if defined(__CUDACC__)
#define FLASH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FLASH_HOST_DEVICE inline
#endif
