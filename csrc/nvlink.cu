// Kernels and host runtime of the nvlink backend (see nvlink.h for the protocol).
#include <cuda_bf16.h>

#include <cstring>
#include <stdexcept>

#include "common.h"
#include "nvlink.h"

namespace ep {
namespace nvl {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kNotifyThreads = 1024;
constexpr int kThreads = 512;

// ------------------------------------------------------------------ memory-model helpers
__device__ __forceinline__ int ld_acquire_sys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(int* p, int v) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_volatile(const int* p) {
  int v;
  asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// 16-byte loads that skip L1 (data written by other GPUs / other kernels).
__device__ __forceinline__ int4 ld_nc_v4(const int4* p) {
  int4 v;
  asm volatile("ld.global.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ void st_na_v4(int4* p, const int4& v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ int* flag_at(const Ctx& c, int owner, int kind, int src) {
  return reinterpret_cast<int*>(c.peers[owner] + c.off_flags) + kind * kMaxRanks + src;
}

// 0 = arrived, 1 = timed out (the peer is missing), 2 = gave up because another wait timed out.
__device__ __forceinline__ int wait_geq(const int* p, int target, unsigned long long deadline,
                                        const int* aborted) {
  unsigned it = 0;
  while (static_cast<int>(static_cast<unsigned>(ld_acquire_sys(p)) - static_cast<unsigned>(target)) < 0) {
    if (((++it) & 127u) == 0) {
      if (ld_volatile(aborted)) return 2;
      if (globaltimer() > deadline) return 1;
    }
  }
  return 0;
}

__device__ void record_timeout(const Ctx& c, int peer, int kernel_id) {
  atomicExch(c.aborted, 1);
  volatile HostInfo* h = c.host;
  h->missing[peer] = 1;
  h->err_kernel = kernel_id;
  __threadfence_system();
  h->err = 1;
  __threadfence_system();
}

// Every thread waits for flag[kind][p] >= target at this rank for p in [0, W) except `skip`
// (thread p waits for peer p). Returns true when the block must stop (timeout or abort).
__device__ bool block_wait_peers(const Ctx& c, int kind, int target, int skip, int kernel_id,
                                 unsigned long long deadline, int* s_fail) {
  const int tid = threadIdx.x;
  if (tid == 0) *s_fail = ld_volatile(c.aborted);
  __syncthreads();
  if (*s_fail) return true;
  if (tid < c.world && tid != skip) {
    int r = wait_geq(flag_at(c, c.rank, kind, tid), target, deadline, c.aborted);
    if (r == 1) record_timeout(c, tid, kernel_id);
    if (r != 0) *s_fail = 1;
  }
  __syncthreads();
  return *s_fail != 0;
}

// True in exactly one block, the last to arrive; all blocks' prior writes are visible to it.
__device__ bool last_block(unsigned* ctr) {
  __shared__ int s_last;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned prev = atomicAdd(ctr, 1u);
    s_last = (prev == gridDim.x - 1);
    if (s_last) {
      atomicExch(ctr, 0u);
      __threadfence_system();
    }
  }
  __syncthreads();
  return s_last != 0;
}

__device__ __forceinline__ int find_src(const int* off, int W, int i) {
  int s = 0;
#pragma unroll
  for (int r = 1; r < kMaxRanks; ++r)
    if (r < W && i >= off[r]) s = r;
  return s;
}

template <int U>
__device__ __forceinline__ void warp_copy(const int4* __restrict__ src, int4* __restrict__ dst,
                                          int n16, int lane) {
  for (int base = 0; base < n16; base += 32 * U) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = base + u * 32 + lane;
      if (j < n16) v[u] = ld_nc_v4(src + j);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = base + u * 32 + lane;
      if (j < n16) st_na_v4(dst + j, v[u]);
    }
  }
}

__device__ __forceinline__ unsigned token_mask(const int64_t* row, int K, int EL, int E, int* ecnt) {
  unsigned mask = 0;
  for (int k = 0; k < K; ++k) {
    const int64_t e = row[k];
    if (e < 0 || e >= E) continue;
    if (ecnt) atomicAdd(&ecnt[e], 1);
    mask |= 1u << static_cast<int>(e / EL);
  }
  return mask;
}

// ------------------------------------------------------------------ notify
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
  if (block_wait_peers(c, F_META_ACK, n - 1, me, 1, deadline, &s_fail)) return;
  if (block_wait_peers(c, F_PULL_DONE, e_prev, me, 1, deadline, &s_fail)) return;

  // Pass 1: per-thread contiguous token range, counts per destination rank and per expert.
  const int per = (T + blockDim.x - 1) / blockDim.x;
  const int t0 = min(T, tid * per), t1 = min(T, t0 + per);
  int cnt[kMaxRanks];
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) cnt[r] = 0;
  for (int t = t0; t < t1; ++t) {
    const unsigned m = token_mask(topk_idx + static_cast<size_t>(t) * K, K, EL, E, s_ecnt);
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) cnt[r] += (m >> r) & 1u;
  }
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
  int* send_list = reinterpret_cast<int*>(c.peers[me] + c.off_send_list);
  int pos[kMaxRanks];
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) pos[r] = s_wsum[warp][r] + incl[r] - cnt[r];
  for (int t = t0; t < t1; ++t) {
    const unsigned m = token_mask(topk_idx + static_cast<size_t>(t) * K, K, EL, E, nullptr);
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
  if (block_wait_peers(c, F_COUNT, n, me, 1, deadline, &s_fail)) return;

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

// ------------------------------------------------------------------ stage
__global__ void __launch_bounds__(kThreads)
stage_kernel(Ctx c, const int4* __restrict__ x, int T, int row_bytes, const float* __restrict__ scales,
             int nscales, const int64_t* __restrict__ idx, const float* __restrict__ w, int K) {
  __shared__ int s_fail;
  const int e = c.epochs[E_DISPATCH] + 1;
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  if (block_wait_peers(c, F_PULL_DONE, e - 1, c.rank, 2, deadline, &s_fail)) return;
  char* base = c.peers[c.rank];
  const size_t gtid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t gsize = static_cast<size_t>(gridDim.x) * blockDim.x;
  {
    int4* dst = reinterpret_cast<int4*>(base + c.off_stage_x);
    const size_t n = static_cast<size_t>(T) * row_bytes / 16;
    constexpr int kU = 8;  // 8 x 16 B loads in flight per thread
    size_t i = gtid;
    for (; i + (kU - 1) * gsize < n; i += kU * gsize) {
      int4 v[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) v[u] = ld_nc_v4(x + i + u * gsize);
#pragma unroll
      for (int u = 0; u < kU; ++u) st_na_v4(dst + i + u * gsize, v[u]);
    }
    for (; i < n; i += gsize) st_na_v4(dst + i, ld_nc_v4(x + i));
  }
  if (scales) {
    float* dst = reinterpret_cast<float*>(base + c.off_stage_scales);
    const size_t n = static_cast<size_t>(T) * nscales;
    for (size_t i = gtid; i < n; i += gsize) dst[i] = scales[i];
  }
  if (idx) {
    int64_t* dst = reinterpret_cast<int64_t*>(base + c.off_stage_idx);
    const size_t n = static_cast<size_t>(T) * K;
    for (size_t i = gtid; i < n; i += gsize) dst[i] = idx[i];
  }
  if (w) {
    float* dst = reinterpret_cast<float*>(base + c.off_stage_w);
    const size_t n = static_cast<size_t>(T) * K;
    for (size_t i = gtid; i < n; i += gsize) dst[i] = w[i];
  }
  if (last_block(c.counters + C_STAGE)) {
    if (threadIdx.x < c.world) st_release_sys(flag_at(c, threadIdx.x, F_STAGE, c.rank), e);
  }
}

// ------------------------------------------------------------------ pull (dispatch receive)
// A warp owns an equal contiguous share of the received rows and works through it in batches of 32
// rows. Per batch: lane j fetches row j's (source, token) and writes its local topk ids/weights
// (independent remote loads, all in flight together); then the batch's rows are copied as one flat
// stream of 16-byte vectors, kPullU loads per lane in flight, with no bubble between rows.
constexpr int kPullU = 8;

__global__ void __launch_bounds__(kThreads)
pull_kernel(Ctx c, int4* __restrict__ out_x, int row_bytes, float* __restrict__ out_scales, int nscales,
            int64_t* __restrict__ out_idx, float* __restrict__ out_w, int K,
            const int* __restrict__ recv_off, int* __restrict__ recv_src, int cached, int R_alloc) {
  __shared__ int s_off[kMaxRanks + 1];
  __shared__ int s_fail;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int W = c.world, me = c.rank, EL = c.local_experts;
  const int e = c.epochs[E_DISPATCH] + 1;
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  if (tid <= W) s_off[tid] = recv_off[tid];
  if (block_wait_peers(c, F_STAGE, e, -1, 3, deadline, &s_fail)) return;
  const int R = s_off[W];
  const int n16 = row_bytes / 16;
  const int gw = blockIdx.x * nwarps + warp, NW = gridDim.x * nwarps;
  const int64_t lo = static_cast<int64_t>(me) * EL, hi = lo + EL;
  const int per_warp = (R + NW - 1) / NW;
  const int r0 = min(R, gw * per_warp), r1 = min(R, r0 + per_warp);
  for (int b = r0; b < r1; b += 32) {
    const int nrows = min(32, r1 - b);
    const int i = b + lane;
    int src = 0, tok = 0;
    if (lane < nrows) {
      src = find_src(s_off, W, i);
      if (cached) {
        tok = recv_src[i];
      } else {
        const int* sl = reinterpret_cast<const int*>(c.peers[src] + c.off_send_list);
        tok = ld_volatile(sl + static_cast<size_t>(me) * c.max_tokens + (i - s_off[src]));
        recv_src[i] = tok;
      }
      if (out_idx || out_w) {  // this lane's row: local expert ids and weights
        const int64_t* gi = reinterpret_cast<const int64_t*>(c.peers[src] + c.off_stage_idx) + static_cast<size_t>(tok) * K;
        const float* gwt = reinterpret_cast<const float*>(c.peers[src] + c.off_stage_w) + static_cast<size_t>(tok) * K;
        for (int k0 = 0; k0 < K; k0 += 8) {
          int64_t g[8];
          float wv[8];
#pragma unroll
          for (int q = 0; q < 8; ++q) {
            if (k0 + q < K) {
              g[q] = gi[k0 + q];
              wv[q] = out_w ? gwt[k0 + q] : 0.f;
            }
          }
#pragma unroll
          for (int q = 0; q < 8; ++q) {
            if (k0 + q < K) {
              const bool mine = g[q] >= lo && g[q] < hi;
              if (out_idx) out_idx[static_cast<size_t>(i) * K + k0 + q] = mine ? g[q] - lo : -1;
              if (out_w) out_w[static_cast<size_t>(i) * K + k0 + q] = mine ? wv[q] : 0.f;
            }
          }
        }
      }
    }
    // rows of the batch as one flat stream of 16-byte vectors
    const int total = nrows * n16;
    for (int v0 = 0; v0 < total; v0 += 32 * kPullU) {
      int4 v[kPullU];
#pragma unroll
      for (int u = 0; u < kPullU; ++u) {
        const int vi = v0 + u * 32 + lane;
        const int j = min(vi / n16, 31);
        const int s = __shfl_sync(kFull, src, j), t = __shfl_sync(kFull, tok, j);
        if (vi < total)
          v[u] = ld_nc_v4(reinterpret_cast<const int4*>(c.peers[s] + c.off_stage_x + static_cast<size_t>(t) * row_bytes) +
                          (vi - j * n16));
      }
      int4* out_b = out_x + static_cast<size_t>(b) * n16;  // the batch's rows are contiguous in out_x
#pragma unroll
      for (int u = 0; u < kPullU; ++u) {
        const int vi = v0 + u * 32 + lane;
        if (vi < total) st_na_v4(out_b + vi, v[u]);
      }
    }
    if (out_scales) {  // FP8 scales: a flat stream of floats
      const int stotal = nrows * nscales;
      for (int v0 = 0; v0 < stotal; v0 += 32 * 8) {
        float f[8];
        int at[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int vi = v0 + u * 32 + lane;
          const int j = min(vi / nscales, 31);
          const int s = __shfl_sync(kFull, src, j), t = __shfl_sync(kFull, tok, j);
          at[u] = -1;
          if (vi < stotal) {
            const int col = vi - j * nscales;
            f[u] = reinterpret_cast<const float*>(c.peers[s] + c.off_stage_scales)[static_cast<size_t>(t) * nscales + col];
            at[u] = (b + j) * nscales + col;
          }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u)
          if (at[u] >= 0) out_scales[at[u]] = f[u];
      }
    }
  }
  // Worst-case-sized outputs: padding rows route nowhere.
  for (int i = R + blockIdx.x * blockDim.x + tid; i < R_alloc; i += gridDim.x * blockDim.x) {
    for (int k = 0; k < K; ++k) {
      if (out_idx) out_idx[static_cast<size_t>(i) * K + k] = -1;
      if (out_w) out_w[static_cast<size_t>(i) * K + k] = 0.f;
    }
  }
  if (last_block(c.counters + C_PULL)) {
    if (tid < W) st_release_sys(flag_at(c, tid, F_PULL_DONE, me), e);
    if (tid == 0) c.epochs[E_DISPATCH] = e;
  }
}

// ------------------------------------------------------------------ combine
// Send: a warp owns an equal contiguous share of the rows that go to other ranks; per batch of 32
// rows, lane j resolves row j's destination slot, then the batch is copied as one flat stream of
// 16-byte vectors (local loads, remote stores), kPullU vectors per lane per round.
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
  if (block_wait_peers(c, F_REDUCE_DONE, ce - 1, me, 4, deadline, &s_fail)) return;
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
    if (lane < nrows) {
      const int k = b + lane;
      row = k < self_lo ? k : k + self_n;  // skip the rows this rank sent itself
      src = find_src(s_off, W, row);
      slot = me * c.max_tokens + (row - s_off[src]);
    }
    const int total = nrows * n16;
    for (int v0 = 0; v0 < total; v0 += 32 * kPullU) {
      int4 v[kPullU];
#pragma unroll
      for (int u = 0; u < kPullU; ++u) {
        const int vi = v0 + u * 32 + lane;
        const int j = min(vi / n16, 31);
        const int r = __shfl_sync(kFull, row, j);
        if (vi < total) v[u] = ld_nc_v4(x + static_cast<size_t>(r) * n16 + (vi - j * n16));
      }
#pragma unroll
      for (int u = 0; u < kPullU; ++u) {
        const int vi = v0 + u * 32 + lane;
        const int j = min(vi / n16, 31);
        const int s = __shfl_sync(kFull, src, j), sl = __shfl_sync(kFull, slot, j);
        if (vi < total)
          st_na_v4(reinterpret_cast<int4*>(c.peers[s] + c.off_combine + static_cast<size_t>(sl) * row_bytes) +
                       (vi - j * n16),
                   v[u]);
      }
    }
  }
  if (last_block(c.counters + C_SEND)) {
    if (tid < W && tid != me) st_release_sys(flag_at(c, tid, F_COMBINE, me), ce);
  }
}

__device__ __forceinline__ void add_bf16x8(float* acc, const int4& v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(h[q]);
    acc[2 * q] += f.x;
    acc[2 * q + 1] += f.y;
  }
}

// Sum of one token's slots (own rows read in place from x), float accumulation, BF16 out. For each
// chunk of 32*U vectors the loads of all (up to MAXW) slots are issued before any is summed, so one
// chunk costs one memory round trip.
template <int MAXW, int U>
__device__ __forceinline__ void reduce_token(const Ctx& c, const int4* __restrict__ x,
                                             const int* __restrict__ send_pos, int self_lo,
                                             int4* __restrict__ y, int t, int lane) {
  const int W = c.world, me = c.rank;
  const int n16 = c.hidden * 2 / 16;
  const size_t row16 = static_cast<size_t>(n16);
  const int4* area = reinterpret_cast<const int4*>(c.peers[me] + c.off_combine);
  const int mypos = lane < W ? send_pos[static_cast<size_t>(t) * W + lane] : -1;
  const int4* srcp[MAXW];
#pragma unroll
  for (int r = 0; r < MAXW; ++r) {
    const int p = __shfl_sync(kFull, mypos, r);
    srcp[r] = (r < W && p >= 0) ? (r == me ? x + static_cast<size_t>(self_lo + p) * row16
                                          : area + (static_cast<size_t>(r) * c.max_tokens + p) * row16)
                                : nullptr;
  }
  for (int base = 0; base < n16; base += 32 * U) {
    int4 v[MAXW][U];
#pragma unroll
    for (int r = 0; r < MAXW; ++r)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int j = base + u * 32 + lane;
        if (srcp[r] && j < n16) v[r][u] = ld_nc_v4(srcp[r] + j);
      }
    float acc[U][8];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[u][q] = 0.f;
#pragma unroll
    for (int r = 0; r < MAXW; ++r)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int j = base + u * 32 + lane;
        if (srcp[r] && j < n16) add_bf16x8(acc[u], v[r][u]);
      }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = base + u * 32 + lane;
      if (j < n16) {
        int4 o;
        __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
        for (int q = 0; q < 4; ++q) h[q] = __floats2bfloat162_rn(acc[u][2 * q], acc[u][2 * q + 1]);
        y[static_cast<size_t>(t) * row16 + j] = o;
      }
    }
  }
}

// Reduce (split combine): a warp per token, after every peer has flagged COMBINE.
template <int MAXW, int U>
__global__ void __launch_bounds__(kThreads)
combine_reduce_kernel(Ctx c, const int4* __restrict__ x, const int* __restrict__ send_pos,
                      const int* __restrict__ recv_off, int4* __restrict__ y, int T) {
  __shared__ int s_fail;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int W = c.world, me = c.rank;
  const int ce = c.epochs[E_COMBINE] + 1;
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  if (block_wait_peers(c, F_COMBINE, ce, me, 5, deadline, &s_fail)) return;
  const int self_lo = recv_off[me];
  const int gw = blockIdx.x * nwarps + warp, NW = gridDim.x * nwarps;
  for (int t = gw; t < T; t += NW) reduce_token<MAXW, U>(c, x, send_pos, self_lo, y, t, lane);
  if (last_block(c.counters + C_REDUCE)) {
    if (tid < W && tid != me) st_release_sys(flag_at(c, tid, F_REDUCE_DONE, me), ce);
    if (tid == 0) c.epochs[E_COMBINE] = ce;
  }
}

// Fused combine: one kernel whose warps take work units from a queue: first the send units (32
// rows for one source; units interleave the sources so every source's early tokens go first), then
// the reduce units (kChunk tokens each, in token order). After a send unit a warp adds, per
// (chunk, own rank), the rows it delivered to the source's arrival counters; a reduce unit waits
// until every peer's counter for its chunk reaches the rows expected from that peer (known from
// send_pos), sums, and zeroes the counters. Sending and reducing overlap.
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
  if (block_wait_peers(c, F_REDUCE_DONE, ce - 1, me, 4, deadline, &s_fail)) return;
  const int self_lo = s_off[me];
  const int n16 = c.hidden * 2 / 16;
  const size_t row_bytes = static_cast<size_t>(c.hidden) * 2;
  const int npeers = W - 1;
  int max_nb = 0;
  for (int s = 0; s < W; ++s)
    if (s != me) max_nb = max(max_nb, (s_off[s + 1] - s_off[s] + 31) / 32);
  const int nsend = npeers > 0 ? max_nb * npeers : 0;
  const int nchunks = (T + kChunk - 1) / kChunk;
  int* arrive = reinterpret_cast<int*>(c.peers[me] + c.off_arrive);  // [chunk][src]
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
      const int4* src0 = x + static_cast<size_t>(row0) * n16;  // contiguous rows, contiguous slots
      warp_copy<kPullU>(src0, reinterpret_cast<int4*>(dst0), total, lane);
      __threadfence_system();
      __syncwarp();
      const int ch = lane < nrows ? recv_src[row0 + lane] / kChunk : -1;
      const unsigned m = __match_any_sync(kFull, ch);
      if (ch >= 0 && lane == __ffs(m) - 1) {
        int* ctr = reinterpret_cast<int*>(c.peers[s] + c.off_arrive) + ch * kMaxRanks + me;
        asm volatile("red.release.sys.global.add.s32 [%0], %1;" ::"l"(ctr), "r"(__popc(m)) : "memory");
      }
    } else if (unit - nsend < nchunks) {
      const int chunk = unit - nsend, t0 = chunk * kChunk, nt = min(kChunk, T - t0);
      int ok = 1;
      if (lane < W && lane != me) {
        int expect = 0;
        for (int t = t0; t < t0 + nt; ++t) expect += send_pos[static_cast<size_t>(t) * W + lane] >= 0;
        int* ctr = arrive + chunk * kMaxRanks + lane;
        const int r = expect ? wait_geq(ctr, expect, deadline, c.aborted) : 0;
        if (r == 1) record_timeout(c, lane, 5);
        ok = r == 0;
      }
      if (!__all_sync(kFull, ok)) {
        failed = true;
        break;
      }
      __syncwarp();  // the acquiring lanes' view of the arrived rows extends to the whole warp
      for (int t = t0; t < t0 + nt; ++t) reduce_token<MAXW, U>(c, x, send_pos, self_lo, y, t, lane);
      if (lane < W) arrive[chunk * kMaxRanks + lane] = 0;  // all of this combine's rows have arrived
    } else {
      break;
    }
  }
  // Every warp reaches the block barrier of last_block (a failed warp only stops taking work).
  if (last_block(c.counters + C_FUSED)) {
    if (!ld_volatile(c.aborted)) {
      if (tid < W && tid != me) st_release_sys(flag_at(c, tid, F_REDUCE_DONE, me), ce);
      if (tid == 0) c.epochs[E_COMBINE] = ce;
    }
    if (tid == 0) atomicExch(c.counters + C_QUEUE, 0u);
  }
}

size_t align_up(size_t v, size_t a = 256) { return (v + a - 1) / a * a; }

int grid_for(int num_sms) { return num_sms < 1 ? 1 : num_sms; }

}  // namespace

// ------------------------------------------------------------------ host runtime
Runtime::Runtime(int device, int rank, int world, int max_tokens, int hidden, int num_experts,
                 double timeout_s)
    : device_(device), rank_(rank), world_(world), max_tokens_(max_tokens), hidden_(hidden),
      num_experts_(num_experts), timeout_s_(timeout_s) {
  if (world < 1 || world > kMaxRanks) throw std::invalid_argument("nvlink backend supports 1..8 ranks");
  if (rank < 0 || rank >= world) throw std::invalid_argument("rank out of range");
  if (num_experts <= 0 || num_experts % world) throw std::invalid_argument("num_experts must be a multiple of world");
  if (hidden <= 0 || hidden % 128) throw std::invalid_argument("hidden must be a positive multiple of 128");
  if (max_tokens <= 0) throw std::invalid_argument("max_tokens must be positive");
  local_experts_ = num_experts / world;
  set_device();
  size_t off = 0;
  ctx_.off_flags = off;
  off = align_up(off + sizeof(int) * F_NUM * kMaxRanks);
  ctx_.off_meta = off;
  off = align_up(off + sizeof(int) * kMaxRanks * (1 + local_experts_));
  ctx_.off_send_list = off;
  off = align_up(off + sizeof(int) * static_cast<size_t>(world) * max_tokens);
  ctx_.off_arrive = off;
  off = align_up(off + sizeof(int) * kMaxRanks * (static_cast<size_t>(max_tokens) / kChunk + 1));
  ctx_.off_stage_x = off;
  ctx_.stage_row_cap = static_cast<size_t>(hidden) * 2;
  off = align_up(off + ctx_.stage_row_cap * max_tokens);
  ctx_.off_stage_scales = off;
  off = align_up(off + sizeof(float) * static_cast<size_t>(max_tokens) * (hidden / 128));
  ctx_.off_stage_idx = off;
  off = align_up(off + sizeof(int64_t) * static_cast<size_t>(max_tokens) * kMaxTopk);
  ctx_.off_stage_w = off;
  off = align_up(off + sizeof(float) * static_cast<size_t>(max_tokens) * kMaxTopk);
  ctx_.off_combine = off;
  off = align_up(off + static_cast<size_t>(world) * max_tokens * hidden * 2);
  bytes_ = off;
  EP_CUDA_CHECK(cudaMalloc(&base_, bytes_));
  EP_CUDA_CHECK(cudaMemset(base_, 0, ctx_.off_stage_x));  // flags, meta, send lists
  EP_CUDA_CHECK(cudaMalloc(&local_, 256));
  EP_CUDA_CHECK(cudaMemset(local_, 0, 256));
  const size_t host_bytes = sizeof(HostInfo) + sizeof(int) * local_experts_;
  EP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_), host_bytes, cudaHostAllocMapped));
  std::memset(host_, 0, host_bytes);
  EP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev_), host_, 0));
  EP_CUDA_CHECK(cudaDeviceSynchronize());
  for (int r = 0; r < kMaxRanks; ++r) ctx_.peers[r] = nullptr;
  ctx_.peers[rank] = base_;
  ctx_.rank = rank;
  ctx_.world = world;
  ctx_.max_tokens = max_tokens;
  ctx_.num_experts = num_experts;
  ctx_.local_experts = local_experts_;
  ctx_.hidden = hidden;
  ctx_.epochs = reinterpret_cast<int*>(local_);
  ctx_.counters = reinterpret_cast<unsigned*>(static_cast<char*>(local_) + 64);
  ctx_.aborted = reinterpret_cast<int*>(static_cast<char*>(local_) + 128);
  ctx_.host = host_dev_;
  ctx_.timeout_ns = static_cast<unsigned long long>(timeout_s * 1e9);
}

Runtime::~Runtime() {
  try {
    close();
  } catch (...) {
  }
}

void Runtime::set_device() const { EP_CUDA_CHECK(cudaSetDevice(device_)); }

std::string Runtime::ipc_handle() const {
  if (!base_) throw std::runtime_error("nvlink runtime is closed");
  set_device();
  cudaIpcMemHandle_t h;
  EP_CUDA_CHECK(cudaIpcGetMemHandle(&h, base_));
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

void Runtime::open_peers(const std::vector<std::string>& handles) {
  if (static_cast<int>(handles.size()) != world_) throw std::invalid_argument("need one IPC handle per rank");
  set_device();
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    if (handles[p].size() != sizeof(cudaIpcMemHandle_t)) throw std::invalid_argument("bad IPC handle size");
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handles[p].data(), sizeof(h));
    void* ptr = nullptr;
    EP_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess));
    ctx_.peers[p] = static_cast<char*>(ptr);
  }
  opened_ = true;
}

void Runtime::close() {
  if (!base_) return;
  set_device();
  cudaDeviceSynchronize();
  for (int p = 0; p < world_; ++p) {
    if (p != rank_ && ctx_.peers[p]) cudaIpcCloseMemHandle(ctx_.peers[p]);
    ctx_.peers[p] = nullptr;
  }
  cudaFree(base_);
  base_ = nullptr;
  if (local_) cudaFree(local_);
  local_ = nullptr;
  if (host_) cudaFreeHost(host_);
  host_ = nullptr;
  opened_ = false;
  cudaGetLastError();
}

static void check_open(bool opened, const void* base) {
  if (!base || !opened) throw std::runtime_error("nvlink runtime is closed or its peers are not opened");
}

void Runtime::notify(uintptr_t topk_idx, int T, int K, uintptr_t send_pos, uintptr_t is_in,
                     uintptr_t recv_off, uintptr_t tpe, uintptr_t stream) {
  check_open(opened_, base_);
  if (T < 0 || T > max_tokens_) throw std::invalid_argument("num_tokens exceeds max_tokens_per_rank");
  if (K < 1 || K > kMaxTopk) throw std::invalid_argument("topk must be in [1, 32]");
  set_device();
  const size_t smem = sizeof(int) * num_experts_;
  if (smem > 48 * 1024) throw std::invalid_argument("too many experts for the notify kernel");
  notify_kernel<<<1, kNotifyThreads, smem, reinterpret_cast<cudaStream_t>(stream)>>>(
      ctx_, reinterpret_cast<const int64_t*>(topk_idx), T, K, reinterpret_cast<int*>(send_pos),
      reinterpret_cast<bool*>(is_in), reinterpret_cast<int*>(recv_off), reinterpret_cast<int64_t*>(tpe));
  EP_CUDA_CHECK(cudaGetLastError());
}

void Runtime::stage(uintptr_t x, int T, int row_bytes, uintptr_t scales, int nscales, uintptr_t topk_idx,
                    uintptr_t weights, int K, int num_sms, uintptr_t stream) {
  check_open(opened_, base_);
  if (T < 0 || T > max_tokens_) throw std::invalid_argument("num_tokens exceeds max_tokens_per_rank");
  if (row_bytes <= 0 || row_bytes % 16 || static_cast<size_t>(row_bytes) > ctx_.stage_row_cap)
    throw std::invalid_argument("row bytes must be a multiple of 16 and at most hidden*2");
  if (nscales > hidden_ / 128) throw std::invalid_argument("too many scales per row");
  if (K > kMaxTopk) throw std::invalid_argument("topk must be at most 32");
  set_device();
  stage_kernel<<<grid_for(num_sms), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      ctx_, reinterpret_cast<const int4*>(x), T, row_bytes, reinterpret_cast<const float*>(scales), nscales,
      reinterpret_cast<const int64_t*>(topk_idx), reinterpret_cast<const float*>(weights), K);
  EP_CUDA_CHECK(cudaGetLastError());
}

void Runtime::pull(uintptr_t out_x, int row_bytes, uintptr_t out_scales, int nscales, uintptr_t out_idx,
                   uintptr_t out_w, int K, uintptr_t recv_off, uintptr_t recv_src, int cached, int R_alloc,
                   int num_sms, uintptr_t stream) {
  check_open(opened_, base_);
  if (row_bytes <= 0 || row_bytes % 16 || static_cast<size_t>(row_bytes) > ctx_.stage_row_cap)
    throw std::invalid_argument("row bytes must be a multiple of 16 and at most hidden*2");
  if (K > kMaxTopk) throw std::invalid_argument("topk must be at most 32");
  set_device();
  pull_kernel<<<grid_for(num_sms), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      ctx_, reinterpret_cast<int4*>(out_x), row_bytes, reinterpret_cast<float*>(out_scales), nscales,
      reinterpret_cast<int64_t*>(out_idx), reinterpret_cast<float*>(out_w), K,
      reinterpret_cast<const int*>(recv_off), reinterpret_cast<int*>(recv_src), cached, R_alloc);
  EP_CUDA_CHECK(cudaGetLastError());
}

void Runtime::combine(uintptr_t x, uintptr_t send_pos, uintptr_t recv_off, uintptr_t recv_src, uintptr_t y, int T,
                      int num_sms, int fused, uintptr_t stream) {
  check_open(opened_, base_);
  if (T < 0 || T > max_tokens_) throw std::invalid_argument("num_tokens exceeds max_tokens_per_rank");
  set_device();
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const int4* xp = reinterpret_cast<const int4*>(x);
  const int* sp = reinterpret_cast<const int*>(send_pos);
  const int* ro = reinterpret_cast<const int*>(recv_off);
  int4* yp = reinterpret_cast<int4*>(y);
  if (fused) {
    // recv_src may be null when this rank received no rows (the kernel then never reads it)
    const int* rs = reinterpret_cast<const int*>(recv_src);
    if (world_ <= 4)
      combine_fused_kernel<4, 3><<<grid_for(num_sms), kThreads, 0, s>>>(ctx_, xp, sp, ro, rs, yp, T);
    else
      combine_fused_kernel<8, 2><<<grid_for(num_sms), kThreads, 0, s>>>(ctx_, xp, sp, ro, rs, yp, T);
    EP_CUDA_CHECK(cudaGetLastError());
    return;
  }
  combine_send_kernel<<<grid_for(num_sms), kThreads, 0, s>>>(ctx_, xp, ro);
  EP_CUDA_CHECK(cudaGetLastError());
  if (world_ <= 4)
    combine_reduce_kernel<4, 4><<<grid_for(num_sms), kThreads, 0, s>>>(ctx_, xp, sp, ro, yp, T);
  else
    combine_reduce_kernel<8, 2><<<grid_for(num_sms), kThreads, 0, s>>>(ctx_, xp, sp, ro, yp, T);
  EP_CUDA_CHECK(cudaGetLastError());
}

int Runtime::num_recv() const { return static_cast<volatile HostInfo*>(host_)->num_recv; }
std::vector<int> Runtime::recv_counts() const {
  volatile HostInfo* h = host_;
  std::vector<int> v(world_);
  for (int i = 0; i < world_; ++i) v[i] = h->recv_counts[i];
  return v;
}
std::vector<int> Runtime::send_counts() const {
  volatile HostInfo* h = host_;
  std::vector<int> v(world_);
  for (int i = 0; i < world_; ++i) v[i] = h->send_counts[i];
  return v;
}
std::vector<int> Runtime::tokens_per_expert() const {
  volatile int* t = host_->tokens_per_expert;
  std::vector<int> v(local_experts_);
  for (int i = 0; i < local_experts_; ++i) v[i] = t[i];
  return v;
}
int Runtime::error() const { return host_ ? static_cast<volatile HostInfo*>(host_)->err : 0; }
int Runtime::error_kernel() const { return host_ ? static_cast<volatile HostInfo*>(host_)->err_kernel : 0; }
std::vector<int> Runtime::missing_ranks() const {
  std::vector<int> v;
  if (!host_) return v;
  volatile HostInfo* h = host_;
  for (int i = 0; i < world_; ++i)
    if (h->missing[i]) v.push_back(i);
  return v;
}
std::vector<int> Runtime::epochs() const {
  std::vector<int> v(E_NUM);
  set_device();
  EP_CUDA_CHECK(cudaMemcpy(v.data(), local_, sizeof(int) * E_NUM, cudaMemcpyDeviceToHost));
  return v;
}

}  // namespace nvl
}  // namespace ep
