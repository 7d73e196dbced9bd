// combine, send half (split mode): each rank writes the rows it received back into the source's
// IPC combine area, slot [its rank][position on the source], with remote stores.
//
// Protocol, at combine epoch ce = epochs[E_COMBINE] + 1:
//   1. wait REDUCE_DONE[p] >= ce-1 at this rank for every peer p: p has finished summing the
//      previous combine out of its combine area, so this rank may overwrite its slots there.
//   2. copy; the last block releases COMBINE[me] = ce at every peer (the reduce kernel waits on it).
// Rows this rank sent itself are not copied: the reduce reads them in place. A timeout records the
// missing peer with K_SEND and returns. Row i is x[x_rows[i]] where the call routes x (nvlink.h, CombineRoute).
#include "common/copy.cuh"
#include "common/error.h"
#include "nvlink/device.cuh"
#include "nvlink/kernels.h"

namespace ep {
namespace nvl {
namespace {

// A warp owns an equal contiguous share of the rows that go to other ranks; per batch of 32 rows,
// lane j resolves row j's destination slot, then the batch is copied as one flat stream of 16-byte
// vectors (local loads, remote stores), kPullU vectors per lane per round.
__global__ void __launch_bounds__(kThreads)
combine_send_kernel(Ctx c, const int4* __restrict__ x, const int* __restrict__ recv_off) {
  __shared__ int s_off[kMaxRanks + 1];
  __shared__ int s_fail;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int W = c.world, me = c.rank;
  const int ce = c.epochs[E_COMBINE] + 1;
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  if (tid <= W) s_off[tid] = recv_off[tid];
  // The source must have finished reducing the previous combine out of its combine area.
  if (block_wait_peers(c, F_REDUCE_DONE, ce - 1, me, K_SEND, deadline, &s_fail)) return;
  const int R = s_off[W];
  const int self_lo = s_off[me], self_n = s_off[me + 1] - s_off[me];
  const int n16 = c.hidden * 2 / 16;
  const size_t row_bytes = static_cast<size_t>(c.hidden) * 2;
  const int gw = blockIdx.x * nwarps + warp, NW = gridDim.x * nwarps;
  const int nsend = R - self_n;
  const int per_warp = (nsend + NW - 1) / NW;
  const int k0 = min(nsend, gw * per_warp), k1 = min(nsend, k0 + per_warp);
  for (int b = k0; b < k1; b += 32) {
    const int nrows = min(32, k1 - b);
    int row = 0, src = 0, slot = 0;
    long long xr = 0;  // row of x (CombineRoute::x_rows), resolved once per row
    if (lane < nrows) {
      const int k = b + lane;
      row = k < self_lo ? k : k + self_n;  // skip the rows this rank sent itself
      src = find_src(s_off, W, row);
      slot = me * c.max_tokens + (row - s_off[src]);
      xr = static_cast<long long>(x_row(c, row));
    }
    warp_copy_rows<kPullU>(
        nrows * n16, n16, lane,
        [&](int j) {
          const long long r = __shfl_sync(kFull, xr, j);
          return [=](int vi) { return x + static_cast<size_t>(r) * n16 + (vi - j * n16); };
        },
        [&](int j) {
          const int s = __shfl_sync(kFull, src, j), sl = __shfl_sync(kFull, slot, j);
          return [=, &c](int vi) {
            return reinterpret_cast<int4*>(c.peers[s] + c.off_combine + static_cast<size_t>(sl) * row_bytes) +
                   (vi - j * n16);
          };
        });
  }
  if (last_block(c.counters + C_SEND)) {
    if (tid < W && tid != me) st_release_sys(flag_at(c, tid, F_COMBINE, me), ce);
  }
}

}  // namespace

void launch_combine_send(const Ctx& c, int blocks, const int4* x, const int* recv_off, cudaStream_t stream) {
  combine_send_kernel<<<blocks, kThreads, 0, stream>>>(c, x, recv_off);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nvl
}  // namespace ep
