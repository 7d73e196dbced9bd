// The one-rank node's packing of the rail's slots (ep_plugin/backends/hierarchical/local.py, LocalNode.pack)
// in one launch.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace ep {

constexpr int kLocalPackMaxSlots = 32768;    // nodes * max_tokens: one byte of shared memory per slot
constexpr int kLocalPackMaxExperts = 1024;   // local experts: one counter each in shared memory
constexpr int kLocalPackMaxNodes = 1024;

// topk [slots, topk] int64: the rail's node-local expert ids (-1: not here). Writes valid [slots] bool (a
// slot holds a token: one of its ids >= 0), order [slots] int64 (the valid slots in slot order, then the
// others in slot order), place [slots] int64 (its inverse), num [1] int64 (valid slots), per_expert
// [experts] int64 (ids equal to e, over every slot), node_counts [slots / max_tokens] int64 (valid slots of
// each source node's block of max_tokens).
void launch_local_pack(const int64_t* topk, int slots, int topk_n, int experts, int max_tokens, bool* valid,
                       int64_t* order, int64_t* place, int64_t* num, int64_t* per_expert, int64_t* node_counts,
                       cudaStream_t stream);

}  // namespace ep
