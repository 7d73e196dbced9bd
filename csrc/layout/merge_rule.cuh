// The rule of ep_plugin/expert_major.py's merge_repeats for one (token, slot), shared by its kernel
// (merge_repeats.cu) and by nvlink's stage, which merges while it copies the ids (nvlink/dispatch.cu).
#pragma once
#include <cstdint>

namespace ep {

// ids: the token's K ids; ws: its K weights or null. Slot k's merged id: -1 where an earlier slot names
// the same expert; with ws, *w = the slot-order float sum of the weights of every slot naming that expert.
__device__ __forceinline__ int64_t merged_slot(const int64_t* ids, const float* ws, int k, int K, float* w) {
  const int64_t id = ids[k];
  bool earlier = false;
  for (int j = 0; j < k; ++j) earlier |= ids[j] == id;
  if (ws != nullptr) {
    float sum = 0.f;
    for (int j = 0; j < K; ++j)
      if (ids[j] == id) sum += ws[j];
    *w = sum;
  }
  return earlier ? -1 : id;
}

}  // namespace ep
