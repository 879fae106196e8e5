// launch_zero_unowned_rows: zeroes the rows of varlen outputs (out, dq, dk, dv) past cu_seqlens[batch], the rows that
// belong to no sequence, reading that entry on the device: no host synchronisation, current under CUDA-graph replay,
// and a launch that writes nothing when every row is owned. Called by csrc/api/flash_api.cpp.
#pragma once

#include <cstdint>

namespace flash::sm80 {

// One row-major tensor of total_rows rows of row_bytes contiguous bytes each; its owned rows end at *end_row
// (&cu_seqlens[batch]), clamped to [0, total_rows].
struct UnownedRows {
  void* data = nullptr;
  int64_t row_bytes = 0;
  int64_t total_rows = 0;
  const int32_t* end_row = nullptr;
};

constexpr int kMaxUnownedRowTensors = 3;  // dq, dk, dv of one backward call

struct UnownedRowsParams {
  UnownedRows tensors[kMaxUnownedRowTensors];
  int count = 0;
};

// Launches on `stream` (a cudaStream_t); nothing for count == 0.
void launch_zero_unowned_rows(const UnownedRowsParams& params, void* stream);

}  // namespace flash::sm80
