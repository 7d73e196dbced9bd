// The rows in use of a worst-case-sized expert buffer: those before the last group's end, read on the device
// (zero_tail.cu writes the rest, swiglu_rows.cu computes these only). An end outside [0, rows] is clamped.
#pragma once

namespace ep {

__device__ __forceinline__ long long rows_in_use(const int* ends, int groups, long long rows) {
  const long long end = groups > 0 ? static_cast<long long>(ends[groups - 1]) : 0;
  return end < 0 ? 0 : (end > rows ? rows : end);
}

}  // namespace ep
