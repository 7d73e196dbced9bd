// stage_pull: stage and pull of a rank-major dispatch in one kernel, side by side, where stage then
// pull (dispatch.cu, pull_tma.cu) run one after the other (comm.dispatch_kernel: fused).
//
// Why: on 2x H200 (4096 tokens, hidden 7168, 24 SMs) stage took 66 us and the pull 192 us, and no
// pull could start before the last block of every rank's stage had finished. Here each block has two
// halves:
//   warps 16..31 (stage): copy this rank's tokens into its stage area in sub-chunks of kStageSub
//     tokens (rows, FP8 scales, topk ids, weights) and release STAGE_READY[me][sub] = e at every rank
//     after each one. Sub-chunk s is block s % grid's, so the grid stages in token order, a round of
//     one sub-chunk per block at a time.
//   warps 0..15 (pull, as pull_tma.cu): warps 1..15 resolve batches of kBatch received rows (source
//     token, local ids, weights, FP8 scales), each row once STAGE_READY of its token's sub-chunk has
//     arrived, and hand each batch to thread 0 through a ring of kSlots batches in shared memory;
//     thread 0 streams the batch's rows through the bulk-copy ring (common/tma.cuh's BulkRing).
//     Batch b is block b % grid's and holds rows of source (me + b) % W: the grid pulls every source at
//     once, each in its token order, behind the sources' staging.
// Measured on one H200 at W=1 (4096 tokens, hidden 7168, 24 SMs; local copies, so no overlap can win
// there: both halves are bound by the SMs' memory bandwidth): contiguous shares per block instead of
// the strides left the pulls waiting on the middle of other blocks' shares (173 us against 140);
// 16-token sub-chunks and 16-row batches against 32: BF16 140.5 / 141.5 us, FP8 117.7 / 129.9,
// cached 125.1 / 132.8 (stage then pull: 134.3, 119.0, 128.3).
//
// Protocol, at dispatch epoch e = epochs[E_DISPATCH] + 1 (notify has run):
//   - the whole block waits PULL_DONE[p] >= e - 1 for every peer p (p no longer reads the stage area);
//   - block 0 releases LISTS[me] = e at every rank: this rank's send lists (notify) are complete;
//   - a fresh pull reads a source's send list after LISTS[src] >= e, a row's data after
//     STAGE_READY[src][sub] >= e;
//   - the last block releases STAGE[me] and PULL_DONE[me] = e at every rank and sets
//     epochs[E_DISPATCH] = e (STAGE for a peer running the separate pull).
// The separate stage kernel releases LISTS and every STAGE_READY too, so ranks may mix the two.
// A timeout records the missing peer (K_STAGE or K_PULL), stops the block's waits through s_fail and
// the abort word, and the block returns without releasing.
//
// kRouted (Ctx::out_route): the metadata warps also resolve each row's output row (beside its source and
// token), thread 0 takes it from there into the ring slot's destination, and the ids, weights, scales and
// padding rows go to the output rows too. The plain instantiation reads no index.
//
// Contract order (a fresh dispatch whose Ctx::out_route has to_contract; the hierarchical backend's inner
// exchange): before their first batch the metadata warps compute one shift per source rank of the contract
// (contract_shifts: lower bounds in every forwarder's send list, read once LISTS[l] >= e, the wait the fresh
// pull makes anyway, bounded by the same deadline), then place each row as the routed kernel does, at the
// position its forwarder and slot give, recording it in to_contract; block 0 writes the per-source counts.
// No new flag: the lists are complete before any row of them moves, as for the plain fresh pull. With notify
// inside (block 0's stage half) the shifts read recv_off once NOTIFIED, after the pull half's barrier, and the
// lists once notify released LISTS, as the plain pull with notify inside does.
#include "common/copy.cuh"
#include "common/error.h"
#include "common/tma.cuh"
#include "nvlink/device.cuh"
#include "nvlink/kernels.h"
#include "nvlink/notify.cuh"
#include "nvlink/pull_meta.cuh"

namespace ep {
namespace nvl {
namespace {

constexpr int kHalf = 512;           // threads per half: pull (warps 0..15), stage (warps 16..31)
constexpr int kFusedThreads = 2 * kHalf;
constexpr int kMetaWarps = kHalf / 32 - 1;
constexpr int kBatch = 16;           // received rows per hand-off: a lane each (at most 32)
constexpr int kSlots = 16;           // batches resolved ahead of thread 0
constexpr int kStageBarrier = 1;     // named barrier of the stage half
constexpr int kScaleU = 4;           // FP8 scale loads in flight per lane (64 registers a thread: 8 spill)
constexpr int kScaleU4 = 2;          // the same as 16-byte loads (kVecScales: a row's scales are whole float4s)
constexpr int kMetaThreads = kMetaWarps * 32;
constexpr int kMetaBarrier = 2;      // named barrier of the metadata warps (contract order's shifts)
constexpr int kPullBarrier = 3;      // named barrier of the pull half (notify inside: recv_off read once)

// Where the pull writes row i: row i (plain), out_rows[i] (indexed: a cached dispatch's to_contract), or the
// position computed from its forwarder and slot (contract: the fresh dispatch; DispatchRoute in nvlink.h).
enum RouteMode { kPlain = 0, kIndexed = 1, kContract = 2 };

struct StageIn {
  const int4* x;
  int T;
  const float* scales;
  const int64_t* idx;
  const float* w;
};

struct PullOut {
  char* x;
  float* scales;
  int64_t* idx;
  float* w;
  const int* recv_off;
  int* recv_src;
  int cached, R_alloc;
};

__device__ __forceinline__ bool failed(const int* s_fail) { return *static_cast<const volatile int*>(s_fail) != 0; }

// Waits for a peer's flag from one lane; a timeout is recorded against kernel_id and fails the block.
__device__ __forceinline__ bool lane_wait(const Ctx& c, const int* flag, int target, int peer, int kernel_id,
                                          unsigned long long deadline, int* s_fail) {
  const int r = wait_geq(flag, target, deadline, c.aborted);
  if (r == kArrived) return true;
  if (r == kTimedOut) record_timeout(c, peer, kernel_id);
  *static_cast<volatile int*>(s_fail) = 1;
  return false;
}

// Notify inside (notify.cuh): one thread waits for NOTIFIED >= e, then recv_off is this dispatch's. The
// deadline has half a timeout more than the notify group's waits, so that a missing peer is recorded by
// notify (naming it), not here; a timeout here names this rank (its notify never finished).
__device__ __forceinline__ void wait_notified(const Ctx& c, int e, unsigned long long deadline, int* s_fail) {
  const int r = wait_geq(c.notified, e, deadline + c.timeout_ns / 2, c.aborted);
  if (r == kTimedOut) record_timeout(c, c.rank, K_NOTIFY);
  if (r != kArrived) *static_cast<volatile int*>(s_fail) = 1;
}

// The stage half: sub-chunks first, first + stride, ... of this rank's tokens (the stagers stage them in
// token order, a round of `stride` sub-chunks at a time), each released at every rank when done.
__device__ void stage_half(const Ctx& c, const StageIn& in, int row_bytes, int nscales, int K, int e, int stid,
                           int first, int stride) {
  const int nsub = (in.T + kStageSub - 1) / kStageSub;
  char* base = c.peers[c.rank];
  const size_t n16 = row_bytes / 16;
  for (int sub = first; sub < nsub; sub += stride) {
    const int t0 = sub * kStageSub, nt = min(kStageSub, in.T - t0);
    grid_copy<8>(in.x + t0 * n16, reinterpret_cast<int4*>(base + c.off_stage_x) + t0 * n16, nt * n16, stid, kHalf);
    if (in.scales) {
      float* dst = reinterpret_cast<float*>(base + c.off_stage_scales) + static_cast<size_t>(t0) * nscales;
      for (int i = stid; i < nt * nscales; i += kHalf) dst[i] = in.scales[static_cast<size_t>(t0) * nscales + i];
    }
    if (in.idx) {
      int64_t* dst = reinterpret_cast<int64_t*>(base + c.off_stage_idx) + static_cast<size_t>(t0) * K;
      for (int i = stid; i < nt * K; i += kHalf) dst[i] = in.idx[static_cast<size_t>(t0) * K + i];
    }
    if (in.w) {
      float* dst = reinterpret_cast<float*>(base + c.off_stage_w) + static_cast<size_t>(t0) * K;
      for (int i = stid; i < nt * K; i += kHalf) dst[i] = in.w[static_cast<size_t>(t0) * K + i];
    }
    named_barrier(kStageBarrier, kHalf);  // the half's writes of this sub-chunk, before its release
    // (a system fence before the release measured 3 us slower per dispatch at W=1 and adds no order)
    if (stid < c.world) st_release_sys(stage_ready_at(c, stid, c.rank, sub), e);
  }
}

// Contract order: s_delta[g] for each source rank g = s*P + l of the contract (P: this node's ranks, the
// kernel's world), start[g] - recv_off[l] - below[l][s], so that received row i from forwarder l out of slot
// s*M + t goes to s_delta[g] + i (what contract_order.cu computes after the exchange, from the same counts).
// Every metadata thread (mt in [0, kMetaThreads)) calls it and reaches both barriers, failed or not; block 0
// writes the counts. A wait that fails leaves s_fail set (the caller stops on it).
__device__ void contract_shifts(const Ctx& c, const int* s_off, int e, unsigned long long deadline, int* s_fail,
                                int* s_delta, int mt) {
  const int P = c.world, N = c.out_route.nodes, M = c.out_route.slot_tokens, me = c.rank;
  // below[l][s] into s_delta[s*P + l]: the first entry >= s*M of l's ascending send list to this rank
  for (int q = mt; q < N * P; q += kMetaThreads) {
    const int l = q % P, s = q / P;
    int lo = 0;
    if (s > 0 && lane_wait(c, flag_at(c, me, F_LISTS, l), e, l, K_PULL, deadline, s_fail)) {
      const int* sl =
          reinterpret_cast<const int*>(c.peers[l] + c.off_send_list) + static_cast<size_t>(me) * c.max_tokens;
      int hi = s_off[l + 1] - s_off[l];
      const int key = s * M;
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (ld_volatile(sl + mid) < key) lo = mid + 1;
        else hi = mid;
      }
    }
    s_delta[q] = lo;
  }
  __syncwarp();  // bar.sync is an aligned barrier: each warp reaches it converged (lanes left the loop apart)
  named_barrier(kMetaBarrier, kMetaThreads);
  if (mt == 0) {  // counts and shifts in contract order (g ascending reads s_delta[g] and [g + P] before they change)
    int start = 0;
    for (int g = 0; g < N * P; ++g) {
      const int l = g % P, below = s_delta[g];
      const int n = (g + P < N * P ? s_delta[g + P] : s_off[l + 1] - s_off[l]) - below;
      if (blockIdx.x == 0) c.out_route.counts[g] = n;
      s_delta[g] = start - s_off[l] - below;
      start += n;
    }
  }
  __syncwarp();
  named_barrier(kMetaBarrier, kMetaThreads);
}

// Resolves received row i (lane's row of a batch): its source and token, its local ids and weights
// (written at output row o), once the source has staged the token. False when a wait failed.
// kContract: o is computed here from the source and token (s_delta, contract_shifts) and recorded in to_contract.
template <bool kContract>
__device__ __forceinline__ bool resolve_row(const Ctx& c, const int* s_off, const PullOut& out, int K, int e, int i,
                                            int& o, const int* s_delta, unsigned long long deadline, int* s_fail,
                                            unsigned& lists_ok, int& ok_src, int& ok_sub, int& src, int& tok) {
  const int W = c.world, me = c.rank;
  src = find_src(s_off, W, i);
  if (!out.cached && !((lists_ok >> src) & 1u)) {
    if (!lane_wait(c, flag_at(c, me, F_LISTS, src), e, src, K_PULL, deadline, s_fail)) return false;
    lists_ok |= 1u << src;
  }
  tok = pull_row_token(c, s_off, src, i, out.cached, out.recv_src);
  if constexpr (kContract) {  // clamped: a token read after a failed wait elsewhere must not write past the outputs
    const int G = c.out_route.nodes * W;
    const int g = min(max(tok / c.out_route.slot_tokens * W + src, 0), G - 1);
    const long long p = static_cast<long long>(s_delta[g]) + i;
    o = static_cast<int>(p < 0 ? 0 : (p >= out.R_alloc ? out.R_alloc - 1 : p));
    c.out_route.to_contract[i] = o;
  }
  const int sub = tok / kStageSub;
  if (src != ok_src || sub != ok_sub) {
    if (!lane_wait(c, stage_ready_at(c, me, src, sub), e, src, K_PULL, deadline, s_fail)) return false;
    ok_src = src;
    ok_sub = sub;
  }
  if (out.idx || out.w) {
    const int64_t lo = static_cast<int64_t>(me) * c.local_experts, hi = lo + c.local_experts;
    pull_row_meta(c, src, tok, o, K, lo, hi, out.idx, out.w);
  }
  return true;
}

template <int kMode, bool kVecScales>
__global__ void __launch_bounds__(kFusedThreads, 1)
stage_pull_tma_kernel(Ctx c, StageIn in, PullOut out, int row_bytes, int nscales, int K, int nslot, NotifyOut nout,
                      int notify_inside) {
  constexpr bool kRouted = kMode != kPlain;
  extern __shared__ __align__(128) char s_ring[];
  __shared__ uint64_t s_bar[kRingMaxSlots];
  __shared__ int s_dst[kRingMaxSlots];  // the output row of each ring slot's item
  __shared__ int s_src[kSlots][kBatch], s_tok[kSlots][kBatch];
  __shared__ int s_out[kRouted ? kSlots : 1][kBatch];  // routed: each resolved row's output row
  __shared__ int s_delta[kMode == kContract ? kMaxContractRanks : 1];  // contract: each source rank's shift
  __shared__ int s_ready[kSlots];  // batch number resolved into the slot
  __shared__ int s_taken;          // batches thread 0 has issued
  __shared__ int s_off[kMaxRanks + 1];
  __shared__ int s_fail;
  __shared__ int s_nwsum[kHalf / 32][kMaxRanks], s_ntotal[kMaxRanks], s_nfail;  // notify inside (block 0)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int W = c.world, me = c.rank;
  const int e = c.epochs[E_DISPATCH] + 1;
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  __shared__ int s_len[kRingMaxSlots], s_gend[kRingMaxSlots];  // the ring's items and store groups
  RunRing<kRingLag, kRingMaxSlots> ring{s_ring, s_bar, s_len, s_gend, nslot, row_bytes};
  if (tid == 0) {
    ring.init();
    s_taken = 0;
  }
  if (tid < kSlots) s_ready[tid] = -1;
  if (tid == 0) s_nfail = 0;
  if (!notify_inside && tid <= W) s_off[tid] = out.recv_off[tid];  // inside: once notify releases it (below)
  if (block_wait_peers(c, F_PULL_DONE, e - 1, me, K_STAGE, deadline, &s_fail)) return;
  // every thread has read the wait's verdict before any writes s_fail again (wait_notified, lane_wait): a thread
  // that read a later write would leave alone, and the named barriers below count it
  __syncthreads();
  // Received rows in batches of up to kBatch rows of one source, global batch g = blockIdx.x + q * gridDim.x
  // being this block's q-th: batch g holds round g / W of source (me + g) % W, so the grid pulls every
  // source at once (each rank starting on another), in each source's token order, behind its staging.
  // (In receive order, source 0 first, every rank read the same source while the others' links idled:
  // 1227 us against stage + pull's 704 at EP4, 24 SMs, 4x H200, 2026-11-26.)
  // First row and row count (0 past the end of its source) of this block's q-th batch.
  auto batch_at = [&](int q, int& nrows) {
    const int g = static_cast<int>(blockIdx.x) + q * static_cast<int>(gridDim.x);
    const int s = (me + g % W) % W, a = s_off[s] + (g / W) * kBatch;
    nrows = max(0, min(kBatch, s_off[s + 1] - a));
    return a;
  };

  int nbatch = 0;  // this block's batches (the pull half's)
  if (warp < kHalf / 32) {  // the pull half: this dispatch's receive offsets, then its batches
    if (notify_inside) {  // this dispatch's recv_off, once notify (block 0's stage half) has written it
      if (tid == 0) {        // one reader decides (s_fail may change under the others)
        wait_notified(c, e, deadline, &s_fail);
        const bool ok = !failed(&s_fail);
        for (int s = 0; s <= W; ++s) s_off[s] = ok ? ld_volatile(out.recv_off + s) : 0;
      }
      named_barrier(kPullBarrier, kHalf);
    }
    int max_rounds = 0;
    for (int s = 0; s < W; ++s) max_rounds = max(max_rounds, (s_off[s + 1] - s_off[s] + kBatch - 1) / kBatch);
    nbatch = (max_rounds * W - static_cast<int>(blockIdx.x) + gridDim.x - 1) / gridDim.x;
  }

  if (warp >= kHalf / 32) {  // ---- stage half
    const int stid = tid - kHalf;
    const int G = static_cast<int>(gridDim.x);
    int first = blockIdx.x, stride = G;
    bool nfail = false;  // the same in every thread of the half (notify_group's answer), unlike s_fail
    if (!notify_inside) {
      if (blockIdx.x == 0 && stid < W) st_release_sys(flag_at(c, stid, F_LISTS, me), e);
    } else {
      // Block 0's stage half is notify (the ring's memory holds its per-expert counts: the pull half of the
      // block touches the ring only after NOTIFIED); with other blocks, they stage everything.
      if (blockIdx.x == 0)
        nfail = notify_group<false, kHalf>(c, NotifyGroup<kHalf>{stid, kStageBarrier}, in.idx, in.T, K, nout,
                                           reinterpret_cast<int*>(s_ring), s_nwsum, s_ntotal, &s_nfail, e);
      if (nfail && stid == 0) *static_cast<volatile int*>(&s_fail) = 1;
      first = G > 1 ? static_cast<int>(blockIdx.x) - 1 : 0;
      stride = G > 1 ? G - 1 : 1;
    }
    if (first >= 0 && !nfail) stage_half(c, in, row_bytes, nscales, K, e, stid, first, stride);
    if (notify_inside) {  // the padding below starts at recv_off[W]
      if (stid == 0) wait_notified(c, e, deadline, &s_fail);
      named_barrier(kStageBarrier, kHalf);
    }
    const int R = notify_inside ? (failed(&s_fail) ? out.R_alloc : ld_volatile(out.recv_off + W)) : s_off[W];
    // rows [R, R_alloc) of a worst-case output route nowhere
    for (int i = R + blockIdx.x * kHalf + stid; i < out.R_alloc; i += gridDim.x * kHalf) {
      const size_t o = out_row<kMode == kIndexed>(c, i, out.R_alloc);  // contract order keeps them in place
      if constexpr (kMode == kContract) c.out_route.to_contract[i] = i;
      for (int k = 0; k < K; ++k) {
        if (out.idx) out.idx[o * K + k] = -1;
        if (out.w) out.w[o * K + k] = 0.f;
      }
    }
  } else if (warp > 0) {  // ---- metadata warps: batch m is warp 1 + m % kMetaWarps's
    unsigned lists_ok = 0;
    int ok_src = -1, ok_sub = -1;
    if constexpr (kMode == kContract) contract_shifts(c, s_off, e, deadline, &s_fail, s_delta, tid - 32);
    for (int m = warp - 1; m < nbatch; m += kMetaWarps) {
      const int slot = m % kSlots;
      if (lane == 0)  // the slot's previous batch has been issued
        while (ld_acquire_cta_shared(&s_taken) < m - kSlots + 1 && !failed(&s_fail)) {
        }
      __syncwarp();
      if (failed(&s_fail)) break;
      int nrows = 0;
      const int a = batch_at(m, nrows), i = a + lane;
      int src = 0, tok = 0, o = i;
      if (lane < nrows) {
        o = out_row<kMode == kIndexed>(c, i, out.R_alloc);
        resolve_row<kMode == kContract>(c, s_off, out, K, e, i, o, s_delta, deadline, &s_fail, lists_ok, ok_src,
                                        ok_sub, src, tok);
      }
      __syncwarp();
      if (failed(&s_fail)) break;
      if (lane < kBatch) {
        s_src[slot][lane] = src;
        s_tok[slot][lane] = tok;
        if constexpr (kRouted) s_out[slot][lane] = o;
      }
      if constexpr (kRouted) __syncwarp();  // the scales below read the batch's output rows from s_out
      if constexpr (kVecScales) {  // the batch's FP8 scales as 16-byte loads, kScaleU4 in flight per lane
        const int n4 = nscales >> 2, total = nrows * n4;
        for (int v0 = 0; v0 < total; v0 += 32 * kScaleU4) {
          float4 f[kScaleU4];
#pragma unroll
          for (int u = 0; u < kScaleU4; ++u) {
            const int vi = v0 + u * 32 + lane;
            const int j = min(vi / n4, kBatch - 1);
            const int s = __shfl_sync(kFull, src, j), t = __shfl_sync(kFull, tok, j);
            if (vi < total)
              f[u] = reinterpret_cast<const float4*>(c.peers[s] + c.off_stage_scales)[static_cast<size_t>(t) * n4 +
                                                                                       (vi - j * n4)];
          }
#pragma unroll
          for (int u = 0; u < kScaleU4; ++u) {
            const int vi = v0 + u * 32 + lane;
            if (vi < total) {
              const int j = vi / n4;
              const size_t row = kRouted ? static_cast<size_t>(s_out[slot][j]) : static_cast<size_t>(a + j);
              reinterpret_cast<float4*>(out.scales)[row * n4 + (vi - j * n4)] = f[u];
            }
          }
        }
      } else if (out.scales) {  // the batch's FP8 scales: a flat stream of floats, kScaleU loads in flight per lane
        const int total = nrows * nscales;
        for (int v0 = 0; v0 < total; v0 += 32 * kScaleU) {
          float f[kScaleU];
#pragma unroll
          for (int u = 0; u < kScaleU; ++u) {
            const int vi = v0 + u * 32 + lane;
            const int j = min(vi / nscales, kBatch - 1);
            const int s = __shfl_sync(kFull, src, j), t = __shfl_sync(kFull, tok, j);
            if (vi < total)
              f[u] = reinterpret_cast<const float*>(c.peers[s] + c.off_stage_scales)[static_cast<size_t>(t) * nscales +
                                                                                      (vi - j * nscales)];
          }
#pragma unroll
          for (int u = 0; u < kScaleU; ++u) {
            const int vi = v0 + u * 32 + lane;
            if constexpr (kRouted) {  // value vi is column vi - j * nscales of row j's output row
              const int j = vi / nscales;
              if (vi < total) out.scales[static_cast<size_t>(s_out[slot][j]) * nscales + (vi - j * nscales)] = f[u];
            } else {
              if (vi < total) out.scales[static_cast<size_t>(a) * nscales + vi] = f[u];
            }
          }
        }
      }
      __threadfence_block();
      __syncwarp();
      if (lane == 0) st_release_cta_shared(&s_ready[slot], m);
    }
  } else if (lane == 0) {  // ---- thread 0: stream the resolved batches through the ring, a run at a time
    auto store_oldest = [&]() {
      const int dst = s_dst[ring.slot_of(ring.tail)];
      int n = 0;
      const char* rows = ring.wait_oldest(n);
      tma_store(out.x + static_cast<size_t>(dst) * row_bytes, rows, static_cast<uint32_t>(n) * row_bytes);
      ring.pop(n);
    };
    for (int m = 0; m < nbatch; ++m) {
      const int slot = m % kSlots;
      bool ok = true;
      while (ld_acquire_cta_shared(&s_ready[slot]) != m)
        if (failed(&s_fail)) {
          ok = false;
          break;
        }
      if (!ok) break;
      fence_proxy_async();  // the sources' stage writes, acquired by the metadata warps, before the bulk loads
      int nrows = 0;
      const int a = batch_at(m, nrows);
      for (int j = 0; j < nrows;) {  // a run: rows of consecutive tokens of one source to consecutive output rows
        const int src = s_src[slot][j], tok = s_tok[slot][j], dst = kRouted ? s_out[slot][j] : a + j;
        const int n = run_rows(s_src[slot], s_tok[slot], kRouted ? s_out[slot] : nullptr, j, nrows,
                               ring.fit(kRunRows));
        while (ring.full(n)) store_oldest();
        s_dst[ring.slot_of(ring.head)] = dst;
        ring.load(c.peers[src] + c.off_stage_x + static_cast<size_t>(tok) * row_bytes, n);
        j += n;
      }
      st_release_cta_shared(&s_taken, m + 1);
    }
    while (!ring.empty()) store_oldest();  // loads in flight complete even after a failure
    tma_store_wait_all();  // out.x written before PULL_DONE and the kernel's end
    fence_proxy_async();   // ... and ordered before the generic release below
  }
  __syncthreads();
  if (failed(&s_fail)) return;
  if (last_block(c.counters + C_PULL)) {
    if (tid < W) {
      st_release_sys(flag_at(c, tid, F_STAGE, me), e);
      st_release_sys(flag_at(c, tid, F_PULL_DONE, me), e);
    }
    if (tid == 0) c.epochs[E_DISPATCH] = e;
  }
}

}  // namespace

bool stage_pull_tma_fits(int row_bytes) { return pull_tma_fits(row_bytes); }

bool stage_pull_notify_fits(int row_bytes, int num_experts) {
  return stage_pull_tma_fits(row_bytes) &&
         sizeof(int) * static_cast<size_t>(num_experts) <= static_cast<size_t>(ring_slots(row_bytes)) * row_bytes;
}

namespace {

// One instantiation per (mode, scale loads): each with its own shared-memory attribute, set once per device.
template <int kMode, bool kVec>
void launch_one(int blocks, size_t smem, cudaStream_t stream, const Ctx& c, const StageIn& in, const PullOut& out,
                int row_bytes, int nscales, int K, int nslot, const NotifyOut& nout, int inside) {
  static bool smem_set[64] = {};
  ring_smem_once(stage_pull_tma_kernel<kMode, kVec>, smem_set);
  stage_pull_tma_kernel<kMode, kVec>
      <<<blocks, kFusedThreads, smem, stream>>>(c, in, out, row_bytes, nscales, K, nslot, nout, inside);
}

template <int kMode>
void launch_mode(bool vec, int blocks, size_t smem, cudaStream_t stream, const Ctx& c, const StageIn& in,
                 const PullOut& out, int row_bytes, int nscales, int K, int nslot, const NotifyOut& nout, int inside) {
  (vec ? launch_one<kMode, true> : launch_one<kMode, false>)(blocks, smem, stream, c, in, out, row_bytes, nscales, K,
                                                             nslot, nout, inside);
}

}  // namespace

void launch_stage_pull_tma(const Ctx& c, int blocks, const int4* x, int T, int row_bytes, const float* scales,
                           int nscales, const int64_t* topk_idx, const float* weights, int K, int4* out_x,
                           float* out_scales, int64_t* out_idx, float* out_w, const int* recv_off, int* recv_src,
                           int cached, int R_alloc, cudaStream_t stream, const NotifyOut* notify) {
  const int nslot = ring_slots(row_bytes);
  const StageIn in{x, T, scales, topk_idx, weights};
  const PullOut out{reinterpret_cast<char*>(out_x), out_scales, out_idx, out_w, recv_off, recv_src, cached, R_alloc};
  const size_t smem = static_cast<size_t>(nslot) * row_bytes;
  const NotifyOut nout = notify != nullptr ? *notify : NotifyOut{};
  const int inside = notify != nullptr ? 1 : 0;
  // (topk_idx is null for a rank with no tokens: notify reads none)
  EP_CHECK_ARG(!inside || (!cached && c.out_route.out_rows == nullptr && stage_pull_notify_fits(row_bytes, c.num_experts)),
               "stage_pull with notify inside: a fresh rank-major dispatch (plain or in contract order) whose "
               "per-expert counts (%d experts) fit the ring of rows of %d bytes; got cached=%d, out_rows %s",
               c.num_experts, row_bytes, cached, c.out_route.out_rows ? "set" : "null");
  // FP8 scales as 16-byte loads where each row's are whole float4s at aligned rows (the stage area's rows are, by its
  // layout); BF16 and other widths run the instantiation without them, as before
  const bool vec = out_scales != nullptr && nscales % 4 == 0 && reinterpret_cast<uintptr_t>(out_scales) % 16 == 0;
  if (c.out_route.to_contract != nullptr) {
    EP_CHECK_ARG(!out.cached && c.out_route.out_rows == nullptr && c.out_route.counts != nullptr &&
                     c.out_route.nodes >= 1 && c.out_route.nodes * c.world <= kMaxContractRanks &&
                     c.out_route.slot_tokens >= 1 && c.out_route.nodes * c.out_route.slot_tokens == c.max_tokens,
                 "stage_pull (contract order): a fresh dispatch over nodes x ranks <= %d source ranks whose tokens "
                 "are nodes x slot_tokens = max_tokens; got cached=%d, out_rows %s, counts %s, nodes=%d, ranks=%d, "
                 "slot_tokens=%d, max_tokens=%d", kMaxContractRanks, out.cached,
                 c.out_route.out_rows ? "set" : "null", c.out_route.counts ? "set" : "null", c.out_route.nodes,
                 c.world, c.out_route.slot_tokens, c.max_tokens);
    launch_mode<kContract>(vec, blocks, smem, stream, c, in, out, row_bytes, nscales, K, nslot, nout, inside);
  } else if (c.out_route.out_rows != nullptr) {
    launch_mode<kIndexed>(vec, blocks, smem, stream, c, in, out, row_bytes, nscales, K, nslot, nout, inside);
  } else {
    launch_mode<kPlain>(vec, blocks, smem, stream, c, in, out, row_bytes, nscales, K, nslot, nout, inside);
  }
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nvl
}  // namespace ep
