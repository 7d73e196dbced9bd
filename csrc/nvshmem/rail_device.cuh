// The rail kernels' shared view of memory (rail.h has the protocol).
//
// Symmetric heap of every rank, per parity p (0/1: the call's index on the host, & 1), indexed by
// the source node s of a slot s*M + t:
//   disp_flag[p][N]        u64 signal words; rail peer on node s sets [s] to epoch + 1
//   disp_count[p][N]       int, T of the source on node s
//   disp_x[p][N*M]         rows: BF16 [H], or FP8 [H] bytes
//   disp_sf[p][N*M][H/128] float32 scales (FP8 only)
//   disp_topk[p][N*M*K]    int64 topk_f, row-major for the call's K (room for KMAX)
//   disp_w[p][N*M*K]       float32 wf
//   comb_flag[p][N]        u64, as disp_flag, for combine
//   comb_rows[p][N*M]      BF16 [H] rows the forwarder on node s sent back for token t (pulled combine: the
//                          rows this rank forwarded, slot s*M + t at row s*M + t, read by rank (s, l))
// RDMA staging (only when a peer is not reachable over P2P: NVSHMEM puts need a symmetric source):
//   stage_x[M], stage_sf[M][H/128], stage_topk[N][M*K], stage_w[N][M*K], comb_stage[N*M].
#pragma once
#include <cuda_bf16.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "common/ptx.cuh"
#include "common/wait.cuh"
#include "nvshmem/host_report.h"
#include "nvshmem/shmem_device.cuh"

namespace ep {
namespace rail {

constexpr int kMaxNodes = 128;
constexpr int kMaxTopk = 32;  // one lane per k
constexpr int kThreads = 512;
constexpr int kSend = 1, kRecv = 2;  // phases of one launch
constexpr int kKernelDispatch = 20, kKernelCombine = 21;

// Local (not symmetric) ints: epochs of each half, last-block tickets, then the mask of left-out
// nodes [N], then the abort word.
enum StateIndex { kDispSendEpoch = 0, kDispRecvEpoch, kCombSendEpoch, kCombRecvEpoch,
                  kTicketDispSend, kTicketDispRecv, kTicketCombSend, kTicketCombRecv, kMask };

struct HostInfo : HostReport<kMaxNodes> {};  // host-mapped: what a wait that timed out reports (by node), and bad expert ids

struct Ctx {
  int rank, ranks_per_node, local, node, nodes;
  int num_experts, node_experts;  // E, EN = E / N
  int max_tokens, max_topk, hidden;
  int row_bytes;    // of an xf row: 2H (BF16) or H (FP8)
  int scales;       // H / 128 with FP8, else 0
  char* heap;                  // this rank's symmetric base
  char* peer[kMaxNodes];       // nvshmem_ptr(heap, rail peer on node m), or nullptr (NVSHMEM puts)
  long long disp_flag[2], disp_count[2], disp_x[2], disp_sf[2], disp_topk[2], disp_w[2];
  long long comb_flag[2], comb_rows[2];
  long long stage_x, stage_sf, stage_topk, stage_w, comb_stage;  // -1 when every peer is P2P
  int* state;
  int* aborted;
  HostInfo* host;
  unsigned long long timeout_ns;
};

__device__ __forceinline__ int rail_pe(const Ctx& c, int m) { return m * c.ranks_per_node + c.local; }

__device__ __forceinline__ unsigned* ticket(const Ctx& c, int i) { return reinterpret_cast<unsigned*>(c.state + i); }

// s_live[m] = 1 unless node m's rail peer is left out (set_mask); read once per launch, by the block.
__device__ __forceinline__ void load_live(const Ctx& c, int* s_live) {
  for (int m = threadIdx.x; m < c.nodes; m += blockDim.x) s_live[m] = ld_volatile(c.state + kMask + m) == 0;
  __syncthreads();
}

// Node of expert id e for lane-per-k work: -1 for ids outside [0, E) or on a node not in s_ok.
__device__ __forceinline__ int node_of(const Ctx& c, long long e, const int* s_ok) {
  if (e < 0 || e >= c.num_experts) return -1;
  const int m = static_cast<int>(e / c.node_experts);
  return s_ok[m] ? m : -1;
}

// Lanes k < K hold node (or -1); true on the lane of the first k naming each node (all lanes call).
__device__ __forceinline__ bool first_of_node(int node, int K, int lane) {
  bool first = node >= 0;
  for (int j = 0; j < K; ++j) {
    const int o = __shfl_sync(kFull, node, j);
    if (j < lane && o == node) first = false;
  }
  return first;
}

// The end of a send half, by every block: its NVSHMEM puts complete (quiet), then the last block to
// arrive (after every block's fence) signals each live rail peer with epoch + 1 at flag_off and
// advances the half's epoch.
__device__ inline void finish_send(const Ctx& c, bool put, long long flag_off, int epoch, int epoch_index,
                                   int ticket_index, const int* s_live) {
  if (__syncthreads_or(put) && threadIdx.x == 0) nvshmem_quiet();
  if (last_block(ticket(c, ticket_index))) {
    for (int m = threadIdx.x; m < c.nodes; m += blockDim.x)
      if (s_live[m]) signal_peer(c.peer[m], c.heap, flag_off, c.node, rail_pe(c, m), epoch + 1);
    __syncthreads();
    if (threadIdx.x == 0) c.state[epoch_index] = epoch + 1;
  }
}

// The end of a receive half: the last block advances the half's epoch.
__device__ inline void finish_recv(const Ctx& c, int epoch_index, int ticket_index) {
  if (last_block(ticket(c, ticket_index)) && threadIdx.x == 0)
    c.state[epoch_index] = ld_volatile(c.state + epoch_index) + 1;
}

// The kernels (rail_dispatch.cu, rail_combine.cu), launched by rail_runtime.cu. Each runs its send
// half, its receive half or both (phases); the parities are the host's call counts & 1 per half.
struct DispatchIn {
  const int4* x;           // [T, H] BF16, or FP8 bytes
  const float* scales;     // [T, H/128] (FP8)
  const int64_t* topk;     // [T, K] global expert ids
  const float* weights;    // [T, K] or nullptr (no wf)
};

template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1)
    dispatch(Ctx c, DispatchIn in, int T, int K, int phases, int send_parity, int recv_parity);

// kPull: the pulled combine (rail.h): rows stay in the forwarder's own comb_rows, the origin reads them.
template <bool kPull>
__global__ void __launch_bounds__(kThreads, 1)
    combine(Ctx c, const int4* y_f, const int64_t* y_rows, const uint8_t* slot_valid, const int64_t* topk, int T, int K,
            int phases, int send_parity, int recv_parity, int4* y);

}  // namespace rail
}  // namespace ep
