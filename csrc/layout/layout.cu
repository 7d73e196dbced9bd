// The dispatch layout kernel: per-rank and per-expert token counts and the token -> rank table.
#include "layout/layout.h"

#include "common/error.h"
#include "common/token_mask.cuh"

namespace ep {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxRanks = 64;  // a token's rank set fits one 64-bit mask

// Each block counts its tokens into shared memory and adds the block totals to global memory once,
// so global atomics scale with blocks, not with tokens.
__global__ void __launch_bounds__(kThreads)
dispatch_layout_kernel(const int64_t* __restrict__ topk_idx, int num_tokens, int num_topk,
                       int num_ranks, int num_experts, int* __restrict__ tokens_per_rank,
                       int* __restrict__ tokens_per_expert, bool* __restrict__ is_token_in_rank) {
  extern __shared__ int smem[];
  int* rank_count = smem;                // [num_ranks]
  int* expert_count = smem + num_ranks;  // [num_experts]
  for (int i = threadIdx.x; i < num_ranks + num_experts; i += blockDim.x) smem[i] = 0;
  __syncthreads();

  const int experts_per_rank = num_experts / num_ranks;
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < num_tokens; t += gridDim.x * blockDim.x) {
    const unsigned long long mask = token_rank_mask<unsigned long long, true>(
        topk_idx + static_cast<int64_t>(t) * num_topk, num_topk, experts_per_rank, num_experts, expert_count);
    for (int r = 0; r < num_ranks; ++r) {
      const bool in = (mask >> r) & 1ull;
      is_token_in_rank[static_cast<int64_t>(t) * num_ranks + r] = in;
      if (in) atomicAdd(&rank_count[r], 1);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < num_ranks; i += blockDim.x)
    if (rank_count[i]) atomicAdd(&tokens_per_rank[i], rank_count[i]);
  for (int i = threadIdx.x; i < num_experts; i += blockDim.x)
    if (expert_count[i]) atomicAdd(&tokens_per_expert[i], expert_count[i]);
}

}  // namespace

void launch_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_ranks,
                            int num_experts, int* tokens_per_rank, int* tokens_per_expert,
                            bool* is_token_in_rank, cudaStream_t stream) {
  EP_CHECK_ARG(num_ranks > 0 && num_ranks <= kMaxRanks, "num_ranks must be in [1, %d], got %d", kMaxRanks,
               num_ranks);
  EP_CHECK_ARG(num_experts > 0 && num_experts % num_ranks == 0,
               "num_experts must be a positive multiple of num_ranks, got num_experts=%d, num_ranks=%d",
               num_experts, num_ranks);
  EP_CUDA_CHECK(cudaMemsetAsync(tokens_per_rank, 0, sizeof(int) * num_ranks, stream));
  EP_CUDA_CHECK(cudaMemsetAsync(tokens_per_expert, 0, sizeof(int) * num_experts, stream));
  if (num_tokens == 0) return;
  const int blocks = (num_tokens + kThreads - 1) / kThreads < 132 ? (num_tokens + kThreads - 1) / kThreads : 132;
  const size_t smem = sizeof(int) * (num_ranks + num_experts);
  dispatch_layout_kernel<<<blocks, kThreads, smem, stream>>>(topk_idx, num_tokens, num_topk, num_ranks,
                                                             num_experts, tokens_per_rank,
                                                             tokens_per_expert, is_token_in_rank);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep
