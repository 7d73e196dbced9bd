// The nvlink host runtime: buffer layout, CUDA IPC, argument checks, launches, readbacks.
#include "nvlink/runtime.h"

#include <cuda_runtime.h>

#include <cstring>
#include <functional>
#include <initializer_list>

#include "common/error.h"
#include "nvlink/kernels.h"

namespace ep {
namespace nvl {
namespace {

size_t align_up(size_t v, size_t a = 256) { return (v + a - 1) / a * a; }

// One block per SM asked for; at least one so that the flags are always released.
int grid_for(int num_sms) { return num_sms < 1 ? 1 : num_sms; }

template <typename T>
T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

cudaStream_t stream_of(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

}  // namespace

Runtime::Runtime(int device, int rank, int world, int max_tokens, int hidden, int num_experts,
                 double timeout_s)
    : device_(device), rank_(rank), world_(world), max_tokens_(max_tokens), hidden_(hidden),
      num_experts_(num_experts), timeout_s_(timeout_s) {
  EP_CHECK_ARG(world >= 1 && world <= kMaxRanks, "nvlink backend supports 1..%d ranks, got world=%d", kMaxRanks,
               world);
  EP_CHECK_ARG(rank >= 0 && rank < world, "rank out of range: rank=%d, world=%d", rank, world);
  EP_CHECK_ARG(num_experts > 0 && num_experts % world == 0,
               "num_experts must be a multiple of world, got num_experts=%d, world=%d", num_experts, world);
  EP_CHECK_ARG(hidden > 0 && hidden % 128 == 0, "hidden must be a positive multiple of 128, got %d", hidden);
  EP_CHECK_ARG(max_tokens > 0, "max_tokens must be positive, got %d", max_tokens);
  local_experts_ = num_experts / world;
  set_device();
  // One buffer, the same layout on every rank, so that a peer's offsets are this rank's offsets.
  size_t off = 0;
  ctx_.off_flags = off;
  off = align_up(off + sizeof(int) * F_NUM * kMaxRanks);
  ctx_.off_meta = off;
  off = align_up(off + sizeof(int) * kMaxRanks * (1 + local_experts_));
  ctx_.off_send_list = off;
  off = align_up(off + sizeof(int) * static_cast<size_t>(world) * max_tokens);
  ctx_.off_arrive = off;
  off = align_up(off + sizeof(int) * kMaxRanks * (static_cast<size_t>(max_tokens) / kChunk + 1));
  ctx_.off_stage_ready = off;
  ctx_.stage_subs = (max_tokens + kStageSub - 1) / kStageSub;
  off = align_up(off + sizeof(int) * kMaxRanks * static_cast<size_t>(ctx_.stage_subs));
  ctx_.off_combine_ready = off;
  ctx_.combine_subs = (max_tokens + kCombineSub - 1) / kCombineSub;
  off = align_up(off + sizeof(int) * kMaxRanks * static_cast<size_t>(ctx_.combine_subs));
  ctx_.off_stage_x = off;
  ctx_.stage_row_cap = static_cast<size_t>(hidden) * 2;
  off = align_up(off + ctx_.stage_row_cap * max_tokens);
  ctx_.off_stage_scales = off;
  off = align_up(off + sizeof(float) * static_cast<size_t>(max_tokens) * (hidden / 128));
  ctx_.off_stage_idx = off;
  off = align_up(off + sizeof(int64_t) * static_cast<size_t>(max_tokens) * kMaxTopk);
  ctx_.off_stage_w = off;
  off = align_up(off + sizeof(float) * static_cast<size_t>(max_tokens) * kMaxTopk);
  ctx_.off_combine = off;
  off = align_up(off + static_cast<size_t>(world) * max_tokens * hidden * 2);
  bytes_ = off;
  EP_CUDA_CHECK(cudaMalloc(&base_, bytes_));
  EP_CUDA_CHECK(cudaMemset(base_, 0, ctx_.off_stage_x));  // flags, meta, send lists
  EP_CUDA_CHECK(cudaMalloc(&local_, 256));
  EP_CUDA_CHECK(cudaMemset(local_, 0, 256));
  const size_t host_bytes = sizeof(HostInfo) + sizeof(int) * local_experts_;
  EP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_), host_bytes, cudaHostAllocMapped));
  std::memset(host_, 0, host_bytes);
  EP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev_), host_, 0));
  EP_CUDA_CHECK(cudaDeviceSynchronize());
  for (int r = 0; r < kMaxRanks; ++r) ctx_.peers[r] = nullptr;
  ctx_.peers[rank] = base_;
  ctx_.rank = rank;
  ctx_.world = world;
  ctx_.max_tokens = max_tokens;
  ctx_.num_experts = num_experts;
  ctx_.local_experts = local_experts_;
  ctx_.hidden = hidden;
  ctx_.epochs = reinterpret_cast<int*>(local_);
  ctx_.counters = reinterpret_cast<unsigned*>(static_cast<char*>(local_) + 64);
  ctx_.aborted = reinterpret_cast<int*>(static_cast<char*>(local_) + 128);
  ctx_.notified = reinterpret_cast<int*>(static_cast<char*>(local_) + 192);
  ctx_.combine_ce = reinterpret_cast<int*>(static_cast<char*>(local_) + 224);
  ctx_.host = host_dev_;
  ctx_.timeout_ns = static_cast<unsigned long long>(timeout_s * 1e9);
}

Runtime::~Runtime() {
  try {
    close();
  } catch (...) {
  }
}

void Runtime::set_device() const { EP_CUDA_CHECK(cudaSetDevice(device_)); }

std::string Runtime::ipc_handle() const {
  EP_CHECK(base_ != nullptr, "nvlink runtime is closed");
  set_device();
  cudaIpcMemHandle_t h;
  EP_CUDA_CHECK(cudaIpcGetMemHandle(&h, base_));
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

void Runtime::open_peers(const std::vector<std::string>& handles) {
  EP_CHECK_ARG(static_cast<int>(handles.size()) == world_, "need one IPC handle per rank: got %zu, world=%d",
               handles.size(), world_);
  set_device();
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    EP_CHECK_ARG(handles[p].size() == sizeof(cudaIpcMemHandle_t), "bad IPC handle size: rank %d sent %zu bytes, expected %zu",
                 p, handles[p].size(), sizeof(cudaIpcMemHandle_t));
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handles[p].data(), sizeof(h));
    void* ptr = nullptr;
    EP_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess));
    ctx_.peers[p] = static_cast<char*>(ptr);
  }
  opened_ = true;
}

// Best effort, errors ignored: close() also runs from the destructor and after a failed call.
void Runtime::close() {
  if (!base_) return;
  set_device();
  cudaDeviceSynchronize();
  for (int p = 0; p < world_; ++p) {
    if (p != rank_ && ctx_.peers[p]) cudaIpcCloseMemHandle(ctx_.peers[p]);
    ctx_.peers[p] = nullptr;
  }
  cudaFree(base_);
  base_ = nullptr;
  if (local_) cudaFree(local_);
  local_ = nullptr;
  if (host_) cudaFreeHost(host_);
  host_ = nullptr;
  for (cudaEvent_t* ev : {&fork_, &notified_, &staged_}) {
    if (*ev) cudaEventDestroy(*ev);
    *ev = nullptr;
  }
  if (side_) cudaStreamDestroy(side_);
  side_ = nullptr;
  begun_T_ = -1;
  opened_ = false;
  cudaGetLastError();
}

void Runtime::check_open() const {
  EP_CHECK(base_ && opened_, "nvlink runtime is closed or its peers are not opened (closed=%d, peers opened=%d)",
           base_ == nullptr, static_cast<int>(opened_));
}

void Runtime::check_tokens(int T) const {
  EP_CHECK_ARG(T >= 0 && T <= max_tokens_, "num_tokens exceeds max_tokens_per_rank: num_tokens=%d, max_tokens=%d",
               T, max_tokens_);
}

void Runtime::check_row_bytes(int row_bytes) const {
  EP_CHECK_ARG(row_bytes > 0 && row_bytes % 16 == 0 && static_cast<size_t>(row_bytes) <= ctx_.stage_row_cap,
               "row bytes must be a multiple of 16 and at most hidden*2 = %zu, got %d", ctx_.stage_row_cap, row_bytes);
}

namespace {
// The device view of pinned host memory (the same address under unified addressing); an error for
// memory that is not pinned, before a kernel could fault on it.
template <typename T>
T* mapped(uintptr_t host) {
  if (!host) return nullptr;
  void* dev = nullptr;
  EP_CUDA_CHECK(cudaHostGetDevicePointer(&dev, reinterpret_cast<void*>(host), 0));
  return static_cast<T*>(dev);
}

// notify's outputs for a stage_pull that runs it inside (notify_stage_pull, stage_pull_contract)
NotifyOut notify_out(uintptr_t send_pos, uintptr_t is_in, uintptr_t recv_off, uintptr_t tpe, uintptr_t host_tpe,
                     uintptr_t host_recv_off) {
  return NotifyOut{ptr<int>(send_pos), ptr<bool>(is_in), ptr<int>(recv_off), ptr<int64_t>(tpe),
                   mapped<int64_t>(host_tpe), mapped<int>(host_recv_off)};
}
}  // namespace

void Runtime::notify(uintptr_t topk_idx, int T, int K, uintptr_t send_pos, uintptr_t is_in,
                     uintptr_t recv_off, uintptr_t tpe, uintptr_t stream, uintptr_t host_tpe,
                     uintptr_t host_recv_off, int merge_repeats) {
  check_open();
  check_tokens(T);
  EP_CHECK_ARG(K >= 1 && K <= kMaxTopk, "topk must be in [1, %d], got %d", kMaxTopk, K);
  set_device();
  launch_notify(ctx_, ptr<const int64_t>(topk_idx), T, K, ptr<int>(send_pos), ptr<bool>(is_in), ptr<int>(recv_off),
                ptr<int64_t>(tpe), mapped<int64_t>(host_tpe), mapped<int>(host_recv_off), merge_repeats != 0,
                stream_of(stream));
}

void Runtime::check_stage(int T, int row_bytes, int nscales, int K) const {
  check_open();
  check_tokens(T);
  check_row_bytes(row_bytes);
  EP_CHECK_ARG(nscales <= hidden_ / 128, "too many scales per row: nscales=%d, at most hidden/128 = %d", nscales,
               hidden_ / 128);
  EP_CHECK_ARG(K <= kMaxTopk, "topk must be at most %d, got %d", kMaxTopk, K);
}

void Runtime::stage(uintptr_t x, int T, int row_bytes, uintptr_t scales, int nscales, uintptr_t topk_idx,
                    uintptr_t weights, int K, int num_sms, uintptr_t stream, int merge_repeats) {
  check_stage(T, row_bytes, nscales, K);
  set_device();
  if (stage_ce_ && merge_repeats == 0) {  // merged ids are computed by the stage kernel
    launch_stage_copies(ctx_, ptr<const int4>(x), T, row_bytes, ptr<const float>(scales), nscales,
                        ptr<const int64_t>(topk_idx), ptr<const float>(weights), K, stream_of(stream));
    return;
  }
  launch_stage(ctx_, grid_for(num_sms), ptr<const int4>(x), T, row_bytes, ptr<const float>(scales), nscales,
               ptr<const int64_t>(topk_idx), ptr<const float>(weights), K, merge_repeats != 0, stream_of(stream));
}

void Runtime::stage_begin(uintptr_t x, int T, int row_bytes, uintptr_t scales, int nscales, uintptr_t topk_idx,
                          uintptr_t weights, int K, uintptr_t stream) {
  check_stage(T, row_bytes, nscales, K);
  EP_CHECK(begun_T_ < 0, "stage_begin called twice without stage_end");
  set_device();
  ensure_side();
  if (!forked_) EP_CUDA_CHECK(cudaEventRecord(fork_, stream_of(stream)));
  forked_ = false;
  EP_CUDA_CHECK(cudaStreamWaitEvent(side_, fork_, 0));
  launch_stage_copies_begin(ctx_, ptr<const int4>(x), T, row_bytes, ptr<const float>(scales), nscales,
                            ptr<const int64_t>(topk_idx), ptr<const float>(weights), K, side_);
  begun_T_ = T;
}

void Runtime::stage_fork(uintptr_t stream) {
  EP_CHECK(begun_T_ < 0, "stage_fork called while a stage_begin awaits its stage_end");
  set_device();
  ensure_side();
  EP_CUDA_CHECK(cudaEventRecord(fork_, stream_of(stream)));
  forked_ = true;
}

void Runtime::ensure_side() {
  if (side_ != nullptr) return;
  // the highest priority: the combine's releases (one block each) are waited on by the peers while their pull
  // kernels hold SMs, and should not queue behind other work of lower priority
  int least = 0, greatest = 0;
  EP_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  EP_CUDA_CHECK(cudaStreamCreateWithPriority(&side_, cudaStreamNonBlocking, greatest));
  for (cudaEvent_t* ev : {&fork_, &notified_, &staged_}) EP_CUDA_CHECK(cudaEventCreateWithFlags(ev, cudaEventDisableTiming));
}

void Runtime::stage_end(uintptr_t stream) {
  EP_CHECK(begun_T_ >= 0, "stage_end without stage_begin");
  set_device();
  const int T = begun_T_;
  begun_T_ = -1;
  EP_CUDA_CHECK(cudaEventRecord(notified_, stream_of(stream)));
  EP_CUDA_CHECK(cudaStreamWaitEvent(side_, notified_, 0));
  launch_stage_copies_end(ctx_, T, side_);
  EP_CUDA_CHECK(cudaEventRecord(staged_, side_));
  EP_CUDA_CHECK(cudaStreamWaitEvent(stream_of(stream), staged_, 0));
}

bool Runtime::tma_supported() const {
  set_device();
  return nvl::tma_supported();
}

// The route travels in a copy of the context, as combine's does: ctx_'s stays zero for every other call.
Ctx Runtime::routed(uintptr_t out_rows) const {
  Ctx c = ctx_;
  c.out_route = DispatchRoute{ptr<const int64_t>(out_rows)};
  return c;
}

void Runtime::pull(uintptr_t out_x, int row_bytes, uintptr_t out_scales, int nscales, uintptr_t out_idx,
                   uintptr_t out_w, int K, uintptr_t recv_off, uintptr_t recv_src, int cached, int R_alloc,
                   int num_sms, uintptr_t stream, uintptr_t out_rows) {
  check_open();
  check_row_bytes(row_bytes);
  EP_CHECK_ARG(K <= kMaxTopk, "topk must be at most %d, got %d", kMaxTopk, K);
  set_device();
  const auto launch = tma_ && pull_tma_fits(row_bytes) ? launch_pull_tma : launch_pull;
  launch(out_rows ? routed(out_rows) : ctx_, grid_for(num_sms), ptr<int4>(out_x), row_bytes, ptr<float>(out_scales),
         nscales, ptr<int64_t>(out_idx), ptr<float>(out_w), K, ptr<const int>(recv_off), ptr<int>(recv_src), cached,
         R_alloc, stream_of(stream));
}

void Runtime::stage_pull(uintptr_t x, int T, int row_bytes, uintptr_t scales, int nscales, uintptr_t topk_idx,
                         uintptr_t weights, int K, uintptr_t out_x, uintptr_t out_scales, uintptr_t out_idx,
                         uintptr_t out_w, uintptr_t recv_off, uintptr_t recv_src, int cached, int R_alloc,
                         int num_sms, uintptr_t stream, uintptr_t out_rows) {
  set_device();
  if (!(tma_ && stage_pull_tma_fits(row_bytes))) {
    stage(x, T, row_bytes, scales, nscales, topk_idx, weights, K, num_sms, stream);
    pull(out_x, row_bytes, out_scales, nscales, out_idx, out_w, K, recv_off, recv_src, cached, R_alloc, num_sms,
         stream, out_rows);
    return;
  }
  launch_stage_pull_checked(out_rows ? routed(out_rows) : ctx_, x, T, row_bytes, scales, nscales, topk_idx, weights,
                            K, out_x, out_scales, out_idx, out_w, recv_off, recv_src, cached, R_alloc, num_sms, stream);
}

void Runtime::notify_stage_pull(uintptr_t topk_idx, int T, int K, uintptr_t send_pos, uintptr_t is_in,
                                uintptr_t recv_off, uintptr_t tpe, uintptr_t host_tpe, uintptr_t host_recv_off,
                                uintptr_t x, int row_bytes, uintptr_t scales, int nscales, uintptr_t weights,
                                uintptr_t out_x, uintptr_t out_scales, uintptr_t out_idx, uintptr_t out_w,
                                uintptr_t recv_src, int R_alloc, int num_sms, uintptr_t stream) {
  set_device();
  if (!(tma_ && stage_pull_notify_fits(row_bytes, num_experts_))) {
    notify(topk_idx, T, K, send_pos, is_in, recv_off, tpe, stream, host_tpe, host_recv_off, 0);
    stage_pull(x, T, row_bytes, scales, nscales, topk_idx, weights, K, out_x, out_scales, out_idx, out_w, recv_off,
               recv_src, 0, R_alloc, num_sms, stream);
    return;
  }
  // (send_pos, is_in and topk_idx of a rank with no tokens are empty tensors: null pointers, never read)
  EP_CHECK_ARG(recv_off != 0 && tpe != 0, "notify_stage_pull writes notify's recv_off and tpe: both are needed");
  const NotifyOut nout = notify_out(send_pos, is_in, recv_off, tpe, host_tpe, host_recv_off);
  launch_stage_pull_checked(ctx_, x, T, row_bytes, scales, nscales, topk_idx, weights, K, out_x, out_scales, out_idx,
                            out_w, recv_off, recv_src, 0, R_alloc, num_sms, stream, &nout);
}

// stage_pull_tma with the call's route in c: the checks of its arguments, then the launch (stage_pull and
// stage_pull_contract, which checked that the bulk-copy kernel applies; notify_stage_pull, notify inside).
void Runtime::launch_stage_pull_checked(const Ctx& c, uintptr_t x, int T, int row_bytes, uintptr_t scales,
                                        int nscales, uintptr_t topk_idx, uintptr_t weights, int K, uintptr_t out_x,
                                        uintptr_t out_scales, uintptr_t out_idx, uintptr_t out_w, uintptr_t recv_off,
                                        uintptr_t recv_src, int cached, int R_alloc, int num_sms,
                                        uintptr_t stream, const NotifyOut* notify) const {
  check_open();
  check_tokens(T);
  check_row_bytes(row_bytes);
  EP_CHECK_ARG(nscales <= hidden_ / 128, "too many scales per row: nscales=%d, at most hidden/128 = %d", nscales,
               hidden_ / 128);
  EP_CHECK_ARG(K >= 1 && K <= kMaxTopk, "topk must be in [1, %d], got %d", kMaxTopk, K);
  launch_stage_pull_tma(c, grid_for(num_sms), ptr<const int4>(x), T, row_bytes, ptr<const float>(scales), nscales,
                        ptr<const int64_t>(topk_idx), ptr<const float>(weights), K, ptr<int4>(out_x),
                        ptr<float>(out_scales), ptr<int64_t>(out_idx), ptr<float>(out_w), ptr<const int>(recv_off),
                        ptr<int>(recv_src), cached, R_alloc, stream_of(stream), notify);
}

bool Runtime::stage_pull_contract_fits(int row_bytes, int nodes) const {
  set_device();
  return tma_ && stage_pull_tma_fits(row_bytes) && nodes >= 1 && nodes * world_ <= kMaxContractRanks &&
         max_tokens_ % nodes == 0;
}

void Runtime::stage_pull_contract(uintptr_t x, int T, int row_bytes, uintptr_t scales, int nscales,
                                  uintptr_t topk_idx, uintptr_t weights, int K, uintptr_t out_x, uintptr_t out_scales,
                                  uintptr_t out_idx, uintptr_t out_w, uintptr_t recv_off, uintptr_t recv_src,
                                  int R_alloc, int nodes, uintptr_t to_contract, uintptr_t counts, int num_sms,
                                  uintptr_t stream, uintptr_t send_pos, uintptr_t is_in, uintptr_t tpe,
                                  uintptr_t host_tpe, uintptr_t host_recv_off) {
  check_open();
  EP_CHECK_ARG(stage_pull_contract_fits(row_bytes, nodes),
               "stage_pull_contract runs the bulk-copy stage_pull only (tma on: %d, rows of %d bytes fit its ring: "
               "%d), over nodes x ranks <= %d source ranks with max_tokens %d a multiple of nodes (nodes=%d, "
               "ranks=%d); ask stage_pull_contract_fits first", static_cast<int>(tma_), row_bytes,
               static_cast<int>(stage_pull_tma_fits(row_bytes)), kMaxContractRanks, max_tokens_, nodes, world_);
  EP_CHECK_ARG(to_contract != 0 && counts != 0, "stage_pull_contract writes to_contract and counts: both are needed");
  Ctx c = ctx_;  // the route in a per-call copy, as routed()'s
  c.out_route = DispatchRoute{nullptr, ptr<int64_t>(to_contract), ptr<int64_t>(counts), nodes, max_tokens_ / nodes};
  // tpe given: notify inside, as notify_stage_pull (the contract's shifts read the send lists once LISTS, and
  // recv_off once NOTIFIED, both released by block 0's notify); where the ring cannot hold the per-expert
  // counts, notify first
  const bool inside = tpe != 0 && stage_pull_notify_fits(row_bytes, num_experts_);
  if (tpe != 0 && !inside) notify(topk_idx, T, K, send_pos, is_in, recv_off, tpe, stream, host_tpe, host_recv_off, 0);
  const NotifyOut nout = inside ? notify_out(send_pos, is_in, recv_off, tpe, host_tpe, host_recv_off) : NotifyOut{};
  launch_stage_pull_checked(c, x, T, row_bytes, scales, nscales, topk_idx, weights, K, out_x, out_scales, out_idx,
                            out_w, recv_off, recv_src, 0, R_alloc, num_sms, stream, inside ? &nout : nullptr);
}

void Runtime::combine(uintptr_t x, uintptr_t send_pos, uintptr_t recv_off, uintptr_t recv_src, uintptr_t y, int T,
                      int num_sms, int mode, uintptr_t stream, uintptr_t x_rows, uintptr_t y_blocks,
                      int block_tokens) {
  check_open();
  check_tokens(T);
  set_device();
  EP_CHECK_ARG(mode >= kCombineSplit && mode <= kCombinePull, "combine mode must be 0 (split), 1 (fused), "
               "2 (pipelined) or 3 (pull), got %d", mode);
  EP_CHECK_ARG(y_blocks == 0 || block_tokens > 0, "combine: y_blocks needs block_tokens > 0, got %d", block_tokens);
  EP_CHECK_ARG(T == 0 || y != 0 || y_blocks != 0, "combine: y or y_blocks is required for %d tokens", T);
  const int blocks = grid_for(num_sms);
  // the call's route travels in a copy of the context (ctx_'s stays zero: dispatches and combine_expert)
  Ctx c = ctx_;
  c.route = CombineRoute{ptr<const int64_t>(x_rows), ptr<char* const>(y_blocks), y_blocks != 0 ? block_tokens : 0};
  if (mode == kCombinePull && tma_ && combine_pull_tma_fits(hidden_ * 2, world_, pull_stage_slots_)) {
    launch_combine_pull_tma(c, blocks, ptr<const int4>(x), ptr<const int>(send_pos), ptr<const int>(recv_off),
                            ptr<int4>(y), T, pull_stage_slots_, pull_diag_ | (pull_variant_ << 4), stream_of(stream));
    return;
  }
  if (mode == kCombinePipelined && tma_ && combine_pipe_tma_fits(hidden_ * 2)) {
    launch_combine_pipe_tma(c, blocks, ptr<const int4>(x), ptr<const int>(send_pos), ptr<const int>(recv_off),
                            ptr<const int>(recv_src), ptr<int4>(y), T, stream_of(stream));
    return;
  }
  if (mode != kCombineSplit) {  // fused, or pipelined / pull where their bulk copies do not apply
    launch_combine_fused(c, blocks, ptr<const int4>(x), ptr<const int>(send_pos), ptr<const int>(recv_off),
                         ptr<const int>(recv_src), ptr<int4>(y), T, stream_of(stream));
    return;
  }
  launch_combine_send(c, blocks, ptr<const int4>(x), ptr<const int>(recv_off), stream_of(stream));
  launch_combine_reduce(c, blocks, ptr<const int4>(x), ptr<const int>(send_pos), ptr<const int>(recv_off),
                        ptr<int4>(y), T, false, stream_of(stream));
}

void Runtime::set_pull_diag(int d) {
  // (bit 8 is kDiagStagedByCopies, combine_copy_engine's own: set on the plain path it would leave every peer waiting)
  EP_CHECK_ARG(d >= 0 && d <= 7, "pull_diag must be in [0, 7] (1 stage only, 2 loads only, +4 profile), got %d", d);
  pull_diag_ = d;
}

void Runtime::set_combine_copy_rounds(int n) {
  EP_CHECK_ARG(n >= 1 && n <= 64, "combine_copy_rounds must be in [1, 64], got %d", n);
  combine_rounds_ = n;
}

bool Runtime::combine_copy_engine_fits() const {
  set_device();
  return tma_ && combine_pull_copies_fits(hidden_ * 2, world_);
}

void Runtime::combine_copy_engine(uintptr_t x, uintptr_t send_pos, uintptr_t recv_off, uintptr_t y, int T,
                                  int num_sms, uintptr_t stream, const std::vector<int>& recv_off_host) {
  check_open();
  EP_CHECK_ARG(static_cast<int>(recv_off_host.size()) == world_ + 1 && recv_off_host[0] == 0,
               "recv_off_host must hold the W + 1 = %d receive offsets from 0, got %zu", world_ + 1,
               recv_off_host.size());
  for (int o = 0; o < world_; ++o)
    EP_CHECK_ARG(recv_off_host[o + 1] >= recv_off_host[o] && recv_off_host[o + 1] - recv_off_host[o] <= max_tokens_,
                 "recv_off_host[%d..%d] = %d..%d: a source's rows must be between 0 and max_tokens = %d", o, o + 1,
                 recv_off_host[o], recv_off_host[o + 1], max_tokens_);
  pull_beside_stage("combine_copy_engine", x, send_pos, recv_off, y, T, num_sms, stream, 0, [&](int) {
    launch_combine_stage_copies(ctx_, ptr<const char>(x), recv_off_host.data(), combine_rounds_, side_);
  });
  ++combine_copy_calls_;
}

void Runtime::pull_beside_stage(const char* who, uintptr_t x, uintptr_t send_pos, uintptr_t recv_off, uintptr_t y,
                                int T, int num_sms, uintptr_t stream, int diag,
                                const std::function<void(int free_sms)>& stage) {
  check_tokens(T);
  EP_CHECK_ARG(T == 0 || y != 0, "%s: y is required for %d tokens", who, T);
  EP_CHECK_ARG(combine_copy_engine_fits(), "%s runs the bulk-copy pull kernel (sm_90+, tma on, a token's %d rows of %d "
               "bytes in its ring); ask combine_copy_engine_fits first", who, world_, hidden_ * 2);
  set_device();
  int sms = 0;
  EP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
  const int blocks = grid_for(num_sms);
  EP_CHECK_ARG(blocks < sms, "%s needs SMs beside the pull kernel's %d blocks for its stage (the GPU has %d)", who,
               blocks, sms);
  EP_CHECK(begun_T_ < 0, "%s called between a dispatch's stage_begin and its stage_end (they share the side stream's "
           "events)", who);
  forked_ = false;  // (a stage_fork whose dispatch raised before its stage_begin: fork_ is recorded anew below)
  ensure_side();
  cudaStream_t s = stream_of(stream);
  launch_combine_snap(ctx_, s);
  EP_CUDA_CHECK(cudaEventRecord(fork_, s));
  EP_CUDA_CHECK(cudaStreamWaitEvent(side_, fork_, 0));
  // The stage before the pull kernel: where the side stream shares a hardware queue with the call's stream, a release
  // queued behind the spinning pull kernel does not start before that kernel ends, which waits on the peers' releases
  // (4x H200, session 15: the pull-first order timed out).
  stage(sms - blocks);
  launch_combine_pull_tma(ctx_, blocks, ptr<const int4>(x), ptr<const int>(send_pos), ptr<const int>(recv_off),
                          ptr<int4>(y), T, 0, pull_diag_ | kDiagStagedByCopies | diag | (pull_variant_ << 4), s);
  EP_CUDA_CHECK(cudaEventRecord(staged_, side_));
  EP_CUDA_CHECK(cudaStreamWaitEvent(s, staged_, 0));
}

void Runtime::set_pull_stage_slots(int n) {
  EP_CHECK_ARG(n >= 3 && n <= kPullStageMaxSlots, "pull_stage_slots must be in [3, %d], got %d", kPullStageMaxSlots, n);
  pull_stage_slots_ = n;
}

void Runtime::set_pull_variant(int v) {
  EP_CHECK_ARG(v >= 0 && v < 128 && (v & 3) != 3,
               "pull_variant must be in [0, 127] with bits 0-1 not both set (3, 7, ... are not variants), got %d", v);
  pull_variant_ = v;
}

size_t Runtime::expert_scratch_ints(int num_sms) const {
  return nvl::expert_scratch_ints(grid_for(num_sms), local_experts_);
}

void Runtime::expert_pull(uintptr_t out_x, int row_bytes, uintptr_t out_scales, int nscales, uintptr_t out_idx,
                          uintptr_t out_w, int K, uintptr_t recv_off, uintptr_t recv_src, uintptr_t positions,
                          int cached, int R_alloc, int alignment, uintptr_t scratch, uintptr_t offsets,
                          uintptr_t counts, int num_sms, uintptr_t stream) {
  check_open();
  check_row_bytes(row_bytes);
  EP_CHECK_ARG(K >= 1 && K <= kMaxTopk, "topk must be in [1, %d], got %d", kMaxTopk, K);
  EP_CHECK_ARG(alignment >= 1, "expert alignment must be positive, got %d", alignment);
  set_device();
  const int blocks = grid_for(num_sms);
  if (!cached)
    launch_expert_meta(ctx_, blocks, ptr<int64_t>(out_idx), ptr<const int>(recv_off), ptr<int>(recv_src),
                       ptr<int>(positions), K, R_alloc, alignment, ptr<int>(scratch), ptr<int64_t>(offsets),
                       stream_of(stream));
  const auto launch = tma_ && expert_pull_tma_fits(row_bytes, K, nscales) ? launch_expert_pull_tma : launch_expert_pull;
  launch(ctx_, blocks, ptr<int4>(out_x), row_bytes, ptr<float>(out_scales), nscales, ptr<float>(out_w), K,
         ptr<const int>(recv_off), ptr<const int>(recv_src), ptr<int>(positions), ptr<const int64_t>(out_idx), cached,
         ptr<const int>(scratch), ptr<const int64_t>(offsets), ptr<const int64_t>(counts), stream_of(stream));
}

void Runtime::combine_expert(uintptr_t x, uintptr_t positions, int K, uintptr_t send_pos, uintptr_t recv_off,
                             uintptr_t y, int T, int num_sms, uintptr_t stream) {
  check_open();
  check_tokens(T);
  EP_CHECK_ARG(K >= 1 && K <= kMaxTopk, "topk must be in [1, %d], got %d", kMaxTopk, K);
  set_device();
  const int blocks = grid_for(num_sms);
  launch_combine_expert_send(ctx_, blocks, ptr<const int4>(x), ptr<const int>(recv_off), ptr<const int>(positions), K,
                             stream_of(stream));
  launch_combine_reduce(ctx_, blocks, ptr<const int4>(x), ptr<const int>(send_pos), ptr<const int>(recv_off),
                        ptr<int4>(y), T, true, stream_of(stream));
}

void Runtime::combine_expert_staged(uintptr_t x, uintptr_t positions, int K, uintptr_t send_pos, uintptr_t recv_off,
                                    uintptr_t y, int T, int num_sms, uintptr_t stream) {
  check_open();
  EP_CHECK_ARG(K >= 1 && K <= kMaxTopk, "topk must be in [1, %d], got %d", kMaxTopk, K);
  pull_beside_stage("combine_expert_staged", x, send_pos, recv_off, y, T, num_sms, stream, kDiagOwnStaged,
                    [&](int free_sms) {
                      launch_expert_stage(ctx_, free_sms, ptr<const int4>(x), ptr<const int>(recv_off),
                                          ptr<const int>(positions), K, side_);
                    });
  ++combine_expert_staged_calls_;
}

void Runtime::expert_sum(uintptr_t x, uintptr_t positions, int K, uintptr_t recv_off, uintptr_t rows, int blocks,
                         uintptr_t stream) {
  check_open();
  EP_CHECK_ARG(K >= 1 && K <= kMaxTopk, "topk must be in [1, %d], got %d", kMaxTopk, K);
  set_device();
  launch_expert_sum(ctx_, grid_for(blocks), ptr<const int4>(x), ptr<const int>(recv_off), ptr<const int>(positions),
                    K, ptr<int4>(rows), stream_of(stream));
}

// The readbacks go through volatile: the kernels write this memory behind the compiler's back.
int Runtime::num_recv() const { return static_cast<volatile HostInfo*>(host_)->num_recv; }
std::vector<int> Runtime::recv_counts() const {
  volatile HostInfo* h = host_;
  std::vector<int> v(world_);
  for (int i = 0; i < world_; ++i) v[i] = h->recv_counts[i];
  return v;
}
std::vector<int> Runtime::send_counts() const {
  volatile HostInfo* h = host_;
  std::vector<int> v(world_);
  for (int i = 0; i < world_; ++i) v[i] = h->send_counts[i];
  return v;
}
std::vector<int> Runtime::tokens_per_expert() const {
  volatile int* t = host_->tokens_per_expert;
  std::vector<int> v(local_experts_);
  for (int i = 0; i < local_experts_; ++i) v[i] = t[i];
  return v;
}
int Runtime::take_bad_expert_ids() {
  if (!host_) return 0;
  volatile HostInfo* h = host_;
  const int v = h->bad_expert_ids;
  if (v) h->bad_expert_ids = 0;
  return v;
}
int Runtime::error() const { return host_ ? static_cast<volatile HostInfo*>(host_)->err : 0; }
int Runtime::error_kernel() const { return host_ ? static_cast<volatile HostInfo*>(host_)->err_kernel : 0; }
std::vector<int> Runtime::missing_ranks() const {
  std::vector<int> v;
  if (!host_) return v;
  volatile HostInfo* h = host_;
  for (int i = 0; i < world_; ++i)
    if (h->missing[i]) v.push_back(i);
  return v;
}
std::vector<int> Runtime::epochs() const {
  std::vector<int> v(E_NUM);
  set_device();
  EP_CUDA_CHECK(cudaMemcpy(v.data(), local_, sizeof(int) * E_NUM, cudaMemcpyDeviceToHost));
  return v;
}

}  // namespace nvl
}  // namespace ep
