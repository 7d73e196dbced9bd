// combine, pipelined mode (comm.combine_kernel: pipelined): the fused kernel's protocol (arrival
// counters per chunk of kChunk tokens, reduce units that wait on them) with the sends moved by bulk
// copies (TMA) from one thread per block, while the block's other warps reduce.
//
// Why: the split combine reduces only after every peer's send has finished (send + reduce in series:
// EP4, 24 SMs, 757 us on 4x H200), and the fused kernel's register sends hold 16 warps x 8 x 16 B in
// flight per SM, which bounds the bytes a warp can push over NVLink; its warps also alternate sending
// and waiting. Here the sends are contiguous (a source's rows are contiguous in x and in its combine
// area), so one thread streams them through the shared-memory ring as whole rows, and 15 warps per
// block reduce chunks as they complete.
//
// Each block: thread 0 streams send units through common/tma.cuh's BulkRing (local x -> shared ->
// the source's combine area, slot [me][position]). A unit is up to unit_rows (8 or 32) consecutive rows for one
// source; units interleave the sources (rotated by rank, so the ranks start on different links) and
// are strided over blocks, so every link carries rows at once and the sources' early tokens go first.
// Once a unit's bulk stores have completed (wait_group), one system fence and a relaxed add per
// chunk publish its rows on the source's arrival counters. Warps 1.. take reduce units (chunks of
// kChunk tokens, in token order) from the queue and sum each once its rows have arrived.
//
// Protocol, at combine epoch ce = epochs[E_COMBINE] + 1 (as combine_fused.cu):
//   1. wait REDUCE_DONE[p] >= ce-1 at this rank for every peer p;
//   2. sends, arrival adds and reduce units as above (a reduce unit zeroes its counters);
//   3. the last block releases REDUCE_DONE[me] = ce at every peer and sets epochs[E_COMBINE] = ce
//      unless the call was aborted, and resets the work queue.
// A timeout in step 1 is recorded with K_SEND, a chunk wait with K_REDUCE; sends never wait on a peer.
#include "common/error.h"
#include "common/tma.cuh"
#include "nvlink/combine_sum.cuh"
#include "nvlink/kernels.h"

namespace ep {
namespace nvl {
namespace {

constexpr int kWriteLag = 16;  // bulk store groups in flight before the oldest is waited for (6 / 16 / 28
                               // measured alike: 680 us queued at EP4, 24 SMs, 4x H200, 2026-11-26)
constexpr int kPend = 64;      // ring items between loaded and published (> kRingMaxSlots + kWriteLag)

struct PendUnit {
  int src, row0, n;  // n > 0 on a unit's last item: rows row0 .. row0+n-1 of x, sent to src
};

// unit_rows: rows per send unit (one system fence per unit, then its chunks' adds). A store's shared
// memory is free once read (the ring's own lag), so kWriteLag may exceed the ring's slots.
template <int MAXW, int U>
__global__ void __launch_bounds__(kThreads, 1)
combine_pipe_tma_kernel(Ctx c, const char* __restrict__ x, const int* __restrict__ send_pos,
                        const int* __restrict__ recv_off, const int* __restrict__ recv_src, int4* __restrict__ y,
                        int T, int nslot, int unit_rows) {
  extern __shared__ __align__(128) char s_ring[];
  __shared__ uint64_t s_bar[kRingMaxSlots];
  __shared__ char* s_dst[kRingMaxSlots];  // where each ring slot's row goes
  __shared__ PendUnit s_pend[kPend];
  __shared__ int s_off[kMaxRanks + 1];
  __shared__ int s_fail;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int W = c.world, me = c.rank;
  const int ce = c.epochs[E_COMBINE] + 1;
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  const int row_bytes = c.hidden * 2;
  BulkRing<kRingLag> ring{s_ring, s_bar, nslot, row_bytes};
  if (tid == 0) ring.init();
  if (tid <= W) s_off[tid] = recv_off[tid];
  // The sources must have finished the previous combine with their combine area and counters.
  if (block_wait_peers(c, F_REDUCE_DONE, ce - 1, me, K_SEND, deadline, &s_fail)) return;

  if (tid == 0) {  // ---- the sender
    const int npeers = W - 1;
    int max_units = 0;
    for (int s = 0; s < W; ++s)
      if (s != me) max_units = max(max_units, (s_off[s + 1] - s_off[s] + unit_rows - 1) / unit_rows);
    const int nunits = max_units * npeers;
    int published = 0;  // ring items whose units have been published
    // Publishes the units of the items whose writes are complete: every item below `done`.
    auto publish = [&](int done) {
      bool fenced = false;
      for (; published < done; ++published) {
        const PendUnit u = s_pend[published % kPend];
        if (u.n == 0) continue;
        if (!fenced) {  // the unit's rows (async-proxy writes, complete) before its counters
          fence_proxy_async();
          __threadfence_system();
          fenced = true;
        }
        int* ctr = reinterpret_cast<int*>(c.peers[u.src] + c.off_arrive) + me;  // arrive[chunk][me] at src
        int ch = recv_src[u.row0] / kChunk, k = 0;
        for (int j = 0; j < u.n; ++j) {
          const int cj = recv_src[u.row0 + j] / kChunk;
          if (cj != ch) {
            red_add_relaxed_sys(ctr + ch * kMaxRanks, k);
            ch = cj;
            k = 0;
          }
          ++k;
        }
        red_add_relaxed_sys(ctr + ch * kMaxRanks, k);
      }
    };
    auto store_oldest = [&]() {
      tma_store(s_dst[ring.slot_of(ring.tail)], ring.wait_oldest(), row_bytes);
      ring.pop();
      tma_store_wait<kWriteLag>();  // items below tail - kWriteLag are written
      if (ring.tail - kWriteLag > published) publish(ring.tail - kWriteLag);
    };
    fence_proxy_async();  // the peers' reads of their areas (acquired above) before the bulk writes
    for (int u = blockIdx.x; u < nunits; u += gridDim.x) {
      const int s = (me + 1 + u % npeers) % W;
      const int q0 = (u / npeers) * unit_rows, cnt = s_off[s + 1] - s_off[s];
      if (q0 >= cnt) continue;
      const int n = min(unit_rows, cnt - q0), row0 = s_off[s] + q0;
      char* dst0 = c.peers[s] + c.off_combine + (static_cast<size_t>(me) * c.max_tokens + q0) * row_bytes;
      for (int j = 0; j < n; ++j) {
        while (ring.full()) store_oldest();
        s_dst[ring.slot_of(ring.head)] = dst0 + static_cast<size_t>(j) * row_bytes;
        s_pend[ring.head % kPend] = PendUnit{s, row0, j == n - 1 ? n : 0};
        ring.load(x + x_row(c, row0 + j) * row_bytes, row_bytes);  // x[x_rows[i]] where routed (CombineRoute)
      }
    }
    while (!ring.empty()) store_oldest();
    tma_store_wait_all();
    publish(ring.tail);
  } else if (warp > 0) {  // ---- reduce units, in token order
    const int self_lo = s_off[me];
    const int nchunks = (T + kChunk - 1) / kChunk;
    while (true) {
      int unit = 0;
      if (lane == 0) unit = static_cast<int>(atomicAdd(c.counters + C_QUEUE, 1u));
      unit = __shfl_sync(kFull, unit, 0);
      if (unit >= nchunks) break;
      if (!reduce_chunk<MAXW, U>(c, reinterpret_cast<const int4*>(x), send_pos, self_lo, y, T, unit, lane,
                                 deadline))
        break;
    }
  }
  finish_queued_combine(c, ce);
}

}  // namespace

bool combine_pipe_tma_fits(int row_bytes) { return ring_slots(row_bytes) > kRingLag + 1 && tma_supported(); }

namespace {

template <int MAXW, int U>
void launch_pipe(const Ctx& c, int blocks, const char* x, const int* send_pos, const int* recv_off,
                 const int* recv_src, int4* y, int T, int nslot, cudaStream_t stream) {
  // Rows per send unit: 8 at EP2 (measured there), 32 above (EP4, 24 SMs: 645 us queued against 681 with
  // 8, 4x H200, 2026-11-26: fewer system fences per row). A pause between the reduce warps' polls
  // (200 ns) measured no different from a tight spin: none.
  const int unit_rows = c.world <= 2 ? 8 : 32;
  static bool smem_set[64] = {};
  ring_smem_once(combine_pipe_tma_kernel<MAXW, U>, smem_set);
  combine_pipe_tma_kernel<MAXW, U><<<blocks, kThreads, static_cast<size_t>(nslot) * c.hidden * 2, stream>>>(
      c, x, send_pos, recv_off, recv_src, y, T, nslot, unit_rows);
}

}  // namespace

void launch_combine_pipe_tma(const Ctx& c, int blocks, const int4* x, const int* send_pos, const int* recv_off,
                             const int* recv_src, int4* y, int T, cudaStream_t stream) {
  const int nslot = ring_slots(c.hidden * 2);
  const char* xb = reinterpret_cast<const char*>(x);
  // recv_src may be null when this rank received no rows (no unit is then sent)
  if (c.world <= 4)
    launch_pipe<4, 3>(c, blocks, xb, send_pos, recv_off, recv_src, y, T, nslot, stream);
  else
    launch_pipe<8, 2>(c, blocks, xb, send_pos, recv_off, recv_src, y, T, nslot, stream);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nvl
}  // namespace ep
