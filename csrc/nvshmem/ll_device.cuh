// The low-latency kernels' shared view of memory (see low_latency.h for the protocol).
//
// Symmetric heap of every rank, per parity p (0/1, the parity of the call's epoch, so that a fast
// peer's next call never writes what a slow rank is still reading):
//   disp_flag[p][W]        u64 signal words; source s sets [s] to epoch + 1 after its rows and counts
//   disp_cnt[p][W][EL]     int, rows source s sent to each local expert
//   disp_slots[p][EL][W][M] slot = 16-byte header {token, k} + payload (BF16 row, or FP8 row + scales)
//   comb_flag[p][W]        u64, as disp_flag, for combine
//   comb_rows[p][M*KMAX]   BF16 rows sent back, at token * KMAX + k
// RDMA staging (only when a peer is not reachable over P2P): stage_rows[M] slots, stage_cnt[E] ints,
// comb_stage[EL*W*M] rows: NVSHMEM puts need a symmetric source.
//
// Output sets (comm.low_latency.output_buffers = N > 0, every peer P2P; ll_dispatch_direct.cu): instead
// of the slots, N sets of the dispatch's outputs live in the heap and the senders write each row
// straight into its final row there, so no receive copy runs:
//   cnt_all[p][W][E]       int, every source's rows per global expert, sent to every rank first
//   cnt_flag[p][W]         u64, source s sets [s] to epoch + 1 once its counts are there
//   out_set[i]             data [EL][W*M][H] BF16, or FP8 [EL][W*M][H] + scales [EL][H/128][W*M] float32
//                          + row-major scales [EL][W*M][H/128] float32 (kScalesRowMajor) in the same
//                          bytes; src_info [EL][W*M] int; row_slot [EL][W*M] int; info [EL][W*M] int2
//                          {token, combine slot} (kPackedInfo)
//   cnt_word[p][W][E]      u64 (epoch + 1) << 32 | rows, kCountWords' counts: a word carries its own
//                          epoch, so it needs neither a fence nor cnt_flag behind it
//   set's rec              int [W] tokens of each source, then [W][M][KMAX] the row (el * W*M + row) of
//                          each (source, token, k) in this rank's set, -1 where k is not this rank's:
//                          what kOwnerReduce's combine sums per (source, token); every entry of a
//                          source's tokens is rewritten by each dispatch, so nothing needs clearing
//   comb_w[p][W][M][KMAX]  u64 (epoch + 1) << 32 | float bits: the weight of (source, token, k), sent by
//                          the source at its combine's start to the pick's owner (kOwnerReduce)
// A row's place: the rows of lower source ranks for that expert first (cnt_all), then this source's
// in token order. The host picks the set of each call (the same on every rank); a set is rewritten N
// dispatches later.
#pragma once
#include <cuda_bf16.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "common/ptx.cuh"
#include "common/wait.cuh"
#include "nvshmem/host_report.h"
#include "nvshmem/shmem_device.cuh"

namespace ep {
namespace ll {

constexpr int kMaxRanks = 64;
constexpr int kThreads = 512;
constexpr int kHeaderBytes = 16;
constexpr int kMaxSets = 8;  // output sets in the heap at most
constexpr int kSend = 1, kRecv = 2;  // phases of one launch
// Variant bits ORed into `phases` (the engine's `kernel_flags`, for A/B runs; 0 = the default code):
constexpr int kSerialPrologue = 4;   // combine receive: thread 0 gathers each token's picks serially
// The direct dispatch (ll_dispatch_direct.cu; every rank of a call must pass the same bits):
constexpr int kScalesRowMajor = 8;   // FP8: a row's scales in one contiguous remote write, transposed on receive
constexpr int kPackedInfo = 16;      // token and combine slot in one 8-byte remote store, split on receive
constexpr int kFp8Wide = 32;         // FP8: 16 bytes per store (two BF16 units per thread)
constexpr int kCountWords = 64;      // counts tagged with the epoch: a row waits for its expert's words only
constexpr int kPreload = 128;        // a token's first row loads issued before its wait for the lower ranks' counts
constexpr int kLeanStores = 256;     // a (token, k)'s row and scale addresses made once; FP8: a group's scale stored by its lanes
constexpr int kEarlyRow = 512;       // with kPreload: the block's first row loads issued at entry, before the routing loads
constexpr int kLoadsAhead = 1024;     // combine receive: picks loaded before the signal wait, a thread's rows all in flight
constexpr int kCopy8 = 2048;          // row copies (combine send, slot-path dispatch receive): 8 loads in flight per lane, not 4
constexpr int kSpreadRows = 4096;     // combine send: rows dealt to warps in a stride order, so every block mixes peers' and own rows
constexpr int kLeanRouting = 8192;    // direct dispatch: the rank mask read once per block, a token's slots counted by a warp per k
constexpr int kLightTickets = 16384;  // direct dispatch and combine: send tickets behind fence.acq_rel.sys, receive tickets unfenced
constexpr int kArrivalOrder = 32768;  // direct dispatch: each (source, expert) block reserved at the owner by an atomic, sources in arrival order
// comm.low_latency.combine_reduce owner: the owner of a token's experts sums their rows (weighted, float32, k
// ascending) into one BF16 row per (token, owner rank), and the token's rank sums those rows in the order of
// each rank's first pick. With output sets in the heap the owner does it before sending (one row per (token,
// rank) crosses NVLink instead of one per pick: ll_combine.cu, "Owner sums"); elsewhere (and under a receive
// hook: kPerPickSend) the token's rank does it from the picks' rows, with the same roundings.
constexpr int kOwnerReduce = 65536;
// With kOwnerReduce, a combine whose receive half is a hook: every pick's row leaves as without it and the
// receive half makes each owner's sum (the same numbers). The owners' sums need the sources' weights, so
// that send half would wait for every peer's combine to start -- holding its SMs through the caller's
// compute -- while this one never waits.
constexpr int kPerPickSend = 131072;
constexpr int kVariantMask = kSerialPrologue | kScalesRowMajor | kPackedInfo | kFp8Wide | kCountWords | kPreload |
                             kLeanStores | kEarlyRow | kLoadsAhead | kCopy8 | kSpreadRows | kLeanRouting | kLightTickets |
                             kArrivalOrder | kOwnerReduce | kPerPickSend;
constexpr int kPhaseMask = kSend | kRecv;
constexpr int kMaxScaleGroups = 256;  // H / 128 with kScalesRowMajor (a row's scales pass through shared memory)
constexpr int kKernelDispatch = 10, kKernelCombine = 11;

// Whether the direct dispatch's receive half has rows to fix up (every block takes a share), or only
// the counts to write (block 0 alone). The host sizes the receive launch with it.
__host__ __device__ __forceinline__ bool direct_recv_rows(bool fp8, int flags) {
  return (flags & kPackedInfo) != 0 || (fp8 && (flags & kScalesRowMajor) != 0);
}

// Local (not symmetric) ints: epochs of each half, last-block tickets, the mask of left-out ranks.
enum StateIndex { kDispSendEpoch = 0, kDispRecvEpoch, kCombSendEpoch, kCombRecvEpoch,
                  kTicketDispSend, kTicketDispRecv, kTicketCombSend, kTicketCombRecv, kMask };

struct HostInfo : HostReport<kMaxRanks> {};  // host-mapped: what a wait that timed out reports, and expert ids out of range

struct Ctx {
  int rank, world, num_experts, local_experts, max_tokens, max_topk, hidden;
  int slot_bytes;  // header + BF16 row, rounded to 16
  char* heap;                 // this rank's symmetric base
  char* peer[kMaxRanks];      // nvshmem_ptr(heap, r): P2P address, or nullptr (RDMA)
  long long disp_flag[2], disp_cnt[2], disp_slots[2], comb_flag[2], comb_rows[2];
  long long stage_rows, stage_cnt, comb_stage;  // -1 when every peer is P2P
  int sets;                                      // output sets in the heap (0: slots and a receive copy)
  long long cnt_all[2], cnt_flag[2], cnt_word[2], out_set[kMaxSets];
  long long set_scales, set_src_info, set_row_slot;  // offsets inside a set
  long long set_scales_rm, set_info;                 // offsets inside a set (kScalesRowMajor, kPackedInfo)
  long long set_rec;                                 // offset inside a set (kOwnerReduce's records)
  long long comb_w[2];                               // kOwnerReduce's weight words, per parity (-1 without sets)
  // kArrivalOrder, per parity: the owner's reservation counters [EL], this rank's begins [E] (for its own
  // blocks, behind arr_ready = epoch + 1), the words (begin << 32) | count [W][E] for the owner's receive
  long long arr_resv[2], arr_begin[2], arr_ready[2], arr_word[2];
  int* state;
  int* aborted;
  HostInfo* host;
  unsigned long long timeout_ns;
  unsigned long long* stamps;  // phase stamps (benchmarks only): [2][kStampBlocks][kStampSlots], or nullptr
};

// Phase stamps: where a benchmark asked for them (Runtime::set_stamps), thread 0 of each block writes
// %globaltimer at the phase boundaries of a kernel (kStampDispatch, kStampCombine) into
// stamps[kernel][block][slot]; every call overwrites them, so a reader sees the last call's. Off (the
// default) it is a load of a null pointer from the parameters and a branch: nothing on the row path.
constexpr int kStampSlots = 8, kStampBlocks = 1024;  // a buffer of 2 * 1024 * 8 u64 (128 KiB)
constexpr int kStampDispatch = 0, kStampCombine = 1;
// dispatch_direct's slots: entry, routing loaded, the first token's destinations known (the count
// wait), every row stored, after the block's fence (the stores acknowledged), the signal sent (the last
// block), the receive half's signals seen, the receive half done
enum DispatchStamp { kDsEntry = 0, kDsRouting, kDsPlaced, kDsRowsOut, kDsFenced, kDsSignal, kDsSignalsIn, kDsDone };
// combine's slots: entry, rows sent, after the block's fence, the signal sent (the last block), the
// receive half's signals seen, the sums done (after the block's fence), and inside the receive half the
// first token's picks known (row addresses and weights in shared memory), its sums stored
enum CombineStamp { kCsEntry = 0, kCsRowsOut, kCsFenced, kCsSignal, kCsSignalsIn, kCsDone, kCsPicked, kCsSummed };

__device__ __forceinline__ void stamp(const Ctx& c, int kernel, int slot) {
  if (c.stamps != nullptr && threadIdx.x == 0 && blockIdx.x < kStampBlocks)
    c.stamps[(kernel * kStampBlocks + blockIdx.x) * kStampSlots + slot] = globaltimer();
}

__device__ __forceinline__ unsigned long long ld_volatile_u64(const unsigned long long* w) {
  unsigned long long v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(w) : "memory");
  return v;
}

__device__ __forceinline__ bool left_out(const Ctx& c, int r) { return ld_volatile(c.state + kMask + r) != 0; }

__device__ __forceinline__ unsigned* ticket(const Ctx& c, int i) { return reinterpret_cast<unsigned*>(c.state + i); }

// Slot of (local expert el, source s, index i) in parity p, relative to a rank's heap base.
__device__ __forceinline__ long long slot_offset(const Ctx& c, int p, int el, int s, int i) {
  return c.disp_slots[p] + ((static_cast<long long>(el) * c.world + s) * c.max_tokens + i) * c.slot_bytes;
}

__device__ __forceinline__ long long comb_row_offset(const Ctx& c, int p, int token, int k) {
  return c.comb_rows[p] + (static_cast<long long>(token) * c.max_topk + k) * c.hidden * 2;
}

// Exclusive scan of n ints in shared memory into off[0..n] (off[n] = total), by the whole block.
__device__ inline void block_exclusive_scan(const int* in, int* off, int n) {
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int per = (n + 31) / 32;
    const int lo = min(n, lane * per), hi = min(n, lo + per);
    int sum = 0;
    for (int i = lo; i < hi; ++i) sum += in[i];
    int incl = sum;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(kFull, incl, d);
      if (lane >= d) incl += v;
    }
    int run = incl - sum;
    for (int i = lo; i < hi; ++i) {
      off[i] = run;
      run += in[i];
    }
    if (lane == 31) off[n] = incl;
  }
  __syncthreads();
}

// Index j with off[j] <= i < off[j + 1] (off ascending, off[0] = 0 <= i < off[n]).
__device__ __forceinline__ int find_segment(const int* off, int n, int i) {
  int lo = 0, hi = n;  // invariant: off[lo] <= i < off[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (off[mid] <= i) lo = mid; else hi = mid;
  }
  return lo;
}

// Sets this rank's signal word (at flag_off, index rank) on every rank not left out to epoch + 1: a
// release store over P2P, or an NVSHMEM signal behind a fence where a rank has no P2P path (signal_peer
// in shmem_device.cuh, with the flag waits and copy loops the two kernel families share). Called by
// one block after every block's rows are out (last_block's fences order them before it).
__device__ inline void signal_ranks(const Ctx& c, long long flag_off, int epoch) {
  for (int d = threadIdx.x; d < c.world; d += blockDim.x)
    if (!left_out(c, d)) signal_peer(c.peer[d], c.heap, flag_off, c.rank, d, epoch + 1);
}

}  // namespace ll
}  // namespace ep
