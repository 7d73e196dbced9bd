// The internode backend's contract order (ep_plugin/backends/hierarchical/backend.py, contract_order), in
// one launch.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace ep {

// recv_off [per_node + 1] int32: the inner (NVLink) dispatch's row offsets per forwarder; recv_src [rows]
// int32: each row's slot s*max_tokens + t on its forwarder. Writes counts [nodes*per_node] int64 (rows from
// each source rank g = s*per_node + l) and pos [rows] int64 (each row's contract position; rows from
// recv_off[per_node] on stay in place; every position clamped to [0, rows), whatever recv_src holds).
void launch_contract_order(const int* recv_off, const int* recv_src, int nodes, int per_node, int max_tokens,
                           int rows, int64_t* counts, int64_t* pos, cudaStream_t stream);

}  // namespace ep
