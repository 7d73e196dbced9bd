// Expert-major receive: the rows addressed to this rank go straight from the sources' stage areas
// into their local experts' segments (one copy per (token, local expert)), with no rank-major copy
// and no permute pass after it. Replaces `pull` in an expert-major dispatch; notify and stage are
// the same.
//
// Layout (the reference is ep_plugin/expert_major.py): expert e's rows start at offsets[e], each
// segment padded with zero rows to a multiple of `alignment`; inside a segment rows keep the
// received order (source rank, then position on the source), so the layout is deterministic.
//
// Two kernels, over the same partition of the received rows (a warp owns a contiguous share and
// walks it in batches of 32 rows), so the second finds in the scratch what the first left there:
//   expert_meta : (after STAGE from every rank) per row: source token (recv_src), local expert ids
//                 (out_idx, rank-major [R, K]), and for each local slot its rank among this warp's
//                 routes of that expert (from a per-warp bit mask of the batch's lanes per expert).
//                 Per block: the warps' exclusive prefix per expert; the last block scans the
//                 blocks, pads the segments and writes offsets [E_local + 1], so that
//                 position = rank in warp + warp prefix + block base (block base includes offsets).
//   expert_pull : turns the ranks into positions (written back into `positions`, the map combine
//                 needs) and copies each row once from NVLink into every one of its positions
//                 (+ weights, FP8 scales); zeroes the padding rows; the last block releases
//                 PULL_DONE[me] = e at every rank and sets epochs[E_DISPATCH] = e.
// A cached dispatch runs expert_pull alone, with the positions of the handle.
#include "common/error.h"
#include "nvlink/device.cuh"
#include "nvlink/kernels.h"
#include "nvlink/pull_meta.cuh"

namespace ep {
namespace nvl {
namespace {

constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

__global__ void __launch_bounds__(kThreads)
expert_meta_kernel(Ctx c, int64_t* __restrict__ out_idx, const int* __restrict__ recv_off,
                   int* __restrict__ recv_src, int* __restrict__ positions, int K, int R_alloc, int alignment,
                   int* __restrict__ scratch, int64_t* __restrict__ offsets) {
  extern __shared__ int smem[];
  int* s_mask = smem;                       // [kWarps][EL]: lanes of the batch routing to e
  int* s_run = smem + kWarps * c.local_experts;  // [kWarps][EL]: routes of e in this warp so far
  __shared__ int s_off[kMaxRanks + 1];
  __shared__ int s_fail;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int W = c.world, me = c.rank, EL = c.local_experts;
  const int e = c.epochs[E_DISPATCH] + 1;
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  for (int i = tid; i < 2 * kWarps * EL; i += blockDim.x) smem[i] = 0;
  if (tid <= W) s_off[tid] = recv_off[tid];
  if (block_wait_peers(c, F_STAGE, e, -1, K_PULL, deadline, &s_fail)) return;
  const int R = s_off[W];
  const int gw = blockIdx.x * kWarps + warp, NW = gridDim.x * kWarps;
  const int64_t lo = static_cast<int64_t>(me) * EL;
  const int per_warp = (R + NW - 1) / NW;
  const int r0 = min(R, gw * per_warp), r1 = min(R, r0 + per_warp);
  int* mask = s_mask + warp * EL;
  int* run = s_run + warp * EL;
  for (int b = r0; b < r1; b += 32) {
    const int i = b + lane;
    const bool have = i < r1;
    int64_t loc[kMaxTopk];
    if (have) {
      const int src = find_src(s_off, W, i);
      const int* sl = reinterpret_cast<const int*>(c.peers[src] + c.off_send_list);
      const int tok = ld_volatile(sl + static_cast<size_t>(me) * c.max_tokens + (i - s_off[src]));
      recv_src[i] = tok;
      const int64_t* gi = reinterpret_cast<const int64_t*>(c.peers[src] + c.off_stage_idx) + static_cast<size_t>(tok) * K;
#pragma unroll 8
      for (int k = 0; k < K; ++k) {
        const int64_t g = gi[k] - lo;
        loc[k] = (g >= 0 && g < EL) ? g : -1;
      }
      for (int k = 0; k < K; ++k) {
        out_idx[static_cast<size_t>(i) * K + k] = loc[k];
        if (loc[k] >= 0) atomicOr(mask + loc[k], 1 << lane);
      }
    }
    __syncwarp();
    if (have) {
      for (int k = 0; k < K; ++k) {
        int rel = -1;
        if (loc[k] >= 0) rel = run[loc[k]] + __popc(mask[loc[k]] & lanemask_lt());
        positions[static_cast<size_t>(i) * K + k] = rel;
      }
    }
    __syncwarp();
    for (int x = lane; x < EL; x += 32) {
      const int m = mask[x];
      if (m) {
        run[x] += __popc(m);
        mask[x] = 0;
      }
    }
    __syncwarp();
  }
  // Rows past R of a worst-case-sized output route nowhere.
  for (int i = R + blockIdx.x * blockDim.x + tid; i < R_alloc; i += gridDim.x * blockDim.x)
    for (int k = 0; k < K; ++k) {
      out_idx[static_cast<size_t>(i) * K + k] = -1;
      positions[static_cast<size_t>(i) * K + k] = -1;
    }
  __syncthreads();
  // scratch: wpre [NW][EL] (warp prefix inside its block), blk [gridDim][EL] (block count, then base)
  int* wpre = scratch;
  int* blk = scratch + static_cast<size_t>(NW) * EL;
  for (int x = tid; x < EL; x += blockDim.x) {
    int acc = 0;
    for (int w = 0; w < kWarps; ++w) {
      wpre[static_cast<size_t>(blockIdx.x * kWarps + w) * EL + x] = acc;
      acc += s_run[w * EL + x];
    }
    blk[static_cast<size_t>(blockIdx.x) * EL + x] = acc;
  }
  if (last_block(c.counters + C_META)) {
    // per expert: blocks' exclusive prefix (in place) and total; then the aligned segment starts
    int* s_tot = smem;  // reuses the masks: every warp of this block is done with them
    for (int x = tid; x < EL; x += blockDim.x) {
      int acc = 0;
      for (int bk = 0; bk < gridDim.x; ++bk) {
        int* p = blk + static_cast<size_t>(bk) * EL + x;
        const int v = *p;
        *p = acc;
        acc += v;
      }
      s_tot[x] = (acc + alignment - 1) / alignment * alignment;
    }
    __syncthreads();
    if (warp == 0) {  // exclusive scan of the padded totals, 32 experts per step
      int carry = 0;
      for (int x0 = 0; x0 < EL; x0 += 32) {
        const int x = x0 + lane;
        const int v = x < EL ? s_tot[x] : 0;
        int inc = v;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
          const int u = __shfl_up_sync(kFull, inc, d);
          if (lane >= d) inc += u;
        }
        if (x < EL) {
          offsets[x] = carry + inc - v;
          s_tot[x] = carry + inc - v;
        }
        carry += __shfl_sync(kFull, inc, 31);
      }
      if (lane == 0) offsets[EL] = carry;
    }
    __syncthreads();
    for (int i = tid; i < gridDim.x * EL; i += blockDim.x) blk[i] += s_tot[i % EL];
  }
}

// A warp per row at a time (the rows expert_meta gave this warp): lanes < K resolve the row's
// positions (ballot of the valid ones), then the row is read once over NVLink, kPullU vectors per
// lane in flight, and stored at every position. (Measured on 2x H200, 4096 tokens x 7168, top-8:
// faster than streaming a batch of rows through shared-memory position lists, 613 vs 899 us.)
__global__ void __launch_bounds__(kThreads)
expert_pull_kernel(Ctx c, int4* __restrict__ out_x, int row_bytes, float* __restrict__ out_scales, int nscales,
                   float* __restrict__ out_w, int K, const int* __restrict__ recv_off,
                   const int* __restrict__ recv_src, int* __restrict__ positions, const int64_t* __restrict__ out_idx,
                   int cached, const int* __restrict__ scratch, const int64_t* __restrict__ offsets,
                   const int64_t* __restrict__ counts) {
  __shared__ int s_off[kMaxRanks + 1];
  __shared__ int s_fail;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int W = c.world, me = c.rank, EL = c.local_experts;
  const int e = c.epochs[E_DISPATCH] + 1;
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  if (tid <= W) s_off[tid] = recv_off[tid];
  // A cached dispatch waits for the stage here; a fresh one's meta kernel has waited already (any
  // epoch passes), and this kernel only checks the abort word.
  if (block_wait_peers(c, F_STAGE, cached ? e : e - (1 << 30), -1, K_PULL, deadline, &s_fail)) return;
  const int R = s_off[W];
  const int n16 = row_bytes / 16;
  const int gw = blockIdx.x * kWarps + warp, NW = gridDim.x * kWarps;
  const int* wpre = scratch + static_cast<size_t>(gw) * EL;
  const int* blk = scratch + static_cast<size_t>(NW) * EL + static_cast<size_t>(blockIdx.x) * EL;
  const int per_warp = (R + NW - 1) / NW;
  const int r0 = min(R, gw * per_warp), r1 = min(R, r0 + per_warp);
  for (int i = r0; i < r1; ++i) {
    const int src = find_src(s_off, W, i);
    const int tok = recv_src[i];
    int pos = -1;
    if (lane < K) {
      pos = positions[static_cast<size_t>(i) * K + lane];
      if (pos >= 0 && !cached) {
        const int x = static_cast<int>(out_idx[static_cast<size_t>(i) * K + lane]);
        pos += wpre[x] + blk[x];
        positions[static_cast<size_t>(i) * K + lane] = pos;
      }
      if (pos >= 0 && out_w)
        out_w[pos] = reinterpret_cast<const float*>(c.peers[src] + c.off_stage_w)[static_cast<size_t>(tok) * K + lane];
    }
    const unsigned dmask = __ballot_sync(kFull, pos >= 0);
    const int4* row = reinterpret_cast<const int4*>(c.peers[src] + c.off_stage_x + static_cast<size_t>(tok) * row_bytes);
    for (int v0 = 0; v0 < n16; v0 += 32 * kPullU) {
      int4 v[kPullU];
#pragma unroll
      for (int u = 0; u < kPullU; ++u) {
        const int j = v0 + u * 32 + lane;
        if (j < n16) v[u] = ld_nc_v4(row + j);
      }
      for (unsigned m = dmask; m; m &= m - 1) {
        const int p = __shfl_sync(kFull, pos, __ffs(m) - 1);
        int4* dst = out_x + static_cast<size_t>(p) * n16;
#pragma unroll
        for (int u = 0; u < kPullU; ++u) {
          const int j = v0 + u * 32 + lane;
          if (j < n16) st_na_v4(dst + j, v[u]);
        }
      }
    }
    if (out_scales) {
      const float* ss = reinterpret_cast<const float*>(c.peers[src] + c.off_stage_scales) + static_cast<size_t>(tok) * nscales;
      for (int j0 = 0; j0 < nscales; j0 += 32) {
        const int j = j0 + lane;
        const float f = j < nscales ? ss[j] : 0.f;
        for (unsigned m = dmask; m; m &= m - 1) {
          const int p = __shfl_sync(kFull, pos, __ffs(m) - 1);
          if (j < nscales) out_scales[static_cast<size_t>(p) * nscales + j] = f;
        }
      }
    }
  }
  expert_pad_rows(gw, NW, lane, EL, offsets, counts, out_x, n16, out_scales, nscales, out_w);
  if (last_block(c.counters + C_PULL)) {
    if (tid < W) st_release_sys(flag_at(c, tid, F_PULL_DONE, me), e);
    if (tid == 0) c.epochs[E_DISPATCH] = e;
  }
}

}  // namespace

size_t expert_scratch_ints(int blocks, int local_experts) {
  return static_cast<size_t>(blocks) * (kWarps + 1) * local_experts;
}

void launch_expert_meta(const Ctx& c, int blocks, int64_t* out_idx, const int* recv_off, int* recv_src,
                        int* positions, int K, int R_alloc, int alignment, int* scratch, int64_t* offsets,
                        cudaStream_t stream) {
  const size_t smem = sizeof(int) * 2 * kWarps * c.local_experts;
  EP_CHECK_ARG(smem <= 48 * 1024, "too many local experts for the expert-major receive: %d, at most %d",
               c.local_experts, static_cast<int>(48 * 1024 / (sizeof(int) * 2 * kWarps)));
  expert_meta_kernel<<<blocks, kThreads, smem, stream>>>(c, out_idx, recv_off, recv_src, positions, K, R_alloc,
                                                         alignment, scratch, offsets);
  EP_CUDA_CHECK(cudaGetLastError());
}

void launch_expert_pull(const Ctx& c, int blocks, int4* out_x, int row_bytes, float* out_scales, int nscales,
                        float* out_w, int K, const int* recv_off, const int* recv_src, int* positions,
                        const int64_t* out_idx, int cached, const int* scratch, const int64_t* offsets,
                        const int64_t* counts, cudaStream_t stream) {
  expert_pull_kernel<<<blocks, kThreads, 0, stream>>>(c, out_x, row_bytes, out_scales, nscales, out_w, K, recv_off,
                                                      recv_src, positions, out_idx, cached, scratch, offsets,
                                                      counts);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nvl
}  // namespace ep
