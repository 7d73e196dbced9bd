// ep_plugin._C.RailRuntime: the RDMA half of the hierarchical (internode) high-throughput backend. A
// token bound for node m crosses once to its "rail peer" there (rank m*P + l for a rank of local
// index l), which forwards it inside node m over NVLink (the intranode backend, not this file).
//
// Protocol. W ranks = N nodes x P; every rank builds one Runtime after nvshmem_init (a collective:
// one symmetric allocation, zeroed, then a barrier). Rank (n, l) talks only to its N rail peers
// (m, l), itself included (m = n).
// - dispatch, send half: for every token t < T and every live node m, the row of topk_f (ids on
//   node m minus m*EN, else -1) and of wf goes to slot n*M + t of peer (m, l); the x row (and the
//   FP8 scales) only where t selects an expert on node m; then T, then one signal per peer carrying
//   epoch + 1 (P2P stores or NVSHMEM puts; the last block signals, after every block's fence).
// - dispatch, receive half: waits for the N signals (deadline timeout_s, recorded in host-mapped
//   memory, never a trap), then marks slots s*M + t for t >= T_s as routed nowhere (topk_f -1,
//   wf 0). The outputs are the symmetric buffers themselves: xf [N*M, H], sf [N*M, H/128],
//   topk_f [N*M, K], wf [N*M, K] of the call's parity (buffers(p) gives their addresses).
// - combine, send half: the forwarder sends row i = s*M + t of y_f (where slot_valid[i]) to slot
//   n*M + t of rank (s, l), then signals each peer. Receive half: waits for the N signals, and the
//   origin sums, per token, the rows of the nodes its ids select, in float32, nodes ascending.
//   Placed rows (every rail peer P2P): the caller's kernel, earlier on the stream, has stored those rows
//   itself at combine_targets(parity of the send) and fenced them; the send half then only signals.
// - pulled combine (pull = 1, every rail peer P2P; HierarchicalBackend.pull_combine): the forwarder keeps
//   row s*M + t in its OWN comb_rows[p] (its send half copies y_f there, or the caller's kernel stored it at
//   combine_own_targets(p) and fenced it), then signals as above; the origin's receive half waits for the same
//   signals and reads node m's row of token t from rank (m, l)'s comb_rows[p] row n*M + t over P2P. Every rank
//   of the group must take the same form for a call (the signal means "ready to read" here, "landed" there).
//   The rows stay put until the forwarder's combine k + 2 overwrites them, which it issues after its receive
//   half of combine k + 1, which waited for every origin's send of k + 1, issued after that origin's reads of
//   combine k: the same chain as the pushed form's (below), with reader and writer swapped.
//
// Parity. Each kind has its own epochs (device, for signal values: replays of a CUDA graph advance
// them) and its own two buffers; the buffer of call k is k & 1, counted on the host (calls are
// issued in the same order on every rank), so the host can return views without a sync and a graph
// captures the addresses the kernels write. Two buffers suffice: peer q writes our buffer k & 1 again
// only in its call k + 2, which it issues after its receive half of call k + 1, which waited for our
// send of call k + 1, which our stream runs after everything enqueued before it. So dispatch k's
// views are safe to read by work enqueued before our dispatch k + 1; after it, they stay intact
// until the peers' dispatch k + 2, which in a MoE step (dispatch k, [dispatch k + 1], combine k, ...)
// follows their combine k, whose receive waits for our combine k send, enqueued after our reads of
// dispatch k. Combine's buffers are read by its own receive half, before our next combine's send.
//
// No NVSHMEM type here: the bindings compile without the wheel's headers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace ep {
namespace rail {

struct HostInfo;

// Addresses of one parity's dispatch outputs (sf 0 unless FP8); topk_f and wf hold N*M*K entries
// for the call's K (room for max_topk), row-major.
struct Buffers {
  uintptr_t xf, sf, topk_f, wf;
};

class Runtime {
 public:
  // fp8: rows are FP8 data plus float32 scales per 128 channels, else BF16. force_puts: treat every
  // peer as lacking P2P (NVSHMEM puts from staging buffers, as across nodes): tests the RDMA path on
  // one host.
  Runtime(int rank, int world, int ranks_per_node, int num_experts, int max_tokens, int max_topk, int hidden,
          int fp8, double timeout_s, int num_blocks, int force_puts = 0);
  ~Runtime();
  // Symmetric bytes the Runtime allocates; stage: with the staging areas NVSHMEM puts need (any peer
  // without P2P).
  static size_t heap_bytes(int world, int ranks_per_node, int num_experts, int max_tokens, int max_topk, int hidden,
                           int fp8, int stage);

  // phases: kSend (1), kRecv (2) or both. The receive half reads no input but K.
  void dispatch(uintptr_t x, uintptr_t scales, uintptr_t topk_idx, uintptr_t weights, int T, int K, int phases,
                uintptr_t stream);
  // y_rows (0: none): int64 [N*M], slot i's row is y_f[y_rows[i]]. placed: the send half only signals (y_f and
  // y_rows 0): the rows are in place (combine_targets), which needs every rail peer over P2P.
  // pull: the pulled combine (protocol above), both halves of a call alike; needs every rail peer over P2P.
  void combine(uintptr_t y_f, uintptr_t slot_valid, uintptr_t topk_idx, int T, int K, int phases, uintptr_t y,
               uintptr_t stream, uintptr_t y_rows = 0, int placed = 0, int pull = 0);
  Buffers buffers(int parity) const;
  int next_dispatch_parity() const { return static_cast<int>(disp_recv_calls_ & 1); }
  // Where combine's send half of parity p puts this node's rows at each rail peer: [N] addresses (the row of
  // slot s*M + t is at [s] + t * 2H), every one mapped here over P2P; empty unless all_p2p().
  std::vector<uintptr_t> combine_targets(int parity) const;
  // The pulled combine's: [N] addresses in this rank's own comb_rows of parity p (slot s*M + t at [s] + t * 2H),
  // for a kernel of the caller's to store the rows there; empty unless all_p2p() (the origins read them over P2P).
  std::vector<uintptr_t> combine_own_targets(int parity) const;
  int next_combine_parity() const { return static_cast<int>(comb_send_calls_ & 1); }

  void set_mask(const std::vector<int>& left_out);  // global ranks; clears a recorded timeout (synchronous)
  int error() const;
  int error_kernel() const;
  std::vector<int> missing_ranks() const;  // global ranks
  int take_bad_expert_ids();  // 1 if a send half since the last call saw an id outside [-1, E); clears it
  bool all_p2p() const { return all_p2p_; }
  size_t bytes() const { return bytes_; }
  void destroy(bool collective);  // nvshmem_free (collective) unless after a fault

 private:
  std::vector<uintptr_t> comb_rows_of(int parity, bool own) const;  // combine_targets / combine_own_targets
  void check_call(int T, int K, int phases, const char* what) const;
  int world_, ranks_per_node_, local_, nodes_, max_tokens_, max_topk_, hidden_, fp8_, num_blocks_;
  unsigned long long disp_send_calls_ = 0, disp_recv_calls_ = 0, comb_send_calls_ = 0, comb_recv_calls_ = 0;
  size_t bytes_ = 0;
  bool all_p2p_ = true;
  char* heap_ = nullptr;
  int* state_ = nullptr;
  HostInfo* host_ = nullptr;
  HostInfo* host_dev_ = nullptr;
  void* ctx_ = nullptr;  // rail::Ctx (rail_device.cuh)
};

}  // namespace rail
}  // namespace ep
