// combine, fused mode: one kernel whose warps first send rows and then reduce tokens, so a source
// starts summing its early tokens while later rows are still in flight.
//
// Protocol, at combine epoch ce = epochs[E_COMBINE] + 1:
//   1. wait REDUCE_DONE[p] >= ce-1 at this rank for every peer p: p has finished the previous
//      combine with its combine area and its arrival counters.
//   2. send unit (32 rows for one source s): copy into s's combine area, fence, then add, per
//      8-token chunk of s's tokens, the number of rows delivered to s's arrival counter
//      arrive[chunk][me] with a release reduction.
//      reduce unit (one chunk of this rank's tokens): wait until arrive[chunk][p] reaches the rows
//      expected from p (from send_pos), sum, then zero those counters for the next combine.
//   3. the last block releases REDUCE_DONE[me] = ce at every peer and sets epochs[E_COMBINE] = ce
//      unless the call was aborted, and resets the work queue.
// The step-1 wait records a timeout with K_SEND, a chunk wait with K_REDUCE; a warp that fails
// stops taking work but still reaches the last-block barrier.
#include "common/copy.cuh"
#include "common/error.h"
#include "nvlink/combine_sum.cuh"
#include "nvlink/kernels.h"

namespace ep {
namespace nvl {
namespace {

// Warps take work units from a queue: first the send units (units interleave the sources so every
// source's early tokens go first), then the reduce units (kChunk tokens each, in token order).
// Sending and reducing overlap.
template <int MAXW, int U>
__global__ void __launch_bounds__(kThreads)
combine_fused_kernel(Ctx c, const int4* __restrict__ x, const int* __restrict__ send_pos,
                     const int* __restrict__ recv_off, const int* __restrict__ recv_src, int4* __restrict__ y,
                     int T) {
  __shared__ int s_off[kMaxRanks + 1];
  __shared__ int s_fail;
  const int tid = threadIdx.x, lane = tid & 31;
  const int W = c.world, me = c.rank;
  const int ce = c.epochs[E_COMBINE] + 1;
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  if (tid <= W) s_off[tid] = recv_off[tid];
  // The sources must have finished the previous combine with their combine area and counters.
  if (block_wait_peers(c, F_REDUCE_DONE, ce - 1, me, K_SEND, deadline, &s_fail)) return;
  const int self_lo = s_off[me];
  const int n16 = c.hidden * 2 / 16;
  const size_t row_bytes = static_cast<size_t>(c.hidden) * 2;
  const int npeers = W - 1;
  int max_nb = 0;
  for (int s = 0; s < W; ++s)
    if (s != me) max_nb = max(max_nb, (s_off[s + 1] - s_off[s] + 31) / 32);
  const int nsend = npeers > 0 ? max_nb * npeers : 0;
  const int nchunks = (T + kChunk - 1) / kChunk;
  bool failed = false;
  while (!failed) {
    int unit = 0;
    if (lane == 0) unit = static_cast<int>(atomicAdd(c.counters + C_QUEUE, 1u));
    unit = __shfl_sync(kFull, unit, 0);
    if (unit < nsend) {
      const int si = unit % npeers, s = si < me ? si : si + 1;
      const int b = (unit / npeers) * 32;
      const int cnt = s_off[s + 1] - s_off[s];
      if (b >= cnt) continue;
      const int nrows = min(32, cnt - b);
      const int row0 = s_off[s] + b;  // rows row0 .. row0+nrows-1 come from source s, slots b ..
      char* dst0 = c.peers[s] + c.off_combine + (static_cast<size_t>(me) * c.max_tokens + b) * row_bytes;
      const int total = nrows * n16;
      if (c.route.x_rows == nullptr) {
        const int4* src0 = x + static_cast<size_t>(row0) * n16;  // contiguous rows, contiguous slots
        warp_copy_rows<kPullU>(total, n16, lane, contiguous(src0), contiguous(reinterpret_cast<int4*>(dst0)));
      } else {  // rows x[x_rows[row0 + j]] (CombineRoute), resolved once per row by lane j
        const long long xr = lane < nrows ? static_cast<long long>(x_row(c, row0 + lane)) : 0;
        warp_copy_rows<kPullU>(
            total, n16, lane,
            [&](int j) {
              const long long r = __shfl_sync(kFull, xr, j);
              return [=](int vi) { return x + static_cast<size_t>(r) * n16 + (vi - j * n16); };
            },
            contiguous(reinterpret_cast<int4*>(dst0)));
      }
      __threadfence_system();
      __syncwarp();
      const int ch = lane < nrows ? recv_src[row0 + lane] / kChunk : -1;
      const unsigned m = __match_any_sync(kFull, ch);
      if (ch >= 0 && lane == __ffs(m) - 1) {
        int* ctr = reinterpret_cast<int*>(c.peers[s] + c.off_arrive) + ch * kMaxRanks + me;
        red_add_release_sys(ctr, __popc(m));
      }
    } else if (unit - nsend < nchunks) {
      if (!reduce_chunk<MAXW, U>(c, x, send_pos, self_lo, y, T, unit - nsend, lane, deadline)) {
        failed = true;
        break;
      }
    } else {
      break;
    }
  }
  // Every warp reaches the block barrier of last_block (a failed warp only stops taking work).
  finish_queued_combine(c, ce);
}

}  // namespace

void launch_combine_fused(const Ctx& c, int blocks, const int4* x, const int* send_pos, const int* recv_off,
                          const int* recv_src, int4* y, int T, cudaStream_t stream) {
  // recv_src may be null when this rank received no rows (the kernel then never reads it)
  if (c.world <= 4)
    combine_fused_kernel<4, 3><<<blocks, kThreads, 0, stream>>>(c, x, send_pos, recv_off, recv_src, y, T);
  else
    combine_fused_kernel<8, 2><<<blocks, kThreads, 0, stream>>>(c, x, send_pos, recv_off, recv_src, y, T);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nvl
}  // namespace ep
