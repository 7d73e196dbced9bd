// Waiting on peers without hanging: every wait has a deadline, and one wait that times out makes
// every other wait of the same call give up through an abort word, so a missing rank costs one
// timeout, not one per flag. Kernels never trap (that would poison the CUDA context); they record
// the failure in host-mapped memory and return.
#pragma once
#include "common/ptx.cuh"

namespace ep {

// What wait_geq returns.
constexpr int kArrived = 0;
constexpr int kTimedOut = 1;  // the peer is missing
constexpr int kGaveUp = 2;    // another wait timed out (the abort word is set)

// Waits for *p >= target, comparing in wrapping arithmetic so that epochs may overflow. The abort
// word and the clock are read every 128 polls only, which keeps the spin on the flag tight.
__device__ __forceinline__ int wait_geq(const int* p, int target, unsigned long long deadline,
                                        const int* aborted) {
  unsigned it = 0;
  while (static_cast<int>(static_cast<unsigned>(ld_acquire_sys(p)) - static_cast<unsigned>(target)) < 0) {
    if (((++it) & 127u) == 0) {
      if (ld_volatile(aborted)) return kGaveUp;
      if (globaltimer() > deadline) return kTimedOut;
    }
  }
  return kArrived;
}

// Sets the abort word, then publishes the failure to the host. C is a transport's kernel context
// with `aborted` (device) and `host` (host-mapped: missing[peer], err_kernel, err). err is written
// last, behind a system fence, so a host that sees err also sees which peer and which kernel.
template <typename C>
__device__ inline void record_timeout(const C& c, int peer, int kernel_id) {
  atomicExch(c.aborted, 1);
  volatile auto* h = c.host;
  h->missing[peer] = 1;
  h->err_kernel = kernel_id;
  __threadfence_system();
  h->err = 1;
  __threadfence_system();
}

// How a block's ticket is fenced (last_block): kSc, __threadfence_system (fence.sc.sys) on both sides;
// kAcqRel, fence.acq_rel.sys -- enough for a release pattern (each block's stores, fence, the relaxed
// ticket; the last block's ticket, fence, then what it publishes); kNone, the ticket alone, for a last
// block that publishes nothing the others wrote (it only moves on an epoch that every block read before
// its ticket; their outputs reach later kernels by stream order).
enum class TicketFence { kSc, kAcqRel, kNone };

template <TicketFence F>
__device__ __forceinline__ void ticket_fence() {
  if constexpr (F == TicketFence::kSc) __threadfence_system();
  if constexpr (F == TicketFence::kAcqRel) fence_acq_rel_sys();
}

// True in exactly one block, the last to arrive; all blocks' prior writes are visible to it (unless F
// is kNone). The counter is reset there, so the next launch (or CUDA-graph replay) starts from zero.
template <TicketFence F = TicketFence::kSc>
__device__ inline bool last_block(unsigned* ctr) {
  __shared__ int s_last;
  ticket_fence<F>();
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned prev = atomicAdd(ctr, 1u);
    s_last = (prev == gridDim.x - 1);
    if (s_last) {
      atomicExch(ctr, 0u);
      ticket_fence<F>();
    }
  }
  __syncthreads();
  return s_last != 0;
}

}  // namespace ep
