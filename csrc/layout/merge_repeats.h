// Repeated experts in a token's top-k: one row per (token, expert) for the expert-major layout.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace ep {

// topk_idx / out_idx: [num_tokens, num_topk] int64; topk_weights / out_weights: float32 of the same shape
// or null. A slot naming the expert of an earlier slot becomes -1 in out_idx; out_weights[t][k] is the
// sum, in slot order, of the weights of every slot of token t naming what slot k names (the first slot
// of an expert gets all of them). The op of ep_plugin/expert_major.py's merge_repeats, in one launch.
void launch_merge_repeats(const int64_t* topk_idx, const float* topk_weights, int64_t* out_idx, float* out_weights,
                          int num_tokens, int num_topk, cudaStream_t stream);

}  // namespace ep
