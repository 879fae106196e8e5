// The attributes of a CUDA device that the binding layer reads on every call (compute capability, SM count, shared
// memory limits), queried once per device and cached: five queries per forward call cost ~2 us of host time on the
// H200 machine (torch profiler), where a decode call's whole GPU time is ~22 us.
#pragma once

#include "sm80/fwd_tile_config.h"

namespace flash::api {

struct DeviceAttributes {
  int sm = 0;  // compute capability as major * 10 + minor
  int num_sms = 0;
  sm80::SmemLimits smem{0, 0};
};

// Attributes of CUDA device `device` (an index); all zero in a build without CUDA.
DeviceAttributes device_attributes(int device);

}  // namespace flash::api
