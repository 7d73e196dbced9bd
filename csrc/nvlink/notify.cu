// notify: the first step of a dispatch. One block computes where this rank's tokens go and tells
// every peer how many rows (and rows per expert) to expect from it.
//
// Protocol, at epoch n = epochs[E_NOTIFY] + 1 (d = epochs[E_DISPATCH], the last finished dispatch):
//   0. count this rank's tokens per destination rank and per expert (its own input only). In an
//      expert-major dispatch (kMerge) a token naming one expert in several slots counts for it once:
//      stage merges the picks the same way (dispatch.cu), so receivers find one route per (token, expert).
//   1. wait META_ACK[p] >= n-1 at this rank for every peer p: p has read the counts this rank wrote
//      into p's meta area last time, so they may be overwritten; and PULL_DONE[p] >= d: p has
//      finished pulling from this rank's send list, which step 2 rewrites.
//   2. write meta[me] = {rows, per-expert counts} into every peer's meta area, fence, release
//      COUNT[me] = n at every rank; then build send_pos / is_in / send_list (this rank's buffer;
//      peers read the send list only after this rank's stage releases STAGE, behind this kernel).
//   3. wait COUNT[p] >= n for every peer, read the meta area: receive offsets, counts per local
//      expert (device outputs and host-mapped info).
//   4. release META_ACK[me] = n at every peer; epochs[E_NOTIFY] = n.
// A timeout in any wait records the missing peer with K_NOTIFY and returns; the host sees err.
#include "common/error.h"
#include "common/fast_div.cuh"
#include "nvlink/device.cuh"
#include "nvlink/kernels.h"

namespace ep {
namespace nvl {
namespace {

constexpr int kNotifyThreads = 512;  // 1024 threads leave 64 registers each: the scan spilled
constexpr int kKeepChunks = 16;  // chunks of 32 tokens per warp whose rank masks (a byte per lane) stay in registers

// A token's rank mask (bit r: some pick lives on rank r) from its K expert ids: token_rank_mask's rule
// (common/token_mask.cuh), with the ids loaded eight at a time (16-byte loads where K is even and the
// rows aligned) before the first use, and the rank found by a multiply-high (common/fast_div.cuh).
// kMerge: a slot naming the expert of an earlier slot is not counted again (the ids of its own group of
// eight are in registers; earlier groups, for K > 8, are read again from L1). The mask is the same.
template <bool kCount, bool kMerge = false>
__device__ __forceinline__ unsigned notify_token_mask(const int64_t* __restrict__ row, int K, bool vec,
                                                      const FastDiv& ediv, int E, int* s_ecnt, bool& bad_id) {
  unsigned m = 0;
  for (int k0 = 0; k0 < K; k0 += 8) {
    int64_t id[8];
    if (vec) {
      const longlong2* v = reinterpret_cast<const longlong2*>(row + k0);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const longlong2 p = k0 + 2 * q < K ? __ldg(v + q) : make_longlong2(-1, -1);
        id[2 * q] = p.x;
        id[2 * q + 1] = p.y;
      }
    } else {
#pragma unroll
      for (int q = 0; q < 8; ++q) id[q] = k0 + q < K ? __ldg(row + k0 + q) : -1;
    }
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const int64_t e = id[q];
      bad_id |= e < -1 || e >= E;
      if (e < 0 || e >= E) continue;
      if (kMerge) {
        bool seen = false;
#pragma unroll
        for (int p = 0; p < q; ++p) seen |= id[p] == e;
        for (int j = 0; j < k0; ++j) seen |= __ldg(row + j) == e;
        if (seen) continue;  // its rank's bit is set already
      }
      if (kCount) atomicAdd(&s_ecnt[e], 1);
      m |= 1u << ediv.div(static_cast<uint32_t>(e));  // the rule of common/token_mask.cuh
    }
  }
  return m;
}

template <bool kMerge>
__global__ void __launch_bounds__(kNotifyThreads, 1)
notify_kernel(Ctx c, const int64_t* __restrict__ topk_idx, int T, int K, int* __restrict__ send_pos,
              bool* __restrict__ is_in, int* __restrict__ recv_off, int64_t* __restrict__ tpe,
              int64_t* __restrict__ host_tpe, int* __restrict__ host_recv_off) {
  extern __shared__ int s_ecnt[];  // [num_experts]
  __shared__ int s_wsum[32][kMaxRanks];
  __shared__ int s_total[kMaxRanks];
  __shared__ int s_fail;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int W = c.world, me = c.rank, EL = c.local_experts, E = c.num_experts;
  const FastDiv ediv(static_cast<uint32_t>(EL));
  const int n = c.epochs[E_NOTIFY] + 1;
  const int e_prev = c.epochs[E_DISPATCH];
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  for (int i = tid; i < E; i += blockDim.x) s_ecnt[i] = 0;

  // Pass 1 reads only this rank's own input: it runs before the waits, while peers may still be
  // reading the previous dispatch's send list. Warp w owns a contiguous range of tokens, taken in
  // chunks of 32 with lane l on the chunk's l-th token: a chunk's loads and stores are contiguous
  // across lanes (a range per thread made every warp load touch 32 cache lines), and ballots order
  // the tokens within a chunk.
  const int per_warp = ((T + nwarps - 1) / nwarps + 31) / 32 * 32;
  const int w0 = min(T, warp * per_warp), w1 = min(T, w0 + per_warp);
  const int nchunks = (w1 - w0 + 31) / 32;  // the same in every lane of a warp
  const bool vec = K % 2 == 0 && (reinterpret_cast<uintptr_t>(topk_idx) & 15) == 0;
  __syncthreads();  // s_ecnt zeroed
  int wcnt[kMaxRanks];
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) wcnt[r] = 0;
  static_assert(kMaxRanks <= 8 && kKeepChunks % 4 == 0, "masks are kept as bytes, four to a register");
  unsigned keep[kKeepChunks / 4];
  bool bad_id = false;  // reported through host memory so that EPBuffer needs no check kernels of its own
  auto count = [&](unsigned m) {
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r)
      if (r < W) wcnt[r] += __popc(__ballot_sync(kFull, (m >> r) & 1u));
  };
#pragma unroll
  for (int j = 0; j < kKeepChunks; ++j) {
    if (j % 4 == 0) keep[j / 4] = 0;
    if (j < nchunks) {
      const int t = w0 + j * 32 + lane;
      const unsigned m = t < w1 ? notify_token_mask<true, kMerge>(topk_idx + static_cast<size_t>(t) * K, K, vec, ediv,
                                                                  E, s_ecnt, bad_id)
                                : 0u;
      keep[j / 4] |= m << (8 * (j % 4));
      count(m);
    }
  }
  for (int j = kKeepChunks; j < nchunks; ++j) {  // more chunks than registers keep: counted here, recomputed below
    const int t = w0 + j * 32 + lane;
    count(t < w1 ? notify_token_mask<true, kMerge>(topk_idx + static_cast<size_t>(t) * K, K, vec, ediv, E, s_ecnt,
                                                   bad_id)
                 : 0u);
  }
  // Exclusive scan of the warps' counts (warp order = token order).
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) s_wsum[warp][r] = wcnt[r];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      const int orig = lane < nwarps ? s_wsum[lane][r] : 0;
      int v = orig;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int u = __shfl_up_sync(kFull, v, d);
        if (lane >= d) v += u;
      }
      if (lane < nwarps) s_wsum[lane][r] = v - orig;
      if (lane == 31) s_total[r] = v;
    }
  }

  // Peers must have consumed my previous meta and finished reading my send list / stage.
  if (block_wait_peers(c, F_META_ACK, n - 1, me, K_NOTIFY, deadline, &s_fail)) return;
  if (block_wait_peers(c, F_PULL_DONE, e_prev, me, K_NOTIFY, deadline, &s_fail)) return;

  // Counts to every rank first (the peers wait on them): meta[me] at rank p = {rows for p,
  // per-expert counts of p's experts}.
  const int stride = 1 + EL;
  for (int i = tid; i < W * stride; i += blockDim.x) {
    const int p = i / stride, j = i % stride;
    const int v = j == 0 ? s_total[p] : s_ecnt[p * EL + j - 1];
    volatile int* dst = reinterpret_cast<int*>(c.peers[p] + c.off_meta) + me * stride + j;
    *dst = v;
  }
  // One system fence per peer, behind a block barrier, makes every thread's meta stores visible
  // before the flag (a fence in each of the 32 warps costs more than the whole exchange).
  __syncthreads();
  if (tid < W) {
    __threadfence_system();
    st_release_sys(flag_at(c, tid, F_COUNT, me), n);
  }

  // Pass 2, while the counts travel: each token's slot per destination and the send lists, in the
  // chunks of pass 1 (a lane's slot: its warp's running count plus the lanes below it in the ballot).
  int* send_list = reinterpret_cast<int*>(c.peers[me] + c.off_send_list);
  int run[kMaxRanks];
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) run[r] = s_wsum[warp][r];
  const unsigned below = (1u << lane) - 1u;
  auto place = [&](int t, unsigned m) {  // every lane of the warp; m = 0 where t >= w1
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      if (r < W) {
        const bool in = (m >> r) & 1u;
        const unsigned b = __ballot_sync(kFull, in);
        const int p = run[r] + __popc(b & below);
        if (t < w1) {
          send_pos[static_cast<size_t>(t) * W + r] = in ? p : -1;
          is_in[static_cast<size_t>(t) * W + r] = in;
          if (in) send_list[static_cast<size_t>(r) * c.max_tokens + p] = t;
        }
        run[r] += __popc(b);
      }
    }
  };
#pragma unroll
  for (int j = 0; j < kKeepChunks; ++j)
    if (j < nchunks) place(w0 + j * 32 + lane, (keep[j / 4] >> (8 * (j % 4))) & 0xffu);
  for (int j = kKeepChunks; j < nchunks; ++j) {
    const int t = w0 + j * 32 + lane;
    bool unused = false;
    place(t, t < w1 ? notify_token_mask<false>(topk_idx + static_cast<size_t>(t) * K, K, vec, ediv, E, nullptr, unused)
                    : 0u);
  }

  if (block_wait_peers(c, F_COUNT, n, me, K_NOTIFY, deadline, &s_fail)) return;
  const int* meta = reinterpret_cast<const int*>(c.peers[me] + c.off_meta);
  if (tid == 0) {
    int acc = 0;
    for (int s = 0; s < W; ++s) {
      const int v = ld_volatile(meta + s * stride);
      recv_off[s] = acc;
      if (host_recv_off) host_recv_off[s] = acc;
      c.host->recv_counts[s] = v;
      acc += v;
    }
    recv_off[W] = acc;
    if (host_recv_off) host_recv_off[W] = acc;
    c.host->num_recv = acc;
  }
  for (int j = tid; j < EL; j += blockDim.x) {
    int sum = 0;
    for (int s = 0; s < W; ++s) sum += ld_volatile(meta + s * stride + 1 + j);
    tpe[j] = sum;
    if (host_tpe) host_tpe[j] = sum;
    c.host->tokens_per_expert[j] = sum;
  }
  if (tid < W) c.host->send_counts[tid] = s_total[tid];
  if (bad_id) c.host->bad_expert_ids = 1;
  __syncthreads();
  if (tid < W && tid != me) st_release_sys(flag_at(c, tid, F_META_ACK, me), n);
  if (tid == 0) c.epochs[E_NOTIFY] = n;
}

}  // namespace

void launch_notify(const Ctx& c, const int64_t* topk_idx, int T, int K, int* send_pos, bool* is_in,
                   int* recv_off, int64_t* tpe, int64_t* host_tpe, int* host_recv_off, bool merge_repeats,
                   cudaStream_t stream) {
  // Per-expert counts live in shared memory, within the default 48 KiB a launch may ask for.
  const size_t smem = sizeof(int) * c.num_experts;
  EP_CHECK_ARG(smem <= 48 * 1024, "too many experts for the notify kernel: num_experts=%d, at most %d",
               c.num_experts, static_cast<int>(48 * 1024 / sizeof(int)));
  const auto kernel = merge_repeats ? notify_kernel<true> : notify_kernel<false>;
  kernel<<<1, kNotifyThreads, smem, stream>>>(c, topk_idx, T, K, send_pos, is_in, recv_off, tpe, host_tpe,
                                              host_recv_off);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nvl
}  // namespace ep
