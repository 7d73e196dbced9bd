// combine, pull mode (comm.combine_kernel: pull): every rank stages the rows it received into its own
// combine area (local copies), and each token's owner reads its rows from the ranks that hold them
// (bulk loads over NVLink) and sums them as they arrive.
//
// Why: the push combines (split, fused, pipelined) move the rows with remote *writes* and reach
// 234-249 GB/s out of each GPU at EP4 (4x H200, 2026-11-26), while the dispatch's pull moves the same
// bytes with remote *reads* at 315 GB/s, the fabric's ceiling (NCCL 316-330). Pulling costs one local
// copy (HBM, overlapped: peers read a sub-chunk as soon as it is staged) and saves the receive-side
// round trip through the combine area: the owner sums straight from shared memory.
//
// Each block, three roles:
//   warp 0, the loader: takes chunks of kChunk tokens from the work queue (token order); for each token
//     and each rank r holding one of its rows (send_pos[t][r] >= 0, r != me) it waits for
//     COMBINE_READY[r][sub] >= ce in its own buffer (a local poll), then bulk-loads the row from r's area
//     into a slot of the load ring (its own row from x, likewise) and hands the token to a reduce warp
//     (a descriptor in shared memory).
//   warp 1, lane 0, the stager: sub-chunks of kCombineSub positions of one owner (up to 16 consecutive
//     rows, contiguous in x and in this rank's area at slot [owner][position]), interleaved over the
//     owners (rotated by rank) and strided over blocks, so every owner's early positions go first; rows
//     stream x -> shared -> area through a BulkRing of Runtime.pull_stage_slots slots in front of the load
//     ring; once a sub-chunk is written, a system fence and a release of COMBINE_READY[me][sub] = ce in the
//     owner's buffer.
//   warps 2..15, the reducers: descriptor d goes to warp 2 + d % 14; a warp waits for the token's slots,
//     sums them in rank order (combine_sum.cuh's sum_rows_bf16), writes y in BF16 and frees the slots and
//     the descriptor.
// Measured on 4x H200 (2026-11-26, EP4, 24 SMs, queued; nvlink_phases.py): reducers reading the own row
// from HBM (first version) held the slots through those reads: 758 us. With the own row in the ring and
// a bulk stager of 5 of 15 slots, 631 (loads alone 600, stage alone 330); register stage warps (6) with
// 16 load slots, 654 (loads alone 554, stage alone 294): the register copies slow the loads down more
// than they free slots for them (at EP2 245 against 268), so they went. Sub-chunks of 4 positions instead of 16 (more
// fences and flags per stager) read 894 us queued at EP4, 24 SMs, on 4x H100 (fused 663, DeepEP 604):
// 16 again, as in the 631 us layout.
//
// Protocol, at combine epoch ce = epochs[E_COMBINE] + 1:
//   1. wait REDUCE_DONE[p] >= ce-1 at this rank for every peer p: p has finished reading this rank's
//      area in the previous combine (pull) or this rank's slots in p's area were summed (push modes);
//   2. stage + COMBINE_READY; load + reduce as above;
//   3. the last block releases REDUCE_DONE[me] = ce at every peer (this rank reads their areas no more)
//      and sets epochs[E_COMBINE] = ce unless the call was aborted, and resets the work queue.
// Compatible with the push modes in either order (flags carry epochs; the arrival counters are not used).
// A timeout on COMBINE_READY is recorded with K_REDUCE; the stagers never wait on a peer.
#include <cuda_bf16.h>

#include "common/error.h"
#include "common/tma.cuh"
#include "nvlink/combine_sum.cuh"
#include "nvlink/kernels.h"

namespace ep {
namespace nvl {
namespace {

constexpr int kPullRingBytes = 224 * 1024;  // the load ring; the static shared memory fits beside it
constexpr int kLoadMaxSlots = 32;
constexpr int kDesc = 32;                   // token descriptors between the loader and the reducers
constexpr int kStoreLag = 4;                // bulk stager: store groups in flight
constexpr int kPend = 16;                   // stager: ring items between loaded and published

struct TokenDesc {
  int t;        // token
  int item0;    // load-ring item of its first remote row
  int present;  // bit r: rank r's row is in the load ring (rank order = item order)
};

__device__ __forceinline__ int* ready_at(const Ctx& c, int owner, int holder, int sub) {
  return reinterpret_cast<int*>(c.peers[owner] + c.off_combine_ready) + static_cast<size_t>(holder) * c.combine_subs + sub;
}

__device__ __forceinline__ void spin_pause() { __nanosleep(20); }

template <int MAXW, int U>
__global__ void __launch_bounds__(kThreads, 1)
combine_pull_tma_kernel(Ctx c, const char* __restrict__ x, const int* __restrict__ send_pos,
                        const int* __restrict__ recv_off, __nv_bfloat16* __restrict__ y, int T, int nslot_stage,
                        int nload, int diag) {
  extern __shared__ __align__(128) char s_mem[];
  __shared__ uint64_t s_lbar[kLoadMaxSlots], s_sbar[kPullStageMaxSlots];
  __shared__ int s_pend[kPend];           // stager: (owner, sub) + 1 of a unit's last item, else 0
  __shared__ int s_freed[kLoadMaxSlots];  // uses of a load slot consumed
  __shared__ int s_dfree[kDesc];          // uses of a descriptor slot consumed
  __shared__ TokenDesc s_desc[kDesc];
  __shared__ int s_pos[kChunk * MAXW];    // loader: send_pos of the chunk
  __shared__ int s_nd, s_end;             // descriptors published; 1 once the loader is done
  __shared__ int s_off[kMaxRanks + 1];
  __shared__ int s_fail;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int W = c.world, me = c.rank;
  const int ce = c.epochs[E_COMBINE] + 1;
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  const int row_bytes = c.hidden * 2;
  char* const load_buf = s_mem + static_cast<size_t>(nslot_stage) * row_bytes;
  BulkRing<kRingLag> ring{s_mem, s_sbar, nslot_stage, row_bytes};
  if (tid == 0) {
    ring.init();
    for (int s = 0; s < nload; ++s) mbar_init(&s_lbar[s], 1);
    fence_mbar_init();
    s_nd = 0;
    s_end = 0;
  }
  if (tid < kLoadMaxSlots) s_freed[tid] = 0;
  if (tid < kDesc) s_dfree[tid] = 0;
  if (tid <= W) s_off[tid] = recv_off[tid];
  // Peers have finished reading this rank's area in the previous combine (and it theirs).
  if (block_wait_peers(c, F_REDUCE_DONE, ce - 1, me, K_SEND, deadline, &s_fail)) return;

  if (warp == 1) {  // ---- the stager
    if (lane == 0) {
      char* area = c.peers[me] + c.off_combine;
      const int npeers = W - 1;
      int max_subs = 0;
      for (int o = 0; o < W; ++o)
        if (o != me) max_subs = max(max_subs, (s_off[o + 1] - s_off[o] + kCombineSub - 1) / kCombineSub);
      const int nunits = max_subs * npeers;
      int published = 0;
      auto publish = [&](int done) {  // releases the sub-chunks whose last item is below `done`
        bool fenced = false;
        for (; published < done; ++published) {
          const int p = s_pend[published % kPend];
          if (p == 0) continue;
          if (!fenced) {  // the sub-chunk's rows (async-proxy writes, complete) before its flag
            fence_proxy_async();
            __threadfence_system();
            fenced = true;
          }
          const int o = (p - 1) / c.combine_subs, sub = (p - 1) % c.combine_subs;
          st_release_sys(ready_at(c, o, me, sub), ce);
        }
      };
      char* dst_of[kPend];  // destination of each ring item, by item index mod kPend
      auto store_oldest = [&]() {
        tma_store(dst_of[ring.tail % kPend], ring.wait_oldest(), row_bytes);
        ring.pop();
        tma_store_wait<kStoreLag>();
        if (ring.tail - kStoreLag > published) publish(ring.tail - kStoreLag);
      };
      fence_proxy_async();  // peers' reads of this area (acquired above) before the bulk writes
      for (int u = blockIdx.x; u < nunits; u += gridDim.x) {
        const int o = (me + 1 + u % npeers) % W;
        const int sub = u / npeers, q0 = sub * kCombineSub, cnt = s_off[o + 1] - s_off[o];
        if (q0 >= cnt) continue;
        if (diag & 2) {  // benchmarks: the loads alone
          st_release_sys(ready_at(c, o, me, sub), ce);
          continue;
        }
        const int n = min(kCombineSub, cnt - q0);
        char* dst0 = area + (static_cast<size_t>(o) * c.max_tokens + q0) * row_bytes;
        const char* src0 = x + static_cast<size_t>(s_off[o] + q0) * row_bytes;
        for (int j = 0; j < n; ++j) {
          while (ring.full()) store_oldest();
          dst_of[ring.head % kPend] = dst0 + static_cast<size_t>(j) * row_bytes;
          s_pend[ring.head % kPend] = j == n - 1 ? o * c.combine_subs + sub + 1 : 0;
          ring.load(src0 + static_cast<size_t>(j) * row_bytes, row_bytes);
        }
      }
      while (!ring.empty()) store_oldest();
      tma_store_wait_all();
      publish(ring.tail);
    }
  } else if (warp == 0) {  // ---- the loader
    const int nchunks = (T + kChunk - 1) / kChunk;
    const int4* area_of[MAXW];
#pragma unroll
    for (int r = 0; r < MAXW; ++r)
      area_of[r] = r < W ? reinterpret_cast<const int4*>(c.peers[r] + c.off_combine +
                                                         static_cast<size_t>(me) * c.max_tokens * row_bytes)
                         : nullptr;
    int ready_sub[MAXW];  // the sub-chunk of rank r last seen staged
#pragma unroll
    for (int r = 0; r < MAXW; ++r) ready_sub[r] = -1;
    int item = 0, nd = 0, failed = 0;
    if (lane == 0) fence_proxy_async();
    while (!failed) {
      int chunk = 0;
      if (lane == 0) chunk = static_cast<int>(atomicAdd(c.counters + C_QUEUE, 1u));
      chunk = __shfl_sync(kFull, chunk, 0);
      if (chunk >= nchunks) break;
      const int t0 = chunk * kChunk, nt = min(kChunk, T - t0);
      for (int i = lane; i < nt * W; i += 32) s_pos[i] = send_pos[static_cast<size_t>(t0) * W + i];
      __syncwarp();
      if (lane == 0) {
        for (int k = 0; k < nt && !failed; ++k) {
          // a free descriptor slot: its previous use has been reduced
          const int ds = nd % kDesc;
          while (ld_acquire_cta_shared(&s_dfree[ds]) < nd / kDesc) spin_pause();
          TokenDesc d{t0 + k, item, 0};
#pragma unroll
          for (int r = 0; r < MAXW; ++r) {
            if (r >= W || failed) continue;
            const int pos = s_pos[k * W + r];
            if (pos < 0) continue;
            const int ls = item % nload;
            if (r == me) {  // the own row too goes through the ring: a reducer then never waits on HBM
              while (ld_acquire_cta_shared(&s_freed[ls]) < item / nload) spin_pause();
              tma_load(load_buf + static_cast<size_t>(ls) * row_bytes, x + static_cast<size_t>(s_off[me] + pos) * row_bytes,
                       row_bytes, &s_lbar[ls]);
              d.present |= 1 << r;
              ++item;
              continue;
            }
            if (diag & 1) continue;  // benchmarks: the stage alone
            const int sub = pos / kCombineSub;
            if (sub != ready_sub[r]) {  // positions rise with t (notify's scan), so this polls once per sub
              const int w = wait_geq(ready_at(c, me, r, sub), ce, deadline, c.aborted);
              if (w != kArrived) {
                if (w == kTimedOut) record_timeout(c, r, K_REDUCE);
                failed = 1;
                continue;
              }
              ready_sub[r] = sub;
              fence_proxy_async();  // the acquired rows before the bulk load reads them
            }
            while (ld_acquire_cta_shared(&s_freed[ls]) < item / nload) spin_pause();
            tma_load(load_buf + static_cast<size_t>(ls) * row_bytes, area_of[r] + static_cast<size_t>(pos) * (row_bytes / 16),
                     row_bytes, &s_lbar[ls]);
            d.present |= 1 << r;
            ++item;
          }
          if (failed) {  // loads issued for this token complete before the block may exit
            for (int n = d.item0; n < item; ++n) mbar_wait(&s_lbar[n % nload], (n / nload) & 1);
            break;
          }
          s_desc[ds] = d;
          st_release_cta_shared(&s_nd, ++nd);
        }
      }
      failed = __shfl_sync(kFull, failed, 0);
      __syncwarp();
    }
    if (lane == 0) st_release_cta_shared(&s_end, 1);
  } else {  // ---- the reducers
    const int n16 = row_bytes / 16, nred = kThreads / 32 - 2;
    for (int d = warp - 2;; d += nred) {
      int ready = 0;
      while (true) {  // descriptor d published, or the loader done without it
        if (ld_acquire_cta_shared(&s_nd) > d) {
          ready = 1;
          break;
        }
        if (ld_acquire_cta_shared(&s_end)) {
          ready = ld_acquire_cta_shared(&s_nd) > d;
          break;
        }
        spin_pause();
      }
      if (!ready) break;
      const TokenDesc td = s_desc[d % kDesc];
      const int4* src[MAXW];
      int item = td.item0;
#pragma unroll
      for (int r = 0; r < MAXW; ++r) {
        src[r] = nullptr;
        if (r >= W) continue;
        if ((td.present >> r) & 1) {
          const int ls = item % nload;
          mbar_wait(&s_lbar[ls], (item / nload) & 1);
          src[r] = reinterpret_cast<const int4*>(load_buf + static_cast<size_t>(ls) * row_bytes);
          ++item;
        }
      }
      sum_rows_bf16<MAXW, U>(src, reinterpret_cast<int4*>(y) + static_cast<size_t>(td.t) * n16, n16, lane,
                             [](const int4* p) { return *p; });
      __syncwarp();  // every lane has read the slots before they are handed back
      if (lane == 0) {
        for (int n = td.item0; n < item; ++n) st_release_cta_shared(&s_freed[n % nload], n / nload + 1);
        st_release_cta_shared(&s_dfree[d % kDesc], d / kDesc + 1);
      }
    }
  }
  finish_queued_combine(c, ce);
}

// The load ring's slots for rows of row_bytes beside stage_slots of a bulk stager's (the rest of the
// dynamic shared memory, capped); 0 when none fit.
__host__ __device__ inline int load_slots(int row_bytes, int stage_slots) {
  if (row_bytes <= 0 || row_bytes % 16) return 0;
  const int n = kPullRingBytes / row_bytes - stage_slots;
  return n < 0 ? 0 : (n < kLoadMaxSlots ? n : kLoadMaxSlots);
}

}  // namespace

// A token needs one load slot per rank holding a row of it (its own included), all at once: the ring
// must hold a whole token's rows or the loader would wait on itself. The stager's ring needs more
// slots than its lag.
bool combine_pull_tma_fits(int row_bytes, int world, int stage_slots) {
  const int n = load_slots(row_bytes, stage_slots);
  return stage_slots > kRingLag && stage_slots <= kPullStageMaxSlots && n >= world && n >= 2 && tma_supported();
}

namespace {

template <int MAXW, int U>
void launch_pull(const Ctx& c, int blocks, const char* x, const int* send_pos, const int* recv_off,
                 __nv_bfloat16* y, int T, int nslot_stage, int diag, cudaStream_t stream) {
  const int row_bytes = c.hidden * 2, nload = load_slots(row_bytes, nslot_stage);
  const size_t smem = static_cast<size_t>(nslot_stage + nload) * row_bytes;
  static bool smem_set[64] = {};
  int dev = 0;
  EP_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64 || !smem_set[dev]) {
    EP_CUDA_CHECK(cudaFuncSetAttribute(combine_pull_tma_kernel<MAXW, U>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       kPullRingBytes));
    if (dev >= 0 && dev < 64) smem_set[dev] = true;
  }
  combine_pull_tma_kernel<MAXW, U><<<blocks, kThreads, smem, stream>>>(c, x, send_pos, recv_off, y, T, nslot_stage,
                                                                        nload, diag);
}

}  // namespace

void launch_combine_pull_tma(const Ctx& c, int blocks, const int4* x, const int* send_pos, const int* recv_off,
                             int4* y, int T, int stage_slots, int diag, cudaStream_t stream) {
  const char* xb = reinterpret_cast<const char*>(x);
  auto* yb = reinterpret_cast<__nv_bfloat16*>(y);
  if (c.world <= 2)
    launch_pull<2, 4>(c, blocks, xb, send_pos, recv_off, yb, T, stage_slots, diag, stream);
  else if (c.world <= 4)
    launch_pull<4, 4>(c, blocks, xb, send_pos, recv_off, yb, T, stage_slots, diag, stream);
  else
    launch_pull<8, 2>(c, blocks, xb, send_pos, recv_off, yb, T, stage_slots, diag, stream);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nvl
}  // namespace ep
