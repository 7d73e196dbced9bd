// pull with bulk copies (TMA): the same receive as pull_kernel in dispatch.cu (rows grouped by source,
// straight into the output; local expert ids, weights, FP8 scales; padding rows of a worst-case output;
// PULL_DONE released at every rank), with the rows moved by the TMA unit instead of registers.
//
// Why: the register pull is bound by bytes in flight per SM (16 warps x 8 x 16 B = 64 KB; its time
// falls almost linearly with SMs: 920 -> 409 us from 8 to 24 SMs at EP2). Here one thread per block
// keeps up to nslot - kLag whole rows in flight (a ring of nslot row slots in shared memory, ~190 KB),
// each a bulk load from a peer's stage area followed by a bulk store into out_x.
//
// Block b owns a contiguous share of the received rows, walked in chunks of kChunkRows. Warps 1..15
// resolve chunk n+1 (source token, ids, weights, scales: independent remote loads) while thread 0
// streams chunk n's rows through the ring; a __syncthreads separates the chunks (double-buffered
// source/token arrays). Ring rule: a load into a slot waits until the store that last read the slot
// is done reading; with at most nslot - kLag loads outstanding, at least kLag stores were issued
// after that one, so cp.async.bulk.wait_group.read kLag suffices and rarely blocks.
#include "common/error.h"
#include "common/tma.cuh"
#include "nvlink/device.cuh"
#include "nvlink/kernels.h"
#include "nvlink/pull_meta.cuh"

namespace ep {
namespace nvl {
namespace {

constexpr int kChunkRows = 256;
constexpr int kLag = 2;                       // stores left draining while the next loads issue
constexpr int kMaxSlots = 32;
constexpr int kRingBytes = 190 * 1024;        // dynamic shared memory for the row slots

__global__ void __launch_bounds__(kThreads)
pull_tma_kernel(Ctx c, char* __restrict__ out_x, int row_bytes, float* __restrict__ out_scales, int nscales,
                int64_t* __restrict__ out_idx, float* __restrict__ out_w, int K, const int* __restrict__ recv_off,
                int* __restrict__ recv_src, int cached, int R_alloc, int nslot) {
  extern __shared__ __align__(128) char s_ring[];
  __shared__ uint64_t s_bar[kMaxSlots];
  __shared__ int s_src[2][kChunkRows], s_tok[2][kChunkRows];
  __shared__ int s_off[kMaxRanks + 1];
  __shared__ int s_fail;
  const int tid = threadIdx.x;
  const int W = c.world, me = c.rank, EL = c.local_experts;
  const int e = c.epochs[E_DISPATCH] + 1;
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  if (tid == 0) {
    for (int s = 0; s < nslot; ++s) mbar_init(&s_bar[s], 1);
    fence_mbar_init();
  }
  if (tid <= W) s_off[tid] = recv_off[tid];
  if (block_wait_peers(c, F_STAGE, e, -1, K_PULL, deadline, &s_fail)) return;
  const int R = s_off[W];
  const int64_t lo = static_cast<int64_t>(me) * EL, hi = lo + EL;
  const int per_block = (R + gridDim.x - 1) / gridDim.x;
  const int r0 = min(R, static_cast<int>(blockIdx.x) * per_block), r1 = min(R, r0 + per_block);
  const int nchunks = (r1 - r0 + kChunkRows - 1) / kChunkRows;
  const int mt = tid - 32, nmt = blockDim.x - 32;  // the metadata threads (warps 1..)
  int issued = r0, stored = r0;                     // thread 0's ring state

  auto store_row = [&](int row) {  // thread 0: wait for row's load, then write it out
    const int u = row - r0, slot = u % nslot;
    mbar_wait(&s_bar[slot], (u / nslot) & 1);  // a bulk load in flight always completes: no deadline
    tma_store(out_x + static_cast<size_t>(row) * row_bytes, s_ring + static_cast<size_t>(slot) * row_bytes,
              row_bytes);
  };

  if (tid == 0) fence_proxy_async();  // the peers' stage writes, acquired above, before the bulk loads
  for (int n = 0; n <= nchunks; ++n) {
    if (tid >= 32 && n < nchunks) {  // resolve chunk n
      const int a = r0 + n * kChunkRows, b = min(r1, a + kChunkRows);
      int* src_of = s_src[n & 1];
      int* tok_of = s_tok[n & 1];
      for (int i = a + mt; i < b; i += nmt) {
        const int src = find_src(s_off, W, i);
        const int tok = pull_row_token(c, s_off, src, i, cached, recv_src);
        src_of[i - a] = src;
        tok_of[i - a] = tok;
        if (out_idx || out_w) pull_row_meta(c, src, tok, i, K, lo, hi, out_idx, out_w);
      }
    } else if (tid == 0 && n > 0) {  // stream chunk n - 1 through the ring
      const int a = r0 + (n - 1) * kChunkRows, b = min(r1, a + kChunkRows);
      const int* src_of = s_src[(n - 1) & 1];
      const int* tok_of = s_tok[(n - 1) & 1];
      for (int row = a; row < b; ++row) {
        while (issued - stored >= nslot - kLag) store_row(stored++);
        tma_store_wait_read<kLag>();
        const int slot = (row - r0) % nslot;
        const char* from = c.peers[src_of[row - a]] + c.off_stage_x + static_cast<size_t>(tok_of[row - a]) * row_bytes;
        tma_load(s_ring + static_cast<size_t>(slot) * row_bytes, from, row_bytes, &s_bar[slot]);
        ++issued;
      }
    }
    __syncthreads();
    if (out_scales && n < nchunks) {  // FP8 scales of chunk n (sources known now): a flat stream of floats
      const int a = r0 + n * kChunkRows, b = min(r1, a + kChunkRows);
      const int* src_of = s_src[n & 1];
      const int* tok_of = s_tok[n & 1];
      // thread 0 may be streaming; the others copy (chunk n's arrays are not overwritten before the next sync)
      for (int v = (tid >= 32 ? mt : -1); v >= 0 && v < (b - a) * nscales; v += nmt) {
        const int j = v / nscales, col = v - j * nscales;
        out_scales[static_cast<size_t>(a + j) * nscales + col] =
            reinterpret_cast<const float*>(c.peers[src_of[j]] + c.off_stage_scales)[static_cast<size_t>(tok_of[j]) * nscales + col];
      }
    }
  }
  if (tid == 0) {
    while (stored < issued) store_row(stored++);
    tma_store_wait_all();  // out_x written before PULL_DONE and the kernel's end
  }
  pull_pad_rows(R, R_alloc, K, out_idx, out_w);
  if (last_block(c.counters + C_PULL)) {
    if (tid < W) st_release_sys(flag_at(c, tid, F_PULL_DONE, me), e);
    if (tid == 0) c.epochs[E_DISPATCH] = e;
  }
}

}  // namespace

int pull_tma_slots(int row_bytes) {
  if (row_bytes <= 0 || row_bytes % 16) return 0;
  return min(kMaxSlots, kRingBytes / row_bytes);
}

bool pull_tma_fits(int row_bytes) { return pull_tma_slots(row_bytes) > kLag; }

void launch_pull_tma(const Ctx& c, int blocks, int4* out_x, int row_bytes, float* out_scales, int nscales,
                     int64_t* out_idx, float* out_w, int K, const int* recv_off, int* recv_src, int cached,
                     int R_alloc, cudaStream_t stream) {
  static bool attr_set = false;  // per process: the kernel's shared memory limit raised once
  if (!attr_set) {
    EP_CUDA_CHECK(cudaFuncSetAttribute(pull_tma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kRingBytes));
    attr_set = true;
  }
  const int nslot = pull_tma_slots(row_bytes);
  pull_tma_kernel<<<blocks, kThreads, static_cast<size_t>(nslot) * row_bytes, stream>>>(
      c, reinterpret_cast<char*>(out_x), row_bytes, out_scales, nscales, out_idx, out_w, K, recv_off, recv_src,
      cached, R_alloc, nslot);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nvl
}  // namespace ep
