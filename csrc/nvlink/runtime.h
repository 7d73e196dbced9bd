// The nvlink host runtime (ep_plugin._C.NvlinkRuntime): owns this rank's IPC buffer, maps the
// peers' buffers, validates each call and launches the kernels. The protocol is in nvlink.h.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "nvlink/nvlink.h"

struct CUstream_st;  // cudaStream_t and cudaEvent_t, without the CUDA runtime's header here
struct CUevent_st;

namespace ep {
namespace nvl {

class Runtime {
 public:
  Runtime(int device, int rank, int world, int max_tokens, int hidden, int num_experts,
          double timeout_s);
  ~Runtime();

  std::string ipc_handle() const;                       // 64 bytes (cudaIpcMemHandle_t)
  void open_peers(const std::vector<std::string>& handles);
  void close();

  // notify: topk_idx [T,K] int64 -> send_pos [T,W] int32, is_in [T,W] bool, recv_off [W+1] int32,
  // tpe [local_experts] int64 (device); host info (num_recv, counts) filled on completion, and tpe /
  // recv_off also written into pinned host buffers host_tpe / host_recv_off when given (not 0), so
  // that no copy follows the kernel. merge_repeats (expert-major): a token's repeated expert counts once.
  void notify(uintptr_t topk_idx, int T, int K, uintptr_t send_pos, uintptr_t is_in,
              uintptr_t recv_off, uintptr_t tpe, uintptr_t stream, uintptr_t host_tpe = 0,
              uintptr_t host_recv_off = 0, int merge_repeats = 0);
  // stage: rows [T, row_bytes] (+ scales [T, nscales] f32, topk_idx [T,K] i64, weights [T,K] f32);
  // merge_repeats (expert-major): ids and weights staged merged, as ep_plugin.expert_major.merge_repeats
  void stage(uintptr_t x, int T, int row_bytes, uintptr_t scales, int nscales, uintptr_t topk_idx,
             uintptr_t weights, int K, int num_sms, uintptr_t stream, int merge_repeats = 0);
  // pull: rows into out_x [R_alloc, row_bytes] (+ out_scales, out_idx [R_alloc,K] i64,
  // out_w [R_alloc,K] f32); recv_src [R_alloc] int32 written (cached=0) or read (cached=1).
  // out_rows (0: none): int64 [R_alloc], the call's DispatchRoute (nvlink.h): row i and its scales, ids and
  // weights written at output row out_rows[i] (every kernel of the rank-major pull takes it).
  void pull(uintptr_t out_x, int row_bytes, uintptr_t out_scales, int nscales, uintptr_t out_idx,
            uintptr_t out_w, int K, uintptr_t recv_off, uintptr_t recv_src, int cached, int R_alloc,
            int num_sms, uintptr_t stream, uintptr_t out_rows = 0);
  // stage + pull of a rank-major dispatch whose outputs exist already (worst-case sized, or a cached
  // dispatch): one kernel that pulls each sub-chunk as soon as its source has staged it where the
  // bulk-copy pull applies (tma() and the row fits its ring), else stage then pull. out_rows: as pull's.
  void stage_pull(uintptr_t x, int T, int row_bytes, uintptr_t scales, int nscales, uintptr_t topk_idx,
                  uintptr_t weights, int K, uintptr_t out_x, uintptr_t out_scales, uintptr_t out_idx,
                  uintptr_t out_w, uintptr_t recv_off, uintptr_t recv_src, int cached, int R_alloc, int num_sms,
                  uintptr_t stream, uintptr_t out_rows = 0);
  // notify + stage_pull of a fresh rank-major worst-case dispatch in one launch, notify inside stage_pull's
  // block 0 (stage_pull_tma.cu, notify.cuh) while the other blocks stage: notify's arguments, then
  // stage_pull's (the stage reads topk_idx too; the pull reads recv_off once notify has written it). Where
  // the bulk-copy kernel does not apply, or its ring cannot hold the per-expert counts: notify, then stage_pull.
  void notify_stage_pull(uintptr_t topk_idx, int T, int K, uintptr_t send_pos, uintptr_t is_in, uintptr_t recv_off,
                         uintptr_t tpe, uintptr_t host_tpe, uintptr_t host_recv_off, uintptr_t x, int row_bytes,
                         uintptr_t scales, int nscales, uintptr_t weights, uintptr_t out_x, uintptr_t out_scales,
                         uintptr_t out_idx, uintptr_t out_w, uintptr_t recv_src, int R_alloc, int num_sms,
                         uintptr_t stream);
  // The fresh stage_pull of the hierarchical backend's inner exchange, writing in the contract's order
  // (nvlink.h, DispatchRoute's contract order): this rank's tokens are `nodes` blocks of max_tokens / nodes
  // rail slots; row i and its scales, ids and weights go to its contract position, to_contract [R_alloc] int64
  // and counts [nodes * world] int64 (rows per source rank) are written. Bulk-copy kernel only: no fallback
  // (stage_pull_contract_fits says whether it runs; the caller picks the plain path before any launch).
  // With tpe (and notify's other outputs) given, notify runs inside it, as in notify_stage_pull (notify first
  // where the ring cannot hold the per-expert counts); without, the caller's notify ran before it.
  bool stage_pull_contract_fits(int row_bytes, int nodes) const;
  void stage_pull_contract(uintptr_t x, int T, int row_bytes, uintptr_t scales, int nscales, uintptr_t topk_idx,
                           uintptr_t weights, int K, uintptr_t out_x, uintptr_t out_scales, uintptr_t out_idx,
                           uintptr_t out_w, uintptr_t recv_off, uintptr_t recv_src, int R_alloc, int nodes,
                           uintptr_t to_contract, uintptr_t counts, int num_sms, uintptr_t stream,
                           uintptr_t send_pos = 0, uintptr_t is_in = 0, uintptr_t tpe = 0, uintptr_t host_tpe = 0,
                           uintptr_t host_recv_off = 0);
  // whether the pulls (rank-major, expert-major) move rows by bulk copies (TMA, the default; rows too
  // large for the ring still use registers) or by register copies
  bool tma() const { return tma_; }
  void set_tma(bool on) { tma_ = on; }
  // whether stage (the separate launch: split dispatches, cached split ones) moves a rank-major dispatch's
  // rows by the copy engine (cudaMemcpyAsync, no SM held) or by the stage kernel on num_sms SMs
  bool stage_copy_engine() const { return stage_ce_; }
  void set_stage_copy_engine(bool on) { stage_ce_ = on; }
  // The copy-engine stage beside notify (a fresh split rank-major dispatch): stage_begin forks a side stream off
  // `stream` -- at the point stage_fork marked, if it was called (before notify's launch, so that notify, the peers'
  // critical path, is not launched behind the stage's host calls), else here -- and queues the wait and the copies
  // there; stage_end, after notify, queues the release there behind notify (the release tells the peers the send
  // lists are complete) and joins `stream` to it. The copies then move while notify runs. One begin, then one end,
  // per dispatch.
  void stage_fork(uintptr_t stream);
  void stage_begin(uintptr_t x, int T, int row_bytes, uintptr_t scales, int nscales, uintptr_t topk_idx,
                   uintptr_t weights, int K, uintptr_t stream);
  void stage_end(uintptr_t stream);
  bool tma_supported() const;  // this build and this GPU run the bulk-copy kernels (sm_90+)
  // The pull combine's stager ring: its shared-memory rows (the loads get the rest). For
  // benchmarks/nvlink_phases.py only, pull_diag times one half alone (1: stage only, remote rows not
  // read; 2: no stage, sub-chunks flagged at once): y is wrong unless it is 0 or 4 (4, added to either:
  // blocks 0 and last printf their loader's and stager's cycles and waits). Values below 16.
  int pull_stage_slots() const { return pull_stage_slots_; }
  void set_pull_stage_slots(int n);
  int pull_diag() const { return pull_diag_; }
  void set_pull_diag(int d);
  // The pull combine's variant (combine_pull_tma.cu, kVar*), for A/B runs; 0 is the kernel as measured
  // so far. Bits 0-1: the stager moves rows (0), halves (1) or quarters (2) through its slots; bit 2: load
  // slots from a free mask, own row loaded last; bit 3: contiguous spans per block (no work queue); bit 4:
  // x read L2 evict_first. Every variant sums the same way (y bit for bit equal).
  // the pull combine's variant (combine_pull_tma.cu); bit 64 (start together) is protocol: the same on every rank
  int pull_variant() const { return pull_variant_; }
  void set_pull_variant(int v);
  // combine: x [R_alloc, H] bf16 rows of this rank, send_pos [T,W], recv_off [W+1] -> y [T,H] bf16.
  // mode kCombineSplit: send kernel, then reduce kernel; kCombineFused: one kernel, senders signal per
  // 8-token chunk and the source reduces each chunk as soon as it is complete (needs recv_src from the
  // dispatch); kCombinePipelined: the same protocol with bulk-copy sends (fused where they do not apply).
  // x_rows / y_blocks + block_tokens (0: none): the call's CombineRoute (nvlink.h): rows read as x[x_rows[i]]
  // (int64 [rows]), sums written to y_blocks[t / block_tokens] (int64 addresses) instead of y (then 0).
  void combine(uintptr_t x, uintptr_t send_pos, uintptr_t recv_off, uintptr_t recv_src, uintptr_t y, int T,
               int num_sms, int mode, uintptr_t stream, uintptr_t x_rows = 0, uintptr_t y_blocks = 0,
               int block_tokens = 0);
  // The pull combine with its stage by the copy engines (combine_stage_copies.cu; off by default: an A/B knob until
  // measured): the snap kernel and the pull kernel (no stager) on `stream`, the copies and their releases on a side
  // stream forked between them, `stream` joined to it. recv_off_host: the dispatch's receive offsets on the host
  // (W + 1). Not for a routed call (x_rows / y_blocks) nor under graph capture (the copies' sizes are the host's), and
  // only with num_sms below the GPU's SM count: the releases (one block each) must find an SM while the pull kernel,
  // whose peers wait on them, holds its own.
  int combine_copy_rounds() const { return combine_rounds_; }  // pieces per owner (a release behind each round)
  void set_combine_copy_rounds(int n);
  bool combine_copy_engine_fits() const;  // the pull kernel without a stager: the ring holds a token's rows
  long long combine_copy_calls() const { return combine_copy_calls_; }  // combines that took this path (tests, benches)
  void combine_copy_engine(uintptr_t x, uintptr_t send_pos, uintptr_t recv_off, uintptr_t y, int T, int num_sms,
                           uintptr_t stream, const std::vector<int>& recv_off_host);

  // Expert-major receive (expert.cu), replacing pull. Fresh (cached=0): recv_src, out_idx [R_alloc,K],
  // positions [R_alloc,K] int32 and offsets [EL+1] int64 written; scratch holds
  // expert_scratch_ints(num_sms) ints. Cached: positions, recv_src, offsets read. counts [EL] int64
  // (rows per local expert, before padding) locate the padding rows to zero.
  void expert_pull(uintptr_t out_x, int row_bytes, uintptr_t out_scales, int nscales, uintptr_t out_idx,
                   uintptr_t out_w, int K, uintptr_t recv_off, uintptr_t recv_src, uintptr_t positions,
                   int cached, int R_alloc, int alignment, uintptr_t scratch, uintptr_t offsets, uintptr_t counts,
                   int num_sms, uintptr_t stream);
  size_t expert_scratch_ints(int num_sms) const;
  // combine of expert-major rows x [N, H] bf16 (positions from the dispatch) -> y [T, H] bf16
  void combine_expert(uintptr_t x, uintptr_t positions, int K, uintptr_t send_pos, uintptr_t recv_off, uintptr_t y,
                      int T, int num_sms, uintptr_t stream);
  // combine of expert-major rows x [N, H] bf16 by the pull kernel on num_sms SMs, its stage the expert sum on the
  // GPU's other SMs beside it (a side stream forked after the snap, `stream` joined to it): the sum writes the rows
  // straight into the combine area and releases them per sub-chunk. Needs combine_copy_engine_fits and num_sms below
  // the GPU's SM count; not for a routed call.
  long long combine_expert_staged_calls() const { return combine_expert_staged_calls_; }  // (tests, benches)
  void combine_expert_staged(uintptr_t x, uintptr_t positions, int K, uintptr_t send_pos, uintptr_t recv_off,
                             uintptr_t y, int T, int num_sms, uintptr_t stream);
  // each received row's local experts of x [N, H] bf16 summed into rows [>= recv_off[W], H] bf16 (rank-major: the
  // x of a combine of the same handle), on `blocks` blocks
  void expert_sum(uintptr_t x, uintptr_t positions, int K, uintptr_t recv_off, uintptr_t rows, int blocks,
                  uintptr_t stream);

  // Host-side readbacks of the host-mapped info (valid after the notify has completed).
  int num_recv() const;
  std::vector<int> recv_counts() const;
  std::vector<int> send_counts() const;
  std::vector<int> tokens_per_expert() const;
  int error() const;
  int take_bad_expert_ids();  // 1 if a notify since the last call saw an id outside [-1, E); clears it
  int error_kernel() const;
  std::vector<int> missing_ranks() const;
  std::vector<int> epochs() const;  // synchronous copy (debugging)
  size_t buffer_bytes() const { return bytes_; }

 private:
  void set_device() const;
  void check_open() const;
  void check_tokens(int T) const;
  void check_row_bytes(int row_bytes) const;
  void check_stage(int T, int row_bytes, int nscales, int K) const;  // a stage's arguments (stage, stage_begin)
  void ensure_side();  // the side stream and its events, made at first use
  // The pull kernel (on num_sms SMs, without its stager: diag kDiagStagedByCopies | diag) beside a stage on the side
  // stream: the snap, the side stream forked after it, stage(SMs the pull kernel leaves free) launched there first,
  // then the pull kernel, `stream` joined to the side stream. `who` names the caller in its errors.
  void pull_beside_stage(const char* who, uintptr_t x, uintptr_t send_pos, uintptr_t recv_off, uintptr_t y, int T,
                         int num_sms, uintptr_t stream, int diag, const std::function<void(int free_sms)>& stage);
  Ctx routed(uintptr_t out_rows) const;  // ctx_ with the call's DispatchRoute
  void launch_stage_pull_checked(const Ctx& c, uintptr_t x, int T, int row_bytes, uintptr_t scales, int nscales,
                                 uintptr_t topk_idx, uintptr_t weights, int K, uintptr_t out_x, uintptr_t out_scales,
                                 uintptr_t out_idx, uintptr_t out_w, uintptr_t recv_off, uintptr_t recv_src,
                                 int cached, int R_alloc, int num_sms, uintptr_t stream,
                                 const NotifyOut* notify = nullptr) const;
  int device_, rank_, world_, max_tokens_, hidden_, num_experts_, local_experts_;
  double timeout_s_;
  size_t bytes_ = 0;
  char* base_ = nullptr;
  void* local_ = nullptr;   // epochs + counters + aborted
  HostInfo* host_ = nullptr;
  HostInfo* host_dev_ = nullptr;
  bool opened_ = false;
  bool tma_ = true;
  bool stage_ce_ = true;
  int combine_rounds_ = 4;
  long long combine_copy_calls_ = 0, combine_expert_staged_calls_ = 0;
  CUstream_st* side_ = nullptr;  // the copy-engine stages' stream (stage_begin, combine_copy_engine), and its events
  CUevent_st *fork_ = nullptr, *notified_ = nullptr, *staged_ = nullptr;
  int begun_T_ = -1;             // the tokens of a stage_begin awaiting its stage_end (-1: none)
  bool forked_ = false;          // stage_fork recorded fork_ for the next stage_begin
  // pull_variant_ 80 = +16 (x read L2 evict_first: 2% faster queued at EP4 24 SMs, session 5) + 64 (every rank's combine
  // starts together: cold -4% at EP4 24 SMs, -6% at 48, -2% at EP2 24, queued level, a late rank costs 1x its delay;
  // 4x H100, session 16)
  int pull_stage_slots_ = 5, pull_diag_ = 0, pull_variant_ = 80;
  Ctx ctx_{};
};

}  // namespace nvl
}  // namespace ep
