// combine of expert-major rows. Each received row is first summed over its local experts' rows (positions from
// the expert-major dispatch, float accumulation in slot order, so the result does not depend on timing) -- the
// unpermute of a grouped-GEMM MoE layer -- and written as BF16 either
//   - into the source's combine area, slot [this rank][position on the source] (the rows this rank sent itself
//     too, into its own area, so that the reduce kernel reads every slot from there): the split combine's send
//     half, done on the way out; the reduce half is combine_reduce.cu with self_in_area = 1; or
//   - into local rank-major rows (expert_sum_kernel), which the pull and push combine kernels then take as any
//     rank-major combine's x: the sum costs one local pass, and the exchange runs at the planned kernel's rate; or
//   - as the pull combine's stager (expert_stage_kernel, Runtime::combine_expert_staged): straight into this rank's
//     combine area, slot [owner][position on this rank], a COMBINE_READY release behind every sub-chunk, on the SMs
//     the pull kernel leaves free and beside it. Why: summed first, the expert combine took the sum's pass plus the
//     exchange (4x H100, EP4, queued: ~280 + ~580 us); beside it the owners start loading once the first sub-chunks
//     are summed, and the sum's write of rank-major rows and the stager's re-read of them are gone.
//
// Protocol as combine_send.cu, at combine epoch ce = epochs[E_COMBINE] + 1: wait REDUCE_DONE[p] >=
// ce-1 for every peer p, write, the last block releases COMBINE[me] = ce at every peer.
#include <cuda_bf16.h>

#include "common/error.h"
#include "nvlink/combine_sum.cuh"
#include "nvlink/kernels.h"

namespace ep {
namespace nvl {
namespace {

constexpr int kU = 2;       // 16-byte vectors per lane per round and position
constexpr int kMaxPos = 8;  // positions (local experts of a row) whose loads are in flight together

// Row i's local experts' rows of x (positions[i * K ..], -1 unused), summed in slot order with float
// accumulation, written to dst in BF16 (n16 16-byte vectors); by one warp. Per round the loads of up to kMaxPos
// positions x kU vectors are all issued before the first is summed: a row costs one memory latency per round, not
// one per position (a row with more local experts takes them kMaxPos at a time, in slot order).
__device__ __forceinline__ void sum_expert_row(const int4* __restrict__ x, const int* __restrict__ positions,
                                               size_t i, int K, int n16, int lane, int4* __restrict__ dst) {
  const int pos = lane < K ? positions[i * K + lane] : -1;
  const unsigned valid = __ballot_sync(kFull, pos >= 0);
  const int npos = __popc(valid);
  // lane q holds the q-th valid position (slot order); `valid` is the same on every lane
  int mine = -1;
  unsigned m = valid;
  for (int q = 0; m; ++q, m &= m - 1) {
    const int p = __shfl_sync(kFull, pos, __ffs(m) - 1);
    if (q == lane) mine = p;
  }
  for (int v0 = 0; v0 < n16; v0 += 32 * kU) {
    float acc[kU][8];
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[u][q] = 0.f;
    for (int p0 = 0; p0 < npos; p0 += kMaxPos) {
      int4 v[kMaxPos][kU];
#pragma unroll
      for (int q = 0; q < kMaxPos; ++q) {
        const int p = __shfl_sync(kFull, mine, min(p0 + q, 31));
        const int4* row = x + static_cast<size_t>(p < 0 ? 0 : p) * n16;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int j = v0 + u * 32 + lane;
          if (p0 + q < npos && j < n16) v[q][u] = ld_nc_v4(row + j);
        }
      }
#pragma unroll
      for (int q = 0; q < kMaxPos; ++q)
#pragma unroll
        for (int u = 0; u < kU; ++u)
          if (p0 + q < npos && v0 + u * 32 + lane < n16) add_bf16x8(acc[u], v[q][u]);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int j = v0 + u * 32 + lane;
      if (j < n16) st_na_v4(dst + j, bf16x8_of(acc[u]));
    }
  }
}

// A warp per received row at a time, its sum into the source's combine area.
__global__ void __launch_bounds__(kThreads)
combine_expert_send_kernel(Ctx c, const int4* __restrict__ x, const int* __restrict__ recv_off,
                           const int* __restrict__ positions, int K) {
  __shared__ int s_off[kMaxRanks + 1];
  __shared__ int s_fail;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int W = c.world, me = c.rank;
  const int ce = c.epochs[E_COMBINE] + 1;
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  if (tid <= W) s_off[tid] = recv_off[tid];
  if (block_wait_peers(c, F_REDUCE_DONE, ce - 1, me, K_SEND, deadline, &s_fail)) return;
  const int R = s_off[W];
  const int n16 = c.hidden * 2 / 16;
  const size_t row_bytes = static_cast<size_t>(c.hidden) * 2;
  const int gw = blockIdx.x * nwarps + warp, NW = gridDim.x * nwarps;
  for (int i = gw; i < R; i += NW) {
    const int src = find_src(s_off, W, i);
    const int slot = me * c.max_tokens + (i - s_off[src]);
    int4* dst = reinterpret_cast<int4*>(c.peers[src] + c.off_combine + static_cast<size_t>(slot) * row_bytes);
    sum_expert_row(x, positions, i, K, n16, lane, dst);
  }
  if (last_block(c.counters + C_SEND)) {
    if (tid < W && tid != me) st_release_sys(flag_at(c, tid, F_COMBINE, me), ce);
  }
}

// A warp per received row at a time, its sum into rows[i]: the rank-major rows any combine kernel takes. No
// peer is touched: a local pass, like the unpermute of a grouped-GEMM MoE layer.
__global__ void __launch_bounds__(kThreads)
expert_sum_kernel(const int4* __restrict__ x, const int* __restrict__ recv_off, const int* __restrict__ positions,
                  int K, int W, int n16, int4* __restrict__ rows) {
  const int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  const int R = recv_off[W];
  const int gw = blockIdx.x * nwarps + (threadIdx.x >> 5), NW = gridDim.x * nwarps;
  for (int i = gw; i < R; i += NW) sum_expert_row(x, positions, i, K, n16, lane, rows + static_cast<size_t>(i) * n16);
}

// The pull combine's stage by summing (launch_expert_stage): units (owner o, sub-chunk of kCombineSub positions)
// in the pull stager's order -- owners interleaved from this rank's successor, this rank's own rows last of each
// round (its own pull kernel loads them from slot [me] like a peer's: kDiagOwnStaged), early positions first -- taken
// by blocks in turn; a warp per row of the unit, then one release of COMBINE_READY[me][sub] = ce at the owner, ce the
// snap kernel's (combine_stage_copies.cu). Never waits on a peer: the snap before it did, and a pull kernel waiting
// on these releases always finds them coming.
__global__ void __launch_bounds__(kThreads)
expert_stage_kernel(Ctx c, const int4* __restrict__ x, const int* __restrict__ recv_off,
                    const int* __restrict__ positions, int K) {
  __shared__ int s_off[kMaxRanks + 1];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int W = c.world, me = c.rank;
  if (ld_volatile(c.aborted)) return;  // the snap timed out: it recorded no epoch to release
  const int ce = *c.combine_ce;
  if (tid <= W) s_off[tid] = recv_off[tid];
  __syncthreads();
  int most = 0;
  for (int o = 0; o < W; ++o) most = max(most, s_off[o + 1] - s_off[o]);
  const int subs = (most + kCombineSub - 1) / kCombineSub, n16 = c.hidden * 2 / 16;
  int4* const area = reinterpret_cast<int4*>(c.peers[me] + c.off_combine);
  for (int u = blockIdx.x; u < subs * W; u += gridDim.x) {
    const int o = (me + 1 + u % W) % W, q0 = (u / W) * kCombineSub, cnt = s_off[o + 1] - s_off[o];
    if (q0 >= cnt) continue;
    const int n = min(kCombineSub, cnt - q0);
    for (int j = warp; j < n; j += nwarps)
      sum_expert_row(x, positions, static_cast<size_t>(s_off[o] + q0 + j), K, n16, lane,
                     area + (static_cast<size_t>(o) * c.max_tokens + q0 + j) * n16);
    __syncthreads();  // the unit's rows, every warp's, before its flag
    if (tid == 0) {
      __threadfence_system();
      st_release_sys(combine_ready_at(c, o, me, q0 / kCombineSub), ce);
    }
  }
}

}  // namespace

void launch_expert_stage(const Ctx& c, int blocks, const int4* x, const int* recv_off, const int* positions, int K,
                         cudaStream_t stream) {
  expert_stage_kernel<<<blocks, kThreads, 0, stream>>>(c, x, recv_off, positions, K);
  EP_CUDA_CHECK(cudaGetLastError());
}

void launch_combine_expert_send(const Ctx& c, int blocks, const int4* x, const int* recv_off, const int* positions,
                                int K, cudaStream_t stream) {
  combine_expert_send_kernel<<<blocks, kThreads, 0, stream>>>(c, x, recv_off, positions, K);
  EP_CUDA_CHECK(cudaGetLastError());
}

void launch_expert_sum(const Ctx& c, int blocks, const int4* x, const int* recv_off, const int* positions, int K,
                       int4* rows, cudaStream_t stream) {
  expert_sum_kernel<<<blocks, kThreads, 0, stream>>>(x, recv_off, positions, K, c.world, c.hidden * 2 / 16, rows);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nvl
}  // namespace ep
