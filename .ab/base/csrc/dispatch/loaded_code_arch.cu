// loaded_code (loaded_code_arch.h): the PTX and binary versions of an empty probe kernel compiled with the same
// -gencode flags as every kernel of the extension, so the image the driver picks for the probe is the one it picks
// for them.
#include "loaded_code_arch.h"

#include <cuda_runtime_api.h>

namespace flash {
namespace {

__global__ void code_arch_probe_kernel() {}

}  // namespace

LoadedCode loaded_code(int device) {
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) return {};
  if (previous != device && cudaSetDevice(device) != cudaSuccess) return {};
  cudaFuncAttributes attributes{};
  const cudaError_t status = cudaFuncGetAttributes(&attributes, code_arch_probe_kernel);
  if (previous != device) cudaSetDevice(previous);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // no loadable image: clear the error so the next launch check does not see it
    return {};
  }
  return LoadedCode{attributes.ptxVersion, attributes.binaryVersion};
}

}  // namespace flash
