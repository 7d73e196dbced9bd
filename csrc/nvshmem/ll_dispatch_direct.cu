// Low-latency dispatch into the output sets in the heap (ll_device.cuh, "Output sets"): every source
// sends its rows per expert to every rank first, waits for those of the lower ranks (they place its
// rows), then writes each (token, expert) row with its token and combine slot straight into the
// owner's set, and signals each rank. The receive half is one block: it waits for the signals and
// writes recv_count and layout_range. Nothing is copied on the receiving side.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "nvshmem/ll_device.cuh"
#include "nvshmem/ll_kernels.h"
#include "nvshmem/ll_send.cuh"

namespace ep {
namespace ll {
namespace {

__device__ __forceinline__ int* cnt_all_at(const Ctx& c, char* base, int p, int s, int e) {
  return reinterpret_cast<int*>(base + c.cnt_all[p]) + static_cast<long long>(s) * c.num_experts + e;
}

// This rank's rows per global expert -> cnt_all[p][rank][*] at every rank not left out, then cnt_flag.
__device__ void broadcast_counts(const Ctx& c, int p, int epoch, const int* s_topk, int TK, int* s_hist) {
  const int E = c.num_experts;
  expert_histogram(s_topk, TK, E, s_hist);
  for (int i = threadIdx.x; i < c.world * E; i += blockDim.x) {
    const int d = i / E, e = i % E;
    if (!left_out(c, d)) *cnt_all_at(c, c.peer[d], p, c.rank, e) = s_hist[e];
  }
  __syncthreads();
  for (int d = threadIdx.x; d < c.world; d += blockDim.x) {
    if (left_out(c, d)) continue;
    __threadfence_system();
    st_release_sys(flag_word(c.peer[d], c.cnt_flag[p], c.rank), epoch + 1);
  }
}

// The rows of this block's tokens. s_low[s] (s < rank): source s's counts are in (0: left out).
template <bool kFp8>
__device__ void send_rows(const Ctx& c, int p, int set, const int4* x, const int* s_topk, int T, int K,
                          int round_scale, const int* s_low, int* self_pos) {
  __shared__ int s_slot[32];
  __shared__ char* s_dst[32];      // the owner's set, or nullptr (nowhere)
  __shared__ long long s_at[32];   // el * W*M + row in that set
  const int EL = c.local_experts, WM = c.world * c.max_tokens, S = c.hidden / 128;
  const int n16 = c.hidden / 8;
  const long long row_bytes = kFp8 ? c.hidden : 2ll * c.hidden;
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    token_slots(s_topk, t, K, s_slot);
    if (threadIdx.x < K) {
      const int k = threadIdx.x, e = s_topk[t * K + k];
      char* dst = nullptr;
      long long at = 0;
      if (e >= 0) {
        int row = s_slot[k];
        for (int s = 0; s < c.rank; ++s)
          if (s_low[s]) row += ld_volatile(cnt_all_at(c, c.heap, p, s, e));
        if (row < WM) {  // always (a source gives an expert at most M rows): a guard, never past the set
          dst = c.peer[e / EL] + c.out_set[set];
          at = static_cast<long long>(e % EL) * WM + row;
          reinterpret_cast<int*>(dst + c.set_src_info)[at] = t;
          reinterpret_cast<int*>(dst + c.set_row_slot)[at] = (c.rank * c.max_tokens + t) * c.max_topk + k;
          if (e / EL == c.rank && self_pos != nullptr) self_pos[t * c.max_topk + k] = static_cast<int>(at);
        }
      }
      s_dst[k] = dst;
      s_at[k] = at;
    }
    __syncthreads();
    stream_row<kFp8>(
        x + static_cast<long long>(t) * n16, n16, round_scale,
        [&](int j, const int4& v) {
          for (int k = 0; k < K; ++k)
            if (s_dst[k] != nullptr) st_na_v4(reinterpret_cast<int4*>(s_dst[k] + s_at[k] * row_bytes) + j, v);
        },
        [&](int j, const uint2& q, float scale, bool first) {
          for (int k = 0; k < K; ++k) {
            char* d = s_dst[k];
            if (d == nullptr) continue;
            reinterpret_cast<uint2*>(d + s_at[k] * row_bytes)[j] = q;
            if (first) {  // scales are [EL][S][W*M]
              const long long el = s_at[k] / WM, row = s_at[k] % WM;
              reinterpret_cast<float*>(d + c.set_scales)[(el * S + j / 16) * WM + row] = scale;
            }
          }
        });
    __syncthreads();
  }
}

// Block 0 of the receive half: every source's signal, then recv_count, layout_range and the stats
// from the counts (already here: they came before the rows).
__device__ void receive_counts(const Ctx& c, const DispatchOut& o) {
  const int W = c.world, EL = c.local_experts, WM = W * c.max_tokens;
  const int epoch = ld_volatile(c.state + kDispRecvEpoch);
  const int p = epoch & 1;
  __shared__ int s_ok[kMaxRanks];
  for (int s = threadIdx.x; s < W; s += blockDim.x)
    s_ok[s] = !left_out(c, s) && wait_signal(c, c.disp_flag[p], s, epoch + 1, kKernelDispatch);
  __syncthreads();
  for (int el = threadIdx.x; el < EL; el += blockDim.x) {
    int begin = 0;
    for (int s = 0; s < W; ++s) {
      const int n = s_ok[s] ? min(ld_volatile(cnt_all_at(c, c.heap, p, s, c.rank * EL + el)), WM - begin) : 0;
      o.layout_range[el * W + s] = (static_cast<long long>(begin) << 32) | static_cast<long long>(n);
      begin += n;
    }
    o.recv_count[el] = begin;
    if (o.recv_stats != nullptr) o.recv_stats[el] += begin;
  }
  __syncthreads();
  if (threadIdx.x == 0) c.state[kDispRecvEpoch] = epoch + 1;
}

}  // namespace

template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1)
    dispatch_direct(Ctx c, const int4* x, const int64_t* topk_idx, int T, int K, int phases, int round_scale,
                    int set, DispatchOut o) {
  extern __shared__ int smem[];
  if (phases & kSend) {
    const int epoch = ld_volatile(c.state + kDispSendEpoch);
    const int p = epoch & 1;
    int* s_topk = smem;  // [T*K], then the last block's histogram [E]
    load_topk(c, topk_idx, T, K, s_topk);
    // the last block has no token when the grid outnumbers the tokens: it sends the counts
    if (blockIdx.x == gridDim.x - 1) broadcast_counts(c, p, epoch, s_topk, T * K, s_topk + T * K);
    __shared__ int s_low[kMaxRanks];
    __shared__ int s_lost;
    if (threadIdx.x == 0) s_lost = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < c.rank; s += blockDim.x) {
      const bool in = !left_out(c, s);
      const bool got = in && wait_signal(c, c.cnt_flag[p], s, epoch + 1, kKernelDispatch);
      s_low[s] = got;
      if (in && !got) s_lost = 1;
    }
    __syncthreads();
    // without a lower rank's counts this rank's rows have no place: none is sent (the timeout is recorded)
    if (!s_lost) send_rows<kFp8>(c, p, set, x, s_topk, T, K, round_scale, s_low, o.self_pos);
    if (last_block(ticket(c, kTicketDispSend))) {
      signal_ranks(c, c.disp_flag[p], epoch);
      __syncthreads();
      if (threadIdx.x == 0) c.state[kDispSendEpoch] = epoch + 1;
    }
  }
  if ((phases & kRecv) && blockIdx.x == 0) {
    __syncthreads();
    receive_counts(c, o);
  }
}

template __global__ void dispatch_direct<false>(Ctx, const int4*, const int64_t*, int, int, int, int, int, DispatchOut);
template __global__ void dispatch_direct<true>(Ctx, const int4*, const int64_t*, int, int, int, int, int, DispatchOut);

}  // namespace ll
}  // namespace ep
