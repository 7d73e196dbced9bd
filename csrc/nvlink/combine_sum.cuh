// The per-token sum of a combine, shared by the split reduce kernel and the fused kernel.
#pragma once
#include <cuda_bf16.h>

#include "nvlink/device.cuh"

namespace ep {
namespace nvl {

__device__ __forceinline__ void add_bf16x8(float* acc, const int4& v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(h[q]);
    acc[2 * q] += f.x;
    acc[2 * q + 1] += f.y;
  }
}

// Eight float sums as one 16-byte vector of BF16 (round to nearest).
__device__ __forceinline__ int4 bf16x8_of(const float* acc) {
  int4 o;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int q = 0; q < 4; ++q) h[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
  return o;
}

// The sum of one token's rows srcp[0..MAXW) (null where a rank holds none), in rank order, float
// accumulation, written to yrow in BF16. For each chunk of 32*U vectors the loads of all rows
// (load(p): one 16-byte vector) are issued before any is summed, so one chunk costs one memory round
// trip. Shared by the push combines' reduce (global rows) and the pull combine (rows in shared memory).
template <int MAXW, int U, typename Load>
__device__ __forceinline__ void sum_rows_bf16(const int4* const (&srcp)[MAXW], int4* __restrict__ yrow, int n16,
                                              int lane, Load load) {
  for (int base = 0; base < n16; base += 32 * U) {
    int4 v[MAXW][U];
#pragma unroll
    for (int r = 0; r < MAXW; ++r)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int j = base + u * 32 + lane;
        if (srcp[r] && j < n16) v[r][u] = load(srcp[r] + j);
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
      if (j < n16) yrow[j] = bf16x8_of(acc[u]);
    }
  }
}

// Sum of one token's slots (own rows read in place from x, or from this rank's own slot of the
// combine area when self_in_area), through sum_rows_bf16, into y's row t or where the call's
// CombineRoute places it. The caller has acquired every slot's arrival.
template <int MAXW, int U>
__device__ __forceinline__ void reduce_token(const Ctx& c, const int4* __restrict__ x,
                                             const int* __restrict__ send_pos, int self_lo,
                                             int4* __restrict__ y, int t, int lane, bool self_in_area) {
  const int W = c.world, me = c.rank;
  const int n16 = c.hidden * 2 / 16;
  const size_t row16 = static_cast<size_t>(n16);
  const int4* area = reinterpret_cast<const int4*>(c.peers[me] + c.off_combine);
  const int mypos = lane < W ? send_pos[static_cast<size_t>(t) * W + lane] : -1;
  // y_blocks (CombineRoute): a token no rank holds a row of has no sum to place, and a null block none
  int4* yrow = y_row(c, y, t, n16);
  if (c.route.y_blocks != nullptr && !__any_sync(kFull, mypos >= 0)) yrow = nullptr;
  if (yrow == nullptr) return;
  const int4* srcp[MAXW];
#pragma unroll
  for (int r = 0; r < MAXW; ++r) {
    const int p = __shfl_sync(kFull, mypos, r);
    srcp[r] = (r < W && p >= 0) ? (r == me && !self_in_area ? x + x_row(c, self_lo + p) * row16
                                          : area + (static_cast<size_t>(r) * c.max_tokens + p) * row16)
                                : nullptr;
  }
  sum_rows_bf16<MAXW, U>(srcp, yrow, n16, lane, [](const int4* p) { return ld_nc_v4(p); });
}

// A reduce unit of the combines that overlap the reduce with the sends (fused, pipelined): waits until
// every peer's arrival counter of chunk `chunk` (arrive[chunk][p] in this rank's buffer) reaches the rows
// expected from that peer (from send_pos), sums the chunk's tokens, then zeroes the counters for the
// next combine. False when a wait failed (a timeout is recorded against K_REDUCE).
template <int MAXW, int U>
__device__ __forceinline__ bool reduce_chunk(const Ctx& c, const int4* __restrict__ x, const int* __restrict__ send_pos,
                                             int self_lo, int4* __restrict__ y, int T, int chunk, int lane,
                                             unsigned long long deadline) {
  const int W = c.world, me = c.rank;
  const int t0 = chunk * kChunk, nt = min(kChunk, T - t0);
  int* arrive = reinterpret_cast<int*>(c.peers[me] + c.off_arrive);  // [chunk][src]
  int ok = 1;
  if (lane < W && lane != me) {
    int expect = 0;
    for (int t = t0; t < t0 + nt; ++t) expect += send_pos[static_cast<size_t>(t) * W + lane] >= 0;
    int* ctr = arrive + chunk * kMaxRanks + lane;
    const int r = expect ? wait_geq(ctr, expect, deadline, c.aborted) : kArrived;
    if (r == kTimedOut) record_timeout(c, lane, K_REDUCE);
    ok = r == kArrived;
  }
  if (!__all_sync(kFull, ok)) return false;
  __syncwarp();  // the acquiring lanes' view of the arrived rows extends to the whole warp
  for (int t = t0; t < t0 + nt; ++t) reduce_token<MAXW, U>(c, x, send_pos, self_lo, y, t, lane, false);
  if (lane < W) arrive[chunk * kMaxRanks + lane] = 0;  // all of this combine's rows have arrived
  return true;
}

// The end of a combine driven by the work queue (fused, pipelined), called by every thread: the last
// block releases REDUCE_DONE[me] = ce at every peer and sets epochs[E_COMBINE] = ce unless the call was
// aborted, and resets the queue for the next combine.
__device__ inline void finish_queued_combine(const Ctx& c, int ce) {
  const int tid = threadIdx.x;
  fence_routed_sums(c);
  if (last_block(c.counters + C_FUSED)) {
    if (!ld_volatile(c.aborted)) {
      if (tid < c.world && tid != c.rank) st_release_sys(flag_at(c, tid, F_REDUCE_DONE, c.rank), ce);
      if (tid == 0) c.epochs[E_COMBINE] = ce;
    }
    if (tid == 0) atomicExch(c.counters + C_QUEUE, 0u);
  }
}

}  // namespace nvl
}  // namespace ep
