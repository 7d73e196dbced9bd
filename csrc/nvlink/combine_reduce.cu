// combine, reduce half (split mode): the source sums, per token, the slots its peers wrote into its
// combine area (combine_send.cu) and its own rows read in place, into y (after combine_expert.cu,
// self_in_area: its own rows too come from its own slots of the area).
//
// Protocol, at combine epoch ce = epochs[E_COMBINE] + 1:
//   1. wait COMBINE[p] >= ce at this rank for every peer p: every slot of this combine is written.
//   2. sum; the last block releases REDUCE_DONE[me] = ce at every peer (p may now overwrite its
//      slots here in the next combine, and reuse the rows it received) and sets
//      epochs[E_COMBINE] = ce.
// A timeout records the missing peer with K_REDUCE and returns.
#include "common/error.h"
#include "nvlink/combine_sum.cuh"
#include "nvlink/kernels.h"

namespace ep {
namespace nvl {
namespace {

// A warp per token, after every peer has flagged COMBINE.
template <int MAXW, int U>
__global__ void __launch_bounds__(kThreads)
combine_reduce_kernel(Ctx c, const int4* __restrict__ x, const int* __restrict__ send_pos,
                      const int* __restrict__ recv_off, int4* __restrict__ y, int T, bool self_in_area) {
  __shared__ int s_fail;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int W = c.world, me = c.rank;
  const int ce = c.epochs[E_COMBINE] + 1;
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  if (block_wait_peers(c, F_COMBINE, ce, me, K_REDUCE, deadline, &s_fail)) return;
  const int self_lo = recv_off[me];
  const int gw = blockIdx.x * nwarps + warp, NW = gridDim.x * nwarps;
  for (int t = gw; t < T; t += NW) reduce_token<MAXW, U>(c, x, send_pos, self_lo, y, t, lane, self_in_area);
  fence_routed_sums(c);
  if (last_block(c.counters + C_REDUCE)) {
    if (tid < W && tid != me) st_release_sys(flag_at(c, tid, F_REDUCE_DONE, me), ce);
    if (tid == 0) c.epochs[E_COMBINE] = ce;
  }
}

}  // namespace

void launch_combine_reduce(const Ctx& c, int blocks, const int4* x, const int* send_pos, const int* recv_off,
                           int4* y, int T, bool self_in_area, cudaStream_t stream) {
  // MAXW slot loads in flight per vector column: fewer ranks afford more columns (U) per round.
  if (c.world <= 4)
    combine_reduce_kernel<4, 4><<<blocks, kThreads, 0, stream>>>(c, x, send_pos, recv_off, y, T, self_in_area);
  else
    combine_reduce_kernel<8, 2><<<blocks, kThreads, 0, stream>>>(c, x, send_pos, recv_off, y, T, self_in_area);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nvl
}  // namespace ep
