// notify: the first step of a dispatch. One block computes where this rank's tokens go and tells
// every peer how many rows (and rows per expert) to expect from it.
//
// Protocol, at epoch n = epochs[E_NOTIFY] + 1 (d = epochs[E_DISPATCH], the last finished dispatch):
//   1. wait META_ACK[p] >= n-1 at this rank for every peer p: p has read the counts this rank wrote
//      into p's meta area last time, so they may be overwritten; and PULL_DONE[p] >= d: p has
//      finished pulling from this rank's send list, which step 2 rewrites.
//   2. build send_pos / is_in / send_list (this rank's buffer), write meta[me] = {rows, per-expert
//      counts} into every peer's meta area, fence, then release COUNT[me] = n at every rank.
//   3. wait COUNT[p] >= n for every peer, read the meta area: receive offsets, counts per local
//      expert (device outputs and host-mapped info).
//   4. release META_ACK[me] = n at every peer; epochs[E_NOTIFY] = n.
// A timeout in any wait records the missing peer with K_NOTIFY and returns; the host sees err.
#include "common/error.h"
#include "common/token_mask.cuh"
#include "nvlink/device.cuh"
#include "nvlink/kernels.h"

namespace ep {
namespace nvl {
namespace {

constexpr int kNotifyThreads = 1024;

__global__ void __launch_bounds__(kNotifyThreads, 1)
notify_kernel(Ctx c, const int64_t* __restrict__ topk_idx, int T, int K, int* __restrict__ send_pos,
              bool* __restrict__ is_in, int* __restrict__ recv_off, int64_t* __restrict__ tpe) {
  extern __shared__ int s_ecnt[];  // [num_experts]
  __shared__ int s_wsum[32][kMaxRanks];
  __shared__ int s_total[kMaxRanks];
  __shared__ int s_fail;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int W = c.world, me = c.rank, EL = c.local_experts, E = c.num_experts;
  const int n = c.epochs[E_NOTIFY] + 1;
  const int e_prev = c.epochs[E_DISPATCH];
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  for (int i = tid; i < E; i += blockDim.x) s_ecnt[i] = 0;

  // Peers must have consumed my previous meta and finished reading my send list / stage.
  if (block_wait_peers(c, F_META_ACK, n - 1, me, K_NOTIFY, deadline, &s_fail)) return;
  if (block_wait_peers(c, F_PULL_DONE, e_prev, me, K_NOTIFY, deadline, &s_fail)) return;

  // Pass 1: per-thread contiguous token range, counts per destination rank and per expert.
  const int per = (T + blockDim.x - 1) / blockDim.x;
  const int t0 = min(T, tid * per), t1 = min(T, t0 + per);
  int cnt[kMaxRanks];
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) cnt[r] = 0;
  bool bad_id = false;  // reported through host memory so that EPBuffer needs no check kernels of its own
  for (int t = t0; t < t1; ++t) {
    const int64_t* row = topk_idx + static_cast<size_t>(t) * K;
    const unsigned m = token_rank_mask<unsigned, true>(row, K, EL, E, s_ecnt);
    for (int k = 0; k < K; ++k) bad_id |= row[k] < -1 || row[k] >= E;
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) cnt[r] += (m >> r) & 1u;
  }
  if (bad_id) c.host->bad_expert_ids = 1;
  // Block-wide exclusive scan of cnt[r] over threads (thread order = token order).
  int incl[kMaxRanks];
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) {
    int v = cnt[r];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int u = __shfl_up_sync(kFull, v, d);
      if (lane >= d) v += u;
    }
    incl[r] = v;
    if (lane == 31) s_wsum[warp][r] = v;
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      const int orig = lane < nwarps ? s_wsum[lane][r] : 0;
      int v = orig;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int u = __shfl_up_sync(kFull, v, d);
        if (lane >= d) v += u;
      }
      if (lane < nwarps) s_wsum[lane][r] = v - orig;
      if (lane == 31) s_total[r] = v;
    }
  }
  __syncthreads();
  // Pass 2: the same tokens again (the masks are cheaper to recompute than to keep), now writing
  // each token's slot per destination.
  int* send_list = reinterpret_cast<int*>(c.peers[me] + c.off_send_list);
  int pos[kMaxRanks];
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) pos[r] = s_wsum[warp][r] + incl[r] - cnt[r];
  for (int t = t0; t < t1; ++t) {
    const unsigned m = token_rank_mask<unsigned, false>(topk_idx + static_cast<size_t>(t) * K, K, EL, E, nullptr);
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      if (r < W) {
        const bool in = (m >> r) & 1u;
        send_pos[static_cast<size_t>(t) * W + r] = in ? pos[r] : -1;
        is_in[static_cast<size_t>(t) * W + r] = in;
        if (in) send_list[static_cast<size_t>(r) * c.max_tokens + pos[r]++] = t;
      }
    }
  }

  // Counts to every rank: meta[me] at rank p = {rows for p, per-expert counts of p's experts}.
  const int stride = 1 + EL;
  for (int i = tid; i < W * stride; i += blockDim.x) {
    const int p = i / stride, j = i % stride;
    const int v = j == 0 ? s_total[p] : s_ecnt[p * EL + j - 1];
    volatile int* dst = reinterpret_cast<int*>(c.peers[p] + c.off_meta) + me * stride + j;
    *dst = v;
  }
  if (tid < W) c.host->send_counts[tid] = s_total[tid];
  __threadfence_system();
  __syncthreads();
  if (tid < W) st_release_sys(flag_at(c, tid, F_COUNT, me), n);
  if (block_wait_peers(c, F_COUNT, n, me, K_NOTIFY, deadline, &s_fail)) return;

  const int* meta = reinterpret_cast<const int*>(c.peers[me] + c.off_meta);
  if (tid == 0) {
    int acc = 0;
    for (int s = 0; s < W; ++s) {
      const int v = ld_volatile(meta + s * stride);
      recv_off[s] = acc;
      c.host->recv_counts[s] = v;
      acc += v;
    }
    recv_off[W] = acc;
    c.host->num_recv = acc;
  }
  for (int j = tid; j < EL; j += blockDim.x) {
    int sum = 0;
    for (int s = 0; s < W; ++s) sum += ld_volatile(meta + s * stride + 1 + j);
    tpe[j] = sum;
    c.host->tokens_per_expert[j] = sum;
  }
  __syncthreads();
  if (tid < W && tid != me) st_release_sys(flag_at(c, tid, F_META_ACK, me), n);
  if (tid == 0) c.epochs[E_NOTIFY] = n;
}

}  // namespace

void launch_notify(const Ctx& c, const int64_t* topk_idx, int T, int K, int* send_pos, bool* is_in,
                   int* recv_off, int64_t* tpe, cudaStream_t stream) {
  // Per-expert counts live in shared memory, within the default 48 KiB a launch may ask for.
  const size_t smem = sizeof(int) * c.num_experts;
  EP_CHECK_ARG(smem <= 48 * 1024, "too many experts for the notify kernel: num_experts=%d, at most %d",
               c.num_experts, static_cast<int>(48 * 1024 / sizeof(int)));
  notify_kernel<<<1, kNotifyThreads, smem, stream>>>(c, topk_idx, T, K, send_pos, is_in, recv_off, tpe);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nvl
}  // namespace ep
