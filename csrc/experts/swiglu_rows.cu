// EPGroupedMLP's weighted SwiGLU (ep_plugin/integrations/megatron/experts.py, bounded_weighted_swiglu) over the rows
// in use only. A dispatch that reads no count on the host (comm.host_sync false) hands the experts its worst case,
// ~4x the rows received at EP4 (131072 rows a rank for 4096 tokens, top-8, 64 local experts), and megatron's
// weighted_swiglu / weighted_swiglu_back run as torch ops over all of them: a dozen elementwise passes over
// [N, 2F] tensors per step. Here one launch each way reads the last expert's end on the device and stops there;
// a warp per row (the backward's per-row sum of the probs' gradient), 16-byte loads and stores.
//
// Not yet run on a GPU (session 15 ran out of device time): EPGroupedMLP.bounded_activation, False by default, turns
// it on; tests/test_swiglu_rows.py checks it against megatron's functions.
#include "experts/swiglu_rows.h"

#include <cuda_bf16.h>

#include "common/error.h"
#include "experts/rows_in_use.cuh"

namespace ep {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;

__device__ __forceinline__ float bf16r(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// torch's CUDA silu and sigmoid of a BF16 value: float math, one rounding to BF16
__device__ __forceinline__ float silu_bf16(float a) { return bf16r(a / (1.0f + expf(-a))); }
__device__ __forceinline__ float sigmoid_bf16(float a) { return bf16r(1.0f / (1.0f + expf(-a))); }

// a warp per row over the grid: this warp's first row, and the rows between its turns
__device__ __forceinline__ long long warp_row0() {
  return static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
}
__device__ __forceinline__ long long warp_rows_step() { return static_cast<long long>(gridDim.x) * kWarps; }

union Vec8 {  // 16 bytes: 8 BF16
  uint4 u;
  __nv_bfloat16 b[8];
};

__global__ void __launch_bounds__(kThreads)
swiglu_rows_fwd_kernel(const uint4* __restrict__ h, const float* __restrict__ w, uint4* __restrict__ y, long long rows,
                       int vecs, const int* __restrict__ ends, int groups) {
  const long long used = rows_in_use(ends, groups, rows);
  const int lane = threadIdx.x & 31;
  for (long long r = warp_row0(); r < used; r += warp_rows_step()) {
    const float wr = w[r];
    const uint4* gate = h + r * 2 * vecs;  // h's row: gate | linear
    uint4* out = y + r * vecs;
    const uint4* lin = gate + vecs;
    for (int v = lane; v < vecs; v += 32) {
      Vec8 a, b, o;
      a.u = gate[v];
      b.u = lin[v];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        // swiglu(y) in BF16 (silu rounded, the product rounded), times the float32 weight, rounded once more
        const float s = bf16r(silu_bf16(__bfloat162float(a.b[k])) * __bfloat162float(b.b[k]));
        o.b[k] = __float2bfloat16_rn(s * wr);
      }
      out[v] = o.u;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
swiglu_rows_bwd_kernel(const uint4* __restrict__ g, const uint4* __restrict__ h, const float* __restrict__ w,
                       uint4* __restrict__ dh, float* __restrict__ dw, long long rows, int vecs,
                       const int* __restrict__ ends, int groups) {
  const long long used = rows_in_use(ends, groups, rows);
  const int lane = threadIdx.x & 31;
  for (long long r = warp_row0(); r < used; r += warp_rows_step()) {
    const float wr = w[r];
    const uint4* gate = h + r * 2 * vecs;
    const uint4* lin = gate + vecs;
    const uint4* grow = g + r * vecs;
    uint4* dgate = dh + r * 2 * vecs;
    uint4* dlin = dgate + vecs;
    float part = 0.0f;
    for (int v = lane; v < vecs; v += 32) {
      Vec8 a, b, gv, da, db;
      a.u = gate[v];
      b.u = lin[v];
      gv.u = grow[v];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float af = __bfloat162float(a.b[k]), bf = __bfloat162float(b.b[k]), gf = __bfloat162float(gv.b[k]);
        // weighted_swiglu_back: swiglu_back(g * w, y) in float32 over BF16 terms, in megatron's order
        const float gw = gf * wr;
        const float sig = sigmoid_bf16(af);
        const float t = bf16r(1.0f + bf16r(af * bf16r(1.0f - sig)));
        const float silu = silu_bf16(af);
        da.b[k] = __float2bfloat16_rn(gw * sig * t * bf);
        db.b[k] = __float2bfloat16_rn(gw * silu);
        // the weight's gradient: swiglu(y) (BF16) times g in float32, summed over the row
        part += bf16r(silu * bf) * gf;
      }
      dgate[v] = da.u;
      dlin[v] = db.u;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
    if (lane == 0) dw[r] = part;
  }
  // rows past the last end: a zero weight gradient (their probs' gradient reaches the dispatcher's backward)
  for (long long r = used + static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x; r < rows;
       r += static_cast<long long>(gridDim.x) * kThreads)
    dw[r] = 0.0f;
}

void check_args(const void* h, const void* y, int64_t rows, int F, const int* ends, int groups, int max_blocks) {
  EP_CHECK_ARG(rows >= 0 && F > 0 && F % 8 == 0, "swiglu_rows: %lld rows of F = %d (a positive multiple of 8)",
               static_cast<long long>(rows), F);
  EP_CHECK_ARG(reinterpret_cast<uintptr_t>(h) % 16 == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0,
               "swiglu_rows: the BF16 rows must be 16-byte aligned");
  EP_CHECK_ARG(groups == 0 || ends != nullptr, "swiglu_rows: %d groups without their ends", groups);
  EP_CHECK_ARG(max_blocks >= 1, "swiglu_rows: max_blocks must be positive, got %d", max_blocks);
}

int grid(int64_t rows, int max_blocks) {
  const long long want = (rows + kWarps - 1) / kWarps;
  return static_cast<int>(want < max_blocks ? (want > 0 ? want : 1) : max_blocks);
}

}  // namespace

void launch_swiglu_rows_fwd(const void* h, const float* w, void* y, int64_t rows, int F, const int* ends, int groups,
                            int max_blocks, cudaStream_t stream) {
  check_args(h, y, rows, F, ends, groups, max_blocks);
  if (rows == 0) return;
  swiglu_rows_fwd_kernel<<<grid(rows, max_blocks), kThreads, 0, stream>>>(
      static_cast<const uint4*>(h), w, static_cast<uint4*>(y), rows, F / 8, ends, groups);
  EP_CUDA_CHECK(cudaGetLastError());
}

void launch_swiglu_rows_bwd(const void* g, const void* h, const float* w, void* dh, float* dw, int64_t rows, int F,
                            const int* ends, int groups, int max_blocks, cudaStream_t stream) {
  check_args(h, dh, rows, F, ends, groups, max_blocks);
  EP_CHECK_ARG(reinterpret_cast<uintptr_t>(g) % 16 == 0, "swiglu_rows: the gradient rows must be 16-byte aligned");
  if (rows == 0) return;
  swiglu_rows_bwd_kernel<<<grid(rows, max_blocks), kThreads, 0, stream>>>(
      static_cast<const uint4*>(g), static_cast<const uint4*>(h), w, static_cast<uint4*>(dh), dw, rows, F / 8, ends,
      groups);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep
