// Intranode expert-parallel transport over CUDA IPC-mapped buffers (the `nvlink` backend).
//
// Every rank cudaMallocs one buffer with the same layout and opens its peers' buffers through CUDA
// IPC handles. Protocol (all waits time out after timeout_s; epochs live on the device so CUDA-graph
// replays stay in step):
//   notify : layout of topk_idx (send_pos, send_list), counts to every peer, per-source receive
//            offsets, per-local-expert counts (device + host-mapped memory).
//   stage  : copy this rank's rows (+ FP8 scales, topk ids/weights) into its IPC stage area, then
//            flag STAGE to every peer.
//   pull   : every rank reads the rows addressed to it straight out of the sources' stage areas
//            (16-byte loads over NVLink, a warp per row) into its output tensor, then flags PULL_DONE.
//   combine: each rank writes the rows it received back into the source's IPC combine area at slot
//            [its rank, position] (remote stores), flags COMBINE; the source sums the slots per
//            token in float (its own rows read in place) and flags REDUCE_DONE.
// A timeout marks the missing rank in host-mapped memory, sets an abort word and returns: kernels
// never trap, so the CUDA context stays usable.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ep {
namespace nvl {

constexpr int kMaxRanks = 8;
constexpr int kMaxTopk = 32;
enum FlagKind { F_COUNT = 0, F_META_ACK, F_STAGE, F_PULL_DONE, F_COMBINE, F_REDUCE_DONE, F_NUM };
enum EpochKind { E_NOTIFY = 0, E_DISPATCH, E_COMBINE, E_NUM };
enum CounterKind { C_STAGE = 0, C_PULL, C_SEND, C_REDUCE, C_FUSED, C_QUEUE, C_NUM };
constexpr int kChunk = 8;  // tokens per arrival counter of the fused combine

// Host-mapped (pinned) results and error state, written by the kernels, read by the host.
struct HostInfo {
  int err;                    // 0 ok, 1 timeout
  int err_kernel;             // which kernel timed out (1 notify, 2 stage, 3 pull, 4 send, 5 reduce)
  int missing[kMaxRanks];     // 1 where that rank did not arrive
  int num_recv;
  int recv_counts[kMaxRanks];
  int send_counts[kMaxRanks];
  int tokens_per_expert[1];   // [num_local_experts] (allocated larger)
};

// Everything a kernel needs, passed by value.
struct Ctx {
  char* peers[kMaxRanks];     // base of every rank's IPC buffer (own included)
  int rank, world;
  int max_tokens, num_experts, local_experts;
  int hidden;
  size_t off_flags, off_meta, off_send_list, off_stage_x, off_stage_scales, off_stage_idx,
      off_stage_w, off_combine, off_arrive;
  size_t stage_row_cap;       // bytes per staged row available (hidden * 2)
  int* epochs;                // [E_NUM] local device
  unsigned* counters;         // [C_NUM] local device
  int* aborted;               // local device
  HostInfo* host;             // device view of the host-mapped info
  unsigned long long timeout_ns;
};

class Runtime {
 public:
  Runtime(int device, int rank, int world, int max_tokens, int hidden, int num_experts,
          double timeout_s);
  ~Runtime();

  std::string ipc_handle() const;                       // 64 bytes (cudaIpcMemHandle_t)
  void open_peers(const std::vector<std::string>& handles);
  void close();

  // notify: topk_idx [T,K] int64 -> send_pos [T,W] int32, is_in [T,W] bool, recv_off [W+1] int32,
  // tpe [local_experts] int64 (device); host info (num_recv, counts) filled on completion.
  void notify(uintptr_t topk_idx, int T, int K, uintptr_t send_pos, uintptr_t is_in,
              uintptr_t recv_off, uintptr_t tpe, uintptr_t stream);
  // stage: rows [T, row_bytes] (+ scales [T, nscales] f32, topk_idx [T,K] i64, weights [T,K] f32)
  void stage(uintptr_t x, int T, int row_bytes, uintptr_t scales, int nscales, uintptr_t topk_idx,
             uintptr_t weights, int K, int num_sms, uintptr_t stream);
  // pull: rows into out_x [R_alloc, row_bytes] (+ out_scales, out_idx [R_alloc,K] i64,
  // out_w [R_alloc,K] f32); recv_src [R_alloc] int32 written (cached=0) or read (cached=1).
  void pull(uintptr_t out_x, int row_bytes, uintptr_t out_scales, int nscales, uintptr_t out_idx,
            uintptr_t out_w, int K, uintptr_t recv_off, uintptr_t recv_src, int cached, int R_alloc,
            int num_sms, uintptr_t stream);
  // combine: x [R_alloc, H] bf16 rows of this rank, send_pos [T,W], recv_off [W+1] -> y [T,H] bf16
  // fused=1: one kernel, senders signal per 8-token chunk and the source reduces each chunk as soon
  // as it is complete (needs recv_src from the dispatch); fused=0: send kernel, then reduce kernel.
  void combine(uintptr_t x, uintptr_t send_pos, uintptr_t recv_off, uintptr_t recv_src, uintptr_t y, int T,
               int num_sms, int fused, uintptr_t stream);

  // Host-side readbacks of the host-mapped info (valid after the notify has completed).
  int num_recv() const;
  std::vector<int> recv_counts() const;
  std::vector<int> send_counts() const;
  std::vector<int> tokens_per_expert() const;
  int error() const;
  int error_kernel() const;
  std::vector<int> missing_ranks() const;
  std::vector<int> epochs() const;  // synchronous copy (debugging)
  size_t buffer_bytes() const { return bytes_; }

 private:
  void set_device() const;
  int device_, rank_, world_, max_tokens_, hidden_, num_experts_, local_experts_;
  double timeout_s_;
  size_t bytes_ = 0;
  char* base_ = nullptr;
  void* local_ = nullptr;   // epochs + counters + aborted
  HostInfo* host_ = nullptr;
  HostInfo* host_dev_ = nullptr;
  bool opened_ = false;
  Ctx ctx_{};
};

}  // namespace nvl
}  // namespace ep
