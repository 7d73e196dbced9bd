// Host side of the low-latency kernels (low_latency.h): the symmetric layout, checks, launches.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <cstring>

#include "common/error.h"
#include "nvshmem/ll_kernels.h"
#include "nvshmem/low_latency.h"

namespace ep {
namespace ll {
namespace {

size_t align16(size_t n) { return (n + 15) / 16 * 16; }
int slot_bytes_for(int hidden) { return static_cast<int>(align16(kHeaderBytes + 2ull * hidden)); }

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// Offsets of ll_device.cuh's layout; returns the total. stage: the RDMA staging areas; sets: output
// sets in place of the slots (ll_dispatch_direct.cu).
size_t layout(Ctx* c, int W, int E, int M, int KMAX, int H, bool stage, int sets) {
  const size_t slot = slot_bytes_for(H);
  size_t at = 0;
  auto take = [&at](size_t n) { const size_t o = at; at = align16(at + n); return static_cast<long long>(o); };
  long long disp_flag[2], cnt_flag[2], comb_flag[2], disp_cnt[2], disp_slots[2], comb_rows[2], cnt_all[2];
  long long cnt_word[2], arr_resv[2], arr_begin[2], arr_ready[2], arr_word[2], comb_w[2];
  for (int p = 0; p < 2; ++p) {
    disp_flag[p] = take(8ull * W);
    cnt_flag[p] = take(8ull * W);
    comb_flag[p] = take(8ull * W);
    disp_cnt[p] = take(4ull * E);
    disp_slots[p] = sets > 0 ? -1 : take(slot * E * M);
    cnt_all[p] = sets > 0 ? take(4ull * W * E) : -1;
    comb_rows[p] = take(2ull * H * M * KMAX);
    cnt_word[p] = sets > 0 ? take(8ull * W * E) : -1;
    arr_resv[p] = sets > 0 ? take(4ull * E) : -1;
    arr_begin[p] = sets > 0 ? take(4ull * E) : -1;
    arr_ready[p] = sets > 0 ? take(16) : -1;
    arr_word[p] = sets > 0 ? take(8ull * W * E) : -1;
    comb_w[p] = sets > 0 ? take(8ull * W * M * KMAX) : -1;
  }
  // a set: data (BF16 rows; FP8 rows and both forms of their scales in the same bytes), src_info,
  // row_slot, info
  const size_t rows = static_cast<size_t>(E) * M;  // EL * W*M
  const size_t scale_bytes = rows * (H / 128) * 4;
  const size_t set_scales = align256(rows * H), set_scales_rm = align256(set_scales + scale_bytes);
  // the FP8 bytes fit in the BF16 rows' at every real size; the max only guards a toy one
  const size_t set_src_info = std::max(align256(2 * rows * H), align256(set_scales_rm + scale_bytes));
  const size_t set_row_slot = set_src_info + align256(4 * rows);
  const size_t set_info = set_row_slot + align256(4 * rows);
  const size_t set_rec = set_info + align256(8 * rows);
  const size_t rec_ints = static_cast<size_t>(W) + static_cast<size_t>(W) * M * KMAX;
  long long out_set[kMaxSets];
  for (int i = 0; i < kMaxSets; ++i) {  // 256-byte aligned: torch tensors view them
    at = i < sets ? align256(at) : at;
    out_set[i] = i < sets ? take(set_rec + 4 * rec_ints) : -1;
  }
  long long stage_rows = -1, stage_cnt = -1, comb_stage = -1;
  if (stage) {
    stage_rows = take(slot * M);
    stage_cnt = take(4ull * E);
    comb_stage = take(2ull * H * E * M);
  }
  if (c != nullptr) {
    for (int p = 0; p < 2; ++p) {
      c->disp_flag[p] = disp_flag[p];
      c->cnt_flag[p] = cnt_flag[p];
      c->cnt_all[p] = cnt_all[p];
      c->cnt_word[p] = cnt_word[p];
      c->arr_resv[p] = arr_resv[p];
      c->arr_begin[p] = arr_begin[p];
      c->arr_ready[p] = arr_ready[p];
      c->arr_word[p] = arr_word[p];
      c->comb_w[p] = comb_w[p];
      c->comb_flag[p] = comb_flag[p];
      c->disp_cnt[p] = disp_cnt[p];
      c->disp_slots[p] = disp_slots[p];
      c->comb_rows[p] = comb_rows[p];
    }
    c->stage_rows = stage_rows;
    c->stage_cnt = stage_cnt;
    c->comb_stage = comb_stage;
    c->sets = sets;
    for (int i = 0; i < kMaxSets; ++i) c->out_set[i] = out_set[i];
    c->set_scales = static_cast<long long>(set_scales);
    c->set_src_info = static_cast<long long>(set_src_info);
    c->set_row_slot = static_cast<long long>(set_row_slot);
    c->set_scales_rm = static_cast<long long>(set_scales_rm);
    c->set_info = static_cast<long long>(set_info);
    c->set_rec = static_cast<long long>(set_rec);
  }
  return at;
}

size_t smem_bytes(int T, int K, int E) {
  const size_t send = static_cast<size_t>(T) * K + E, recv = 2ull * E + 1;
  return 4 * (send > recv ? send : recv);
}

}  // namespace

size_t Runtime::heap_bytes(int world, int num_experts, int max_tokens, int max_topk, int hidden, int output_sets) {
  // room for the slots too: a job without P2P everywhere uses them instead of the sets
  const size_t plain = layout(nullptr, world, num_experts, max_tokens, max_topk, hidden, false, 0);
  const size_t sets = layout(nullptr, world, num_experts, max_tokens, max_topk, hidden, false, output_sets);
  return plain > sets ? plain : sets;
}

Runtime::Runtime(int rank, int world, int num_experts, int max_tokens, int max_topk, int hidden, double timeout_s,
                 int num_blocks, int output_sets)
    : world_(world), max_tokens_(max_tokens), max_topk_(max_topk), hidden_(hidden), num_blocks_(num_blocks),
      max_blocks_(num_blocks) {
  EP_CHECK(nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED, "LowLatencyRuntime: call nvshmem_init first");
  EP_CHECK_ARG(world >= 1 && world <= kMaxRanks, "LowLatencyRuntime: world must be in [1, %d], got %d", kMaxRanks, world);
  EP_CHECK_ARG(rank == nvshmem_my_pe() && world == nvshmem_n_pes(),
               "LowLatencyRuntime: rank %d / world %d differ from NVSHMEM's PE %d of %d", rank, world,
               nvshmem_my_pe(), nvshmem_n_pes());
  EP_CHECK_ARG(num_experts > 0 && num_experts % world == 0, "LowLatencyRuntime: %d experts do not split over %d ranks",
               num_experts, world);
  EP_CHECK_ARG(hidden > 0 && hidden % 8 == 0, "LowLatencyRuntime: hidden must be a positive multiple of 8, got %d", hidden);
  EP_CHECK_ARG(max_tokens > 0, "LowLatencyRuntime: max_tokens must be positive, got %d", max_tokens);
  EP_CHECK_ARG(max_topk > 0 && max_topk <= 32, "LowLatencyRuntime: max_topk must be in [1, 32], got %d", max_topk);
  EP_CHECK_ARG(num_blocks > 0, "LowLatencyRuntime: num_blocks must be positive, got %d", num_blocks);
  EP_CHECK_ARG(output_sets >= 0 && output_sets <= kMaxSets, "LowLatencyRuntime: output_sets must be in [0, %d], got %d",
               kMaxSets, output_sets);
  EP_CHECK_ARG(static_cast<long long>(world) * max_tokens * max_topk < (1ll << 31),
               "LowLatencyRuntime: world * max_tokens * max_topk must stay below 2^31");
  Ctx* c = new Ctx{};
  ctx_ = c;
  // Every rank takes the same decision (staging or not): in a job spanning nodes every rank has a
  // peer without P2P, and nvshmem_ptr is null exactly for those.
  bytes_ = layout(c, world, num_experts, max_tokens, max_topk, hidden, false, output_sets);
  heap_ = static_cast<char*>(nvshmem_malloc(bytes_));  // collective
  EP_CHECK(heap_ != nullptr, "nvshmem_malloc(%zu) failed for the low-latency buffers (raise NVSHMEM_SYMMETRIC_SIZE)",
           bytes_);
  for (int r = 0; r < world; ++r) all_p2p_ = all_p2p_ && nvshmem_ptr(heap_, r) != nullptr;
  if (!all_p2p_) {  // peers across nodes: add the staging areas (every rank of such a job lacks P2P to some peer)
    nvshmem_free(heap_);
    bytes_ = layout(c, world, num_experts, max_tokens, max_topk, hidden, true, 0);  // sets need P2P everywhere
    heap_ = static_cast<char*>(nvshmem_malloc(bytes_));
    EP_CHECK(heap_ != nullptr, "nvshmem_malloc(%zu) failed for the low-latency buffers", bytes_);
  }
  EP_CUDA_CHECK(cudaMemset(heap_, 0, bytes_));
  EP_CUDA_CHECK(cudaMalloc(&local_, sizeof(int) * (kMask + world + 1)));
  EP_CUDA_CHECK(cudaMemset(local_, 0, sizeof(int) * (kMask + world + 1)));
  host_report::allocate(host_, host_dev_);
  EP_CUDA_CHECK(cudaDeviceSynchronize());
  nvshmem_barrier_all();  // nobody writes a peer's slots before that peer has zeroed them

  c->rank = rank;
  c->world = world;
  c->num_experts = num_experts;
  c->local_experts = num_experts / world;
  c->max_tokens = max_tokens;
  c->max_topk = max_topk;
  c->hidden = hidden;
  c->slot_bytes = slot_bytes_for(hidden);
  c->heap = heap_;
  for (int r = 0; r < world; ++r) c->peer[r] = static_cast<char*>(nvshmem_ptr(heap_, r));
  c->state = local_;
  c->aborted = local_ + kMask + world;
  c->host = host_dev_;
  c->timeout_ns = static_cast<unsigned long long>(timeout_s * 1e9);
  const size_t smem = smem_bytes(max_tokens, max_topk, num_experts);
  EP_CHECK_ARG(smem <= 200 * 1024, "LowLatencyRuntime: max_tokens * max_topk + 2 * experts too large for shared memory");
  EP_CUDA_CHECK(cudaFuncSetAttribute(::ep::ll::dispatch<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  EP_CUDA_CHECK(cudaFuncSetAttribute(::ep::ll::dispatch<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  EP_CUDA_CHECK(cudaFuncSetAttribute(::ep::ll::dispatch_direct<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  EP_CUDA_CHECK(cudaFuncSetAttribute(::ep::ll::dispatch_direct<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  EP_CUDA_CHECK(cudaFuncSetAttribute(::ep::ll::combine<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  EP_CUDA_CHECK(cudaFuncSetAttribute(::ep::ll::combine<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
}

Runtime::~Runtime() { destroy(false); }

void Runtime::destroy(bool collective) {
  if (heap_ != nullptr && collective) nvshmem_free(heap_);
  heap_ = nullptr;
  if (local_ != nullptr) cudaFree(local_);
  local_ = nullptr;
  if (host_ != nullptr) cudaFreeHost(host_);
  host_ = nullptr;
  delete static_cast<Ctx*>(ctx_);
  ctx_ = nullptr;
}

// Both halves in one launch: a block's receive half waits for this rank's own signal, which the
// last block to finish sending gives, so every block must be resident at once. A cooperative
// launch guarantees it (or fails at launch) instead of leaving it to whatever else holds SMs.
template <typename Kernel, typename... Args>
static void launch(Kernel kernel, int num_blocks, int phases, size_t smem, cudaStream_t s, Args... args) {
  if ((phases & kPhaseMask) != (kSend | kRecv)) {
    kernel<<<num_blocks, kThreads, smem, s>>>(args...);
    return;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(num_blocks);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  EP_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

void Runtime::check_call(int T, int K) const {
  EP_CHECK(ctx_ != nullptr && heap_ != nullptr, "LowLatencyRuntime: used after destroy()");
  EP_CHECK_ARG(T >= 0 && T <= max_tokens_, "low-latency call: %d tokens, the buffer holds at most %d", T, max_tokens_);
  EP_CHECK_ARG(K >= 1 && K <= max_topk_, "low-latency call: topk %d outside [1, %d]", K, max_topk_);
}

void Runtime::dispatch(uintptr_t x, uintptr_t topk_idx, int T, int K, int use_fp8, int round_scale, int phases,
                       uintptr_t out_x, uintptr_t out_scales, uintptr_t recv_count, uintptr_t src_info,
                       uintptr_t layout_range, uintptr_t row_slot, uintptr_t recv_stats, uintptr_t stream, int out_set,
                       uintptr_t self_pos) {
  check_call(T, K);
  EP_CHECK_ARG((phases & kPhaseMask) != 0 && (phases & ~(kPhaseMask | kVariantMask)) == 0,
               "low-latency dispatch: phases must be 1, 2 or 3 (| variant bits), got %d", phases);
  EP_CHECK_ARG(!use_fp8 || hidden_ % 128 == 0, "low-latency FP8 dispatch needs hidden %% 128 == 0, got %d", hidden_);
  EP_CHECK_ARG(!use_fp8 || !(phases & kScalesRowMajor) || hidden_ / 128 <= kMaxScaleGroups,
               "low-latency dispatch: kScalesRowMajor needs hidden <= %d, got %d", kMaxScaleGroups * 128, hidden_);
  const Ctx& c = *static_cast<Ctx*>(ctx_);
  DispatchOut o{reinterpret_cast<char*>(out_x), reinterpret_cast<float*>(out_scales), reinterpret_cast<int*>(recv_count),
                reinterpret_cast<int*>(src_info), reinterpret_cast<long long*>(layout_range),
                reinterpret_cast<int*>(row_slot), reinterpret_cast<int*>(recv_stats), reinterpret_cast<int*>(self_pos)};
  const size_t smem = smem_bytes(T, K, c.num_experts);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const int4* in = reinterpret_cast<const int4*>(x);
  const int64_t* idx = reinterpret_cast<const int64_t*>(topk_idx);
  if (out_set >= 0) {
    EP_CHECK_ARG(out_set < c.sets, "low-latency dispatch: output set %d, the buffer has %d", out_set, c.sets);
    // the receive half is block 0's, unless it has rows to fix up (direct_recv_rows)
    const bool one = (phases & kPhaseMask) == kRecv && !direct_recv_rows(use_fp8 != 0, phases);
    const int blocks = one ? 1 : num_blocks_;
    if (use_fp8)
      launch(::ep::ll::dispatch_direct<true>, blocks, phases, smem, s, c, in, idx, T, K, phases, round_scale, out_set, o);
    else
      launch(::ep::ll::dispatch_direct<false>, blocks, phases, smem, s, c, in, idx, T, K, phases, round_scale, out_set, o);
  } else if (use_fp8) {
    launch(::ep::ll::dispatch<true>, num_blocks_, phases, smem, s, c, in, idx, T, K, phases, round_scale, o);
  } else {
    launch(::ep::ll::dispatch<false>, num_blocks_, phases, smem, s, c, in, idx, T, K, phases, round_scale, o);
  }
  EP_CUDA_CHECK(cudaGetLastError());
}

void Runtime::combine(uintptr_t x, uintptr_t row_slot, uintptr_t recv_count, uintptr_t topk_idx, uintptr_t weights,
                      int T, int K, int phases, uintptr_t y, uintptr_t stream, uintptr_t self_pos, uintptr_t rec) {
  check_call(T, K);
  // the engine passes one set of bits to both calls: the dispatch's are ignored here
  EP_CHECK_ARG((phases & kPhaseMask) != 0 && (phases & ~(kPhaseMask | kVariantMask)) == 0,
               "low-latency combine: phases must be 1, 2 or 3 (| variant bits), got %d", phases);
  const Ctx& c = *static_cast<Ctx*>(ctx_);
  // kOwnerReduce's send half sums per (source, token) from the dispatch's records: they exist with output sets
  EP_CHECK_ARG(!(phases & kOwnerReduce) || !(phases & kSend) || rec != 0 || c.sets == 0,
               "low-latency combine: kOwnerReduce's send half needs the dispatch's records");
  const size_t smem = smem_bytes(0, 0, c.num_experts);
  auto* kernel = (phases & (kLoadsAhead | kCopy8)) ? ::ep::ll::combine<true> : ::ep::ll::combine<false>;
  launch(kernel, num_blocks_, phases, smem, reinterpret_cast<cudaStream_t>(stream), c,
         reinterpret_cast<const int4*>(x), reinterpret_cast<const int*>(row_slot),
         reinterpret_cast<const int*>(recv_count), reinterpret_cast<const int64_t*>(topk_idx),
         reinterpret_cast<const float*>(weights), T, K, phases, reinterpret_cast<int4*>(y),
         reinterpret_cast<const int*>(self_pos), reinterpret_cast<const int*>(rec));
  EP_CUDA_CHECK(cudaGetLastError());
}

void Runtime::set_mask(const std::vector<int>& left_out) {
  EP_CHECK(ctx_ != nullptr, "LowLatencyRuntime: used after destroy()");
  std::vector<int> mask(world_ + 1, 0);  // + the abort word, cleared with the mask
  for (int r : left_out) {
    EP_CHECK_ARG(r >= 0 && r < world_, "low-latency mask: rank %d outside [0, %d)", r, world_);
    mask[r] = 1;
  }
  host_report::set_mask(local_ + kMask, mask, host_);
}

std::vector<uintptr_t> Runtime::set_pointers(int i) const {
  const Ctx& c = *static_cast<Ctx*>(ctx_);
  EP_CHECK_ARG(i >= 0 && i < c.sets, "LowLatencyRuntime: output set %d, the buffer has %d", i, c.sets);
  const uintptr_t base = reinterpret_cast<uintptr_t>(heap_) + static_cast<uintptr_t>(c.out_set[i]);
  return {base, base + static_cast<uintptr_t>(c.set_scales), base + static_cast<uintptr_t>(c.set_src_info),
          base + static_cast<uintptr_t>(c.set_row_slot), base + static_cast<uintptr_t>(c.set_rec)};
}

void Runtime::set_stamps(uintptr_t stamps) {
  EP_CHECK(ctx_ != nullptr, "LowLatencyRuntime: used after destroy()");
  static_cast<Ctx*>(ctx_)->stamps = reinterpret_cast<unsigned long long*>(stamps);
}

void Runtime::set_num_blocks(int n) {
  EP_CHECK_ARG(n >= 1 && n <= max_blocks_, "LowLatencyRuntime: num_blocks must be in [1, %d], got %d", max_blocks_, n);
  num_blocks_ = n;
}

int Runtime::sets() const { return ctx_ == nullptr ? 0 : static_cast<Ctx*>(ctx_)->sets; }

int Runtime::error() const { return host_report::error(host_); }
int Runtime::error_kernel() const { return host_report::error_kernel(host_); }
int Runtime::take_bad_expert_ids() { return host_report::take_bad_ids(host_); }

std::vector<int> Runtime::missing_ranks() const {
  std::vector<int> out;
  if (host_ == nullptr) return out;
  volatile HostInfo* h = host_;
  for (int r = 0; r < world_; ++r)
    if (h->missing[r]) out.push_back(r);
  return out;
}

}  // namespace ll
}  // namespace ep
