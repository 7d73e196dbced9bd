// Bulk copies by the Tensor Memory Accelerator (sm_90): one thread moves a whole row between global
// memory (local or a peer's, mapped over NVLink) and shared memory, and many rows can be in flight
// per SM without registers holding them. A load completes on an mbarrier (transaction bytes); a store
// is tracked by bulk groups.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

// Built for an older target (EP_PLUGIN_CUDA_ARCH=80, ...): the bulk-copy kernels still compile, with
// traps in place of the sm_90 instructions, and the launchers never pick them (tma_supported).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define EP_NO_TMA 1
#endif

namespace ep {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
#ifndef EP_NO_TMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#else
  __trap();
#endif
}

// Makes initialised mbarriers visible to the async proxy (the TMA unit) before its first use.
__device__ __forceinline__ void fence_mbar_init() {
#ifndef EP_NO_TMA
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// Orders this thread's earlier generic-proxy accesses (e.g. acquiring a peer's flag) before later
// async-proxy ones (bulk copies reading what that peer wrote).
__device__ __forceinline__ void fence_proxy_async() {
#ifndef EP_NO_TMA
  asm volatile("fence.proxy.async;" ::: "memory");
#endif
}

// An L2 eviction policy for tma_load's `policy`: the lines a copy brings in are evicted before normal ones
// (a stream read once).
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t p = 0;
#ifndef EP_NO_TMA
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
#endif
  return p;
}

// Global -> shared, `bytes` (multiple of 16, both addresses 16-byte aligned); completes on bar, whose
// phase also expects the bytes. hinted: with the L2 cache policy `policy` (l2_policy_evict_first).
__device__ __forceinline__ void tma_load(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar,
                                         bool hinted = false, uint64_t policy = 0) {
#ifdef EP_NO_TMA
  __trap();
#else
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
  if (hinted)
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::
            "r"(smem_addr(smem_dst)), "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
        : "memory");
  else
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(smem_dst)),
                 "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
#endif
}

// Waits until bar completes the phase of the given parity (0, 1, 0, ... per use).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#ifdef EP_NO_TMA
  __trap();
#else
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  }
#endif
}

// Shared -> global, in the current bulk group (closed by tma_commit).
__device__ __forceinline__ void tma_store(void* gmem_dst, const void* smem_src, uint32_t bytes) {
#ifdef EP_NO_TMA
  __trap();
#else
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem_dst),
               "r"(smem_addr(smem_src)), "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void tma_commit() {
#ifndef EP_NO_TMA
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}

// At most N bulk groups of this thread still reading shared memory (their smem may be reused after).
template <int N>
__device__ __forceinline__ void tma_store_wait_read() {
#ifndef EP_NO_TMA
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
#endif
}

// At most N bulk groups of this thread not yet complete (the writes of the older ones are done).
template <int N>
__device__ __forceinline__ void tma_store_wait() {
#ifndef EP_NO_TMA
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// Every bulk group of this thread complete (its writes done).
__device__ __forceinline__ void tma_store_wait_all() {
#ifndef EP_NO_TMA
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}

// A ring of slots in shared memory through which one thread streams items (rows, or pieces of a
// contiguous copy): load item head into slot head % nslot, and when the ring is full, the caller waits
// for the oldest item (wait_oldest), writes it out with tma_store and closes one bulk group per item
// (tma_commit, pop). A load into a slot must wait until the item that last used it is done being read;
// with at most nslot - kLag loads outstanding, at least kLag groups were committed after that one, so
// cp.async.bulk.wait_group.read kLag suffices and rarely blocks. Needs nslot > kLag.
template <int kLag>
struct BulkRing {
  char* buf;
  uint64_t* bar;
  int nslot, slot_bytes;
  int head = 0, tail = 0;  // items loaded, items written out

  // Thread 0 of the block, then __syncthreads before any use.
  __device__ void init() const {
    for (int s = 0; s < nslot; ++s) mbar_init(&bar[s], 1);
    fence_mbar_init();
  }
  __device__ bool full() const { return head - tail >= nslot - kLag; }
  __device__ bool empty() const { return head == tail; }
  __device__ int slot_of(int n) const { return n % nslot; }
  // hinted / policy: tma_load's
  __device__ void load(const void* src, uint32_t bytes, bool hinted = false, uint64_t policy = 0) {
    tma_store_wait_read<kLag>();
    const int s = slot_of(head);
    tma_load(buf + static_cast<size_t>(s) * slot_bytes, src, bytes, &bar[s], hinted, policy);
    ++head;
  }
  // The oldest item's data, once loaded (a bulk load in flight always completes: no deadline).
  __device__ const char* wait_oldest() const {
    const int s = slot_of(tail);
    mbar_wait(&bar[s], (tail / nslot) & 1);
    return buf + static_cast<size_t>(s) * slot_bytes;
  }
  __device__ void pop() {
    tma_commit();
    ++tail;
  }
};

// BulkRing with items of several consecutive slots (runs: rows contiguous at the source and at the
// destination moved by one bulk load and one bulk store, so a run of n rows costs one copy's overhead instead of
// n). An item of n slots never wraps (the caller cuts a run at the ring's end: fit), completes on its first
// slot's barrier, and its store is one bulk group. The lag rule of BulkRing counts groups, so with items of
// several slots the reads still pending are tracked per group (gend: the slot position each group ends at):
// a load waits for the newest group that read a slot it overwrites and those before it (wait_group.read with as
// many newer groups left pending as were committed after it), never for the stores it need not. kMaxSlots: the
// capacity of bar, len and gend (nslot <= kMaxSlots).
template <int kLag, int kMaxSlots>
struct RunRing {
  char* buf;
  uint64_t* bar;
  int* len;   // slots of the item that starts at each slot
  int* gend;  // per committed group (mod kMaxSlots): the slot position after its item
  int nslot, slot_bytes;
  int head = 0, tail = 0;  // slots loaded, slots written out (absolute positions)
  int groups = 0;          // store groups committed
  int read_done = 0;       // slot positions below it are no longer read by a store
  uint32_t phase = 0;      // bit s: parity of slot s's barrier's next completion

  // Thread 0 of the block, then __syncthreads before any use.
  __device__ void init() const {
    for (int s = 0; s < nslot; ++s) mbar_init(&bar[s], 1);
    fence_mbar_init();
  }
  __device__ int slot_of(int n) const { return n % nslot; }
  __device__ bool empty() const { return head == tail; }
  // The most slots an item loaded next may take: up to want, no wrap, at most nslot - kLag outstanding.
  __device__ int fit(int want) const {
    const int room = nslot - slot_of(head);
    return min(min(want, room), nslot - kLag);
  }
  __device__ bool full(int n) const { return head + n - tail > nslot - kLag; }
  // An item of n slots (n * slot_bytes bytes from src), n from fit(); the caller made room (full(n) false).
  __device__ void load(const void* src, int n) {
    const int need = head + n - nslot;  // the slots' previous items end at or before it
    if (read_done < need) {  // (then a group was committed: need <= tail - kLag, and positions below tail are stored)
      // the group holding position need - 1: the oldest one ending after it, looked for among the kMaxSlots
      // groups gend still holds (a newer one, where the search stops short, waits for more than it must)
      int g = groups - 1;
      while (g > 0 && groups - g < kMaxSlots && gend[(g - 1) % kMaxSlots] >= need) --g;
      wait_reads_but(groups - 1 - g);  // the groups after it may still read
      read_done = gend[g % kMaxSlots];
    }
    const int s = slot_of(head);
    len[s] = n;
    tma_load(buf + static_cast<size_t>(s) * slot_bytes, src, static_cast<uint32_t>(n) * slot_bytes, &bar[s]);
    head += n;
  }
  // Every committed group but the newest `newer` (at most 7 kept pending) done reading shared memory.
  __device__ static void wait_reads_but(int newer) {
    switch (newer < 7 ? newer : 7) {
      case 0: tma_store_wait_read<0>(); break;
      case 1: tma_store_wait_read<1>(); break;
      case 2: tma_store_wait_read<2>(); break;
      case 3: tma_store_wait_read<3>(); break;
      case 4: tma_store_wait_read<4>(); break;
      case 5: tma_store_wait_read<5>(); break;
      case 6: tma_store_wait_read<6>(); break;
      default: tma_store_wait_read<7>(); break;
    }
  }
  // The oldest item's data and its slot count, once loaded.
  __device__ const char* wait_oldest(int& n) {
    const int s = slot_of(tail);
    mbar_wait(&bar[s], (phase >> s) & 1u);
    phase ^= 1u << s;
    n = len[s];
    return buf + static_cast<size_t>(s) * slot_bytes;
  }
  // After the oldest item's tma_store: closes its group.
  __device__ void pop(int n) {
    tma_commit();
    tail += n;
    gend[groups % kMaxSlots] = tail;
    ++groups;
  }
};

}  // namespace ep
