// ep_plugin._C.LowLatencyRuntime: the low-latency kernels' host side (ll_runtime.cu). Protocol:
// every rank builds one after nvshmem_init (a collective: one symmetric allocation, zeroed, then a
// barrier). dispatch/combine launch one kernel with phases kSend (1), kRecv (2) or both (ORed with the
// variant bits of ll_device.cuh, which every rank of a call passes alike): the send
// half writes rows straight into the owners' symmetric slots (P2P stores, or NVSHMEM puts where a
// peer is not P2P-reachable), then one signal per rank carrying epoch + 1; the receive half waits
// for the signals (deadline timeout_s, recorded in host-mapped memory, never a trap) and packs the
// rows into the caller's tensors. Epochs and tickets live on the device, so calls never sync the
// host and replay in CUDA graphs. Calls must alternate dispatch/combine in the same order on every
// rank; buffers alternate by epoch parity, so one call of a kind may be in flight per rank.
//
// No NVSHMEM type here: the bindings compile without the wheel's headers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace ep {
namespace ll {

struct HostInfo;

class Runtime {
 public:
  // output_sets > 0: that many sets of the dispatch's outputs in the heap, written by the senders
  // directly (ll_device.cuh, "Output sets"); only where every peer is P2P (else sets() is 0).
  Runtime(int rank, int world, int num_experts, int max_tokens, int max_topk, int hidden, double timeout_s,
          int num_blocks, int output_sets);
  ~Runtime();
  static size_t heap_bytes(int world, int num_experts, int max_tokens, int max_topk, int hidden, int output_sets);

  void dispatch(uintptr_t x, uintptr_t topk_idx, int T, int K, int use_fp8, int round_scale, int phases,
                uintptr_t out_x, uintptr_t out_scales, uintptr_t recv_count, uintptr_t src_info,
                uintptr_t layout_range, uintptr_t row_slot, uintptr_t recv_stats, uintptr_t stream, int out_set,
                uintptr_t self_pos);
  // out_set >= 0: into that output set (out_x, out_scales, src_info, row_slot unused: the set's)
  int sets() const;
  std::vector<uintptr_t> set_pointers(int i) const;  // set i's data, scales, src_info, row_slot, rec
  // self_pos (0: none): the dispatch recorded where (token, k) of this rank's own experts landed; the
  // send half skips those rows and the receive half reads them from x (both halves get x then).
  // rec: the dispatch's records (its set's rec, or where a held set moved them), for kOwnerReduce's send
  // half, which also takes topk_idx and weights (its weights go to the picks' owners first)
  void combine(uintptr_t x, uintptr_t row_slot, uintptr_t recv_count, uintptr_t topk_idx, uintptr_t weights,
               int T, int K, int phases, uintptr_t y, uintptr_t stream, uintptr_t self_pos, uintptr_t rec);
  void set_mask(const std::vector<int>& left_out);  // clears a recorded timeout too (synchronous)
  int error() const;
  int error_kernel() const;
  std::vector<int> missing_ranks() const;
  int take_bad_expert_ids();  // 1 if a send half since the last call saw an id outside [-1, E); clears it
  bool all_p2p() const { return all_p2p_; }
  int num_blocks() const { return num_blocks_; }
  // the grid of the next launches (1..the value built with: every block of a SEND|RECV launch is resident)
  void set_num_blocks(int n);
  // Phase stamps for benchmarks (ll_device.cuh, "Phase stamps"): the launches from now on write them to
  // `stamps`, device memory of 2 * 1024 * 8 uint64 (kernel, block, slot); 0 turns them off. A CUDA graph
  // keeps what its capture saw.
  void set_stamps(uintptr_t stamps);
  size_t bytes() const { return bytes_; }
  void destroy(bool collective);  // nvshmem_free (collective) unless after a fault

 private:
  void check_call(int T, int K) const;
  int world_, max_tokens_, max_topk_, hidden_, num_blocks_, max_blocks_;
  size_t bytes_ = 0;
  bool all_p2p_ = true;
  char* heap_ = nullptr;
  int* local_ = nullptr;
  HostInfo* host_ = nullptr;
  HostInfo* host_dev_ = nullptr;
  void* ctx_ = nullptr;  // ll::Ctx (defined in ll_device.cuh)
};

}  // namespace ll
}  // namespace ep
