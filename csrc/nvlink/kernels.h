// The seam between the nvlink host runtime and its kernels: one launcher per kernel. Launch
// configurations (block size, shared memory, template choice by world size) live with the kernels;
// the runtime validates arguments and picks the grid. Every launcher checks the launch.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "nvlink/nvlink.h"

namespace ep {
namespace nvl {

// notify.cu: one block. topk_idx [T,K] int64 -> send_pos [T,W] int32, is_in [T,W] bool,
// recv_off [W+1] int32, tpe [local_experts] int64; counts into the host-mapped info, and copies of
// tpe and recv_off into host_tpe / host_recv_off (pinned host memory, device view) when not null.
// merge_repeats (an expert-major dispatch): a token's repeated expert counts once in tpe.
void launch_notify(const Ctx& c, const int64_t* topk_idx, int T, int K, int* send_pos, bool* is_in,
                   int* recv_off, int64_t* tpe, int64_t* host_tpe, int* host_recv_off, bool merge_repeats,
                   cudaStream_t stream);

// dispatch.cu: stage this rank's rows into its IPC stage area; pull the rows addressed to it.
// merge_repeats (an expert-major dispatch): ids and weights staged merged (layout/merge_rule.cuh).
void launch_stage(const Ctx& c, int blocks, const int4* x, int T, int row_bytes, const float* scales,
                  int nscales, const int64_t* topk_idx, const float* weights, int K, bool merge_repeats,
                  cudaStream_t stream);
void launch_pull(const Ctx& c, int blocks, int4* out_x, int row_bytes, float* out_scales, int nscales,
                 int64_t* out_idx, float* out_w, int K, const int* recv_off, int* recv_src, int cached,
                 int R_alloc, cudaStream_t stream);
// The same stage (rows, FP8 scales, ids, weights; not merged) by the copy engine, no SM held while the bytes
// move: a one-block wait kernel (PULL_DONE), cudaMemcpyAsync per array, a one-block release kernel.
void launch_stage_copies(const Ctx& c, const int4* x, int T, int row_bytes, const float* scales, int nscales,
                         const int64_t* topk_idx, const float* weights, int K, cudaStream_t stream);
// Its two halves: the wait and the copies; the release (which also tells the peers that this rank's send lists are
// complete, so it goes after notify).
void launch_stage_copies_begin(const Ctx& c, const int4* x, int T, int row_bytes, const float* scales, int nscales,
                               const int64_t* topk_idx, const float* weights, int K, cudaStream_t stream);
void launch_stage_copies_end(const Ctx& c, int T, cudaStream_t stream);

// pull_tma.cu: the same pull with the rows moved by bulk copies (TMA) through a shared-memory ring;
// for rows that leave at least three slots of the ring (pull_tma_fits), on sm_90+ builds and GPUs
// (tma_supported).
bool tma_supported();
bool pull_tma_fits(int row_bytes);
void launch_pull_tma(const Ctx& c, int blocks, int4* out_x, int row_bytes, float* out_scales, int nscales,
                     int64_t* out_idx, float* out_w, int K, const int* recv_off, int* recv_src, int cached,
                     int R_alloc, cudaStream_t stream);

// stage_pull_tma.cu: stage and the bulk-copy pull in one kernel, side by side (sub-chunk flags), for
// rows that fit the bulk-copy ring on sm_90+ (stage_pull_tma_fits); same outputs as stage + pull.
// notify (non-null): notify runs inside, in block 0's stage half (notify.cuh), writing what launch_notify's
// kernel would (a fresh rank-major dispatch without merged repeats, whose per-expert counts fit the ring:
// stage_pull_notify_fits); recv_off is then notify's own.
bool stage_pull_tma_fits(int row_bytes);
bool stage_pull_notify_fits(int row_bytes, int num_experts);
void launch_stage_pull_tma(const Ctx& c, int blocks, const int4* x, int T, int row_bytes, const float* scales,
                           int nscales, const int64_t* topk_idx, const float* weights, int K, int4* out_x,
                           float* out_scales, int64_t* out_idx, float* out_w, const int* recv_off, int* recv_src,
                           int cached, int R_alloc, cudaStream_t stream, const NotifyOut* notify = nullptr);

// expert.cu: the expert-major receive (meta, then rows into their experts' segments).
size_t expert_scratch_ints(int blocks, int local_experts);
void launch_expert_meta(const Ctx& c, int blocks, int64_t* out_idx, const int* recv_off, int* recv_src,
                        int* positions, int K, int R_alloc, int alignment, int* scratch, int64_t* offsets,
                        cudaStream_t stream);
void launch_expert_pull(const Ctx& c, int blocks, int4* out_x, int row_bytes, float* out_scales, int nscales,
                        float* out_w, int K, const int* recv_off, const int* recv_src, int* positions,
                        const int64_t* out_idx, int cached, const int* scratch, const int64_t* offsets,
                        const int64_t* counts, cudaStream_t stream);
// expert_pull_tma.cu: expert_pull with the rows moved by bulk copies (TMA), for BF16 rows that fit its ring.
bool expert_pull_tma_fits(int row_bytes, int K, int nscales);
void launch_expert_pull_tma(const Ctx& c, int blocks, int4* out_x, int row_bytes, float* out_scales, int nscales,
                            float* out_w, int K, const int* recv_off, const int* recv_src, int* positions,
                            const int64_t* out_idx, int cached, const int* scratch, const int64_t* offsets,
                            const int64_t* counts, cudaStream_t stream);

// combine_send.cu + combine_reduce.cu (split combine), combine_fused.cu (one kernel),
// combine_expert.cu (send half for expert-major rows; then the reduce with self_in_area).
void launch_combine_send(const Ctx& c, int blocks, const int4* x, const int* recv_off, cudaStream_t stream);
void launch_combine_reduce(const Ctx& c, int blocks, const int4* x, const int* send_pos, const int* recv_off,
                           int4* y, int T, bool self_in_area, cudaStream_t stream);
void launch_combine_expert_send(const Ctx& c, int blocks, const int4* x, const int* recv_off, const int* positions,
                                int K, cudaStream_t stream);
// combine_expert.cu too: each received row's local experts summed into rows [R, H] (rank-major, local).
void launch_expert_sum(const Ctx& c, int blocks, const int4* x, const int* recv_off, const int* positions, int K,
                       int4* rows, cudaStream_t stream);
void launch_combine_fused(const Ctx& c, int blocks, const int4* x, const int* send_pos, const int* recv_off,
                          const int* recv_src, int4* y, int T, cudaStream_t stream);
// combine_pipe_tma.cu: the fused protocol with bulk-copy sends from one thread per block while the
// other warps reduce; for BF16 rows that fit its ring on sm_90+ (combine_pipe_tma_fits).
bool combine_pipe_tma_fits(int row_bytes);
void launch_combine_pipe_tma(const Ctx& c, int blocks, const int4* x, const int* send_pos, const int* recv_off,
                             const int* recv_src, int4* y, int T, cudaStream_t stream);
// combine_pull_tma.cu: the owners read their rows from the ranks that staged them (remote loads);
// where its two shared-memory rings hold a token's rows, on sm_90+ (combine_pull_tma_fits).
// stage_slots: the stager's shared-memory rows (the loads get the rest); diag: see Runtime::pull_diag.
constexpr int kPullStageMaxSlots = 12;
bool combine_pull_tma_fits(int row_bytes, int world, int stage_slots);
void launch_combine_pull_tma(const Ctx& c, int blocks, const int4* x, const int* send_pos, const int* recv_off,
                             int4* y, int T, int stage_slots, int diag, cudaStream_t stream);
// diag bit: the rows were (are being) staged by combine_stage_copies.cu, not by the kernel's stager (stage_slots 0:
// the whole ring loads)
constexpr int kDiagStagedByCopies = 8;
// diag bit (with kDiagStagedByCopies): this rank's own rows are staged too, in its area's slot [me] (the expert sum,
// launch_expert_stage), and loaded from there behind COMBINE_READY[me] like a peer's -- not from x
constexpr int kDiagOwnStaged = 1 << 24;
bool combine_pull_copies_fits(int row_bytes, int world);
// combine_stage_copies.cu: the pull combine's stage by the copy engines (Runtime::combine_copy_engine). The snap
// kernel (on the call's stream, before the pull kernel) waits, as the stager would, until the peers no longer
// read this rank's combine area and records the epoch its releases carry; the copies then move each owner's rows
// into the area in `rounds` pieces, interleaved over the owners, a one-block release kernel behind each round.
// recv_off_host: the dispatch's receive offsets, W + 1 of them, known on the host.
void launch_combine_snap(const Ctx& c, cudaStream_t stream);
void launch_combine_stage_copies(const Ctx& c, const char* x, const int* recv_off_host, int rounds,
                                 cudaStream_t stream);
// combine_expert.cu: the same stage by the expert sum (Runtime::combine_expert_staged): each received row's local
// experts of x summed into this rank's combine area, slot [owner][position] (its own rows into slot [me]), a release
// behind each sub-chunk; on a side stream after the snap, beside the pull kernel (diag kDiagStagedByCopies |
// kDiagOwnStaged)
void launch_expert_stage(const Ctx& c, int blocks, const int4* x, const int* recv_off, const int* positions, int K,
                         cudaStream_t stream);

}  // namespace nvl
}  // namespace ep
