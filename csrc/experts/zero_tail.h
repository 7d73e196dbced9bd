// The rows of a worst-case-sized expert output past the last expert's end, zeroed (EPGroupedMLP's tail).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace ep {

// base: rows x row_bytes (row_bytes a multiple of 16, base 16-byte aligned); ends: [groups] int32 on the device, the
// end row of each group (a cumsum of the per-expert counts). Rows [min(max(ends[groups - 1], 0), rows), rows) are
// set to 0; the rows before them are not touched. groups == 0: every row.
void launch_zero_rows_from(void* base, int64_t rows, int64_t row_bytes, const int* ends, int groups, int max_blocks,
                           cudaStream_t stream);

}  // namespace ep
