// Which ranks a token goes to: the one rule that the layout kernel and the nvlink notify kernel
// (its notify_token_mask, the same rule with batched loads) must agree on, or tokens would be
// counted for one rank and sent to another.
#pragma once
#include <cstdint>

namespace ep {

// row: the token's num_topk expert ids. Experts are split evenly and contiguously, so expert e
// lives on rank e / experts_per_rank; ids outside [0, num_experts) (-1 = no expert) route nowhere.
// Returns bit r set for every rank r the token reaches, once however many of r's experts it
// picked. Mask is wide enough for the caller's rank limit. With kCount, each valid pick also counts
// into expert_count[e] (shared memory); a compile-time switch, because a runtime null test in the
// inner loop changes how the compiler unrolls it.
template <typename Mask, bool kCount>
__device__ __forceinline__ Mask token_rank_mask(const int64_t* row, int num_topk, int experts_per_rank,
                                                int num_experts, int* expert_count) {
  Mask mask = 0;
  for (int k = 0; k < num_topk; ++k) {
    const int64_t e = row[k];
    if (e < 0 || e >= num_experts) continue;
    if (kCount) atomicAdd(&expert_count[e], 1);
    mask |= Mask(1) << (static_cast<int>(e) / experts_per_rank);  // 32-bit: a 64-bit divide is a long subroutine
  }
  return mask;
}

}  // namespace ep
