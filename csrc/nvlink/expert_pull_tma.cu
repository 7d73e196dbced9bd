// expert_pull with bulk copies (TMA), for BF16 rows: the same result as expert_pull_kernel in expert.cu
// (positions resolved and written back, weights, zero padding rows, PULL_DONE released), with each
// received row loaded once into a shared-memory ring (common/tma.cuh's BulkRing) and written by bulk
// stores into every one of its local experts' positions. The register version reads a row in
// dependent rounds of 8 loads per lane, one row per warp at a time; here one thread per block keeps
// up to ~10 rows of 14 KB in flight and the other warps resolve the next chunk's positions (a thread
// per (row, k): the lookups of one slot depend on each other, so slots must not queue in one thread).
//
// Rows are partitioned as in expert_meta (warp gw of the grid owns [gw * per_warp, ...)), so the
// block's rows are contiguous and a row's warp prefix in the scratch is found from its index.
#include "common/error.h"
#include "common/tma.cuh"
#include "nvlink/device.cuh"
#include "nvlink/kernels.h"
#include "nvlink/pull_meta.cuh"

namespace ep {
namespace nvl {
namespace {

constexpr int kWarps = kThreads / 32;
constexpr int kChunkRows = 64;

__global__ void __launch_bounds__(kThreads)
expert_pull_tma_kernel(Ctx c, char* __restrict__ out_x, int row_bytes, float* __restrict__ out_w, int K, const int* __restrict__ recv_off,
                       const int* __restrict__ recv_src, int* __restrict__ positions,
                       const int64_t* __restrict__ out_idx, int cached, const int* __restrict__ scratch,
                       const int64_t* __restrict__ offsets, const int64_t* __restrict__ counts, int nslot) {
  extern __shared__ __align__(128) char s_ring[];
  __shared__ uint64_t s_bar[kRingMaxSlots];
  __shared__ int s_src[2][kChunkRows], s_tok[2][kChunkRows];
  __shared__ int s_pos[2][kChunkRows][kMaxTopk];  // a chunk's positions (-1: not a local expert)
  __shared__ int s_slot_pos[kRingMaxSlots][kMaxTopk];  // the positions of the row in each ring slot
  __shared__ int s_off[kMaxRanks + 1];
  __shared__ int s_fail;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int W = c.world, me = c.rank, EL = c.local_experts;
  const int e = c.epochs[E_DISPATCH] + 1;
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  BulkRing<kRingLag> ring{s_ring, s_bar, nslot, row_bytes};
  if (tid == 0) ring.init();
  if (tid <= W) s_off[tid] = recv_off[tid];
  // A cached dispatch waits for the stage here; a fresh one's meta kernel has waited already (any
  // epoch passes), and this kernel only checks the abort word.
  if (block_wait_peers(c, F_STAGE, cached ? e : e - (1 << 30), -1, K_PULL, deadline, &s_fail)) return;
  const int R = s_off[W];
  const int NW = gridDim.x * kWarps;
  const int per_warp = (R + NW - 1) / NW;
  const int r0 = min(R, static_cast<int>(blockIdx.x) * kWarps * per_warp), r1 = min(R, r0 + kWarps * per_warp);
  const int* blk = scratch + static_cast<size_t>(NW) * EL + static_cast<size_t>(blockIdx.x) * EL;
  const int nchunks = (r1 - r0 + kChunkRows - 1) / kChunkRows;
  const int mt = tid - 32, nmt = blockDim.x - 32;  // the metadata threads (warps 1..)

  auto store_oldest = [&]() {  // thread 0: the oldest row into each of its positions, one bulk group
    const int* pos = s_slot_pos[ring.slot_of(ring.tail)];
    const char* row = ring.wait_oldest();
    for (int k = 0; k < K; ++k)
      if (pos[k] >= 0) tma_store(out_x + static_cast<size_t>(pos[k]) * row_bytes, row, row_bytes);
    ring.pop();
  };

  if (tid == 0) fence_proxy_async();  // the peers' stage writes, acquired before, ahead of the bulk loads
  for (int n = 0; n <= nchunks; ++n) {
    if (tid >= 32 && n < nchunks) {  // resolve chunk n: one thread per (row, k), all loads independent
      const int a = r0 + n * kChunkRows, b = min(r1, a + kChunkRows);
      for (int v = mt; v < (b - a) * K; v += nmt) {
        const int j = v / K, k = v - j * K, i = a + j;
        const int src = find_src(s_off, W, i), tok = recv_src[i];
        int pos = positions[static_cast<size_t>(i) * K + k];
        if (pos >= 0 && !cached) {
          const int x = static_cast<int>(out_idx[static_cast<size_t>(i) * K + k]);
          pos += scratch[static_cast<size_t>(i / per_warp) * EL + x] + blk[x];  // warp prefix + block base
          positions[static_cast<size_t>(i) * K + k] = pos;
        }
        if (pos >= 0 && out_w)
          out_w[pos] = reinterpret_cast<const float*>(c.peers[src] + c.off_stage_w)[static_cast<size_t>(tok) * K + k];
        s_pos[n & 1][j][k] = pos;
        if (k == 0) {
          s_src[n & 1][j] = src;
          s_tok[n & 1][j] = tok;
        }
      }
    } else if (tid == 0 && n > 0) {  // stream chunk n - 1 through the ring
      const int a = r0 + (n - 1) * kChunkRows, b = min(r1, a + kChunkRows);
      const int buf = (n - 1) & 1;
      for (int row = a; row < b; ++row) {
        while (ring.full()) store_oldest();
        int* slot_pos = s_slot_pos[ring.slot_of(ring.head)];
        for (int k = 0; k < K; ++k) slot_pos[k] = s_pos[buf][row - a][k];
        ring.load(c.peers[s_src[buf][row - a]] + c.off_stage_x + static_cast<size_t>(s_tok[buf][row - a]) * row_bytes,
                  row_bytes);
      }
    }
    __syncthreads();
  }
  if (tid == 0) {
    while (!ring.empty()) store_oldest();
    tma_store_wait_all();  // out_x written before PULL_DONE and the kernel's end
    fence_proxy_async();   // ... and ordered before the generic release below
  }
  expert_pad_rows(blockIdx.x * kWarps + warp, NW, lane, EL, offsets, counts, reinterpret_cast<int4*>(out_x),
                  row_bytes / 16, nullptr, 0, out_w);
  if (last_block(c.counters + C_PULL)) {
    if (tid < W) st_release_sys(flag_at(c, tid, F_PULL_DONE, me), e);
    if (tid == 0) c.epochs[E_DISPATCH] = e;
  }
}

}  // namespace

// FP8 rows stay with the register kernel: a version of this one that scattered their scales from the
// metadata warps after each chunk was bound by them (2x H200, 4096 tokens, hidden 7168, cold: FP8
// 553 us against 460 us with registers; BF16 588 against 622 us).
bool expert_pull_tma_fits(int row_bytes, int K, int nscales) {
  return nscales == 0 && K <= kMaxTopk && ring_slots(row_bytes) > kRingLag && tma_supported();
}

void launch_expert_pull_tma(const Ctx& c, int blocks, int4* out_x, int row_bytes, float* out_scales, int nscales,
                            float* out_w, int K, const int* recv_off, const int* recv_src, int* positions,
                            const int64_t* out_idx, int cached, const int* scratch, const int64_t* offsets,
                            const int64_t* counts, cudaStream_t stream) {
  EP_CHECK_ARG(out_scales == nullptr && nscales == 0, "the bulk-copy expert pull takes BF16 rows only");
  static bool smem_set[64] = {};
  ring_smem_once(expert_pull_tma_kernel, smem_set);
  const int nslot = ring_slots(row_bytes);
  expert_pull_tma_kernel<<<blocks, kThreads, static_cast<size_t>(nslot) * row_bytes, stream>>>(
      c, reinterpret_cast<char*>(out_x), row_bytes, out_w, K, recv_off, recv_src, positions,
      out_idx, cached, scratch, offsets, counts, nslot);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nvl
}  // namespace ep
