// What both low-latency dispatch kernels (ll_dispatch.cu: into per-source slots; ll_dispatch_direct.cu:
// straight into the owners' output sets) do alike on the send side: the in-kernel FP8 cast of one
// 16-byte unit of a BF16 row, and each (token, k)'s index among the rows this rank sends its expert.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "nvshmem/ll_device.cuh"

namespace ep {
namespace ll {

// Per 128 channels: amax over 16 lanes holding 8 BF16 each (all 32 lanes call it).
__device__ __forceinline__ float group_amax(float a) {
#pragma unroll
  for (int d = 8; d >= 1; d >>= 1) a = fmaxf(a, __shfl_xor_sync(kFull, a, d));
  return a;
}

__device__ __forceinline__ void unpack_bf16(const int4& v, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

// The scale of a 128-channel group and the factor its values are multiplied by before the cast.
__device__ __forceinline__ void fp8_scale(float group_amax_value, int round_scale, float* scale, float* inv) {
  const float amax = fmaxf(group_amax_value, 1e-4f);
  // The float32 steps torch takes for DeepEP's reference cast on CUDA: `amax / 448.0` is a
  // multiply by the rounded reciprocal, `448.0 / amax` is reciprocal(amax) * 448.
  constexpr float kInv448 = 1.f / 448.f;
  if (round_scale) {
    *scale = exp2f(ceilf(log2f(amax * kInv448)));
    *inv = 1.f / *scale;
  } else {
    *scale = amax * kInv448;
    *inv = (1.f / amax) * 448.f;
  }
}

__device__ __forceinline__ float abs_max8(const float* f) {
  float a = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) a = fmaxf(a, fabsf(f[i]));
  return a;
}

// Two channels per conversion (cvt ...e4m3x2): each value is rounded on its own, so the bytes equal
// one conversion per channel's, in half the instructions and with no byte packing after them.
__device__ __forceinline__ uint2 to_fp8_8(const float* f, float inv) {
  uint2 q;
  __nv_fp8x2_storage_t* q2 = reinterpret_cast<__nv_fp8x2_storage_t*>(&q);
#pragma unroll
  for (int i = 0; i < 4; ++i)  // channel 2i in the low byte, as the little-endian row stores it
    q2[i] = __nv_cvt_float2_to_fp8x2(make_float2(f[2 * i] * inv, f[2 * i + 1] * inv), __NV_SATFINITE, __NV_E4M3);
  return q;
}

// The FP8 bytes of 8 BF16 channels and their 128-channel group's scale. Every lane of the warp calls
// it (the amax shuffles span 16 lanes); lanes past the row pass zeros.
__device__ __forceinline__ uint2 cast_fp8_unit(const int4& v, int round_scale, float* scale_out) {
  float f[8];
  unpack_bf16(v, f);
  float inv;
  fp8_scale(group_amax(abs_max8(f)), round_scale, scale_out, &inv);
  return to_fp8_8(f, inv);
}

// The same for 16 channels (two adjacent units) per lane: a group is 8 lanes, and the 16 FP8 bytes
// leave in one store. max is exact in any order, so the bytes and scales equal cast_fp8_unit's.
__device__ __forceinline__ int4 cast_fp8_pair(const int4& v0, const int4& v1, int round_scale, float* scale_out) {
  float f0[8], f1[8];
  unpack_bf16(v0, f0);
  unpack_bf16(v1, f1);
  float a = fmaxf(abs_max8(f0), abs_max8(f1));
#pragma unroll
  for (int d = 4; d >= 1; d >>= 1) a = fmaxf(a, __shfl_xor_sync(kFull, a, d));
  float inv;
  fp8_scale(a, round_scale, scale_out, &inv);
  const uint2 lo = to_fp8_8(f0, inv), hi = to_fp8_8(f1, inv);
  return make_int4(static_cast<int>(lo.x), static_cast<int>(lo.y), static_cast<int>(hi.x), static_cast<int>(hi.y));
}

// s_hist[E] <- the rows this rank sends each expert (the entries of s_topk naming it). By the whole block.
__device__ inline void expert_histogram(const int* s_topk, int TK, int E, int* s_hist) {
  for (int e = threadIdx.x; e < E; e += blockDim.x) s_hist[e] = 0;
  __syncthreads();
  for (int j = threadIdx.x; j < TK; j += blockDim.x)
    if (s_topk[j] >= 0) atomicAdd(&s_hist[s_topk[j]], 1);
  __syncthreads();
}

constexpr int kRowInFlight = 2;  // a 7168-wide row is 896 units: both of a thread's loads before its stores

// kPreload: the first round of a row's loads -- stream_row's units, or stream_row_fp8_wide's pairs
// when `wide` -- issued before the row's destinations are known, so that they overlap the wait for
// the lower ranks' counts. Every thread of the block calls it.
__device__ __forceinline__ void load_first_round(const int4* src, int n16, bool wide, int4 (&v)[kRowInFlight]) {
  if (wide) {
    const int j = threadIdx.x;
    const bool active = j < n16 / 2;
    v[0] = active ? ld_nc_v4(src + 2 * j) : make_int4(0, 0, 0, 0);
    v[1] = active ? ld_nc_v4(src + 2 * j + 1) : make_int4(0, 0, 0, 0);
    return;
  }
#pragma unroll
  for (int u = 0; u < kRowInFlight; ++u) {
    const int j = u * blockDim.x + threadIdx.x;
    v[u] = j < n16 ? ld_nc_v4(src + j) : make_int4(0, 0, 0, 0);
  }
}

// Streams one BF16 row through the block, a 16-byte unit per thread and round: bf16(j, v) stores unit
// j as is; with kFp8, fp8(j, q, scale, first) stores its 8 FP8 bytes, `first` on the unit that also
// stores its 128-channel group's scale. Every thread of the block calls it (the casts shuffle). kPre:
// the first round's units are `first` (load_first_round), not loaded here.
template <bool kFp8, bool kPre, typename Bf16Store, typename Fp8Store>
__device__ __forceinline__ void stream_row_from(const int4* src, int n16, int round_scale,
                                                const int4 (&first)[kRowInFlight], Bf16Store bf16, Fp8Store fp8) {
  constexpr int kInFlight = kRowInFlight;
  for (int base = 0; base < n16; base += kInFlight * blockDim.x) {
    int4 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int j = base + u * blockDim.x + threadIdx.x;
      if constexpr (kPre) {
        v[u] = base == 0 ? first[u] : (j < n16 ? ld_nc_v4(src + j) : make_int4(0, 0, 0, 0));
      } else {
        v[u] = j < n16 ? ld_nc_v4(src + j) : make_int4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int j = base + u * blockDim.x + threadIdx.x;
      const bool active = j < n16;
      if constexpr (!kFp8) {
        if (active) bf16(j, v[u]);
      } else {
        float scale;
        const uint2 q = cast_fp8_unit(v[u], round_scale, &scale);
        if (active) fp8(j, q, scale, (j % 16) == 0);
      }
    }
  }
}

template <bool kFp8, typename Bf16Store, typename Fp8Store>
__device__ __forceinline__ void stream_row(const int4* src, int n16, int round_scale, Bf16Store bf16, Fp8Store fp8) {
  const int4 none[kRowInFlight] = {};
  stream_row_from<kFp8, false>(src, n16, round_scale, none, bf16, fp8);
}

// stream_row's FP8 form with 16 FP8 bytes per thread and round (kFp8Wide): fp8(j, q, scale, first) stores
// 16-byte unit j of the FP8 row (BF16 units 2j, 2j + 1), `first` on the unit that also stores its
// 128-channel group's scale (group j / 8). n16: BF16 units of the row, a multiple of 16 (H % 128 == 0).
// kPre: the first round's pair is `first` (load_first_round with wide).
template <bool kPre, typename Fp8Store>
__device__ __forceinline__ void stream_row_fp8_wide(const int4* src, int n16, int round_scale,
                                                    const int4 (&first)[kRowInFlight], Fp8Store fp8) {
  const int n32 = n16 / 2;
  // base steps by blockDim.x (a multiple of 32): lane j % 8 == 0 starts a group, as the shuffles assume
  for (int base = 0; base < n32; base += blockDim.x) {
    const int j = base + threadIdx.x;
    const bool active = j < n32;
    int4 v0, v1;
    if (kPre && base == 0) {
      v0 = first[0];
      v1 = first[1];
    } else {
      v0 = active ? ld_nc_v4(src + 2 * j) : make_int4(0, 0, 0, 0);
      v1 = active ? ld_nc_v4(src + 2 * j + 1) : make_int4(0, 0, 0, 0);
    }
    float scale;
    const int4 q = cast_fp8_pair(v0, v1, round_scale, &scale);
    if (active) fp8(j, q, scale, (j % 8) == 0);
  }
}

// slot[k] = the index of (t, k) among this rank's rows for its expert: entries of earlier tokens
// routed to the same expert, then earlier k of token t naming it again (one row each). By the whole
// block; slot is shared memory of at least K ints, valid after the call's last barrier.
__device__ inline void token_slots(const int* s_topk, int t, int K, int* slot) {
  if (threadIdx.x < K) slot[threadIdx.x] = 0;
  __syncthreads();
  for (int j = threadIdx.x; j < t * K; j += blockDim.x) {
    const int e = s_topk[j];
    if (e < 0) continue;
    for (int k = 0; k < K; ++k)
      if (s_topk[t * K + k] == e) atomicAdd(&slot[k], 1);
  }
  __syncthreads();
  if (threadIdx.x < K) {
    const int k = threadIdx.x, e = s_topk[t * K + k];
    for (int k2 = 0; k2 < k; ++k2)
      if (e >= 0 && s_topk[t * K + k2] == e) ++slot[k];
  }
  __syncthreads();
}

// kLeanRouting: token_slots' answer with one barrier and no atomics -- a warp per pick k counts the
// entries of earlier tokens naming its expert, 32 at a time. load_topk has turned every repeat of an
// expert within a token into -1, so no earlier k of token t names e (token_slots' second term is 0).
__device__ inline void token_slots_by_warps(const int* s_topk, int t, int K, int* slot) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int k = warp; k < K; k += warps) {
    const int e = s_topk[t * K + k];
    int n = 0;
    if (e >= 0)
      for (int j = lane; j < t * K; j += 32) n += s_topk[j] == e ? 1 : 0;
    n = __reduce_add_sync(kFull, n);
    if (lane == 0) slot[k] = n;
  }
  __syncthreads();
}

// s_topk[T*K] <- topk_idx as ints, -1 where an entry goes nowhere (id -1, out of range, or owned by
// a left-out rank) or repeats an expert of an earlier k of its token (the contract's one row per
// (token, expert); combine gives the repeat that row too); ids outside [-1, E) are flagged to the
// host. By the whole block. lean (kLeanRouting): the rank mask is read once into shared memory while the
// first ids are in flight, instead of one mask load per id after it arrives (a second round trip).
__device__ inline void load_topk(const Ctx& c, const int64_t* topk_idx, int T, int K, int* s_topk, bool lean = false) {
  const int TK = T * K;
  const int E = c.num_experts, EL = c.local_experts;
  constexpr int kInFlight = 4;  // 128 tokens x top-8 = 2 ids per thread: loaded together, not one by one
  __shared__ int s_out[kMaxRanks];  // lean: left_out of each rank
  bool bad = false;
  for (int base = 0; base < TK; base += kInFlight * blockDim.x) {
    long long id[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int j = base + u * blockDim.x + threadIdx.x;
      id[u] = j < TK ? __ldg(topk_idx + j) : -1;
    }
    if (lean && base == 0) {  // every thread takes this round (TK > 0), so the barrier is uniform
      for (int r = threadIdx.x; r < c.world; r += blockDim.x) s_out[r] = left_out(c, r);
      __syncthreads();
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int j = base + u * blockDim.x + threadIdx.x;
      const long long e = id[u];
      bad |= e < -1 || e >= E;
      const bool ok = e >= 0 && e < E && !(lean ? s_out[static_cast<int>(e) / EL] != 0 : left_out(c, static_cast<int>(e) / EL));
      if (j < TK) s_topk[j] = ok ? static_cast<int>(e) : -1;
    }
  }
  if (bad && blockIdx.x == 0) reinterpret_cast<volatile HostInfo*>(c.host)->bad_ids = 1;
  __syncthreads();
  // A repeat's first occurrence is never rewritten, so the in-place marking reads the same answer
  // whatever order the threads run in.
  for (int j = threadIdx.x; j < TK; j += blockDim.x) {
    const int e = s_topk[j], first = j - j % K;
    if (e < 0) continue;
    for (int q = first; q < j; ++q)
      if (s_topk[q] == e) {
        s_topk[j] = -1;
        break;
      }
  }
  __syncthreads();
}

}  // namespace ll
}  // namespace ep
