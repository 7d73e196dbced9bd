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
//   stage_pull (stage_pull_tma.cu): stage and pull in one kernel, side by side: the source flags each
//            staged sub-chunk of kStageSub tokens (STAGE_READY) and the receivers pull it at once.
//   combine: each rank writes the rows it received back into the source's IPC combine area at slot
//            [its rank, position] (remote stores), flags COMBINE; the source sums the slots per
//            token in float (its own rows read in place) and flags REDUCE_DONE. The pull combine
//            (combine_pull_tma.cu) turns it around: each rank stages its received rows into its own
//            area and the owners read them (remote loads), flagging COMBINE_READY per sub-chunk; by
//            default its ranks start together (F_START: none stages or loads before every peer began).
// A timeout marks the missing rank in host-mapped memory, sets an abort word and returns: kernels
// never trap, so the CUDA context stays usable.
//
// Expert-major dispatch replaces pull with expert_meta + expert_pull (expert.cu): rows land in their
// local experts' segments; its combine sums each row's experts (combine_expert.cu): on the way out of the split
// kernels' send, or into rank-major rows that the other combine kernels take.
//
// Files: this header (shared types), kernels.h (one launcher per kernel), device.cuh (what the
// kernels share), notify.cu, dispatch.cu (stage + pull), expert.cu, combine_send.cu,
// combine_expert.cu, combine_reduce.cu, combine_fused.cu, runtime.h/.cpp (the host runtime behind
// ep_plugin._C.NvlinkRuntime).
#pragma once
#include <cstddef>
#include <cstdint>

namespace ep {
namespace nvl {

constexpr int kMaxRanks = 8;
constexpr int kMaxTopk = 32;
// Source ranks (nodes * ranks per node) a contract-order pull places (DispatchRoute): one shift each in shared memory.
constexpr int kMaxContractRanks = 256;
// F_LISTS: the source's send lists (notify) are complete, before any of its sub-chunks is staged.
// F_START: the source's pull combine has started (its combine epoch; the start-together variant's barrier).
enum FlagKind { F_COUNT = 0, F_META_ACK, F_STAGE, F_PULL_DONE, F_COMBINE, F_REDUCE_DONE, F_LISTS, F_START, F_NUM };
enum EpochKind { E_NOTIFY = 0, E_DISPATCH, E_COMBINE, E_NUM };
enum CounterKind { C_STAGE = 0, C_PULL, C_SEND, C_REDUCE, C_FUSED, C_QUEUE, C_META, C_NUM };
// HostInfo::err_kernel: the step whose wait timed out (0: none), and its name in error messages.
enum KernelId { K_NOTIFY = 1, K_STAGE, K_PULL, K_SEND, K_REDUCE, K_NUM };
constexpr const char* kKernelNames[K_NUM] = {"", "notify", "stage", "pull", "combine-send", "combine-reduce"};
enum CombineMode { kCombineSplit = 0, kCombineFused = 1, kCombinePipelined = 2, kCombinePull = 3 };  // Runtime::combine
constexpr int kChunk = 8;  // tokens per arrival counter of the fused combine
constexpr int kStageSub = 16;  // tokens per STAGE_READY flag (a staged sub-chunk)
constexpr int kCombineSub = 16;  // positions per COMBINE_READY flag of the pull combine (a staged sub-chunk)

// Host-mapped (pinned) results and error state, written by the kernels, read by the host.
struct HostInfo {
  int err;                    // 0 ok, 1 timeout
  int err_kernel;             // which kernel timed out: a KernelId
  int bad_expert_ids;         // sticky: notify saw a topk id outside [-1, E) (routed nowhere); the host clears it
  int missing[kMaxRanks];     // 1 where that rank did not arrive
  int num_recv;
  int recv_counts[kMaxRanks];
  int send_counts[kMaxRanks];
  int tokens_per_expert[1];   // [num_local_experts] (allocated larger)
};

// Where one combine reads its rows and writes its sums, when not x[i] and y[t] (Runtime::combine's x_rows,
// y_blocks). Why: the hierarchical backend's combine first gathered its rows back into the inner
// exchange's order (a pass over every row, 173 us of 1154 at 2x2 on 4x H200) and afterwards copied each
// sum to its origin's rail rows (the rail's send, 255 us); the combine kernels read and write those rows
// anyway, so they take the gather and the placement instead (docs/INTERNODE.md, session 8).
//   x_rows: row i of the combine's input is x[x_rows[i]] (null: x[i]);
//   y_blocks: token t's sum goes to row t % block_tokens of the buffer at y_blocks[t / block_tokens] (device
//     memory, any GPU this one can store to; null: y), and a token that no rank holds a row of is not
//     written (no sum to place); a null block drops its tokens. Each thread that stored a sum ends with a
//     system fence, so a signal the caller's next kernel on the stream releases covers the sums.
struct CombineRoute {
  const int64_t* x_rows;
  char* const* y_blocks;
  int block_tokens;
};

// Where a rank-major pull writes its rows, when not row i (Runtime::pull / stage_pull's out_rows). Why: the
// hierarchical backend's cached dispatch copied every row the inner exchange wrote into the contract's order
// afterwards (scatter_rows: ~200 us of a ~930 us cached dispatch at 2x2 on 4x H100); its positions are known
// before the pull runs, so the pull stores each row there instead (docs/INTERNODE.md, session 10).
//   out_rows: received row i (i < R_alloc, padding rows included) and everything the pull writes for it (FP8
//     scales, local topk ids, weights) go to output row out_rows[i] (int64, values in [0, R_alloc): a
//     permutation, as a scatter's; a value outside is clamped, so that an index left by a timed-out exchange
//     cannot write past the outputs); null: row i. recv_src stays in receive order (the handle's).
//   Contract order (the fresh dispatch, stage_pull_tma only; out_rows null): the pull computes each row's output
//   row itself. This rank is local rank `me` of a node, its peers the node's ranks, and source l's tokens are
//   the rail slots s*slot_tokens + t of node s's rows (the hierarchical backend's inner exchange). Received row
//   i from l out of slot s*M + t goes to start[s*P + l] + (i - recv_off[l] - below[l][s]), below[l][s] being
//   l's rows to this rank from slots below s*M (a lower bound in l's ascending send list) and start[g] the
//   prefix over source ranks g = s*P + l of their counts (the contract's order: node, then local index).
//   to_contract: int64 [R_alloc] written, each row's output row (rows past the valid ones: themselves);
//   counts: int64 [nodes * P] written by block 0, rows per source rank. What contract_order computes
//   afterwards (csrc/layout/contract_order.cu), here before the rows move: no index pass, no reorder pass.
struct DispatchRoute {
  const int64_t* out_rows;
  int64_t* to_contract;  // non-null: contract order (above)
  int64_t* counts;
  int nodes, slot_tokens;
};

// What notify writes (notify.cu, or inside stage_pull): send_pos [T,W], is_in [T,W], recv_off [W+1], tpe [E_l];
// host_tpe / host_recv_off: device views of pinned host memory, or null.
struct NotifyOut {
  int* send_pos;
  bool* is_in;
  int* recv_off;
  int64_t* tpe;
  int64_t* host_tpe;
  int* host_recv_off;
};

// Everything a kernel needs, passed by value.
struct Ctx {
  char* peers[kMaxRanks];     // base of every rank's IPC buffer (own included)
  int rank, world;
  int max_tokens, num_experts, local_experts;
  int hidden;
  size_t off_flags, off_meta, off_send_list, off_stage_x, off_stage_scales, off_stage_idx,
      off_stage_w, off_combine, off_arrive;
  size_t off_stage_ready;     // int [kMaxRanks][stage_subs]: STAGE_READY[src][sub], written by src
  size_t off_combine_ready;   // int [kMaxRanks][combine_subs]: COMBINE_READY[holder][sub] (pull combine), written by holder
  int stage_subs;             // sub-chunks of kStageSub tokens in max_tokens
  int combine_subs;           // sub-chunks of kCombineSub positions in max_tokens
  size_t stage_row_cap;       // bytes per staged row available (hidden * 2)
  int* epochs;                // [E_NUM] local device
  unsigned* counters;         // [C_NUM] local device
  int* aborted;               // local device
  int* notified;              // local device: NOTIFIED, the dispatch epoch whose notify (run inside stage_pull) is done
  int* combine_ce;            // local device: the combine epoch the copy-engine stage releases (its snap kernel's)
  HostInfo* host;             // device view of the host-mapped info
  unsigned long long timeout_ns;
  CombineRoute route;         // this combine call's (zero in the runtime's own Ctx: set on a per-call copy)
  DispatchRoute out_route;    // this pull's, likewise
};

}  // namespace nvl
}  // namespace ep
