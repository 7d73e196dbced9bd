// The low-latency kernels, launched by ll_runtime.cu (separate compilation units: -rdc).
#pragma once
#include <cstdint>

#include "nvshmem/ll_device.cuh"

namespace ep {
namespace ll {

struct DispatchOut {   // the caller's tensors (recv half)
  char* x;             // [EL, W*M, H] BF16, or FP8 bytes
  float* scales;       // FP8: storage [EL, H/128, W*M]
  int* recv_count;     // [EL]
  int* src_info;       // [EL, W*M]
  long long* layout_range;  // [EL, W]
  int* row_slot;       // [EL, W*M]: (source * M + token) * KMAX + k, for combine
  int* recv_stats;     // [EL] or nullptr
  int* self_pos;       // [M * KMAX] or nullptr: where (token, k) of this rank's own experts landed (el * W*M + row)
};

template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) dispatch(Ctx c, const int4* x, const int64_t* topk_idx, int T, int K, int phases,
                            int round_scale, DispatchOut o);

// Into output set `set` of the heap (Ctx::sets > 0): the outputs' x, scales, src_info and row_slot
// are the set's; o gives recv_count, layout_range and recv_stats. The receive half runs in block 0.
template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) dispatch_direct(Ctx c, const int4* x, const int64_t* topk_idx, int T, int K,
                                                               int phases, int round_scale, int set, DispatchOut o);

// self_pos (the dispatch's DispatchOut::self_pos, or nullptr): the rows of this rank's own experts are
// not sent; the receive half reads them from x at self_pos (x then stays valid until it has run).
// kDeep: compiled with kLoadsAhead's and kCopy8's code (launched when phases carry either bit), so that
// the kernel without them keeps its own register allocation.
template <bool kDeep>
__global__ void __launch_bounds__(kThreads, 1) combine(Ctx c, const int4* x, const int* row_slot, const int* recv_count,
                           const int64_t* topk_idx, const float* weights, int T, int K, int phases, int4* y,
                           const int* self_pos, const int* rec);

}  // namespace ll
}  // namespace ep
