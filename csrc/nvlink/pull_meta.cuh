// What the pull kernels (register copies in dispatch.cu / expert.cu, bulk copies in pull_tma.cu /
// expert_pull_tma.cu) write besides the rows themselves: a row's source token, local expert ids and
// weights, read from the source's stage area, and the padding rows of worst-case or aligned outputs.
#pragma once
#include "nvlink/device.cuh"

namespace ep {
namespace nvl {

// The source token of received row i (from source `src`): the handle's recv_src on a cached dispatch,
// else read from the source's send list over NVLink and recorded in recv_src for the handle.
__device__ __forceinline__ int pull_row_token(const Ctx& c, const int* s_off, int src, int i, int cached,
                                              int* __restrict__ recv_src) {
  if (cached) return recv_src[i];
  const int* sl = reinterpret_cast<const int*>(c.peers[src] + c.off_send_list);
  const int tok = ld_volatile(sl + static_cast<size_t>(c.rank) * c.max_tokens + (i - s_off[src]));
  recv_src[i] = tok;
  return tok;
}

// Row i came from token `tok` of rank `src`: its topk ids as local ids (-1 where the expert is not
// in [lo, hi)) and the weights of the local ones (0 elsewhere), written at output row i (the caller's
// out_row). Eight remote loads in flight.
__device__ __forceinline__ void pull_row_meta(const Ctx& c, int src, int tok, int i, int K, int64_t lo, int64_t hi,
                                              int64_t* __restrict__ out_idx, float* __restrict__ out_w) {
  const int64_t* gi = reinterpret_cast<const int64_t*>(c.peers[src] + c.off_stage_idx) + static_cast<size_t>(tok) * K;
  const float* gwt = reinterpret_cast<const float*>(c.peers[src] + c.off_stage_w) + static_cast<size_t>(tok) * K;
  for (int k0 = 0; k0 < K; k0 += 8) {
    int64_t g[8];
    float wv[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      if (k0 + q < K) {
        g[q] = gi[k0 + q];
        wv[q] = out_w ? gwt[k0 + q] : 0.f;
      }
    }
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      if (k0 + q < K) {
        const bool mine = g[q] >= lo && g[q] < hi;
        if (out_idx) out_idx[static_cast<size_t>(i) * K + k0 + q] = mine ? g[q] - lo : -1;
        if (out_w) out_w[static_cast<size_t>(i) * K + k0 + q] = mine ? wv[q] : 0.f;
      }
    }
  }
}

// The output row of received row i (DispatchRoute::out_rows): i itself, or the caller's row for it clamped
// to [0, R_alloc). A template switch rather than a null test: the plain kernels are the ones measured before
// routes existed, with no index load or clamp compiled in (as the pull combine's kRouted).
template <bool kRouted>
__device__ __forceinline__ int out_row(const Ctx& c, int i, int R_alloc) {
  if constexpr (kRouted) {
    const int64_t o = __ldg(c.out_route.out_rows + i);
    return static_cast<int>(o < 0 ? 0 : (o >= R_alloc ? R_alloc - 1 : o));
  } else {
    return i;
  }
}

// Rows [R, R_alloc) of a worst-case-sized output route nowhere (ids -1, weights 0), at their output rows;
// the grid shares them.
template <bool kRouted>
__device__ __forceinline__ void pull_pad_rows(const Ctx& c, int R, int R_alloc, int K, int64_t* __restrict__ out_idx,
                                              float* __restrict__ out_w) {
  for (int i = R + blockIdx.x * blockDim.x + threadIdx.x; i < R_alloc; i += gridDim.x * blockDim.x) {
    const size_t o = out_row<kRouted>(c, i, R_alloc);
    for (int k = 0; k < K; ++k) {
      if (out_idx) out_idx[o * K + k] = -1;
      if (out_w) out_w[o * K + k] = 0.f;
    }
  }
}

// Expert-major outputs: the zero rows that pad each expert's segment up to the alignment (expert x:
// [offsets[x] + counts[x], offsets[x+1])), a warp per expert (warp gw of NW in the grid).
__device__ __forceinline__ void expert_pad_rows(int gw, int NW, int lane, int EL, const int64_t* __restrict__ offsets,
                                                const int64_t* __restrict__ counts, int4* __restrict__ out_x, int n16,
                                                float* __restrict__ out_scales, int nscales, float* __restrict__ out_w) {
  for (int x = gw; x < EL; x += NW) {
    const int64_t p0 = offsets[x] + counts[x], p1 = offsets[x + 1];
    for (int64_t p = p0; p < p1; ++p) {
      for (int j = lane; j < n16; j += 32) out_x[static_cast<size_t>(p) * n16 + j] = make_int4(0, 0, 0, 0);
      for (int j = lane; j < nscales && out_scales; j += 32) out_scales[static_cast<size_t>(p) * nscales + j] = 0.f;
      if (lane == 0 && out_w) out_w[p] = 0.f;
    }
  }
}

}  // namespace nvl
}  // namespace ep
