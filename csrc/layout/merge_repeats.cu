// merge_repeats in one launch: the torch ops it replaces (a [T, K, K] comparison, a mask, a fill, a
// product and a sum) cost six launches and, before the notify of every expert-major dispatch, ~200 us
// of host time at 128 tokens on the GPU host (bench_dispatch's latency case, 4x H100, 2026-11-26).
#include "layout/merge_repeats.h"
#include "layout/merge_rule.cuh"

#include "common/error.h"

namespace ep {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;

// One thread per (token, slot): K loads of the token's ids (a few cache lines, shared with its
// neighbours' threads), so no shared memory.
__global__ void __launch_bounds__(kThreads)
merge_repeats_kernel(const int64_t* __restrict__ topk_idx, const float* __restrict__ topk_weights,
                     int64_t* __restrict__ out_idx, float* __restrict__ out_weights, int64_t n, int K) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int k = static_cast<int>(i % K);
    const float* ws = topk_weights != nullptr ? topk_weights + (i - k) : nullptr;
    out_idx[i] = merged_slot(topk_idx + (i - k), ws, k, K, ws != nullptr ? out_weights + i : nullptr);
  }
}

}  // namespace

void launch_merge_repeats(const int64_t* topk_idx, const float* topk_weights, int64_t* out_idx, float* out_weights,
                          int num_tokens, int num_topk, cudaStream_t stream) {
  EP_CHECK_ARG(num_tokens >= 0 && num_topk > 0, "merge_repeats: num_tokens %d, num_topk %d", num_tokens, num_topk);
  EP_CHECK_ARG((topk_weights == nullptr) == (out_weights == nullptr), "merge_repeats: weights in and out, or neither");
  const int64_t n = static_cast<int64_t>(num_tokens) * num_topk;
  if (n == 0) return;
  const int64_t want = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(want < kMaxBlocks ? want : kMaxBlocks);
  merge_repeats_kernel<<<blocks, kThreads, 0, stream>>>(topk_idx, topk_weights, out_idx, out_weights, n, num_topk);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep
