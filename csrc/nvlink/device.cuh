// What the nvlink kernels share: block size, vectors in flight, where a flag lives, and the
// block-wide wait for one flag from every peer.
#pragma once
#include "common/error.h"
#include "common/ptx.cuh"
#include "common/wait.cuh"
#include "nvlink/nvlink.h"

namespace ep {
namespace nvl {

constexpr int kThreads = 512;  // stage, pull and combine blocks
constexpr int kPullU = 8;      // 16-byte vectors in flight per lane in the warp copies

// The bulk-copy (TMA) kernels' shared-memory ring (common/tma.cuh): its bytes, slot cap and lag.
constexpr int kRingBytes = 176 * 1024;
constexpr int kRingMaxSlots = 32;
constexpr int kRingLag = 2;
// Rows one bulk copy of a pull may move (a run: consecutive tokens of one source to consecutive output rows,
// common/tma.cuh's RunRing). 4 measured best in stage_pull (4x H200, session 19): FP8 rows of 7 KB paid a copy's
// overhead per row before; runs of 8 fill a 12-slot BF16 ring with ~1 item and slowed BF16 by 4%.
constexpr int kRunRows = 4;
// The rows from j on (before `end`, at most `most`) that one bulk copy moves: one source, consecutive tokens and, where
// `out` is given (a routed pull), consecutive output rows (a plain pull's output rows follow its received order).
__device__ __forceinline__ int run_rows(const int* src, const int* tok, const int* out, int j, int end, int most) {
  int n = 1;
  while (n < most && j + n < end && src[j + n] == src[j] && tok[j + n] == tok[j] + n &&
         (out == nullptr || out[j + n] == out[j] + n))
    ++n;
  return n;
}
// Raises a bulk-copy kernel's dynamic shared-memory limit to kRingBytes, once per device (the
// attribute belongs to the device's context). `done`: the calling launcher's own flags.
template <typename Kernel>
inline void ring_smem_once(Kernel kernel, bool (&done)[64]) {
  int dev = 0;
  EP_CUDA_CHECK(cudaGetDevice(&dev));
  const bool tracked = dev >= 0 && dev < 64;
  if (tracked && done[dev]) return;
  EP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kRingBytes));
  if (tracked) done[dev] = true;
}

__host__ __device__ inline int ring_slots(int slot_bytes) {
  if (slot_bytes <= 0 || slot_bytes % 16) return 0;
  const int n = kRingBytes / slot_bytes;
  return n < kRingMaxSlots ? n : kRingMaxSlots;
}

// flag[kind][src] in owner's buffer: src writes it, owner waits on it.
__device__ __forceinline__ int* flag_at(const Ctx& c, int owner, int kind, int src) {
  return reinterpret_cast<int*>(c.peers[owner] + c.off_flags) + kind * kMaxRanks + src;
}

// STAGE_READY[src][sub] in owner's buffer: src has staged tokens [sub * kStageSub, ...) (rows, scales,
// topk ids and weights) for dispatch epoch value it holds.
__device__ __forceinline__ int* stage_ready_at(const Ctx& c, int owner, int src, int sub) {
  return reinterpret_cast<int*>(c.peers[owner] + c.off_stage_ready) + static_cast<size_t>(src) * c.stage_subs + sub;
}

// COMBINE_READY[holder][sub] in owner's buffer (the pull combine): holder has staged positions [sub * kCombineSub, ...)
// of owner's rows in its own combine area, for the combine epoch value it holds.
__device__ __forceinline__ int* combine_ready_at(const Ctx& c, int owner, int holder, int sub) {
  return reinterpret_cast<int*>(c.peers[owner] + c.off_combine_ready) + static_cast<size_t>(holder) * c.combine_subs +
         sub;
}

// Every thread waits for flag[kind][p] >= target at this rank for p in [0, W) except `skip`
// (thread p waits for peer p). Returns true when the block must stop (timeout or abort); a timeout
// is recorded against kernel_id. A thread may read *s_fail after a waiter has set it and return alone:
// safe, as every caller then leaves the kernel and an exiting thread releases the CTA-wide barriers the
// others wait at (PTX `exit`), provided nothing writes *s_fail and no counted (named) barrier comes before
// the caller's next __syncthreads: two waits in a row take one between them (the second's thread 0 rewrites
// *s_fail), and so does stage_pull_tma, whose later waits write it. (group_wait_peers, notify.cuh, waits at
// named barriers and reads its verdict behind one more.) The verdicts reduced by __syncthreads_or instead
// changed the pull combine's registers and cost it 5% at EP4, 24 SMs (4x H100, session 18: 619 against 589 us
// queued).
__device__ inline bool block_wait_peers(const Ctx& c, int kind, int target, int skip, int kernel_id,
                                        unsigned long long deadline, int* s_fail) {
  const int tid = threadIdx.x;
  if (tid == 0) *s_fail = ld_volatile(c.aborted);
  __syncthreads();
  if (*s_fail) return true;
  if (tid < c.world && tid != skip) {
    int r = wait_geq(flag_at(c, c.rank, kind, tid), target, deadline, c.aborted);
    if (r == kTimedOut) record_timeout(c, tid, kernel_id);
    if (r != kArrived) *s_fail = 1;
  }
  __syncthreads();
  return *s_fail != 0;
}

// The source rank of received row i, given the per-source offsets off[0..W] (rows are grouped by
// source). Unrolled over kMaxRanks with no early exit: a few compares beat a data-dependent loop.
__device__ __forceinline__ int find_src(const int* off, int W, int i) {
  int s = 0;
#pragma unroll
  for (int r = 1; r < kMaxRanks; ++r)
    if (r < W && i >= off[r]) s = r;
  return s;
}

// Combine's row i of x (CombineRoute::x_rows), as a row number of x.
__device__ __forceinline__ size_t x_row(const Ctx& c, int i) {
  return c.route.x_rows != nullptr ? static_cast<size_t>(__ldg(c.route.x_rows + i)) : static_cast<size_t>(i);
}

// Where combine's sum of token t goes (CombineRoute::y_blocks): y's row t, or a block's row; null: nowhere.
__device__ __forceinline__ int4* y_row(const Ctx& c, int4* y, int t, int n16) {
  if (c.route.y_blocks == nullptr) return y + static_cast<size_t>(t) * n16;
  char* b = c.route.y_blocks[t / c.route.block_tokens];
  return b != nullptr ? reinterpret_cast<int4*>(b) + static_cast<size_t>(t % c.route.block_tokens) * n16 : nullptr;
}

// The end of a combine's reduce, by every thread, where the sums went to other buffers (y_blocks): the
// thread's stores before whatever the caller's next kernel signals.
__device__ __forceinline__ void fence_routed_sums(const Ctx& c) {
  if (c.route.y_blocks != nullptr) __threadfence_system();
}

}  // namespace nvl
}  // namespace ep
