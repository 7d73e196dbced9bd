// pull with bulk copies (TMA): the same receive as pull_kernel in dispatch.cu (rows grouped by source,
// straight into the output; local expert ids, weights, FP8 scales; padding rows of a worst-case output;
// PULL_DONE released at every rank), with the rows moved by the TMA unit instead of registers.
//
// Why: the register pull is bound by bytes in flight per SM (16 warps x 8 x 16 B = 64 KB; its time
// falls almost linearly with SMs: 920 -> 409 us from 8 to 24 SMs at EP2). Here one thread per block
// keeps whole rows in flight (common/tma.cuh's RunRing over ~176 KB of shared memory), each run of rows (consecutive
// tokens of one source to consecutive output rows, up to kRunRows) a bulk load from a peer's stage area followed
// by a bulk store into out_x.
//
// Block b owns a contiguous share of the received rows, walked in chunks of kChunkRows. Warps 1..15
// resolve chunk n+1 (source token, ids, weights, scales: independent remote loads) while thread 0
// streams chunk n's rows through the ring; a __syncthreads separates the chunks (double-buffered
// source/token arrays).
//
// kRouted (Ctx::out_route): the metadata threads also resolve each row's output row, thread 0 records it
// per ring slot when it loads the row and stores the row there; ids, weights and scales go there too.
#include "common/error.h"
#include "common/tma.cuh"
#include "nvlink/device.cuh"
#include "nvlink/kernels.h"
#include "nvlink/pull_meta.cuh"

namespace ep {
namespace nvl {
namespace {

constexpr int kChunkRows = 256;

template <bool kRouted>
__global__ void __launch_bounds__(kThreads)
pull_tma_kernel(Ctx c, char* __restrict__ out_x, int row_bytes, float* __restrict__ out_scales, int nscales,
                int64_t* __restrict__ out_idx, float* __restrict__ out_w, int K, const int* __restrict__ recv_off,
                int* __restrict__ recv_src, int cached, int R_alloc, int nslot) {
  extern __shared__ __align__(128) char s_ring[];
  __shared__ uint64_t s_bar[kRingMaxSlots];
  __shared__ int s_src[2][kChunkRows], s_tok[2][kChunkRows];
  // routed: each resolved row's output row, and the output row of each ring slot's item (a slot's row may be
  // stored after the next chunk has been resolved over its chunk's arrays)
  __shared__ int s_out[2][kRouted ? kChunkRows : 1], s_dst[kRouted ? kRingMaxSlots : 1];
  __shared__ int s_off[kMaxRanks + 1];
  __shared__ int s_fail;
  const int tid = threadIdx.x;
  const int W = c.world, me = c.rank, EL = c.local_experts;
  const int e = c.epochs[E_DISPATCH] + 1;
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  __shared__ int s_len[kRingMaxSlots], s_gend[kRingMaxSlots];  // the ring's items and store groups
  RunRing<kRingLag, kRingMaxSlots> ring{s_ring, s_bar, s_len, s_gend, nslot, row_bytes};
  if (tid == 0) ring.init();
  if (tid <= W) s_off[tid] = recv_off[tid];
  if (block_wait_peers(c, F_STAGE, e, -1, K_PULL, deadline, &s_fail)) return;
  const int R = s_off[W];
  const int64_t lo = static_cast<int64_t>(me) * EL, hi = lo + EL;
  const int per_block = (R + gridDim.x - 1) / gridDim.x;
  const int r0 = min(R, static_cast<int>(blockIdx.x) * per_block), r1 = min(R, r0 + per_block);
  const int nchunks = (r1 - r0 + kChunkRows - 1) / kChunkRows;
  const int mt = tid - 32, nmt = blockDim.x - 32;  // the metadata threads (warps 1..)
  auto store_oldest = [&]() {  // thread 0: ring slot n holds row r0 + n, or the output row recorded at its load
    const int dst = kRouted ? s_dst[ring.slot_of(ring.tail)] : r0 + ring.tail;
    int n = 0;
    const char* rows = ring.wait_oldest(n);
    tma_store(out_x + static_cast<size_t>(dst) * row_bytes, rows, static_cast<uint32_t>(n) * row_bytes);
    ring.pop(n);
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
        const int o = out_row<kRouted>(c, i, R_alloc);
        src_of[i - a] = src;
        tok_of[i - a] = tok;
        if constexpr (kRouted) s_out[n & 1][i - a] = o;
        if (out_idx || out_w) pull_row_meta(c, src, tok, o, K, lo, hi, out_idx, out_w);
      }
    } else if (tid == 0 && n > 0) {  // stream chunk n - 1 through the ring
      const int a = r0 + (n - 1) * kChunkRows, b = min(r1, a + kChunkRows);
      const int* src_of = s_src[(n - 1) & 1];
      const int* tok_of = s_tok[(n - 1) & 1];
      const int* out_of = kRouted ? s_out[(n - 1) & 1] : nullptr;
      for (int row = a; row < b;) {  // a run: rows of consecutive tokens of one source to consecutive output rows
        const int j = row - a, src = src_of[j], tok = tok_of[j];
        const int len = run_rows(src_of, tok_of, out_of, j, b - a, ring.fit(kRunRows));
        while (ring.full(len)) store_oldest();
        if constexpr (kRouted) s_dst[ring.slot_of(ring.head)] = out_of[j];
        ring.load(c.peers[src] + c.off_stage_x + static_cast<size_t>(tok) * row_bytes, len);
        row += len;
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
        const int row = kRouted ? s_out[n & 1][j] : a + j;
        out_scales[static_cast<size_t>(row) * nscales + col] =
            reinterpret_cast<const float*>(c.peers[src_of[j]] + c.off_stage_scales)[static_cast<size_t>(tok_of[j]) * nscales + col];
      }
    }
  }
  if (tid == 0) {
    while (!ring.empty()) store_oldest();
    tma_store_wait_all();  // out_x written before PULL_DONE and the kernel's end
    fence_proxy_async();   // ... and ordered before the generic release below
  }
  pull_pad_rows<kRouted>(c, R, R_alloc, K, out_idx, out_w);
  if (last_block(c.counters + C_PULL)) {
    if (tid < W) st_release_sys(flag_at(c, tid, F_PULL_DONE, me), e);
    if (tid == 0) c.epochs[E_DISPATCH] = e;
  }
}

}  // namespace

bool tma_supported() {
  // The bulk-copy kernels run only where they were built for sm_90+ (EP_PLUGIN_CUDA_ARCH) and the
  // current GPU is one; cached per device (a launcher calls this on every launch).
  static int known[64] = {};  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  EP_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) return false;
  if (!known[dev]) {
    cudaFuncAttributes attr{};
    int major = 0;
    EP_CUDA_CHECK(cudaFuncGetAttributes(&attr, pull_tma_kernel<false>));
    EP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    known[dev] = attr.binaryVersion >= 90 && major >= 9 ? 1 : 2;
  }
  return known[dev] == 1;
}

bool pull_tma_fits(int row_bytes) { return ring_slots(row_bytes) > kRingLag && tma_supported(); }

namespace {

template <bool kRouted>
void launch_pull_tma_as(const Ctx& c, int blocks, int4* out_x, int row_bytes, float* out_scales, int nscales,
                        int64_t* out_idx, float* out_w, int K, const int* recv_off, int* recv_src, int cached,
                        int R_alloc, cudaStream_t stream) {
  static bool smem_set[64] = {};  // one set per instantiation: the attribute belongs to each kernel
  ring_smem_once(pull_tma_kernel<kRouted>, smem_set);
  const int nslot = ring_slots(row_bytes);
  pull_tma_kernel<kRouted><<<blocks, kThreads, static_cast<size_t>(nslot) * row_bytes, stream>>>(
      c, reinterpret_cast<char*>(out_x), row_bytes, out_scales, nscales, out_idx, out_w, K, recv_off, recv_src,
      cached, R_alloc, nslot);
}

}  // namespace

void launch_pull_tma(const Ctx& c, int blocks, int4* out_x, int row_bytes, float* out_scales, int nscales,
                     int64_t* out_idx, float* out_w, int K, const int* recv_off, int* recv_src, int cached,
                     int R_alloc, cudaStream_t stream) {
  const auto launch = c.out_route.out_rows != nullptr ? launch_pull_tma_as<true> : launch_pull_tma_as<false>;
  launch(c, blocks, out_x, row_bytes, out_scales, nscales, out_idx, out_w, K, recv_off, recv_src, cached, R_alloc,
         stream);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace nvl
}  // namespace ep
