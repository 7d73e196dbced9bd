// EPGroupedMLP's output rows past the last expert's end, zeroed on the device (ep_plugin/integrations/megatron/
// experts.py, zero_tail_rows_). A worst-case-sized dispatch (comm.host_sync false) hands the experts every row
// the rank could receive; grouped_mm leaves the rows past the last end unwritten, and the contract is zero there.
//
// Why a kernel: the torch form, out.masked_fill_(rows >= ends[-1], 0), is a broadcast elementwise pass that reads
// and writes all N rows, and autograd's copy of it zeroes the gradient's tail in a second such pass. At EP4 the worst
// case is ~4x the rows received (N = 131072 rows of 14 KB per rank for 4096 tokens, top-8): the two passes read
// the 2x H200 profile's +3.5 ms of elementwise_kernel against exact rows (benchmarks/results/
// megatron_layer_profile_2x_h200_2026-11-23.log). Here only the tail is written, with 16-byte stores, and the
// gradient passes through (the grouped GEMMs' backward reads no row past the last end).
#include "experts/zero_tail.h"

#include "common/error.h"
#include "experts/rows_in_use.cuh"

namespace ep {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
zero_rows_from_kernel(int4* __restrict__ base, long long rows, long long row_vecs, const int* __restrict__ ends,
                      int groups) {
  const long long start = rows_in_use(ends, groups, rows);
  const long long end = rows * row_vecs;
  const int4 zero = make_int4(0, 0, 0, 0);
  const long long stride = static_cast<long long>(gridDim.x) * kThreads;
  for (long long i = start * row_vecs + static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x; i < end;
       i += stride)
    base[i] = zero;
}

}  // namespace

void launch_zero_rows_from(void* base, int64_t rows, int64_t row_bytes, const int* ends, int groups, int max_blocks,
                           cudaStream_t stream) {
  EP_CHECK_ARG(rows >= 0 && row_bytes > 0 && row_bytes % 16 == 0, "zero_rows_from: rows %lld of %lld bytes (a "
               "positive multiple of 16)", static_cast<long long>(rows), static_cast<long long>(row_bytes));
  EP_CHECK_ARG(reinterpret_cast<uintptr_t>(base) % 16 == 0, "zero_rows_from: the rows must be 16-byte aligned");
  EP_CHECK_ARG(groups == 0 || ends != nullptr, "zero_rows_from: %d groups without their ends", groups);
  EP_CHECK_ARG(max_blocks >= 1, "zero_rows_from: max_blocks must be positive, got %d", max_blocks);
  const long long vecs = static_cast<long long>(rows) * (row_bytes / 16);
  if (vecs == 0) return;
  // enough blocks for every row (the tail's size is known on the device only), capped: a grid-stride loop
  const long long want = (vecs + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(want < max_blocks ? want : max_blocks);
  zero_rows_from_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<int4*>(base), rows, row_bytes / 16, ends, groups);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep
