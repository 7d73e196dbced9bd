// LocalNode.pack in one launch. On the GPU hosts measured (docs/INTERNODE.md, session 7) the fresh dispatch
// of a node of one rank (2x1) is host-bound: its torch form is ~13 small launches (the slots' flags, a
// prefix sum, the compaction and its inverse, the per-expert histogram, the per-node counts), each ~20-40 us
// of host before its kernel can start, while the GPU waits. One block: the slots are N*M (8192 at 2x1).
#include "layout/local_pack.h"

#include <cub/block/block_scan.cuh>

#include "common/error.h"

namespace ep {
namespace {

constexpr int kThreads = 1024;

__global__ void __launch_bounds__(kThreads, 1)
local_pack_kernel(const int64_t* __restrict__ topk, int slots, int topk_n, int experts, int max_tokens,
                  bool* __restrict__ valid, int64_t* __restrict__ order, int64_t* __restrict__ place,
                  int64_t* __restrict__ num, int64_t* __restrict__ per_expert, int64_t* __restrict__ node_counts) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ unsigned char s_valid[kLocalPackMaxSlots];
  __shared__ int s_expert[kLocalPackMaxExperts];
  __shared__ int s_node[kLocalPackMaxNodes];
  __shared__ int s_total;
  const int nodes = slots / max_tokens;
  for (int i = threadIdx.x; i < slots; i += kThreads) s_valid[i] = 0;
  for (int i = threadIdx.x; i < experts; i += kThreads) s_expert[i] = 0;
  for (int i = threadIdx.x; i < nodes; i += kThreads) s_node[i] = 0;
  __syncthreads();
  // pass 1, coalesced over the ids: the histogram and the slots' flags (same value from several threads)
  const long long total_ids = static_cast<long long>(slots) * topk_n;
#pragma unroll 4
  for (long long e = threadIdx.x; e < total_ids; e += kThreads) {
    const int64_t id = topk[e];
    if (id >= 0) {
      s_valid[e / topk_n] = 1;
      if (id < experts) atomicAdd(&s_expert[id], 1);
    }
  }
  __syncthreads();
  // pass 2, a run of consecutive slots per thread: the prefix count of valid slots, then each slot's place
  const int chunk = (slots + kThreads - 1) / kThreads;
  const int first = min(slots, static_cast<int>(threadIdx.x) * chunk);
  const int last = min(slots, first + chunk);
  int mine = 0;
  for (int s = first; s < last; ++s) mine += s_valid[s];
  int before = 0, total = 0;
  Scan(scan_tmp).ExclusiveSum(mine, before, total);
  int node = -1, node_count = 0;
  for (int s = first; s < last; ++s) {
    const bool v = s_valid[s];
    // valid: its rank among the valid slots; else after all of them, in slot order
    const long long p = v ? before : static_cast<long long>(total) + s - before;
    before += v;
    place[s] = p;
    order[p] = s;
    valid[s] = v;
    const int n = s / max_tokens;
    if (n != node) {
      if (node_count) atomicAdd(&s_node[node], node_count);
      node = n;
      node_count = 0;
    }
    node_count += v;
  }
  if (node >= 0 && node_count) atomicAdd(&s_node[node], node_count);
  if (threadIdx.x == 0) s_total = total;
  __syncthreads();
  for (int i = threadIdx.x; i < experts; i += kThreads) per_expert[i] = s_expert[i];
  for (int i = threadIdx.x; i < nodes; i += kThreads) node_counts[i] = s_node[i];
  if (threadIdx.x == 0) num[0] = s_total;
}

}  // namespace

void launch_local_pack(const int64_t* topk, int slots, int topk_n, int experts, int max_tokens, bool* valid,
                       int64_t* order, int64_t* place, int64_t* num, int64_t* per_expert, int64_t* node_counts,
                       cudaStream_t stream) {
  EP_CHECK_ARG(slots >= 0 && slots <= kLocalPackMaxSlots && topk_n >= 1 && experts >= 1 &&
                   experts <= kLocalPackMaxExperts && max_tokens >= 1 && slots % max_tokens == 0 &&
                   slots / max_tokens <= kLocalPackMaxNodes,
               "local_pack: slots %d (at most %d, a multiple of max_tokens %d), topk %d, experts %d (at most %d)", slots,
               kLocalPackMaxSlots, max_tokens, topk_n, experts, kLocalPackMaxExperts);
  local_pack_kernel<<<1, kThreads, 0, stream>>>(topk, slots, topk_n, experts, max_tokens, valid, order, place, num,
                                                per_expert, node_counts);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep
