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
// Variants (Runtime::pull_variant, default 0 = the layout above; for A/B runs at EP4, where the loads alone
// take 544-585 us with 13 / 11 load slots and the whole kernel 587 with 12, on 4x H100):
//   +1 / +2, the stager moves half / quarter rows. Its BulkRing keeps nslot - kRingLag loads in flight
//     (kRingLag = 2 of the slots are held by stores still reading shared memory): with whole rows 4 stage
//     slots give 2 rows of local loads in flight per SM and 3 slots only 1 (the 702 us row); halves
//     give 3 / 2, quarters 3.5 / 2.5 in the same bytes. So the stage keeps its rate with 3 slots, and the
//     loads get the 13th slot (544 us alone). Costs 2x / 4x bulk copies for the one stager thread
//     (~900 / ~1800 per SM per combine at EP4).
//   +4, free load slots. In ring order the loader reuses slots oldest first, so a token whose row waits on
//     a slow peer holds back every load behind it, even where younger tokens are reduced and their slots
//     idle; and the own row (a local load, in within a few hundred ns) sits in its slot for the whole
//     flight of the token's remote rows. Here the loader takes any free slot (a bit mask the reducers set
//     once they have read a slot; mbarrier parities per slot travel in the descriptor) and loads the own
//     row after the remote ones. A token still holds its slots until its slowest row, but no token waits
//     for another's.
//   +8, spans (session 5, for the cold call): each block's loader takes a contiguous span of 7/8 of the
//     tokens (then the last eighth from the work queue, for balance) and its stager a contiguous span of
//     7/8 of each owner's positions (the last eighth strided), so each SM touches ~1/G of x, y and every
//     area instead of all of them. In variant 0 every SM's loads and stores sweep the whole ~600 MB a
//     combine touches (x 212 MB, own area 159, peers' areas 159, y 59 at EP4), all ~290 of its 2 MB
//     pages, with 24-48 SMs each warming its own translations after the cold call's flush; DeepEP's
//     channels touch contiguous slices. Costs: skewed routing unbalances the spans (the queued eighth
//     evens out a few %).
//   +16, evict_first x: the stager's and the own-row reads of x (read once) are L2 evict_first, so the
//     staged rows the peers are about to read stay in the holder's L2 (their reads are latency-bound).
//   +32, paced loads (session 7, for the cold call): a block's loader takes its next chunk only once the
//     block's stager has staged at least that fraction of its sub-chunks (less one). With every rank
//     started together the stage (216 us alone at EP4, 48 SMs) runs ahead of the loads (557 us) and the
//     pace never binds; but a rank that starts late finds its peers' rows all staged, and its loaders then
//     run flat out while its own stager -- whose rows every peer is waiting for -- shares the SM's bulk
//     copies with them: the `skewed` protocol measured one late rank costing the others 1.5x (24 SMs) to
//     2.3x (48 SMs) its delay. The pace gives the late rank's stage the SM first.
//   +64, start together (session 16, in the default): what the pace aimed at, by the other end -- no rank stages or
//     loads before every rank's combine has started (kVarStartTogether below), so a late rank never finds its peers'
//     rows staged ahead of its own stage. (In the copy-engine mode the side stream's copies are not held back:
//     only the pull kernel, whose loads wait with the rest.)
// Summing each row as it arrives (releasing a slot per row) was not taken: the partial sums need FP32 (a
// token's 7168 columns are 28 KB, two rows of the ring, or 224 registers a lane for a warp), which costs
// about the slots it frees at EP4 (~3.6 rows a token, one of them the own row), and arrival order would
// make y depend on timing (rounding). Every variant sums in rank order: y is bit for bit that of variant 0.
//
// Copy mode (diag kDiagStagedByCopies, Runtime::combine_copy_engine, off by default): no stager in any block, all
// of the ring loads; the rows are staged and COMBINE_READY released by combine_stage_copies.cu's copies and one-block
// release kernels on a side stream, step 2's flags with the same values (the two modes mix across ranks).
// Expert mode (kDiagStagedByCopies | kDiagOwnStaged, Runtime::combine_expert_staged, the expert-major combine's):
// the stage is combine_expert.cu's expert sum on the other SMs, which writes the own rows into slot [me] of this
// rank's area too; the loader takes them from there behind COMBINE_READY[me][me] like any holder's.
//
// Protocol, at combine epoch ce = epochs[E_COMBINE] + 1:
//   0. (start together, variant +64, the default) block 0 stores F_START[me] = ce at every peer;
//   1. wait REDUCE_DONE[p] >= ce-1 at this rank for every peer p: p has finished reading this rank's
//      area in the previous combine (pull) or this rank's slots in p's area were summed (push modes);
//      with +64, then wait F_START[p] >= ce (every peer's pull combine of this epoch has started);
//   2. stage + COMBINE_READY; load + reduce as above;
//   3. the last block releases REDUCE_DONE[me] = ce at every peer (this rank reads their areas no more)
//      and sets epochs[E_COMBINE] = ce unless the call was aborted, and resets the work queue.
// Compatible with the push modes in either order (flags carry epochs; the arrival counters are not used).
// A timeout on COMBINE_READY or F_START is recorded with K_REDUCE; past step 1 the stagers never wait on a peer.
// The +64 bit is part of the protocol: every rank must run the same (Runtime::pull_variant is set alike everywhere),
// else a rank with it waits for an F_START the others never store, to the timeout.
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
constexpr int kStoreLag = 4;                // bulk stager: store groups in flight (of whole rows; x split)
constexpr int kPend = 64;                   // stager: ring items between loaded and published (< 12 x 4 - 2 + 16)

// Runtime::pull_variant, passed in launch_combine_pull_tma's diag above its low 4 bits (diag >> 4):
//   bits 0-1: the stager's item is a row / 2^v (0: whole rows, today's; 1: halves; 2: quarters);
//   bit 2 (kVarFreeSlots): load slots from a free mask instead of in ring order, own row loaded last;
//   bit 3 (kVarSpans): each block owns a contiguous span of 7/8 of the tokens (its loader) and of every
//     owner's staged positions (its stager), the last eighth queued / strided as in variant 0;
//   bit 4 (kVarEvictX): the reads of x (staged rows, own rows: read once) are L2 evict_first -- the default
//     (Runtime::pull_variant_ = 16) since session 5: 2% faster queued and aligned at EP4 24 SMs, level at 48;
//     +8 (spans) lost 18-36% in the same run (benchmarks/NOTES_nvlink.md, "Cold combine at EP4, session 5").
//   bit 6 (kVarStartTogether): every block waits, before it stages or loads, until every peer's pull combine of
//     this epoch has started (F_START, signalled by block 0 first thing) -- DeepEP's combine starts behind a notify
//     kernel that waits for every rank the same way. Why: a rank that starts late finds its peers' rows staged, its
//     loaders run flat out beside its own stager, whose rows every peer waits for, and the slowest rank's cold
//     call ran ~25 us past a late start + the aligned kernel (benchmarks/NOTES_nvlink.md, session 16); with the
//     barrier every rank runs the aligned kernel from the last start on, for one flag's round trip. In the default
//     (Runtime::pull_variant_ = 80) since session 16: EP4 cold 719.6 -> 688.8 us at 24 SMs and 732.2 -> 686.4 at 48,
//     queued level (587 / 586), one late rank's 55 us costing the slowest 1x its delay instead of 1.5-2.3x (4x H100).
// Both leave every token's sum as it is (rank order, float, one rounding): y is bit for bit the same.
constexpr int kVarSplitMask = 3, kVarFreeSlots = 4, kVarSpans = 8, kVarEvictX = 16, kVarPace = 32,
              kVarStartTogether = 64, kMaxSplit = 4;
constexpr int kPaceDone = 1 << 30;  // s_staged once the stager has published everything

struct TokenDesc {
  int t;        // token
  int item0;    // load-ring item of its first remote row (ring order only)
  int present;  // bit r: rank r's row is in the load ring (rank order = item order in ring order)
  unsigned char ls[kMaxRanks];  // kVarFreeSlots: rank r's load slot (low 6 bits), its mbarrier parity (bit 7)
};

__device__ __forceinline__ void spin_pause() { __nanosleep(20); }

// kVarSpans: block b's share of n items is [span_of(n, b), span_of(n, b + 1)); the last kSpanTail-th of the
// items are not in the spans (queued or strided, for balance).
constexpr int kSpanTail = 8;
__device__ __forceinline__ int span_of(int n, int b) {
  return static_cast<int>(static_cast<long long>(n) * b / gridDim.x);
}

template <int MAXW, int U, bool kFree, bool kRouted>
__global__ void __launch_bounds__(kThreads, 1)
combine_pull_tma_kernel(Ctx c, const char* __restrict__ x, const int* __restrict__ send_pos,
                        const int* __restrict__ recv_off, __nv_bfloat16* __restrict__ y, int T, int nslot_stage,
                        int nload, int diag) {
  extern __shared__ __align__(128) char s_mem[];
  __shared__ uint64_t s_lbar[kLoadMaxSlots], s_sbar[kPullStageMaxSlots * kMaxSplit];
  __shared__ int s_pend[kPend];           // stager: (owner, sub) + 1 of a unit's last item, else 0
  __shared__ int s_freed[kLoadMaxSlots];  // uses of a load slot consumed
  __shared__ int s_dfree[kDesc];          // uses of a descriptor slot consumed
  __shared__ TokenDesc s_desc[kDesc];
  __shared__ int s_pos[kChunk * MAXW];    // loader: send_pos of the chunk
  __shared__ long long s_xown[kChunk];    // loader, CombineRoute::x_rows: the chunk's own rows in x
  __shared__ int s_nd, s_end;             // descriptors published; 1 once the loader is done
  __shared__ int s_off[kMaxRanks + 1];
  __shared__ int s_fail;
  __shared__ unsigned s_freemask;         // kFree: bit s set while load slot s is free
  __shared__ int s_staged, s_units;       // kVarPace: units the stager has staged / will stage (-1: not yet known)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int W = c.world, me = c.rank;
  const int ce = c.epochs[E_COMBINE] + 1;
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  const int row_bytes = c.hidden * 2;
  const bool own_staged = diag & kDiagOwnStaged;  // the own rows from this rank's area too (the expert sum's stage)
  const int variant = (diag & ~kDiagOwnStaged) >> 4;
  diag &= 15;
  const bool spans = variant & kVarSpans, evict_x = variant & kVarEvictX, pace = variant & kVarPace;
  const uint64_t x_policy = evict_x ? l2_policy_evict_first() : 0;
  // diag & 4 (benchmarks: nvlink_phases.py --pull-profile): blocks 0 and the last print where their loader
  // and stager spent the call, in SM cycles (clock64): waits on a peer's COMBINE_READY, on a free load
  // slot, on a free descriptor, and the whole role.
  const bool prof = (diag & 4) && (blockIdx.x == 0 || blockIdx.x == gridDim.x - 1);
  auto tic = [&]() -> long long { return prof ? clock64() : 0; };
  // The stager's items: rows, or pieces of 1/split of a row (16-byte multiples) in the same shared memory.
  // The ring keeps nslot - kRingLag loads in flight, so at 4 stage slots whole rows leave 2 rows of local
  // loads in flight per SM, halves 3 and quarters 3.5, and at 3 slots 1 / 2 / 2.5: the stage needs fewer
  // slots for the same rate, and the loads get the rest.
  int split = min(1 << (variant & kVarSplitMask), kMaxSplit);
  while (split > 1 && row_bytes % (16 * split)) split >>= 1;
  const int item_bytes = row_bytes / split;
  char* const load_buf = s_mem + static_cast<size_t>(nslot_stage) * row_bytes;
  BulkRing<kRingLag> ring{s_mem, s_sbar, nslot_stage * split, item_bytes};
  if (tid == 0) {
    ring.init();
    for (int s = 0; s < nload; ++s) mbar_init(&s_lbar[s], 1);
    fence_mbar_init();
    s_nd = 0;
    s_end = 0;
    s_freemask = nload >= 32 ? ~0u : (1u << nload) - 1;
    s_staged = 0;
    s_units = -1;
  }
  if (tid < kLoadMaxSlots) s_freed[tid] = 0;
  if (tid < kDesc) s_dfree[tid] = 0;
  if (tid <= W) s_off[tid] = recv_off[tid];
  const bool together = variant & kVarStartTogether;
  // (an aborted buffer does not say it started: its peers time out naming it, as without the bit)
  if (together && blockIdx.x == 0 && tid < W && tid != me && !ld_volatile(c.aborted))
    st_release_sys(flag_at(c, tid, F_START, me), ce);
  // Peers have finished reading this rank's area in the previous combine (and it theirs).
  if (block_wait_peers(c, F_REDUCE_DONE, ce - 1, me, K_SEND, deadline, &s_fail)) return;
  // kVarStartTogether: every peer's combine has started (a timeout names the peer that never did). The barrier
  // first: every thread has read the first wait's s_fail before the second wait's thread 0 rewrites it.
  if (together) {
    __syncthreads();
    if (block_wait_peers(c, F_START, ce, me, K_REDUCE, deadline, &s_fail)) return;
  }

  if (warp == 1) {  // ---- the stager (none where the copy engines stage: diag & kDiagStagedByCopies)
    if (lane == 0 && !(diag & kDiagStagedByCopies)) {
      char* area = c.peers[me] + c.off_combine;
      const int npeers = W - 1;
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
          st_release_sys(combine_ready_at(c, o, me, sub), ce);
        }
      };
      char* dst_of[kPend] = {};  // destination of each ring item, by item index mod kPend
      const int lag = kStoreLag * split;  // the same store bytes in flight whatever the item size
      auto store_oldest = [&]() {
        tma_store(dst_of[ring.tail % kPend], ring.wait_oldest(), item_bytes);
        ring.pop();
        if (split == 1)
          tma_store_wait<kStoreLag>();
        else if (split == 2)
          tma_store_wait<2 * kStoreLag>();
        else
          tma_store_wait<4 * kStoreLag>();
        if (ring.tail - lag > published) publish(ring.tail - lag);
      };
      const long long t_stage = tic();
      const unsigned long long g_stage = prof ? globaltimer() : 0;
      fence_proxy_async();  // peers' reads of this area (acquired above) before the bulk writes
      // owner o's sub-chunk `sub`: x -> shared -> area, its flag once written (publish)
      int units = 0;  // kVarPace: units handed to the ring so far (s_staged, for the loader)
      auto stage_unit = [&](int o, int sub) {
        if (pace) st_release_cta_shared(&s_staged, units++);  // the previous unit's rows are in the ring
        const int q0 = sub * kCombineSub, cnt = s_off[o + 1] - s_off[o];
        if (q0 >= cnt) return;
        if (diag & 2) {  // benchmarks: the loads alone
          st_release_sys(combine_ready_at(c, o, me, sub), ce);
          return;
        }
        // the sub-chunk's rows are contiguous in the area (item j at j * item_bytes) and in x, unless the call
        // routes x (CombineRoute::x_rows: row i is x[x_rows[i]], one index read per row)
        const int n = min(kCombineSub, cnt - q0) * split;
        char* dst0 = area + (static_cast<size_t>(o) * c.max_tokens + q0) * row_bytes;
        const int i0 = s_off[o] + q0;
        const char* src0 = x + static_cast<size_t>(i0) * row_bytes;
        const bool routed = kRouted && c.route.x_rows != nullptr;
        const char* xrow = nullptr;
        for (int j = 0; j < n; ++j) {
          while (ring.full()) store_oldest();
          dst_of[ring.head % kPend] = dst0 + static_cast<size_t>(j) * item_bytes;
          s_pend[ring.head % kPend] = j == n - 1 ? o * c.combine_subs + sub + 1 : 0;
          if (!routed) {  // the one stager thread issues every copy: no division on this path
            ring.load(src0 + static_cast<size_t>(j) * item_bytes, item_bytes, evict_x, x_policy);
            continue;
          }
          const int piece = j % split;
          if (piece == 0) xrow = x + x_row(c, i0 + j / split) * row_bytes;
          ring.load(xrow + static_cast<size_t>(piece) * item_bytes, item_bytes, evict_x, x_policy);
        }
      };
      // Owner k's (o = me + 1 + k) sub-chunks from first[k] on are strided over blocks, the owners interleaved
      // (all of them in variant 0). kVarSpans: this block first stages sub-chunks [b * F / G, (b + 1) * F / G)
      // of every owner, F = first[k] = 7/8 of the owner's S sub-chunks, the owners interleaved from one rotated
      // by block: about the positions an owner's block b loads in its token span (positions rise with tokens),
      // so a block's pages stay few; the last eighth is strided, as the loaders' last eighth is queued.
      int first[kMaxRanks], most_tail = 0;
      for (int k = 0; k < npeers; ++k) {
        const int o = (me + 1 + k) % W, S = (s_off[o + 1] - s_off[o] + kCombineSub - 1) / kCombineSub;
        first[k] = spans ? S - S / kSpanTail : 0;
        most_tail = max(most_tail, S - first[k]);
      }
      if (pace && !spans) st_release_cta_shared(&s_units, max(0, (most_tail * npeers - static_cast<int>(blockIdx.x) +
                                                                  static_cast<int>(gridDim.x) - 1) / static_cast<int>(gridDim.x)));
      if (spans) {
        int most = 0;
        for (int k = 0; k < npeers; ++k) most = max(most, span_of(first[k], blockIdx.x + 1) - span_of(first[k], blockIdx.x));
        for (int j = 0; j < most; ++j)
          for (int kk = 0; kk < npeers; ++kk) {
            const int k = (kk + blockIdx.x) % npeers, sub = span_of(first[k], blockIdx.x) + j;
            if (sub < span_of(first[k], blockIdx.x + 1)) stage_unit((me + 1 + k) % W, sub);
          }
      }
      for (int u = blockIdx.x; u < most_tail * npeers; u += gridDim.x)
        stage_unit((me + 1 + u % npeers) % W, first[u % npeers] + u / npeers);
      while (!ring.empty()) store_oldest();
      tma_store_wait_all();
      publish(ring.tail);
      if (pace) st_release_cta_shared(&s_staged, kPaceDone);
      if (prof)
        printf("pull prof rank %d block %d variant %d: stager %lld kcycles, globaltimer us %llu -> %llu\n", me,
               blockIdx.x, variant, (tic() - t_stage) / 1000, (g_stage / 1000) % 1000000,
               (globaltimer() / 1000) % 1000000);
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
    unsigned par = 0;  // kFree: bit s, the parity of load slot s's next mbarrier phase
    long long p_ready = 0, p_slot = 0, p_desc = 0;  // diag & 4: cycles waited
    const long long t_load = tic();
    const unsigned long long g_load = prof ? globaltimer() : 0;
    // kFree: any free load slot (lowest first). Only this thread clears bits, the reducers set them once
    // they have read a slot, so the bit found stays set until the atomicAnd. Never waits on itself: a
    // token waiting for a slot holds at most W - 1 of them, fewer than nload (>= W: combine_pull_tma_fits),
    // and every other taken slot belongs to a published token, which a reducer frees once its loads (bulk
    // loads always complete) are in.
    auto claim = [&]() -> int {
      unsigned m;
      const long long t = tic();
      while ((m = static_cast<unsigned>(ld_acquire_cta_shared(reinterpret_cast<const int*>(&s_freemask)))) == 0)
        spin_pause();
      p_slot += tic() - t;
      const int s = __ffs(m) - 1;
      atomicAnd(&s_freemask, ~(1u << s));
      return s;
    };
    // Rank r's sub-chunk `sub` staged (polled once per sub: positions rise with t, notify's scan); false on a
    // timeout (recorded) or an abort.
    auto staged = [&](int r, int sub) -> bool {
      if (sub == ready_sub[r]) return true;
      const long long tr = tic();
      const int w = wait_geq(combine_ready_at(c, me, r, sub), ce, deadline, c.aborted);
      p_ready += tic() - tr;
      if (w != kArrived) {
        if (w == kTimedOut) record_timeout(c, r, K_REDUCE);
        return false;
      }
      ready_sub[r] = sub;
      fence_proxy_async();  // the acquired rows before the bulk load reads them
      return true;
    };
    // the own row at position pos of x (kVarEvictX: evict_first, read once); with CombineRoute::x_rows, row k of the
    // chunk is x[s_xown[k]], resolved by lane k with the chunk's positions (no index read on the loader's path)
    auto load_own = [&](char* dst, int k, int pos, uint64_t* bar) {
      const size_t r = kRouted && c.route.x_rows != nullptr ? static_cast<size_t>(s_xown[k])
                                                            : static_cast<size_t>(s_off[me] + pos);
      tma_load(dst, x + r * row_bytes, row_bytes, bar, evict_x, x_policy);
    };
    if (lane == 0) fence_proxy_async();
    // kVarSpans: chunks [b * F / G, (b + 1) * F / G) in order, F = 7/8 of them (the stager's spans), then
    // the last eighth from the work queue (for balance: a static span's rows vary by a few %); variant 0:
    // every chunk from the queue.
    const int queued0 = spans ? nchunks - nchunks / kSpanTail : 0;
    int span_next = span_of(queued0, blockIdx.x);
    const int span_end = span_of(queued0, blockIdx.x + 1);
    while (!failed) {
      int chunk = 0;
      if (span_next < span_end) {
        chunk = span_next++;
      } else {
        if (lane == 0) chunk = queued0 + static_cast<int>(atomicAdd(c.counters + C_QUEUE, 1u));
        chunk = __shfl_sync(kFull, chunk, 0);
      }
      if (chunk >= nchunks) break;
      if (pace && !spans && lane == 0) {  // this block's stage at least chunk / nchunks along, less one unit
        int total;
        while ((total = ld_acquire_cta_shared(&s_units)) < 0) spin_pause();
        const long long need = static_cast<long long>(total) * chunk / nchunks - 1;
        while (ld_acquire_cta_shared(&s_staged) < need) spin_pause();
      }
      const int t0 = chunk * kChunk, nt = min(kChunk, T - t0);
      for (int i = lane; i < nt * W; i += 32) s_pos[i] = send_pos[static_cast<size_t>(t0) * W + i];
      if (kRouted && c.route.x_rows != nullptr && lane < nt) {
        const int pos = send_pos[static_cast<size_t>(t0 + lane) * W + me];
        s_xown[lane] = pos >= 0 ? static_cast<long long>(x_row(c, s_off[me] + pos)) : 0;
      }
      __syncwarp();
      if (lane == 0) {
        for (int k = 0; k < nt && !failed; ++k) {
          // a free descriptor slot: its previous use has been reduced
          const int ds = nd % kDesc;
          const long long td = tic();
          while (ld_acquire_cta_shared(&s_dfree[ds]) < nd / kDesc) spin_pause();
          p_desc += tic() - td;
          TokenDesc d{t0 + k, item, 0, {}};
          if constexpr (kFree) {
            // Remote rows first, in rank order, each into any free slot; the own row (a local load that
            // lands within a few hundred ns) last, so that its slot idles least while the remote rows are
            // in flight. The slots a token holds no longer block the loader behind it: a token whose rows
            // are all in is reduced and its slots reused whatever older token still waits for a row (in
            // ring order the loader waited for the oldest item's token before reusing any slot).
            int own = -1;
#pragma unroll
            for (int r = 0; r < MAXW; ++r) {
              if (r >= W || failed) continue;
              const int pos = s_pos[k * W + r];
              if (pos < 0) continue;
              if (r == me && !own_staged) {
                own = pos;
                continue;
              }
              if (diag & 1) continue;  // benchmarks: the stage alone
              if (!staged(r, pos / kCombineSub)) {
                failed = 1;
                continue;
              }
              const int ls = claim();
              tma_load(load_buf + static_cast<size_t>(ls) * row_bytes,
                       area_of[r] + static_cast<size_t>(pos) * (row_bytes / 16), row_bytes, &s_lbar[ls]);
              d.ls[r] = static_cast<unsigned char>(ls | (((par >> ls) & 1u) << 7));
              par ^= 1u << ls;
              d.present |= 1 << r;
            }
            if (own >= 0 && !failed) {
              const int ls = claim();
              load_own(load_buf + static_cast<size_t>(ls) * row_bytes, k, own, &s_lbar[ls]);
              d.ls[me] = static_cast<unsigned char>(ls | (((par >> ls) & 1u) << 7));
              par ^= 1u << ls;
              d.present |= 1 << me;
            }
            if (failed) {  // loads issued for this token complete before the block may exit
#pragma unroll
              for (int r = 0; r < MAXW; ++r)
                if (r < W && ((d.present >> r) & 1)) mbar_wait(&s_lbar[d.ls[r] & 63], d.ls[r] >> 7);
              break;
            }
          } else {
#pragma unroll
            for (int r = 0; r < MAXW; ++r) {
              if (r >= W || failed) continue;
              const int pos = s_pos[k * W + r];
              if (pos < 0) continue;
              const int ls = item % nload;
              if (r == me && !own_staged) {  // the own row too goes through the ring: a reducer never waits on HBM
                const long long ts = tic();
                while (ld_acquire_cta_shared(&s_freed[ls]) < item / nload) spin_pause();
                p_slot += tic() - ts;
                load_own(load_buf + static_cast<size_t>(ls) * row_bytes, k, pos, &s_lbar[ls]);
                d.present |= 1 << r;
                ++item;
                continue;
              }
              if (diag & 1) continue;  // benchmarks: the stage alone
              if (!staged(r, pos / kCombineSub)) {
                failed = 1;
                continue;
              }
              const long long ts = tic();
              while (ld_acquire_cta_shared(&s_freed[ls]) < item / nload) spin_pause();
              p_slot += tic() - ts;
              tma_load(load_buf + static_cast<size_t>(ls) * row_bytes, area_of[r] + static_cast<size_t>(pos) * (row_bytes / 16),
                       row_bytes, &s_lbar[ls]);
              d.present |= 1 << r;
              ++item;
            }
            if (failed) {  // loads issued for this token complete before the block may exit
              for (int n = d.item0; n < item; ++n) mbar_wait(&s_lbar[n % nload], (n / nload) & 1);
              break;
            }
          }
          s_desc[ds] = d;
          st_release_cta_shared(&s_nd, ++nd);
        }
      }
      failed = __shfl_sync(kFull, failed, 0);
      __syncwarp();
    }
    if (lane == 0) st_release_cta_shared(&s_end, 1);
    if (prof && lane == 0)
      printf("pull prof rank %d block %d variant %d: loader %lld kcycles, waits: ready %lld, slot %lld, desc %lld; "
             "globaltimer us %llu -> %llu\n", me, blockIdx.x, variant, (tic() - t_load) / 1000, p_ready / 1000,
             p_slot / 1000, p_desc / 1000, (g_load / 1000) % 1000000, (globaltimer() / 1000) % 1000000);
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
      unsigned slots = 0;  // kFree: the load slots to hand back
#pragma unroll
      for (int r = 0; r < MAXW; ++r) {
        src[r] = nullptr;
        if (r >= W) continue;
        if ((td.present >> r) & 1) {
          int ls;
          if constexpr (kFree) {
            ls = td.ls[r] & 63;
            mbar_wait(&s_lbar[ls], td.ls[r] >> 7);
            slots |= 1u << ls;
          } else {
            ls = item % nload;
            mbar_wait(&s_lbar[ls], (item / nload) & 1);
            ++item;
          }
          src[r] = reinterpret_cast<const int4*>(load_buf + static_cast<size_t>(ls) * row_bytes);
        }
      }
      // y's row, or where the call's CombineRoute places the sum (none for a token without rows, or a null block)
      int4* yrow = reinterpret_cast<int4*>(y) + static_cast<size_t>(td.t) * n16;
      if constexpr (kRouted) {
        yrow = y_row(c, reinterpret_cast<int4*>(y), td.t, n16);
        if (c.route.y_blocks != nullptr && td.present == 0) yrow = nullptr;
      }
      if (yrow != nullptr) sum_rows_bf16<MAXW, U>(src, yrow, n16, lane, [](const int4* p) { return *p; });
      __syncwarp();  // every lane has read the slots before they are handed back
      if (lane == 0) {
        if constexpr (kFree) {
          __threadfence_block();  // with the relaxed atomicOr, a release: the slots' reads before their reuse
          atomicOr(&s_freemask, slots);
        } else {
          for (int n = td.item0; n < item; ++n) st_release_cta_shared(&s_freed[n % nload], n / nload + 1);
        }
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

bool combine_pull_copies_fits(int row_bytes, int world) {
  const int n = load_slots(row_bytes, 0);
  return n >= world && n >= 2 && tma_supported();
}

namespace {

template <int MAXW, int U, bool kFree, bool kRouted>
void launch_pull_kernel(const Ctx& c, int blocks, const char* x, const int* send_pos, const int* recv_off,
                 __nv_bfloat16* y, int T, int nslot_stage, int diag, cudaStream_t stream) {
  const int row_bytes = c.hidden * 2, nload = load_slots(row_bytes, nslot_stage);
  const size_t smem = static_cast<size_t>(nslot_stage + nload) * row_bytes;
  static bool smem_set[64] = {};
  int dev = 0;
  EP_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64 || !smem_set[dev]) {
    EP_CUDA_CHECK(cudaFuncSetAttribute(combine_pull_tma_kernel<MAXW, U, kFree, kRouted>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       kPullRingBytes));
    if (dev >= 0 && dev < 64) smem_set[dev] = true;
  }
  combine_pull_tma_kernel<MAXW, U, kFree, kRouted><<<blocks, kThreads, smem, stream>>>(c, x, send_pos, recv_off, y, T,
                                                                                        nslot_stage, nload, diag);
}

// A routed call (CombineRoute: the hierarchical backend's inner combine) and a plain one compile apart: the plain
// kernel is the one measured before routes existed (its 24-SM rows read 4-5% slower with the checks compiled in).
template <int MAXW, int U, bool kFree>
void launch_pull(const Ctx& c, int blocks, const char* x, const int* send_pos, const int* recv_off,
                 __nv_bfloat16* y, int T, int nslot_stage, int diag, cudaStream_t stream) {
  if (c.route.x_rows != nullptr || c.route.y_blocks != nullptr)
    launch_pull_kernel<MAXW, U, kFree, true>(c, blocks, x, send_pos, recv_off, y, T, nslot_stage, diag, stream);
  else
    launch_pull_kernel<MAXW, U, kFree, false>(c, blocks, x, send_pos, recv_off, y, T, nslot_stage, diag, stream);
}

}  // namespace

void launch_combine_pull_tma(const Ctx& c, int blocks, const int4* x, const int* send_pos, const int* recv_off,
                             int4* y, int T, int stage_slots, int diag, cudaStream_t stream) {
  const char* xb = reinterpret_cast<const char*>(x);
  auto* yb = reinterpret_cast<__nv_bfloat16*>(y);
  if (diag & kDiagStagedByCopies) diag &= ~(kVarPace << 4);  // no stager to pace the loads behind
  const bool free_slots = (diag >> 4) & kVarFreeSlots;  // Runtime::pull_variant (see kVarFreeSlots)
  if (c.world <= 2) {
    if (free_slots)
      launch_pull<2, 4, true>(c, blocks, xb, send_pos, recv_off, yb, T, stage_slots, diag, stream);
    else
      launch_pull<2, 4, false>(c, blocks, xb, send_pos, recv_off, yb, T, stage_slots, diag, stream);
  } else if (c.world <= 4) {
    if (free_slots)
      launch_pull<4, 4, true>(c, blocks, xb, send_pos, recv_off, yb, T, stage_slots, diag, stream);
    else
      launch_pull<4, 4, false>(c, blocks, xb, send_pos, recv_off, yb, T, stage_slots, diag, stream);
  } else {
    if (free_slots)
      launch_pull<8, 2, true>(c, blocks, xb, send_pos, recv_off, yb, T, stage_slots, diag, stream);
    else
      launch_pull<8, 2, false>(c, blocks, xb, send_pos, recv_off, yb, T, stage_slots, diag, stream);
  }
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nvl
}  // namespace ep
