// Rail dispatch: every token's routing row goes to each live rail peer (ids on that peer's node made
// local, others -1), its x row (and FP8 scales) only to the peers whose node it selects; then T and a
// signal per peer. The receive half waits for the peers and marks the slots past each source's T
// as routed nowhere. One kernel does either half or both (kSend|kRecv); rail.h has the protocol.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "nvshmem/rail_device.cuh"

namespace ep {
namespace rail {
namespace {

constexpr int kUnroll = 4;  // 16-byte loads in flight per lane before the stores

// Routing rows of this block's tokens [t0, t1) (a contiguous share, so that one NVSHMEM put per peer
// carries them) for every live node, and T (block 0). ids outside [-1, E) count as -1 and raise the
// sticky flag.
__device__ void send_routing(const Ctx& c, int p, const DispatchIn& in, int T, int K, const int* s_live,
                             bool* put) {
  const int M = c.max_tokens, N = c.nodes, E = c.num_experts;
  const int per = (T + gridDim.x - 1) / gridDim.x;
  const int t0 = min(T, static_cast<int>(blockIdx.x) * per), t1 = min(T, t0 + per);
  const long long slot0 = static_cast<long long>(c.node) * M * K;  // entry of slot n*M in a peer's topk_f
  const bool weights = in.weights != nullptr;
  bool bad = false;
  for (int j = t0 * K + threadIdx.x; j < t1 * K; j += blockDim.x) {
    const long long e = in.topk[j];
    bad |= e < -1 || e >= E;
    const int node = (e >= 0 && e < E) ? static_cast<int>(e / c.node_experts) : -1;
    const long long local = e - static_cast<long long>(node) * c.node_experts;
    const float w = weights ? in.weights[j] : 0.f;
    for (int m = 0; m < N; ++m) {
      if (!s_live[m]) continue;
      const long long id = node == m ? local : -1;
      char* base = c.peer[m];
      long long* ids;
      float* ws;
      if (base != nullptr) {
        ids = reinterpret_cast<long long*>(base + c.disp_topk[p]) + slot0 + j;
        ws = reinterpret_cast<float*>(base + c.disp_w[p]) + slot0 + j;
      } else {
        const long long at = static_cast<long long>(m) * M * K + j;
        ids = reinterpret_cast<long long*>(c.heap + c.stage_topk) + at;
        ws = reinterpret_cast<float*>(c.heap + c.stage_w) + at;
      }
      *ids = id;
      if (weights) *ws = node == m ? w : 0.f;
    }
  }
  if (bad) reinterpret_cast<volatile HostInfo*>(c.host)->bad_ids = 1;
  if (c.stage_topk >= 0 && t1 > t0) {  // block-uniform: the staged rows go out in one put per peer
    __syncthreads();
    const size_t n = static_cast<size_t>(t1 - t0) * K;
    for (int m = 0; m < N; ++m) {
      if (!s_live[m] || c.peer[m] != nullptr) continue;
      const long long at = static_cast<long long>(m) * M * K + static_cast<long long>(t0) * K;
      const long long dst = slot0 + static_cast<long long>(t0) * K;
      nvshmemx_putmem_nbi_block(reinterpret_cast<long long*>(c.heap + c.disp_topk[p]) + dst,
                                reinterpret_cast<long long*>(c.heap + c.stage_topk) + at, n * 8, rail_pe(c, m));
      if (weights)
        nvshmemx_putmem_nbi_block(reinterpret_cast<float*>(c.heap + c.disp_w[p]) + dst,
                                  reinterpret_cast<float*>(c.heap + c.stage_w) + at, n * 4, rail_pe(c, m));
    }
    *put = true;
  }
  if (blockIdx.x == 0) {  // the receive half marks the slots from T on
    for (int m = threadIdx.x; m < N; m += blockDim.x) {
      if (!s_live[m]) continue;
      const long long off = c.disp_count[p] + 4ll * c.node;
      if (c.peer[m] != nullptr) {
        *reinterpret_cast<volatile int*>(c.peer[m] + off) = T;
      } else {
        nvshmem_int_p(reinterpret_cast<int*>(c.heap + off), T, rail_pe(c, m));
        *put = true;
      }
    }
  }
}

// The x rows (and scales): a warp, or `parts` warps when tokens are fewer than warps, loads a row's
// share once and stores it to every node the token selects (lane k finds k's node; the first lane
// naming a node owns it). Peers without P2P get the share from a staged copy by an NVSHMEM put.
template <bool kFp8>
__device__ void send_rows(const Ctx& c, int p, const DispatchIn& in, int T, int K, const int* s_live, bool* put) {
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32, gwarps = gridDim.x * warps;
  const int M = c.max_tokens, S = c.scales;
  const int units = c.row_bytes / 16;
  const int parts = parts_per_row(T, gwarps);
  const int chunk = (units + parts - 1) / parts;
  for (int i = blockIdx.x * warps + threadIdx.x / 32; i < T * parts; i += gwarps) {
    const int t = i / parts, part = i % parts;
    const int node = lane < K ? node_of(c, in.topk[static_cast<long long>(t) * K + lane], s_live) : -1;
    const bool first = first_of_node(node, K, lane);
    const unsigned long long base = first ? reinterpret_cast<unsigned long long>(c.peer[node]) : 0ull;
    const unsigned dests = __ballot_sync(kFull, first);
    const unsigned puts = __ballot_sync(kFull, first && base == 0ull);
    const unsigned stores = dests & ~puts;
    const int begin = part * chunk, end = min(units, begin + chunk);
    if (dests == 0 || begin >= end) continue;
    const long long slot = static_cast<long long>(c.node) * M + t;
    const long long x_off = c.disp_x[p] + slot * c.row_bytes;
    const long long sf_off = c.disp_sf[p] + slot * S * 4;
    const int4* src = in.x + static_cast<long long>(t) * units;
    int4* stage = puts ? reinterpret_cast<int4*>(c.heap + c.stage_x + static_cast<long long>(t) * c.row_bytes) : nullptr;
    float* stage_sf = puts && kFp8 ? reinterpret_cast<float*>(c.heap + c.stage_sf) + static_cast<long long>(t) * S
                                   : nullptr;
    for (int u0 = begin; u0 < end; u0 += 32 * kUnroll) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (u0 + u * 32 + lane < end) v[u] = ld_nc_v4(src + u0 + u * 32 + lane);
      for (unsigned d = stores; d != 0; d &= d - 1) {
        int4* dst = reinterpret_cast<int4*>(reinterpret_cast<char*>(__shfl_sync(kFull, base, __ffs(d) - 1)) + x_off);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (u0 + u * 32 + lane < end) st_na_v4(dst + u0 + u * 32 + lane, v[u]);
      }
      if (puts) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (u0 + u * 32 + lane < end) st_na_v4(stage + u0 + u * 32 + lane, v[u]);
      }
    }
    if constexpr (kFp8) {
      if (part == 0) {
        const float* sc = in.scales + static_cast<long long>(t) * S;
        for (int j0 = 0; j0 < S; j0 += 32) {  // uniform loop: the shuffles need every lane
          const int j = j0 + lane;
          const float f = j < S ? __ldg(sc + j) : 0.f;
          for (unsigned d = stores; d != 0; d &= d - 1) {
            char* b = reinterpret_cast<char*>(__shfl_sync(kFull, base, __ffs(d) - 1));
            if (j < S) reinterpret_cast<float*>(b + sf_off)[j] = f;
          }
          if (puts && j < S) stage_sf[j] = f;
        }
      }
    }
    if (puts) {  // compiled, not run across nodes here (no NIC on the GPU machines); force_puts runs it over P2P
      __syncwarp();
      for (unsigned d = puts; d != 0; d &= d - 1) {
        const int pe = rail_pe(c, __shfl_sync(kFull, node, __ffs(d) - 1));
        nvshmemx_putmem_nbi_warp(c.heap + x_off + begin * 16ll, stage + begin, (end - begin) * 16ull, pe);
        if (kFp8 && part == 0) nvshmemx_putmem_nbi_warp(c.heap + sf_off, stage_sf, S * 4ull, pe);
      }
      *put = true;
    }
  }
}

// The receive half: wait for every live rail peer, then mark slots s*M + t, t >= T_s, as routed
// nowhere (a source that did not arrive: all of its slots).
__device__ void receive(const Ctx& c, int p, int K, const int* s_live) {
  __shared__ int s_from[kMaxNodes];  // T_s, or 0 where source s is left out or did not arrive
  const int M = c.max_tokens, N = c.nodes;
  const int epoch = ld_volatile(c.state + kDispRecvEpoch);
  for (int m = threadIdx.x; m < N; m += blockDim.x) {
    const bool ok = s_live[m] && wait_signal(c, c.disp_flag[p], m, epoch + 1, kKernelDispatch);
    const int t = ok ? ld_volatile(reinterpret_cast<int*>(c.heap + c.disp_count[p]) + m) : 0;
    s_from[m] = min(max(t, 0), M);
  }
  __syncthreads();
  long long* ids = reinterpret_cast<long long*>(c.heap + c.disp_topk[p]);
  float* ws = reinterpret_cast<float*>(c.heap + c.disp_w[p]);
  const long long gtid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long gsize = static_cast<long long>(gridDim.x) * blockDim.x;
  for (int m = 0; m < N; ++m) {
    const long long hi = (static_cast<long long>(m) + 1) * M * K;
    for (long long j = (static_cast<long long>(m) * M + s_from[m]) * K + gtid; j < hi; j += gsize) {
      ids[j] = -1;
      ws[j] = 0.f;
    }
  }
}

}  // namespace

template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1)
    dispatch(Ctx c, DispatchIn in, int T, int K, int phases, int send_parity, int recv_parity) {
  __shared__ int s_live[kMaxNodes];
  load_live(c, s_live);
  if (phases & kSend) {
    const int epoch = ld_volatile(c.state + kDispSendEpoch);
    bool put = false;
    send_routing(c, send_parity, in, T, K, s_live, &put);
    send_rows<kFp8>(c, send_parity, in, T, K, s_live, &put);
    finish_send(c, put, c.disp_flag[send_parity], epoch, kDispSendEpoch, kTicketDispSend, s_live);
  }
  if (phases & kRecv) {
    __syncthreads();
    receive(c, recv_parity, K, s_live);
    finish_recv(c, kDispRecvEpoch, kTicketDispRecv);
  }
}

template __global__ void dispatch<false>(Ctx, DispatchIn, int, int, int, int, int);
template __global__ void dispatch<true>(Ctx, DispatchIn, int, int, int, int, int);

}  // namespace rail
}  // namespace ep
