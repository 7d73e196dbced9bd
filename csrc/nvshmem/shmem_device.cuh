// What the NVSHMEM kernel families (ll_*.cu, rail_*.cu) share: the 32-bit view of a u64 signal word,
// one signal to one peer (P2P store or NVSHMEM signal), the deadline-bounded wait for it, and the
// warp copy loop with its split of a row between warps.
//
// A signal word is a u64 in the receiver's symmetric heap, one per sender; the sender sets it to its
// call's epoch + 1. Over P2P the sender stores the low 32-bit word with release semantics; over RDMA
// it sends an NVSHMEM signal (SET of a value below 2^31, so the high word stays 0) behind a fence.
// Either way the receiver polls the low word with acquire loads, so the data written before the
// signal is visible once the signal is.
#pragma once
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "common/ptx.cuh"
#include "common/wait.cuh"

namespace ep {

// The 32-bit half of the u64 signal word of sender index r at flag_off (little endian: the low word).
__device__ __forceinline__ int* flag_word(char* base, long long off, int r) {
  return reinterpret_cast<int*>(base + off + 8ll * r);
}

// Sets signal word `index` (at flag_off) on PE `pe` to value. peer_base: nvshmem_ptr of the heap on
// pe, or nullptr where pe has no P2P path (then an NVSHMEM signal from heap, this PE's own base).
// The caller has made its data visible first (every block's fence before the last-block ticket, and
// a quiet where it used NVSHMEM puts).
__device__ __forceinline__ void signal_peer(char* peer_base, char* heap, long long flag_off, int index, int pe,
                                            int value) {
  if (peer_base != nullptr) {
    st_release_sys(flag_word(peer_base, flag_off, index), value);
  } else {
    nvshmem_fence();
    nvshmemx_signal_op(reinterpret_cast<uint64_t*>(heap + flag_off + 8ll * index),
                       static_cast<uint64_t>(static_cast<unsigned>(value)), NVSHMEM_SIGNAL_SET, pe);
  }
}

// Waits for signal word r (at flag_off in this PE's heap) to reach target; records a timeout against
// r. C: a kernel context with heap, timeout_ns, aborted and host (see record_timeout). True if the
// signal arrived.
template <typename C>
__device__ inline bool wait_signal(const C& c, long long flag_off, int r, int target, int kernel_id) {
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  const int got = wait_geq(flag_word(c.heap, flag_off, r), target, deadline, c.aborted);
  if (got == kTimedOut) record_timeout(c, r, kernel_id);
  return got == kArrived;
}

// How many warps share one row's copy: with fewer rows than warps (128 tokens, 2 ranks: ~1000 rows
// for ~2000 warps) a warp per row leaves half the warps idle and each copy latency-bound.
__device__ __forceinline__ int parts_per_row(int rows, int warps) {
  const int p = rows > 0 ? warps / rows : 1;
  return p < 1 ? 1 : (p > 8 ? 8 : p);
}

// A stride s ~ 0.618 n with gcd(s, n) = 1 (n >= 1): r -> r * s mod n visits every row once, and rows
// next to each other in the received order (one expert, one source) land far apart.
__device__ __forceinline__ int coprime_stride(int n) {
  if (n <= 2) return 1;
  int s = static_cast<int>(0.6180339887f * static_cast<float>(n)) | 1;
  auto gcd = [](int a, int b) {
    while (b != 0) {
      const int t = a % b;
      a = b;
      b = t;
    }
    return a;
  };
  while (gcd(s, n) != 1) s += 2;  // ends below n: n - 1 (n even) or n - 2 (n odd) is coprime with n
  return s;
}

// A warp copies 16-byte units [begin, end) of a row, U loads in flight per lane before the stores.
template <int U>
__device__ __forceinline__ void warp_copy_units(const int4* src, int4* dst, int begin, int end, int lane) {
  for (int u0 = begin; u0 < end; u0 += 32 * U) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (u0 + u * 32 + lane < end) v[u] = ld_nc_v4(src + u0 + u * 32 + lane);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (u0 + u * 32 + lane < end) st_na_v4(dst + u0 + u * 32 + lane, v[u]);
  }
}

}  // namespace ep
