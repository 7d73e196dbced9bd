// dispatch: stage (the source copies its rows into its own IPC stage area) and pull (every rank
// reads the rows addressed to it out of the sources' stage areas). Pulling rather than pushing lets
// the receiver write its output in place, rows grouped by source, with no second pass.
//
// Protocol, at dispatch epoch e = epochs[E_DISPATCH] + 1 (notify has run: send lists and receive
// offsets are in place):
//   stage: wait PULL_DONE[p] >= e-1 at this rank for every peer p (p no longer reads the stage
//          area about to be overwritten); copy rows, FP8 scales, topk ids and weights; the last
//          block releases LISTS[me], STAGE[me] and every STAGE_READY[me][sub] = e at every rank,
//          itself included (the last for a peer running stage_pull_tma.cu's kernel).
//          In an expert-major dispatch (merge) the ids and weights are staged merged, as
//          ep_plugin/expert_major.py's merge_repeats defines it (csrc/layout/merge_rule.cuh): a slot
//          naming the expert of an earlier slot of its token is staged as -1, and each slot's weight is
//          the sum, in slot order, of the weights of the slots naming its expert. The receivers'
//          expert kernels then find one route per (token, expert) (notify counts it once too).
//   pull : wait STAGE[p] >= e for every rank p, itself included; copy the rows (and their local
//          expert ids and weights) out of the sources' stage areas; the last block releases
//          PULL_DONE[me] = e at every rank and sets epochs[E_DISPATCH] = e.
// A timeout records the missing peer with K_STAGE or K_PULL and returns.
// The rank-major stage has a copy-engine form (launch_stage_copies, Runtime::stage_copy_engine): the same wait in a
// one-block kernel, the arrays copied by cudaMemcpyAsync (the stage area's layout is the inputs'), the same releases
// in a one-block kernel -- no SM held while the rows move (at 8 SMs the stage kernel took 169 us, the copies 51).
#include "common/copy.cuh"
#include "layout/merge_rule.cuh"
#include "common/error.h"
#include "nvlink/device.cuh"
#include "nvlink/kernels.h"
#include "nvlink/pull_meta.cuh"

namespace ep {
namespace nvl {
namespace {

// The end of a stage, by one block: LISTS and STAGE at every rank, and every sub-chunk's STAGE_READY, so that a
// peer in stage_pull (stage_pull_tma.cu) pulls from this stage too.
__device__ __forceinline__ void release_stage(const Ctx& c, int T, int e) {
  if (threadIdx.x < c.world) {
    st_release_sys(flag_at(c, threadIdx.x, F_LISTS, c.rank), e);
    st_release_sys(flag_at(c, threadIdx.x, F_STAGE, c.rank), e);
  }
  const int nsub = (T + kStageSub - 1) / kStageSub;
  for (int i = threadIdx.x; i < nsub * c.world; i += blockDim.x)
    st_release_sys(stage_ready_at(c, i / nsub, c.rank, i % nsub), e);
}

__global__ void __launch_bounds__(kThreads)
stage_kernel(Ctx c, const int4* __restrict__ x, int T, int row_bytes, const float* __restrict__ scales,
             int nscales, const int64_t* __restrict__ idx, const float* __restrict__ w, int K, bool merge) {
  __shared__ int s_fail;
  const int e = c.epochs[E_DISPATCH] + 1;
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  if (block_wait_peers(c, F_PULL_DONE, e - 1, c.rank, K_STAGE, deadline, &s_fail)) return;
  char* base = c.peers[c.rank];
  const size_t gtid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t gsize = static_cast<size_t>(gridDim.x) * blockDim.x;
  // 8 x 16 B loads in flight per thread. (Bulk copies here measured no faster on 2x H200: a local
  // copy, bound by HBM rather than by bytes in flight.)
  grid_copy<8>(x, reinterpret_cast<int4*>(base + c.off_stage_x), static_cast<size_t>(T) * row_bytes / 16, gtid,
               gsize);
  if (scales) {
    float* dst = reinterpret_cast<float*>(base + c.off_stage_scales);
    const size_t n = static_cast<size_t>(T) * nscales;
    for (size_t i = gtid; i < n; i += gsize) dst[i] = scales[i];
  }
  if (merge && idx) {  // one thread per (token, slot): the token's K ids are a few cache lines (merge_repeats.cu)
    int64_t* dst_idx = reinterpret_cast<int64_t*>(base + c.off_stage_idx);
    float* dst_w = w ? reinterpret_cast<float*>(base + c.off_stage_w) : nullptr;
    const size_t n = static_cast<size_t>(T) * K;
    for (size_t i = gtid; i < n; i += gsize) {
      const int k = static_cast<int>(i % K);
      dst_idx[i] = merged_slot(idx + (i - k), dst_w ? w + (i - k) : nullptr, k, K, dst_w ? dst_w + i : nullptr);
    }
  } else {
    if (idx) {
      int64_t* dst = reinterpret_cast<int64_t*>(base + c.off_stage_idx);
      const size_t n = static_cast<size_t>(T) * K;
      for (size_t i = gtid; i < n; i += gsize) dst[i] = idx[i];
    }
    if (w) {
      float* dst = reinterpret_cast<float*>(base + c.off_stage_w);
      const size_t n = static_cast<size_t>(T) * K;
      for (size_t i = gtid; i < n; i += gsize) dst[i] = w[i];
    }
  }
  if (last_block(c.counters + C_STAGE)) release_stage(c, T, e);
}

// The stage by the copy engine (launch_stage_copies): a wait kernel (the peers no longer read the stage area),
// the copies, then a release kernel -- the same flags as stage_kernel's last block, unless a wait timed out.
__global__ void stage_wait_kernel(Ctx c) {
  __shared__ int s_fail;
  const int e = c.epochs[E_DISPATCH] + 1;
  block_wait_peers(c, F_PULL_DONE, e - 1, c.rank, K_STAGE, globaltimer() + c.timeout_ns, &s_fail);
}

__global__ void stage_release_kernel(Ctx c, int T) {
  if (ld_volatile(c.aborted)) return;  // a wait timed out: the copies may have overwritten rows still read
  const int e = c.epochs[E_DISPATCH] + 1;
  __threadfence_system();  // (the copies completed before this kernel began: stream order)
  release_stage(c, T, e);
}

// A warp owns an equal contiguous share of the received rows and works through it in batches of 32
// rows. Per batch: lane j fetches row j's (source, token) and writes its local topk ids/weights
// (independent remote loads, all in flight together); then the batch's rows are copied as one flat
// stream of 16-byte vectors, kPullU loads per lane in flight, with no bubble between rows.
// kRouted (Ctx::out_route): lane j also reads row j's output row, and the copy places each row there.
template <bool kRouted>
__global__ void __launch_bounds__(kThreads)
pull_kernel(Ctx c, int4* __restrict__ out_x, int row_bytes, float* __restrict__ out_scales, int nscales,
            int64_t* __restrict__ out_idx, float* __restrict__ out_w, int K,
            const int* __restrict__ recv_off, int* __restrict__ recv_src, int cached, int R_alloc) {
  __shared__ int s_off[kMaxRanks + 1];
  __shared__ int s_fail;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int W = c.world, me = c.rank, EL = c.local_experts;
  const int e = c.epochs[E_DISPATCH] + 1;
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  if (tid <= W) s_off[tid] = recv_off[tid];
  if (block_wait_peers(c, F_STAGE, e, -1, K_PULL, deadline, &s_fail)) return;
  const int R = s_off[W];
  const int n16 = row_bytes / 16;
  const int gw = blockIdx.x * nwarps + warp, NW = gridDim.x * nwarps;
  const int64_t lo = static_cast<int64_t>(me) * EL, hi = lo + EL;
  const int per_warp = (R + NW - 1) / NW;
  const int r0 = min(R, gw * per_warp), r1 = min(R, r0 + per_warp);
  for (int b = r0; b < r1; b += 32) {
    const int nrows = min(32, r1 - b);
    const int i = b + lane;
    int src = 0, tok = 0, o = i;
    if (lane < nrows) {
      src = find_src(s_off, W, i);
      tok = pull_row_token(c, s_off, src, i, cached, recv_src);
      o = out_row<kRouted>(c, i, R_alloc);
      if (out_idx || out_w) pull_row_meta(c, src, tok, o, K, lo, hi, out_idx, out_w);
    }
    // Remote rows (row j of the batch from lane j's source and token) into contiguous out_x rows, or into
    // row j's output row (routed).
    const auto from = [&](int j) {
      const int s = __shfl_sync(kFull, src, j), t = __shfl_sync(kFull, tok, j);
      return [=, &c](int vi) {
        return reinterpret_cast<const int4*>(c.peers[s] + c.off_stage_x + static_cast<size_t>(t) * row_bytes) +
               (vi - j * n16);
      };
    };
    if constexpr (kRouted) {
      warp_copy_rows<kPullU>(nrows * n16, n16, lane, from, [&](int j) {
        int4* row = out_x + static_cast<size_t>(__shfl_sync(kFull, o, j)) * n16;
        return [=](int vi) { return row + (vi - j * n16); };
      });
    } else {
      warp_copy_rows<kPullU>(nrows * n16, n16, lane, from, contiguous(out_x + static_cast<size_t>(b) * n16));
    }
    if (out_scales) {  // FP8 scales: a flat stream of floats
      const int stotal = nrows * nscales;
      for (int v0 = 0; v0 < stotal; v0 += 32 * 8) {
        float f[8];
        int at[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int vi = v0 + u * 32 + lane;
          const int j = min(vi / nscales, 31);
          const int s = __shfl_sync(kFull, src, j), t = __shfl_sync(kFull, tok, j);
          const int row = kRouted ? __shfl_sync(kFull, o, j) : b + j;
          at[u] = -1;
          if (vi < stotal) {
            const int col = vi - j * nscales;
            f[u] = reinterpret_cast<const float*>(c.peers[s] + c.off_stage_scales)[static_cast<size_t>(t) * nscales + col];
            at[u] = row * nscales + col;
          }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u)
          if (at[u] >= 0) out_scales[at[u]] = f[u];
      }
    }
  }
  pull_pad_rows<kRouted>(c, R, R_alloc, K, out_idx, out_w);  // worst-case-sized outputs
  if (last_block(c.counters + C_PULL)) {
    if (tid < W) st_release_sys(flag_at(c, tid, F_PULL_DONE, me), e);
    if (tid == 0) c.epochs[E_DISPATCH] = e;
  }
}

}  // namespace

void launch_stage(const Ctx& c, int blocks, const int4* x, int T, int row_bytes, const float* scales,
                  int nscales, const int64_t* topk_idx, const float* weights, int K, bool merge_repeats,
                  cudaStream_t stream) {
  stage_kernel<<<blocks, kThreads, 0, stream>>>(c, x, T, row_bytes, scales, nscales, topk_idx, weights, K,
                                                merge_repeats);
  EP_CUDA_CHECK(cudaGetLastError());
}

void launch_stage_copies(const Ctx& c, const int4* x, int T, int row_bytes, const float* scales, int nscales,
                         const int64_t* topk_idx, const float* weights, int K, cudaStream_t stream) {
  launch_stage_copies_begin(c, x, T, row_bytes, scales, nscales, topk_idx, weights, K, stream);
  launch_stage_copies_end(c, T, stream);
}

void launch_stage_copies_begin(const Ctx& c, const int4* x, int T, int row_bytes, const float* scales, int nscales,
                               const int64_t* topk_idx, const float* weights, int K, cudaStream_t stream) {
  stage_wait_kernel<<<1, 32, 0, stream>>>(c);
  EP_CUDA_CHECK(cudaGetLastError());
  char* base = c.peers[c.rank];
  const size_t t = static_cast<size_t>(T);
  auto copy = [&](size_t off, const void* src, size_t bytes) {
    if (src != nullptr && bytes > 0)
      EP_CUDA_CHECK(cudaMemcpyAsync(base + off, src, bytes, cudaMemcpyDeviceToDevice, stream));
  };
  copy(c.off_stage_x, x, t * row_bytes);
  copy(c.off_stage_scales, scales, t * nscales * sizeof(float));
  copy(c.off_stage_idx, topk_idx, t * K * sizeof(int64_t));
  copy(c.off_stage_w, weights, t * K * sizeof(float));
}

void launch_stage_copies_end(const Ctx& c, int T, cudaStream_t stream) {
  stage_release_kernel<<<1, 256, 0, stream>>>(c, T);
  EP_CUDA_CHECK(cudaGetLastError());
}

void launch_pull(const Ctx& c, int blocks, int4* out_x, int row_bytes, float* out_scales, int nscales,
                 int64_t* out_idx, float* out_w, int K, const int* recv_off, int* recv_src, int cached,
                 int R_alloc, cudaStream_t stream) {
  const auto kernel = c.out_route.out_rows != nullptr ? pull_kernel<true> : pull_kernel<false>;
  kernel<<<blocks, kThreads, 0, stream>>>(c, out_x, row_bytes, out_scales, nscales, out_idx, out_w, K, recv_off,
                                          recv_src, cached, R_alloc);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nvl
}  // namespace ep
