// Dispatch layout: which ranks and experts each token goes to.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace ep {

// topk_idx: [num_tokens, num_topk] int64, -1 = no expert. Experts are split evenly and contiguously
// over num_ranks. Writes tokens_per_rank [num_ranks] int32, tokens_per_expert [num_experts] int32
// and is_token_in_rank [num_tokens, num_ranks] bool. A token counts once per rank, however many of
// that rank's experts it picked. Indices outside [-1, num_experts) must be refused by the caller.
void launch_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_ranks,
                            int num_experts, int* tokens_per_rank, int* tokens_per_expert,
                            bool* is_token_in_rank, cudaStream_t stream);

}  // namespace ep
