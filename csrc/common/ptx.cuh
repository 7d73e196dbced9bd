// Loads and stores with an explicit memory order and cache policy. Peers write our buffers over
// NVLink and the host reads mapped memory, so the order of every flag access is spelled out in PTX
// rather than left to what the compiler may reorder or cache.
#pragma once
#include <cuda_runtime.h>

namespace ep {

constexpr unsigned kFull = 0xffffffffu;  // every lane of a warp

// Flags: the acquire load pairs with a peer's release store, so the data written before the flag
// is visible once the flag is.
__device__ __forceinline__ int ld_acquire_sys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// The release/acquire fence at system scope: what a release pattern (stores, fence, a relaxed flag or
// ticket) needs, without fence.sc's single global order (__threadfence_system is fence.sc.sys).
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void st_release_sys(int* p, int v) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Adds to a peer's counter after this thread's stores (arrival counters of the fused combine).
__device__ __forceinline__ void red_add_release_sys(int* p, int v) {
  asm volatile("red.release.sys.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// The same without its own fence, for a thread that has just fenced at system scope (one fence
// before several counters: the pipelined combine's arrival counts).
__device__ __forceinline__ void red_add_relaxed_sys(int* p, int v) {
  asm volatile("red.relaxed.sys.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Re-read on every call (abort words, data behind a flag already acquired): no ordering needed.
__device__ __forceinline__ int ld_volatile(const int* p) {
  int v;
  asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Hand-offs between the warps of one block through shared memory, without a block-wide barrier:
// the release store publishes the writer's earlier shared-memory writes to whoever acquires it.
__device__ __forceinline__ int ld_acquire_cta_shared(const int* p) {
  int v;
  asm volatile("ld.acquire.cta.shared::cta.s32 %0, [%1];"
               : "=r"(v)
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p)))
               : "memory");
  return v;
}
__device__ __forceinline__ void st_release_cta_shared(int* p, int v) {
  asm volatile("st.release.cta.shared::cta.s32 [%0], %1;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(p))),
               "r"(v)
               : "memory");
}
// A barrier among `threads` threads (whole warps) of the block, `id` in 1..15 (0 is __syncthreads).
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Nanoseconds, comparable across the SMs of a GPU: deadlines for waits.
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// 16-byte loads that skip L1 (data written by other GPUs / other kernels).
__device__ __forceinline__ int4 ld_nc_v4(const int4* p) {
  int4 v;
  asm volatile("ld.global.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
// 16-byte stores that leave L1 alone: the data is read by another GPU or a later kernel.
__device__ __forceinline__ void st_na_v4(int4* p, const int4& v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

}  // namespace ep
