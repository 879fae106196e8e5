// device_attributes (device_attributes.h): one query per attribute and device (std::call_once per device), then the
// cached copy, so that threads driving different devices may ask at once.
#include "device_attributes.h"

#include <mutex>

#if defined(FLASH_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "loaded_code_arch.h"
#endif

namespace flash {
namespace {

constexpr int kMaxCachedDevices = 64;  // devices past this index are queried on every call
constexpr int kMajorWeight = 10;

DeviceAttributes query(int device) {
  DeviceAttributes attributes;
#if defined(FLASH_WITH_CUDA)
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  attributes.sm = major * kMajorWeight + minor;
  cudaDeviceGetAttribute(&attributes.num_sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&attributes.smem.per_block_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  cudaDeviceGetAttribute(&attributes.smem.per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  const LoadedCode code = loaded_code(device);
  attributes.code_arch = code.code_arch;
  attributes.binary_arch = code.binary_arch;
#else
  (void)device;
#endif
  return attributes;
}

}  // namespace

DeviceAttributes device_attributes(int device) {
  static DeviceAttributes cached[kMaxCachedDevices];
  static std::once_flag queried[kMaxCachedDevices];
  if (device < 0 || device >= kMaxCachedDevices) return query(device);
  std::call_once(queried[device], [device] { cached[device] = query(device); });
  return cached[device];
}

}  // namespace flash
