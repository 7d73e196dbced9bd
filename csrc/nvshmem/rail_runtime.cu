// Host side of the rail kernels (rail.h): the symmetric layout, checks, launches, the host's call
// counts that pick each call's parity.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstring>

#include "common/error.h"
#include "nvshmem/rail.h"
#include "nvshmem/rail_device.cuh"

namespace ep {
namespace rail {
namespace {

size_t align16(size_t n) { return (n + 15) / 16 * 16; }

struct Shape {
  int nodes, max_tokens, max_topk, hidden, fp8;
  size_t row_bytes() const { return fp8 ? static_cast<size_t>(hidden) : 2ull * hidden; }
  size_t scale_bytes() const { return fp8 ? 4ull * (hidden / 128) : 0; }
};

// Offsets of rail_device.cuh's layout; returns the total. stage: the RDMA staging areas.
size_t layout(Ctx* c, const Shape& s, bool stage) {
  const size_t NM = static_cast<size_t>(s.nodes) * s.max_tokens, N = s.nodes, M = s.max_tokens;
  size_t at = 0;
  auto take = [&at](size_t n) { const size_t o = at; at = align16(at + n); return static_cast<long long>(o); };
  long long flag[2], count[2], x[2], sf[2], topk[2], w[2], cflag[2], rows[2];
  for (int p = 0; p < 2; ++p) {
    flag[p] = take(8 * N);
    count[p] = take(4 * N);
    cflag[p] = take(8 * N);
    x[p] = take(NM * s.row_bytes());
    sf[p] = take(NM * s.scale_bytes());
    topk[p] = take(8 * NM * s.max_topk);
    w[p] = take(4 * NM * s.max_topk);
    rows[p] = take(NM * 2 * s.hidden);
  }
  long long stage_x = -1, stage_sf = -1, stage_topk = -1, stage_w = -1, comb_stage = -1;
  if (stage) {
    stage_x = take(M * s.row_bytes());
    stage_sf = take(M * s.scale_bytes());
    stage_topk = take(8 * NM * s.max_topk);
    stage_w = take(4 * NM * s.max_topk);
    comb_stage = take(NM * 2 * s.hidden);
  }
  if (c != nullptr) {
    for (int p = 0; p < 2; ++p) {
      c->disp_flag[p] = flag[p];
      c->disp_count[p] = count[p];
      c->disp_x[p] = x[p];
      c->disp_sf[p] = sf[p];
      c->disp_topk[p] = topk[p];
      c->disp_w[p] = w[p];
      c->comb_flag[p] = cflag[p];
      c->comb_rows[p] = rows[p];
    }
    c->stage_x = stage_x;
    c->stage_sf = stage_sf;
    c->stage_topk = stage_topk;
    c->stage_w = stage_w;
    c->comb_stage = comb_stage;
  }
  return at;
}

void check_shape(int world, int ranks_per_node, int num_experts, int max_tokens, int max_topk, int hidden, int fp8) {
  EP_CHECK_ARG(world >= 1, "RailRuntime: world must be positive, got %d", world);
  EP_CHECK_ARG(ranks_per_node >= 1 && world % ranks_per_node == 0,
               "RailRuntime: world %d is not a multiple of ranks_per_node %d", world, ranks_per_node);
  EP_CHECK_ARG(world / ranks_per_node <= kMaxNodes, "RailRuntime: %d nodes, at most %d supported",
               world / ranks_per_node, kMaxNodes);
  EP_CHECK_ARG(num_experts > 0 && num_experts % (world / ranks_per_node) == 0,
               "RailRuntime: %d experts do not split over %d nodes", num_experts, world / ranks_per_node);
  EP_CHECK_ARG(max_tokens > 0, "RailRuntime: max_tokens must be positive, got %d", max_tokens);
  EP_CHECK_ARG(max_topk > 0 && max_topk <= kMaxTopk, "RailRuntime: max_topk must be in [1, %d], got %d", kMaxTopk,
               max_topk);
  if (fp8)
    EP_CHECK_ARG(hidden > 0 && hidden % 128 == 0, "RailRuntime: FP8 rows need hidden %% 128 == 0, got %d", hidden);
  else
    EP_CHECK_ARG(hidden > 0 && hidden % 8 == 0, "RailRuntime: BF16 rows need hidden %% 8 == 0 (16-byte rows), got %d",
                 hidden);
  EP_CHECK_ARG(static_cast<long long>(world / ranks_per_node) * max_tokens * max_topk < (1ll << 31),
               "RailRuntime: nodes * max_tokens * max_topk must stay below 2^31");
}

}  // namespace

size_t Runtime::heap_bytes(int world, int ranks_per_node, int num_experts, int max_tokens, int max_topk, int hidden,
                           int fp8, int stage) {
  check_shape(world, ranks_per_node, num_experts, max_tokens, max_topk, hidden, fp8);
  return layout(nullptr, Shape{world / ranks_per_node, max_tokens, max_topk, hidden, fp8 != 0}, stage != 0);
}

Runtime::Runtime(int rank, int world, int ranks_per_node, int num_experts, int max_tokens, int max_topk, int hidden,
                 int fp8, double timeout_s, int num_blocks, int force_puts)
    : world_(world),
      ranks_per_node_(ranks_per_node),
      max_tokens_(max_tokens),
      max_topk_(max_topk),
      hidden_(hidden),
      fp8_(fp8 != 0),
      num_blocks_(num_blocks) {
  EP_CHECK(nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED, "RailRuntime: call nvshmem_init first");
  check_shape(world, ranks_per_node, num_experts, max_tokens, max_topk, hidden, fp8);
  EP_CHECK_ARG(rank == nvshmem_my_pe() && world == nvshmem_n_pes(),
               "RailRuntime: rank %d / world %d differ from NVSHMEM's PE %d of %d", rank, world, nvshmem_my_pe(),
               nvshmem_n_pes());
  int device = 0, sms = 0;
  EP_CUDA_CHECK(cudaGetDevice(&device));
  EP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // A launch with both halves waits, in its early blocks, for its own last block's signal: every
  // block must be resident at once (one per SM at kThreads).
  EP_CHECK_ARG(num_blocks > 0 && num_blocks <= sms, "RailRuntime: num_blocks must be in [1, %d SMs], got %d", sms,
               num_blocks);
  EP_CHECK_ARG(timeout_s > 0, "RailRuntime: timeout_s must be positive, got %g", timeout_s);
  nodes_ = world / ranks_per_node;
  local_ = rank % ranks_per_node;
  const Shape shape{nodes_, max_tokens, max_topk, hidden, fp8_};
  Ctx* c = new Ctx{};
  ctx_ = c;
  // Every rank takes the same decision (staging or not): in a job spanning nodes every rank has a
  // rail peer without P2P, and nvshmem_ptr is null exactly for those.
  bytes_ = layout(c, shape, force_puts != 0);
  heap_ = static_cast<char*>(nvshmem_malloc(bytes_));  // collective
  EP_CHECK(heap_ != nullptr, "nvshmem_malloc(%zu) failed for the rail buffers (raise NVSHMEM_SYMMETRIC_SIZE)", bytes_);
  for (int m = 0; m < nodes_; ++m) all_p2p_ = all_p2p_ && nvshmem_ptr(heap_, m * ranks_per_node + local_) != nullptr;
  if (!all_p2p_ && !force_puts) {  // rail peers across nodes: add the staging areas
    nvshmem_free(heap_);
    bytes_ = layout(c, shape, true);
    heap_ = static_cast<char*>(nvshmem_malloc(bytes_));
    EP_CHECK(heap_ != nullptr, "nvshmem_malloc(%zu) failed for the rail buffers (raise NVSHMEM_SYMMETRIC_SIZE)",
             bytes_);
  }
  if (force_puts) all_p2p_ = false;
  EP_CUDA_CHECK(cudaMemset(heap_, 0, bytes_));
  const size_t state_ints = kMask + nodes_ + 1;  // + the abort word, after the mask
  EP_CUDA_CHECK(cudaMalloc(&state_, sizeof(int) * state_ints));
  EP_CUDA_CHECK(cudaMemset(state_, 0, sizeof(int) * state_ints));
  host_report::allocate(host_, host_dev_);
  EP_CUDA_CHECK(cudaDeviceSynchronize());
  nvshmem_barrier_all();  // nobody writes a peer's slots before that peer has zeroed them

  c->rank = rank;
  c->ranks_per_node = ranks_per_node;
  c->local = local_;
  c->node = rank / ranks_per_node;
  c->nodes = nodes_;
  c->num_experts = num_experts;
  c->node_experts = num_experts / nodes_;
  c->max_tokens = max_tokens;
  c->max_topk = max_topk;
  c->hidden = hidden;
  c->row_bytes = static_cast<int>(shape.row_bytes());
  c->scales = fp8_ ? hidden / 128 : 0;
  c->heap = heap_;
  for (int m = 0; m < nodes_; ++m)
    c->peer[m] = force_puts ? nullptr : static_cast<char*>(nvshmem_ptr(heap_, m * ranks_per_node + local_));
  c->state = state_;
  c->aborted = state_ + kMask + nodes_;
  c->host = host_dev_;
  c->timeout_ns = static_cast<unsigned long long>(timeout_s * 1e9);
}

Runtime::~Runtime() { destroy(false); }

void Runtime::destroy(bool collective) {
  if (heap_ != nullptr && collective) nvshmem_free(heap_);
  heap_ = nullptr;
  if (state_ != nullptr) cudaFree(state_);
  state_ = nullptr;
  if (host_ != nullptr) cudaFreeHost(host_);
  host_ = nullptr;
  delete static_cast<Ctx*>(ctx_);
  ctx_ = nullptr;
}

void Runtime::check_call(int T, int K, int phases, const char* what) const {
  EP_CHECK(ctx_ != nullptr && heap_ != nullptr, "RailRuntime: used after destroy()");
  EP_CHECK_ARG(phases >= 1 && phases <= 3, "rail %s: phases must be 1, 2 or 3, got %d", what, phases);
  EP_CHECK_ARG(T >= 0 && T <= max_tokens_, "rail %s: %d tokens, the buffer holds at most %d", what, T, max_tokens_);
  EP_CHECK_ARG(K >= 1 && K <= max_topk_, "rail %s: topk %d outside [1, %d]", what, K, max_topk_);
}

void Runtime::dispatch(uintptr_t x, uintptr_t scales, uintptr_t topk_idx, uintptr_t weights, int T, int K, int phases,
                       uintptr_t stream) {
  check_call(T, K, phases, "dispatch");
  if (phases & kSend) {
    // T == 0: torch gives an empty tensor a null data pointer, so an FP8 rank without tokens passes
    // scales 0; it must still send its count and signals, or its rail peers wait out timeout_s
    EP_CHECK_ARG(T == 0 || (scales != 0) == fp8_, "rail dispatch: this buffer moves %s rows, %s",
                 fp8_ ? "FP8" : "BF16", fp8_ ? "scales are required" : "scales must be absent");
    EP_CHECK_ARG(T == 0 || (x != 0 && topk_idx != 0), "rail dispatch: x and topk_idx are required for %d tokens", T);
  }
  const Ctx& c = *static_cast<Ctx*>(ctx_);
  const DispatchIn in{reinterpret_cast<const int4*>(x), reinterpret_cast<const float*>(scales),
                      reinterpret_cast<const int64_t*>(topk_idx), reinterpret_cast<const float*>(weights)};
  const int send_parity = static_cast<int>(disp_send_calls_ & 1), recv_parity = static_cast<int>(disp_recv_calls_ & 1);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (fp8_)
    ::ep::rail::dispatch<true><<<num_blocks_, kThreads, 0, s>>>(c, in, T, K, phases, send_parity, recv_parity);
  else
    ::ep::rail::dispatch<false><<<num_blocks_, kThreads, 0, s>>>(c, in, T, K, phases, send_parity, recv_parity);
  EP_CUDA_CHECK(cudaGetLastError());
  if (phases & kSend) ++disp_send_calls_;
  if (phases & kRecv) ++disp_recv_calls_;
}

void Runtime::combine(uintptr_t y_f, uintptr_t slot_valid, uintptr_t topk_idx, int T, int K, int phases, uintptr_t y,
                      uintptr_t stream, uintptr_t y_rows, int placed, int pull) {
  check_call(T, K, phases, "combine");
  EP_CHECK_ARG(!pull || all_p2p_, "rail combine: the pulled combine reads the rail peers' rows, which needs every "
               "rail peer over P2P (all_p2p)");
  if ((phases & kSend) && placed) {
    EP_CHECK_ARG(all_p2p_, "rail combine: placed rows need every rail peer over P2P (combine_targets)");
    EP_CHECK_ARG(y_f == 0 && y_rows == 0, "rail combine: placed rows take no y_f / y_rows");
  } else if (phases & kSend) {
    EP_CHECK_ARG(y_f != 0 && slot_valid != 0, "rail combine: y_f and slot_valid are required by the send half");
  }
  if (phases & kRecv)
    EP_CHECK_ARG(T == 0 || (topk_idx != 0 && y != 0), "rail combine: topk_idx and y are required for %d tokens", T);
  const Ctx& c = *static_cast<Ctx*>(ctx_);
  const int send_parity = static_cast<int>(comb_send_calls_ & 1), recv_parity = static_cast<int>(comb_recv_calls_ & 1);
  auto* kernel = pull ? ::ep::rail::combine<true> : ::ep::rail::combine<false>;
  kernel<<<num_blocks_, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      c, reinterpret_cast<const int4*>(y_f), reinterpret_cast<const int64_t*>(y_rows),
      reinterpret_cast<const uint8_t*>(slot_valid),
      reinterpret_cast<const int64_t*>(topk_idx), T, K, phases, send_parity, recv_parity, reinterpret_cast<int4*>(y));
  EP_CUDA_CHECK(cudaGetLastError());
  if (phases & kSend) ++comb_send_calls_;
  if (phases & kRecv) ++comb_recv_calls_;
}

Buffers Runtime::buffers(int parity) const {
  EP_CHECK(ctx_ != nullptr && heap_ != nullptr, "RailRuntime: used after destroy()");
  EP_CHECK_ARG(parity == 0 || parity == 1, "rail buffers: parity must be 0 or 1, got %d", parity);
  const Ctx& c = *static_cast<const Ctx*>(ctx_);
  const auto at = [this](long long off) { return reinterpret_cast<uintptr_t>(heap_ + off); };
  return Buffers{at(c.disp_x[parity]), fp8_ ? at(c.disp_sf[parity]) : 0, at(c.disp_topk[parity]),
                 at(c.disp_w[parity])};
}

std::vector<uintptr_t> Runtime::combine_targets(int parity) const { return comb_rows_of(parity, false); }

std::vector<uintptr_t> Runtime::combine_own_targets(int parity) const { return comb_rows_of(parity, true); }

// [N] row-block addresses in comb_rows of `parity`, node m's block each: this node's block at every rail peer m
// (the pushed form's targets) or block m of this rank's own (the pulled form's); empty unless all_p2p().
std::vector<uintptr_t> Runtime::comb_rows_of(int parity, bool own) const {
  EP_CHECK(ctx_ != nullptr && heap_ != nullptr, "RailRuntime: used after destroy()");
  EP_CHECK_ARG(parity == 0 || parity == 1, "rail combine targets: parity must be 0 or 1, got %d", parity);
  std::vector<uintptr_t> out;
  if (!all_p2p_) return out;
  const Ctx& c = *static_cast<const Ctx*>(ctx_);
  const long long block = static_cast<long long>(max_tokens_) * hidden_ * 2;
  for (int m = 0; m < nodes_; ++m)
    out.push_back(own ? reinterpret_cast<uintptr_t>(heap_ + c.comb_rows[parity] + m * block)
                      : reinterpret_cast<uintptr_t>(c.peer[m] + c.comb_rows[parity] + c.node * block));
  return out;
}

void Runtime::set_mask(const std::vector<int>& left_out) {
  EP_CHECK(ctx_ != nullptr, "RailRuntime: used after destroy()");
  std::vector<int> mask(nodes_ + 1, 0);  // + the abort word, cleared with the mask
  for (int r : left_out) {
    EP_CHECK_ARG(r >= 0 && r < world_, "rail mask: rank %d outside [0, %d)", r, world_);
    if (r % ranks_per_node_ == local_) mask[r / ranks_per_node_] = 1;  // other ranks are no rail peers of ours
  }
  host_report::set_mask(state_ + kMask, mask, host_);
}

int Runtime::error() const { return host_report::error(host_); }
int Runtime::error_kernel() const { return host_report::error_kernel(host_); }
int Runtime::take_bad_expert_ids() { return host_report::take_bad_ids(host_); }

std::vector<int> Runtime::missing_ranks() const {
  std::vector<int> out;
  if (host_ == nullptr) return out;
  volatile HostInfo* h = host_;
  for (int m = 0; m < nodes_; ++m)
    if (h->missing[m]) out.push_back(m * ranks_per_node_ + local_);
  return out;
}

}  // namespace rail
}  // namespace ep
