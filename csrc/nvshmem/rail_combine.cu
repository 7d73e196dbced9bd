// Rail combine: the forwarder sends each valid slot's row of y_f back to the token's origin (slot
// s*M + t goes to rank (s, l), at its slot n*M + t), then signals every live rail peer; the origin
// sums, per token, the rows of the nodes its ids select, in float32 with nodes ascending, into BF16.
// One kernel does either half or both (kSend|kRecv); rail.h has the protocol. Slot i's row is
// y_f[y_rows[i]] where the caller passes y_rows (a one-rank node's gather back to slots, read in place);
// with y_f null the rows are in place already (Runtime::combine_targets) and the send half only signals.
// kPull (every rail peer over P2P): the rows wait in the forwarder's own comb_rows (slot s*M + t at row
// s*M + t, local stores) and the origin's receive half reads them from its rail peers; the signal then
// says "my rows for you are ready" instead of "your rows have landed" (rail.h, pulled combine).
#include <nvshmem.h>
#include <nvshmemx.h>

#include "nvshmem/rail_device.cuh"

namespace ep {
namespace rail {
namespace {

constexpr int kUnits = 2;  // 16-byte units per lane summed together
constexpr int kBatch = 4;  // rows (nodes) loaded per unit before the adds

template <bool kPull>
__device__ void send_back(const Ctx& c, int p, const int4* y_f, const int64_t* y_rows, const uint8_t* slot_valid,
                          const int* s_live, bool* put) {
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32, gwarps = gridDim.x * warps;
  const int M = c.max_tokens, NM = c.nodes * M;
  const int units = c.hidden / 8;
  // NVSHMEM puts send whole rows: one warp per row when some peer needs them
  const int parts = !kPull && c.comb_stage >= 0 ? 1 : parts_per_row(NM, gwarps);
  const int chunk = (units + parts - 1) / parts;
  for (int i = blockIdx.x * warps + threadIdx.x / 32; i < NM * parts; i += gwarps) {
    const int slot = i / parts, part = i % parts;
    const int s = slot / M, t = slot % M;
    if (!slot_valid[slot] || !s_live[s]) continue;
    const int begin = part * chunk, end = min(units, begin + chunk);
    if (begin >= end) continue;
    const int4* src = y_f + (y_rows != nullptr ? __ldg(y_rows + slot) : static_cast<long long>(slot)) * units;
    if constexpr (kPull) {  // into this rank's own row of the slot: the origin reads it from here
      warp_copy_units<4>(src, reinterpret_cast<int4*>(c.heap + c.comb_rows[p] + static_cast<long long>(slot) * c.hidden * 2),
                         begin, end, lane);
      continue;
    }
    const long long off = c.comb_rows[p] + (static_cast<long long>(c.node) * M + t) * c.hidden * 2;
    char* base = c.peer[s];
    // P2P: straight into the origin's row; RDMA: into this rank's staging row, then a put
    char* row = base != nullptr ? base + off : c.heap + c.comb_stage + static_cast<long long>(slot) * c.hidden * 2;
    warp_copy_units<4>(src, reinterpret_cast<int4*>(row), begin, end, lane);
    if (base == nullptr) {  // compiled, not run across nodes here; force_puts runs it over P2P
      __syncwarp();
      nvshmemx_putmem_nbi_warp(c.heap + off, row, static_cast<size_t>(c.hidden) * 2, rail_pe(c, s));
      *put = true;
    }
  }
}

// The receive half: wait for every live rail peer, then y[t] = sum over the nodes t selects
// (ascending, those that arrived) of the row their forwarder sent; zeros where t selects none.
// kPull: node m's row of token t is row n*M + t of the forwarder's own comb_rows, read over P2P
// (peer[m]; this rank's own for m = n), instead of row m*M + t of ours.
template <bool kPull>
__device__ void reduce_tokens(const Ctx& c, int p, const int64_t* topk, int T, int K, int4* y,
                              const int* s_live) {
  __shared__ int s_ok[kMaxNodes];
  __shared__ int s_nodes[kThreads / 32][kMaxTopk];  // per warp: the token's nodes, ascending
  const int M = c.max_tokens, N = c.nodes;
  const int epoch = ld_volatile(c.state + kCombRecvEpoch);
  for (int m = threadIdx.x; m < N; m += blockDim.x)
    s_ok[m] = s_live[m] && wait_signal(c, c.comb_flag[p], m, epoch + 1, kKernelCombine);
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int gwarps = gridDim.x * warps;
  const int units = c.hidden / 8;
  const int parts = parts_per_row(T, gwarps);
  const int chunk = (units + parts - 1) / parts;
  int* nodes = s_nodes[warp];
  const char* rows = c.heap + c.comb_rows[p];
  const long long row_bytes = c.hidden * 2ll;
  const long long pull_off = c.comb_rows[p] + static_cast<long long>(c.node) * M * row_bytes;
  // The pulled form's rows are a remote read away (~1-2 us over NVLink, not HBM's few hundred ns): twice the
  // bytes in flight per warp (4 units of a row, 2 nodes at a time; the same registers). Only how many loads
  // are issued before the adds changes; every element still adds its nodes in ascending order.
  constexpr int kU = kPull ? 4 : kUnits, kB = kPull ? 2 : kBatch;
  for (int i = blockIdx.x * warps + warp; i < T * parts; i += gwarps) {
    const int t = i / parts, part = i % parts;
    const int node = lane < K ? node_of(c, topk[static_cast<long long>(t) * K + lane], s_ok) : -1;
    const bool first = first_of_node(node, K, lane);
    const unsigned firsts = __ballot_sync(kFull, first);
    int rank = 0;  // distinct nodes below this lane's
    for (int j = 0; j < K; ++j) {
      const int o = __shfl_sync(kFull, node, j);
      if (((firsts >> j) & 1u) && o < node) ++rank;
    }
    if (first) nodes[rank] = node;
    __syncwarp();
    const int nn = __popc(firsts);
    const int begin = part * chunk, end = min(units, begin + chunk);
    for (int u0 = begin; u0 < end; u0 += 32 * kU) {
      float acc[kU][8];
#pragma unroll
      for (int u = 0; u < kU; ++u)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[u][e] = 0.f;
      for (int q0 = 0; q0 < nn; q0 += kB) {
        int4 v[kB][kU];
#pragma unroll
        for (int b = 0; b < kB; ++b) {
          if (q0 + b >= nn) break;
          const int m = nodes[q0 + b];
          const int4* row = reinterpret_cast<const int4*>(
              kPull ? c.peer[m] + pull_off + t * row_bytes : rows + (static_cast<long long>(m) * M + t) * row_bytes);
#pragma unroll
          for (int u = 0; u < kU; ++u)
            if (u0 + u * 32 + lane < end) v[b][u] = ld_nc_v4(row + u0 + u * 32 + lane);
        }
#pragma unroll
        for (int b = 0; b < kB; ++b) {  // nodes in ascending order, each add rounded to float32
          if (q0 + b >= nn) break;
#pragma unroll
          for (int u = 0; u < kU; ++u) {
            if (u0 + u * 32 + lane >= end) continue;
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[b][u]);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float2 f = __bfloat1622float2(h[e]);
              acc[u][2 * e] = __fadd_rn(acc[u][2 * e], f.x);
              acc[u][2 * e + 1] = __fadd_rn(acc[u][2 * e + 1], f.y);
            }
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int j = u0 + u * 32 + lane;
        if (j >= end) continue;
        int4 out;
        __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
        for (int e = 0; e < 4; ++e) o[e] = __floats2bfloat162_rn(acc[u][2 * e], acc[u][2 * e + 1]);
        y[static_cast<long long>(t) * units + j] = out;
      }
    }
    __syncwarp();  // nodes[] is rewritten for the warp's next token
  }
}

}  // namespace

template <bool kPull>
__global__ void __launch_bounds__(kThreads, 1)
    combine(Ctx c, const int4* y_f, const int64_t* y_rows, const uint8_t* slot_valid, const int64_t* topk, int T, int K,
            int phases, int send_parity, int recv_parity, int4* y) {
  __shared__ int s_live[kMaxNodes];
  load_live(c, s_live);
  if (phases & kSend) {
    const int epoch = ld_volatile(c.state + kCombSendEpoch);
    bool put = false;
    if (y_f != nullptr) send_back<kPull>(c, send_parity, y_f, y_rows, slot_valid, s_live, &put);
    finish_send(c, put, c.comb_flag[send_parity], epoch, kCombSendEpoch, kTicketCombSend, s_live);
  }
  if (phases & kRecv) {
    __syncthreads();
    reduce_tokens<kPull>(c, recv_parity, topk, T, K, y, s_live);
    finish_recv(c, kCombRecvEpoch, kTicketCombRecv);
  }
}

template __global__ void combine<false>(Ctx, const int4*, const int64_t*, const uint8_t*, const int64_t*, int, int,
                                       int, int, int, int4*);
template __global__ void combine<true>(Ctx, const int4*, const int64_t*, const uint8_t*, const int64_t*, int, int,
                                      int, int, int, int4*);

}  // namespace rail
}  // namespace ep
