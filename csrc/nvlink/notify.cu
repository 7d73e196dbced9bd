// notify: the first step of a dispatch. One block computes where this rank's tokens go and tells
// every peer how many rows (and rows per expert) to expect from it.
//
// Protocol, at epoch n = epochs[E_NOTIFY] + 1 (d = epochs[E_DISPATCH], the last finished dispatch):
//   0. count this rank's tokens per destination rank and per expert (its own input only). In an
//      expert-major dispatch (kMerge) a token naming one expert in several slots counts for it once:
//      stage merges the picks the same way (dispatch.cu), so receivers find one route per (token, expert).
//   1. wait META_ACK[p] >= n-1 at this rank for every peer p: p has read the counts this rank wrote
//      into p's meta area last time, so they may be overwritten; and PULL_DONE[p] >= d: p has
//      finished pulling from this rank's send list, which step 2 rewrites.
//   2. write meta[me] = {rows, per-expert counts} into every peer's meta area, fence, release
//      COUNT[me] = n at every rank; then build send_pos / is_in / send_list (this rank's buffer;
//      peers read the send list only after this rank's stage releases STAGE, behind this kernel).
//   3. wait COUNT[p] >= n for every peer, read the meta area: receive offsets, counts per local
//      expert (device outputs and host-mapped info).
//   4. release META_ACK[me] = n at every peer; epochs[E_NOTIFY] = n.
// A timeout in any wait records the missing peer with K_NOTIFY and returns; the host sees err.
// The protocol's code is notify_group (notify.cuh), which stage_pull runs inside itself too.
#include "common/error.h"
#include "nvlink/device.cuh"
#include "nvlink/kernels.h"
#include "nvlink/notify.cuh"

namespace ep {
namespace nvl {
namespace {

constexpr int kNotifyThreads = 512;  // 1024 threads leave 64 registers each: the scan spilled

template <bool kMerge>
__global__ void __launch_bounds__(kNotifyThreads, 1)
notify_kernel(Ctx c, const int64_t* __restrict__ topk_idx, int T, int K, NotifyOut o) {
  extern __shared__ int s_ecnt[];  // [num_experts]
  __shared__ int s_wsum[kNotifyThreads / 32][kMaxRanks];
  __shared__ int s_total[kMaxRanks];
  __shared__ int s_fail;
  if (threadIdx.x == 0) s_fail = 0;  // notify_group's first barrier orders it
  notify_group<kMerge, kNotifyThreads>(c, NotifyGroup<kNotifyThreads>{static_cast<int>(threadIdx.x), -1}, topk_idx,
                                       T, K, o, s_ecnt, s_wsum, s_total, &s_fail, 0);
}

}  // namespace

void launch_notify(const Ctx& c, const int64_t* topk_idx, int T, int K, int* send_pos, bool* is_in,
                   int* recv_off, int64_t* tpe, int64_t* host_tpe, int* host_recv_off, bool merge_repeats,
                   cudaStream_t stream) {
  // Per-expert counts live in shared memory, within the default 48 KiB a launch may ask for.
  const size_t smem = sizeof(int) * c.num_experts;
  EP_CHECK_ARG(smem <= 48 * 1024, "too many experts for the notify kernel: num_experts=%d, at most %d",
               c.num_experts, static_cast<int>(48 * 1024 / sizeof(int)));
  const auto kernel = merge_repeats ? notify_kernel<true> : notify_kernel<false>;
  kernel<<<1, kNotifyThreads, smem, stream>>>(c, topk_idx, T, K,
                                              NotifyOut{send_pos, is_in, recv_off, tpe, host_tpe, host_recv_off});
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nvl
}  // namespace ep
