// The attributes of a CUDA device that every forward call reads (compute capability, SM count, shared-memory
// limits: the binding layer's split planning and the launcher), queried once per device and cached. Torch-free, so
// the kernel launchers use it too. Queried per call, they took ~0.5 us each under the torch profiler on the H200
// machine, five per decode call whose whole GPU time is ~20 us.
#pragma once

#include "sm80/fwd_tile_config.h"

namespace flash {

struct DeviceAttributes {
  int sm = 0;  // compute capability as major * 10 + minor
  // The architecture the loaded kernels were compiled for (loaded_code_arch.h): sm90-only device code exists only
  // where this is >= 90, whatever `sm` is.
  int code_arch = 0;
  int binary_arch = 0;  // the SASS arch the GPU runs (its own where the driver JIT-compiled PTX)
  int num_sms = 0;
  sm80::SmemLimits smem{0, 0};
};

// Attributes of CUDA device `device` (an index); all zero in a build without CUDA.
DeviceAttributes device_attributes(int device);

}  // namespace flash
