// Low-latency combine: each received row goes back to its source at (token, k); the source sums
// its tokens' K rows with their weights (float32, k ascending, multiply and add rounded apart, as
// the reference does) into BF16. One kernel does either half or both (kSend|kRecv).
//
// kLoadsAhead (a variant bit, ll_device.cuh): the receive half's latency chain per token is the picks'
// loads (id, weight), then the rows' loads, then the sums, then the store; with the bit the block's first
// token's picks are loaded before the wait for the signals (inputs of this rank: nothing to wait for), and
// a thread whose token has two 16-byte units per thread (H <= 16 * blockDim, K <= 8) issues the loads of
// both units' rows before any sum, instead of one unit's after the other's. The sums are the same, in the
// same k order: the output is bit-identical.
// kLightTickets: the send half's ticket behind fence.acq_rel.sys, the receive half's without a fence.
// kSpreadRows (the send half): rows dealt to warps in a stride order (send_rows). The same rows to the same
// places: the output is bit-identical.
// kOwnerReduce ("Owner sums" below): one row per (token, owner rank) instead of one per pick.
// kCopy8 (the send half): a warp's share of a row (~448 units at H = 7168 when rows are fewer than
// warps) is 14 units per lane, i.e. four rounds of load-then-store at 4 loads in flight, each round one
// HBM latency before its stores can go; at 8 in flight it is two.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "nvshmem/ll_device.cuh"
#include "nvshmem/ll_kernels.h"

namespace ep {
namespace ll {
namespace {

__device__ void send_rows(const Ctx& c, int p, const int4* x, const int* row_slot, const int* recv_count,
                          bool skip_self, int* smem, bool* any_rdma, bool copy8, bool spread) {
  const int W = c.world, EL = c.local_experts, M = c.max_tokens, WM = W * M;
  const int MK = M * c.max_topk;
  int* s_cnt = smem;
  int* s_off = smem + EL;
  for (int el = threadIdx.x; el < EL; el += blockDim.x) s_cnt[el] = recv_count[el];
  block_exclusive_scan(s_cnt, s_off, EL);
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int n16 = c.hidden / 8;
  const int total = s_off[EL];
  // NVSHMEM puts send whole rows: one warp per row when some peer needs them. kSpreadRows: the rows
  // leave in a stride order, so that a block's warps (consecutive items) hold rows of several sources --
  // in the received order a block's rows share one source, and the blocks holding peers' rows carry the
  // whole NVLink traffic while the others, with this rank's own rows (skipped), idle; the parts are
  // sized by the rows expected to leave (all but ~1/W with skip_self), so that more warps share them.
  const int leaving = spread && skip_self ? total - total / c.world : total;
  const int parts = c.comb_stage >= 0 ? 1 : parts_per_row(leaving, gridDim.x * warps);
  const int chunk = (n16 + parts - 1) / parts;
  const int stride = spread ? coprime_stride(total) : 1;
  for (int i = blockIdx.x * warps + threadIdx.x / 32; i < total * parts; i += gridDim.x * warps) {
    const int r = spread ? static_cast<int>(static_cast<long long>(i / parts) * stride % total) : i / parts;
    const int part = i % parts;
    const int el = find_segment(s_off, EL, r);
    const long long in_row = static_cast<long long>(el) * WM + (r - s_off[el]);
    const int slot = row_slot[in_row];
    const int s = slot / MK, at = slot % MK;
    if (left_out(c, s) || (skip_self && s == c.rank)) continue;  // own rows: the receive half reads x
    const int4* src = x + in_row * n16;
    const long long off = c.comb_rows[p] + static_cast<long long>(at) * c.hidden * 2;
    char* base = c.peer[s];
    // P2P: straight into the source's row; RDMA: into this rank's staging row, then a put
    char* row = base != nullptr ? base + off : c.heap + c.comb_stage + in_row * c.hidden * 2;
    if (copy8)
      warp_copy_units<8>(src, reinterpret_cast<int4*>(row), part * chunk, min(n16, (part + 1) * chunk), lane);
    else
      warp_copy_units<4>(src, reinterpret_cast<int4*>(row), part * chunk, min(n16, (part + 1) * chunk), lane);
    if (base == nullptr) {  // compiled, not run here (no NIC on the GPU machines)
      __syncwarp();
      nvshmemx_putmem_nbi_warp(c.heap + off, row, static_cast<size_t>(c.hidden) * 2, s);
      *any_rdma = true;
    }
  }
}


// acc += w[u] * v[u] for u < min(n, 8), in u (= k) order, the multiply and the add rounded apart.
__device__ __forceinline__ void accumulate_rows(float (&acc)[8], const int4* v, const float* w, int n) {
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    if (u >= n) break;
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[u]);
    const float wu = w[u];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      acc[2 * i] = __fadd_rn(acc[2 * i], __fmul_rn(wu, f.x));
      acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], __fmul_rn(wu, f.y));
    }
  }
}

__device__ __forceinline__ int4 to_bf16_unit(const float (&acc)[8]) {
  int4 out;
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return out;
}

// ---------------------------------------------------------------- Owner sums (kOwnerReduce)
// With output sets in the heap the dispatch left, at each owner, a record per (source, token): the row of
// each pick k held there (ll_dispatch_direct.cu, write_records). The combine's send half first sends this
// rank's weights to its picks' owners (epoch-tagged words: no fence, no flag), then sums, for every (source,
// token) with rows here, those rows with the source's weights -- float32, k ascending, multiply and add
// rounded apart -- into one BF16 row, stored at the source's (token, first such k). At EP2 with top-8 that is
// one row per token where the picks' rows were four. The token's rank then adds those rows in the order of
// each rank's first pick (reduce_tokens_owner). Elsewhere (the slot path) and under a receive hook
// (kPerPickSend: a send half that waits for the peers' weights would hold its SMs through the caller's
// compute) the rows still leave per pick and the token's rank makes each owner's sum, with the same roundings.

// This rank's weights to the owners of its picks (not left out; its own too when its rows go through the send).
__device__ void send_weights(const Ctx& c, int p, int epoch, const int64_t* topk_idx, const float* weights, int T,
                             int K, bool skip_self) {
  const int EL = c.local_experts, E = c.num_experts;
  const unsigned long long tag = static_cast<unsigned long long>(static_cast<unsigned>(epoch + 1)) << 32;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < T * K; i += gridDim.x * blockDim.x) {
    const long long id = topk_idx[i];
    if (id < 0 || id >= E) continue;
    const int d = static_cast<int>(id) / EL;
    if (left_out(c, d) || (skip_self && d == c.rank)) continue;
    const int t = i / K, k = i - t * K;
    auto* w = reinterpret_cast<volatile unsigned long long*>(c.peer[d] + c.comb_w[p]) +
              (static_cast<long long>(c.rank) * c.max_tokens + t) * c.max_topk + k;
    *w = tag | __float_as_uint(weights[i]);
  }
}

// Source s's weight of (t, k), waited for by its epoch tag; false on a timeout (recorded) or an abort.
__device__ bool wait_weight(const Ctx& c, int p, int epoch, int s, int t, int k, float* w,
                            unsigned long long deadline) {
  const unsigned long long* word = reinterpret_cast<const unsigned long long*>(c.heap + c.comb_w[p]) +
                                   (static_cast<long long>(s) * c.max_tokens + t) * c.max_topk + k;
  const unsigned target = static_cast<unsigned>(epoch + 1);
  for (unsigned it = 1;; ++it) {
    const unsigned long long v = ld_volatile_u64(word);
    // an older call's word of this parity carries a smaller tag; no newer one can come before this send
    if (static_cast<int>(static_cast<unsigned>(v >> 32) - target) >= 0) {
      *w = __uint_as_float(static_cast<unsigned>(v & 0xffffffffull));
      return true;
    }
    if ((it & 127u) == 0) {
      if (ld_volatile(c.aborted)) return false;
      if (globaltimer() > deadline) {
        record_timeout(c, s, kKernelCombine);
        return false;
      }
    }
  }
}

// Every (source, token) with rows here: their weighted sum to the source's (token, first k held here). A
// warp takes one part of one (source, token)'s row (parts as send_rows sizes them).
__device__ void send_sums(const Ctx& c, int p, int epoch, const int4* x, const int* rec, int K, bool skip_self,
                          int* smem) {
  constexpr int kWarps = kThreads / 32;
  __shared__ const int4* s_src[kWarps][32];
  __shared__ float s_wt[kWarps][32];
  const int W = c.world, M = c.max_tokens, KM = c.max_topk;
  const int n16 = c.hidden / 8;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int* s_T = smem;
  int* s_off = smem + W;
  for (int s = threadIdx.x; s < W; s += blockDim.x)
    s_T[s] = left_out(c, s) || (skip_self && s == c.rank) ? 0 : min(max(rec[s], 0), M);
  block_exclusive_scan(s_T, s_off, W);
  const int items = s_off[W];
  // few items (128 tokens per peer): up to 16 warps share one, each reading its picks' rows for a part
  const int parts = items > 0 ? max(1, min(16, gridDim.x * warps / items)) : 1;
  const int chunk = (n16 + parts - 1) / parts;
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  for (int i = blockIdx.x * warps + warp; i < items * parts; i += gridDim.x * warps) {
    const int item = i / parts, part = i - item * parts;
    const int s = find_segment(s_off, W, item), t = item - s_off[s];
    int at = -1;
    float w = 0.f;
    if (lane < K) {
      at = rec[W + (static_cast<long long>(s) * M + t) * KM + lane];
      if (at >= 0 && !wait_weight(c, p, epoch, s, t, lane, &w, deadline)) at = -1;
    }
    const unsigned have = __ballot_sync(kFull, at >= 0);
    if (have == 0) continue;  // no pick of this token here
    if (at >= 0) {
      const int q = __popc(have & ((1u << lane) - 1u));
      s_src[warp][q] = x + static_cast<long long>(at) * n16;
      s_wt[warp][q] = w;
    }
    __syncwarp();
    const int nk = __popc(have), kfirst = __ffs(have) - 1;
    int4* dst = reinterpret_cast<int4*>(c.peer[s] + comb_row_offset(c, p, t, kfirst));
    const int lo = part * chunk, hi = min(n16, lo + chunk);
    for (int j = lo + lane; j < hi; j += 32) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int q0 = 0; q0 < nk; q0 += 8) {  // up to 8 rows' loads in flight before the sums (k order)
        int4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u)
          if (q0 + u < nk) v[u] = ld_nc_v4(s_src[warp][q0 + u] + j);
        accumulate_rows(acc, v, &s_wt[warp][q0], nk - q0);
      }
      st_na_v4(dst + j, to_bf16_unit(acc));
    }
    __syncwarp();  // s_src / s_wt of this item read before the next item's
  }
}

// y's unit j of a token: the weighted sum of its nk <= 8 rows' unit j (k order), v[u] = row u's unit j.
__device__ __forceinline__ int4 weighted_sum(const int4* v, const float* w, int nk) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  accumulate_rows(acc, v, w, nk);
  return to_bf16_unit(acc);
}

// kLoadsAhead: a token's units j and j + blockDim.x (j = threadIdx.x), up to 8 rows each, all 16 loads
// issued before the sums. Every thread of the block calls it; n16 <= 2 * blockDim.x, nk <= 8.
__device__ __forceinline__ void reduce_two_units(const int4* const* rows, const float* s_w, int nk, int n16,
                                                 int4* y_row) {
  const int j0 = threadIdx.x, j1 = threadIdx.x + blockDim.x;
  int4 v0[8], v1[8];
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    if (u < nk) {
      const int4* row = rows[u];
      if (j0 < n16) v0[u] = ld_nc_v4(row + j0);
      if (j1 < n16) v1[u] = ld_nc_v4(row + j1);
    }
  }
  if (j0 < n16) y_row[j0] = weighted_sum(v0, s_w, nk);  // the weights stay in shared memory: registers
  if (j1 < n16) y_row[j1] = weighted_sum(v1, s_w, nk);  // hold the 16 units
}

// The receive half's start: s_ok[s] = rank s is in and its combine signal of this epoch came (a timeout is
// recorded and leaves s out of the sums). By the whole block.
__device__ void wait_combine_signals(const Ctx& c, int p, int epoch, int* s_ok) {
  for (int s = threadIdx.x; s < c.world; s += blockDim.x)
    s_ok[s] = !left_out(c, s) && wait_signal(c, c.comb_flag[p], s, epoch + 1, kKernelCombine);
  __syncthreads();
  stamp(c, kStampCombine, kCsSignalsIn);
}

// serial_prologue (kSerialPrologue): thread 0 gathers a token's picks one k after another (the
// earlier code, kept for A/B); otherwise warp 0 does it with one lane per k. ahead: kLoadsAhead.
__device__ void reduce_tokens(const Ctx& c, const int64_t* topk_idx, const float* weights, int T, int K,
                              int4* y, const int4* x, const int* self_pos, bool serial_prologue, bool ahead) {
  const int EL = c.local_experts, E = c.num_experts;
  const int epoch = ld_volatile(c.state + kCombRecvEpoch);
  const int p = epoch & 1;
  __shared__ int s_ok[kMaxRanks];
  __shared__ float s_w[32];
  __shared__ const int4* s_row[32];  // where row q of the token is read
  __shared__ int s_e[32];            // the token's ids (a repeated expert reads its first k's row)
  __shared__ int s_nk;
  // kLoadsAhead: warp 0's picks of the block's first token, in flight through the signal wait below
  long long id0 = -1;
  float w0 = 0.f;
  const bool picks_ahead = ahead && !serial_prologue && threadIdx.x < K && static_cast<int>(blockIdx.x) < T;
  if (picks_ahead) {
    id0 = topk_idx[static_cast<long long>(blockIdx.x) * K + threadIdx.x];
    w0 = weights[static_cast<long long>(blockIdx.x) * K + threadIdx.x];
  }
  wait_combine_signals(c, p, epoch, s_ok);
  const int n16 = c.hidden / 8;
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    if (!serial_prologue) {
      // warp 0, lane k = pick k: its id, weight and row address loaded in parallel (one round of loads,
      // not K dependent ones), a repeated expert's first k found by shuffles, the kept picks packed
      // in k order by a ballot
      if (threadIdx.x < 32) {
        const int k = threadIdx.x;
        int e = -1;
        float wk = 0.f;
        if (k < K) {
          const bool first_token = picks_ahead && t == static_cast<int>(blockIdx.x);
          const long long id = first_token ? id0 : topk_idx[static_cast<long long>(t) * K + k];
          e = (id < 0 || id >= E) ? -1 : static_cast<int>(id);
          wk = first_token ? w0 : weights[static_cast<long long>(t) * K + k];
        }
        int first = k;
        for (int q = 0; q < K; ++q) {
          const int eq = __shfl_sync(kFull, e, q);
          if (q < first && eq == e) first = q;
        }
        const bool keep = k < K && e >= 0 && s_ok[e / EL];
        const int4* row = nullptr;
        if (keep)
          row = self_pos != nullptr && e / EL == c.rank
                    ? x + static_cast<long long>(self_pos[t * c.max_topk + first]) * (c.hidden / 8)
                    : reinterpret_cast<const int4*>(c.heap + comb_row_offset(c, p, t, first));
        const unsigned kept = __ballot_sync(kFull, keep);
        if (keep) {
          const int at = __popc(kept & ((1u << k) - 1u));
          s_w[at] = wk;
          s_row[at] = row;
        }
        if (k == 0) s_nk = __popc(kept);
      }
    } else {
    if (threadIdx.x < K) {
      const long long e = topk_idx[static_cast<long long>(t) * K + threadIdx.x];
      s_e[threadIdx.x] = (e < 0 || e >= E) ? -1 : static_cast<int>(e);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int nk = 0;
      for (int k = 0; k < K; ++k) {
        const int e = s_e[k];
        if (e < 0 || !s_ok[e / EL]) continue;
        int first = k;  // the dispatch sent one row per (token, expert): that of the first k naming it
        for (int q = 0; q < k; ++q)
          if (s_e[q] == e) {
            first = q;
            break;
          }
        s_w[nk] = weights[static_cast<long long>(t) * K + k];
        s_row[nk] = self_pos != nullptr && e / EL == c.rank
                        ? x + static_cast<long long>(self_pos[t * c.max_topk + first]) * (c.hidden / 8)
                        : reinterpret_cast<const int4*>(c.heap + comb_row_offset(c, p, t, first));
        ++nk;
      }
      s_nk = nk;
    }
    }  // serial_prologue
    __syncthreads();
    if (t == static_cast<int>(blockIdx.x)) stamp(c, kStampCombine, kCsPicked);
    const int nk = s_nk;
    if (ahead && nk <= 8 && n16 <= 2 * static_cast<int>(blockDim.x)) {
      reduce_two_units(s_row, s_w, nk, n16, y + static_cast<long long>(t) * n16);
      __syncthreads();
      if (t == static_cast<int>(blockIdx.x)) stamp(c, kStampCombine, kCsSummed);
      continue;
    }
    for (int j = threadIdx.x; j < n16; j += blockDim.x) {
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.f;
      // up to 8 rows' loads in flight before the sums (which keep the k order)
      for (int q0 = 0; q0 < nk; q0 += 8) {
        int4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u)
          if (q0 + u < nk)
            v[u] = ld_nc_v4(s_row[q0 + u] + j);
        accumulate_rows(acc, v, s_w + q0, nk - q0);
      }
      y[static_cast<long long>(t) * n16 + j] = to_bf16_unit(acc);
    }
    __syncthreads();
    if (t == static_cast<int>(blockIdx.x)) stamp(c, kStampCombine, kCsSummed);
  }
}


// kOwnerReduce's receive half: y[t] = the sum, over the ranks holding t's picks in the order of each one's
// first pick, of that rank's BF16 sum (float32: its picks' rows weighted, k ascending, rounded to BF16 at
// the end), float32, rounded to BF16. A rank's sum came as one row (`pre`: its owner made it, send_sums)
// or is made here from its picks' rows: this rank's own (read from x at self_pos), or every rank's on the
// slot path (no records there: the rows came per pick).
__device__ void reduce_tokens_owner(const Ctx& c, const int64_t* topk_idx, const float* weights, int T, int K,
                                    int4* y, const int4* x, const int* self_pos, bool per_pick) {
  const int EL = c.local_experts, E = c.num_experts;
  const int epoch = ld_volatile(c.state + kCombRecvEpoch);
  const int p = epoch & 1;
  const bool sums_sent = c.sets > 0 && !per_pick;  // the direct dispatch's records: owners sent sums
  __shared__ int s_ok[kMaxRanks];
  __shared__ float s_w[32];
  __shared__ const int4* s_row[32];
  __shared__ int s_last[32];  // the term closes its rank's sum
  __shared__ int s_nk;
  wait_combine_signals(c, p, epoch, s_ok);
  const int n16 = c.hidden / 8;
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    if (threadIdx.x < 32) {
      const int k = threadIdx.x;
      int e = -1;
      float wk = 0.f;
      if (k < K) {
        const long long id = topk_idx[static_cast<long long>(t) * K + k];
        e = (id < 0 || id >= E) ? -1 : static_cast<int>(id);
        wk = weights[static_cast<long long>(t) * K + k];
      }
      const bool keep = k < K && e >= 0 && s_ok[e / EL];
      const int d = keep ? e / EL : -1;
      int first_e = k, first_d = k;  // the first k naming this expert; the first kept k on this rank
      for (int q = 0; q < K; ++q) {
        const int eq = __shfl_sync(kFull, e, q), dq = __shfl_sync(kFull, d, q);
        if (q < first_e && eq == e) first_e = q;
        if (q < first_d && dq == d) first_d = q;
      }
      const bool own = d == c.rank && self_pos != nullptr;
      const bool pre = sums_sent && !own;
      const bool term = keep && (!pre || k == first_d);
      // the terms in (first_d, k) order: each rank's terms together, ranks by first pick
      int pos = 0, after = 0;
      for (int q = 0; q < K; ++q) {
        const int tq = __shfl_sync(kFull, term ? 1 : 0, q), fq = __shfl_sync(kFull, first_d, q);
        if (tq && (fq < first_d || (fq == first_d && q < k))) ++pos;
        if (tq && fq == first_d && q > k) ++after;
      }
      if (term) {
        s_w[pos] = pre ? 1.f : wk;  // 0 + 1 * v == v: a sent sum passes through its own rounding unchanged
        s_row[pos] = own ? x + static_cast<long long>(self_pos[t * c.max_topk + first_e]) * n16
                         : reinterpret_cast<const int4*>(c.heap + comb_row_offset(c, p, t, pre ? first_d : first_e));
        s_last[pos] = after == 0;
      }
      const unsigned terms = __ballot_sync(kFull, term);
      if (k == 0) s_nk = __popc(terms);
    }
    __syncthreads();
    if (t == static_cast<int>(blockIdx.x)) stamp(c, kStampCombine, kCsPicked);
    const int nk = s_nk;
    for (int j = threadIdx.x; j < n16; j += blockDim.x) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int q0 = 0; q0 < nk; q0 += 8) {
        int4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u)
          if (q0 + u < nk) v[u] = ld_nc_v4(s_row[q0 + u] + j);
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          if (q0 + u >= nk) break;
          const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[u]);
          const float wu = s_w[q0 + u];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(h[i]);
            part[2 * i] = __fadd_rn(part[2 * i], __fmul_rn(wu, f.x));
            part[2 * i + 1] = __fadd_rn(part[2 * i + 1], __fmul_rn(wu, f.y));
          }
          if (s_last[q0 + u]) {  // the rank's sum rounded to BF16, then added
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              acc[i] = __fadd_rn(acc[i], __bfloat162float(__float2bfloat16_rn(part[i])));
              part[i] = 0.f;
            }
          }
        }
      }
      y[static_cast<long long>(t) * n16 + j] = to_bf16_unit(acc);
    }
    __syncthreads();
    if (t == static_cast<int>(blockIdx.x)) stamp(c, kStampCombine, kCsSummed);
  }
}

}  // namespace

template <bool kDeep>
__global__ void __launch_bounds__(kThreads, 1)
    combine(Ctx c, const int4* x, const int* row_slot, const int* recv_count, const int64_t* topk_idx,
               const float* weights, int T, int K, int phases, int4* y, const int* self_pos, const int* rec) {
  extern __shared__ int smem[];
  if (phases & kSend) {
    stamp(c, kStampCombine, kCsEntry);
    const int epoch = ld_volatile(c.state + kCombSendEpoch);
    const int p = epoch & 1;
    bool any_rdma = false;
    if ((phases & kOwnerReduce) && !(phases & kPerPickSend) && c.sets > 0) {
      send_weights(c, p, epoch, topk_idx, weights, T, K, self_pos != nullptr);
      send_sums(c, p, epoch, x, rec, K, self_pos != nullptr, smem);
    } else {
      send_rows(c, p, x, row_slot, recv_count, self_pos != nullptr, smem, &any_rdma, kDeep && (phases & kCopy8) != 0,
                (phases & kSpreadRows) != 0);
    }
    if (any_rdma) nvshmem_quiet();
    stamp(c, kStampCombine, kCsRowsOut);
    const bool light = (phases & kLightTickets) != 0;
    const bool last = light ? last_block<TicketFence::kAcqRel>(ticket(c, kTicketCombSend))
                            : last_block(ticket(c, kTicketCombSend));
    stamp(c, kStampCombine, kCsFenced);
    if (last) {
      signal_ranks(c, c.comb_flag[p], epoch);
      __syncthreads();
      if (threadIdx.x == 0) c.state[kCombSendEpoch] = epoch + 1;
      stamp(c, kStampCombine, kCsSignal);
    }
  }
  if (phases & kRecv) {
    __syncthreads();
    if (phases & kOwnerReduce)
      reduce_tokens_owner(c, topk_idx, weights, T, K, y, x, self_pos, (phases & kPerPickSend) != 0);
    else
      reduce_tokens(c, topk_idx, weights, T, K, y, x, self_pos, (phases & kSerialPrologue) != 0,
                    kDeep && (phases & kLoadsAhead) != 0);
    // kLightTickets: y reaches later kernels by stream order; the ticket only moves the epoch on
    const bool last = (phases & kLightTickets) ? last_block<TicketFence::kNone>(ticket(c, kTicketCombRecv))
                                               : last_block(ticket(c, kTicketCombRecv));
    if (last && threadIdx.x == 0) c.state[kCombRecvEpoch] = ld_volatile(c.state + kCombRecvEpoch) + 1;
    stamp(c, kStampCombine, kCsDone);
  }
}

template __global__ void combine<false>(Ctx, const int4*, const int*, const int*, const int64_t*, const float*, int,
                                        int, int, int4*, const int*, const int*);
template __global__ void combine<true>(Ctx, const int4*, const int*, const int*, const int64_t*, const float*, int,
                                       int, int, int4*, const int*, const int*);

}  // namespace ll
}  // namespace ep
