// Low-latency dispatch: a copy per (token, expert) into the owner's slot for (expert, this source),
// then counts and one signal per destination; the receive half packs each expert's rows in source
// order into the caller's [EL, W*M, H] tensor. One kernel does either half or both (kSend|kRecv).
// Of the variant bits (ll_device.cuh) only kFp8Wide acts here (16-byte FP8 stores into the slots), and
// kCopy8 in the receive half: 8 loads in flight per lane in the rows' copy out of the slots, not 4.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "nvshmem/ll_device.cuh"
#include "nvshmem/ll_kernels.h"
#include "nvshmem/ll_send.cuh"

namespace ep {
namespace ll {
namespace {

// The send half for the tokens of this block. s_topk holds the T*K expert ids (int), -1 where a
// (token, k) goes nowhere (invalid id or left-out owner).
template <bool kFp8>
__device__ void send_tokens(const Ctx& c, int p, const int4* x, const int* s_topk, int T, int K,
                            int round_scale, bool* any_rdma, int flags) {
  __shared__ int s_slot[32];
  __shared__ char* s_dst[32];
  __shared__ int s_rdma;
  const int EL = c.local_experts;
  const int n16 = c.hidden / 8;  // 16-byte units of a BF16 row
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    if (threadIdx.x == 0) s_rdma = 0;
    token_slots(s_topk, t, K, s_slot);
    if (threadIdx.x < K) {
      const int k = threadIdx.x, e = s_topk[t * K + k];
      char* dst = nullptr;
      if (e >= 0) {
        const int d = e / EL;
        const long long off = slot_offset(c, p, e % EL, c.rank, s_slot[k]);
        if (c.peer[d] != nullptr) {
          dst = c.peer[d] + off;
          *reinterpret_cast<int4*>(dst) = make_int4(t, k, 0, 0);
        } else {
          s_rdma = 1;
        }
      }
      s_dst[k] = dst;
    }
    __syncthreads();
    const bool rdma = s_rdma != 0;
    char* stage = rdma ? c.heap + c.stage_rows + static_cast<long long>(t) * c.slot_bytes : nullptr;
    if (rdma && threadIdx.x == 0) *reinterpret_cast<int4*>(stage) = make_int4(t, 0, 0, 0);
    const int4* src = x + static_cast<long long>(t) * n16;
    auto bf16_store = [&](int j, const int4& v) {
      for (int k = 0; k < K; ++k)
        if (s_dst[k] != nullptr) st_na_v4(reinterpret_cast<int4*>(s_dst[k] + kHeaderBytes) + j, v);
      if (rdma) st_na_v4(reinterpret_cast<int4*>(stage + kHeaderBytes) + j, v);
    };
    auto fp8_store = [&](int j, const uint2& q, float scale, bool first) {
      for (int k = 0; k < K; ++k) {
        char* d = s_dst[k];
        if (d == nullptr) continue;
        reinterpret_cast<uint2*>(d + kHeaderBytes)[j] = q;
        if (first) reinterpret_cast<float*>(d + kHeaderBytes + c.hidden)[j / 16] = scale;
      }
      if (rdma) {
        reinterpret_cast<uint2*>(stage + kHeaderBytes)[j] = q;
        if (first) reinterpret_cast<float*>(stage + kHeaderBytes + c.hidden)[j / 16] = scale;
      }
    };
    // kFp8Wide: 16 FP8 bytes per store, and a warp's 4 scales are 16 contiguous bytes of the slot
    auto fp8_wide_store = [&](int j, const int4& q, float scale, bool first) {
      for (int k = 0; k < K; ++k) {
        char* d = s_dst[k];
        if (d == nullptr) continue;
        st_na_v4(reinterpret_cast<int4*>(d + kHeaderBytes) + j, q);
        if (first) reinterpret_cast<float*>(d + kHeaderBytes + c.hidden)[j / 8] = scale;
      }
      if (rdma) {
        st_na_v4(reinterpret_cast<int4*>(stage + kHeaderBytes) + j, q);
        if (first) reinterpret_cast<float*>(stage + kHeaderBytes + c.hidden)[j / 8] = scale;
      }
    };
    if (kFp8 && (flags & kFp8Wide)) {
      const int4 none[kRowInFlight] = {};
      stream_row_fp8_wide<false>(src, n16, round_scale, none, fp8_wide_store);
    } else {
      stream_row<kFp8>(src, n16, round_scale, bf16_store, fp8_store);
    }
    if (rdma) {  // NVSHMEM puts from the staged slot to the peers without P2P (compiled, not run here)
      __syncthreads();
      const int bytes = kHeaderBytes + (kFp8 ? c.hidden + c.hidden / 32 : c.hidden * 2);
      for (int k = 0; k < K; ++k) {
        const int e = s_topk[t * K + k];
        if (e < 0 || s_dst[k] != nullptr) continue;
        if (threadIdx.x == 0) reinterpret_cast<int*>(stage)[1] = k;
        __syncthreads();
        const int d = e / EL;
        nvshmemx_putmem_nbi_block(c.heap + slot_offset(c, p, e % EL, c.rank, s_slot[k]), stage, bytes, d);
        __syncthreads();
        if (threadIdx.x == 0) nvshmem_quiet();  // the header's k is rewritten for the next put
        __syncthreads();
      }
      *any_rdma = true;
    }
    __syncthreads();
  }
}

// Rows per (destination expert) -> the owners' disp_cnt, by one block before the rows: the signal
// (after every block's fence) makes them visible with the rows.
__device__ void send_counts(const Ctx& c, int p, const int* s_topk, int TK, int* s_hist) {
  const int E = c.num_experts, EL = c.local_experts;
  expert_histogram(s_topk, TK, E, s_hist);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int d = e / EL;
    if (left_out(c, d)) continue;
    const long long off = c.disp_cnt[p] + 4ll * (c.rank * EL + e % EL);
    if (c.peer[d] != nullptr) {
      *reinterpret_cast<volatile int*>(c.peer[d] + off) = s_hist[e];
    } else {
      int* staged = reinterpret_cast<int*>(c.heap + c.stage_cnt) + e;
      *staged = s_hist[e];
      nvshmem_int_put_nbi(reinterpret_cast<int*>(c.heap + off), staged, 1, d);
    }
  }
  if (c.stage_cnt >= 0) nvshmem_quiet();  // the counts' puts complete before this block's ticket
  __syncthreads();
}


// The receive half: wait for every source, then pack each expert's rows (source order, then slot
// order = token order) into out; block 0 writes counts, layout ranges and the statistics.
template <bool kFp8>
__device__ void receive(const Ctx& c, const DispatchOut& o, int* smem, bool copy8) {
  const int W = c.world, EL = c.local_experts, M = c.max_tokens, WM = W * M;
  const int epoch = ld_volatile(c.state + kDispRecvEpoch);
  const int p = epoch & 1;
  const int n = W * EL;
  int* s_cnt = smem;          // [EL][W]
  int* s_off = smem + n;      // [EL*W + 1]
  __shared__ int s_ok[kMaxRanks];
  for (int s = threadIdx.x; s < W; s += blockDim.x)
    s_ok[s] = !left_out(c, s) && wait_signal(c, c.disp_flag[p], s, epoch + 1, kKernelDispatch);
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int el = i / W, s = i % W;
    s_cnt[i] = s_ok[s] ? ld_volatile(reinterpret_cast<int*>(c.heap + c.disp_cnt[p]) + s * EL + el) : 0;
  }
  block_exclusive_scan(s_cnt, s_off, n);
  if (blockIdx.x == 0) {
    for (int el = threadIdx.x; el < EL; el += blockDim.x) {
      const int cnt = s_off[(el + 1) * W] - s_off[el * W];
      o.recv_count[el] = cnt;
      if (o.recv_stats != nullptr) o.recv_stats[el] += cnt;
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const long long begin = s_off[i] - s_off[(i / W) * W];
      o.layout_range[i] = (begin << 32) | static_cast<long long>(s_cnt[i]);
    }
  }
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int total = s_off[n];
  const int units = kFp8 ? c.hidden / 16 : c.hidden / 8;  // 16-byte units of the payload's data
  const int S = c.hidden / 128;
  const int parts = parts_per_row(total, gridDim.x * warps);
  const int chunk = (units + parts - 1) / parts;
  for (int i = blockIdx.x * warps + threadIdx.x / 32; i < total * parts; i += gridDim.x * warps) {
    const int r = i / parts, part = i % parts;
    const int pair = find_segment(s_off, n, r);
    const int el = pair / W, s = pair % W;
    const int idx = r - s_off[pair], row = r - s_off[el * W];
    const char* slot = c.heap + slot_offset(c, p, el, s, idx);
    const long long out_row = static_cast<long long>(el) * WM + row;
    if (part == 0 && lane == 0) {
      const int4 h = ld_nc_v4(reinterpret_cast<const int4*>(slot));
      o.src_info[out_row] = h.x;
      o.row_slot[out_row] = (s * M + h.x) * c.max_topk + h.y;
      if (s == c.rank && o.self_pos != nullptr) o.self_pos[h.x * c.max_topk + h.y] = static_cast<int>(out_row);
    }
    const int4* src = reinterpret_cast<const int4*>(slot + kHeaderBytes);
    int4* dst = reinterpret_cast<int4*>(o.x + out_row * (kFp8 ? c.hidden : c.hidden * 2));
    if (copy8)
      warp_copy_units<8>(src, dst, part * chunk, min(units, (part + 1) * chunk), lane);
    else
      warp_copy_units<4>(src, dst, part * chunk, min(units, (part + 1) * chunk), lane);
    if constexpr (kFp8) {
      if (part == 0) {
        const float* sc = reinterpret_cast<const float*>(slot + kHeaderBytes + c.hidden);
        for (int j = lane; j < S; j += 32)
          o.scales[(static_cast<long long>(el) * S + j) * WM + row] = __ldg(sc + j);
      }
    }
  }
}

}  // namespace

template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1)
    dispatch(Ctx c, const int4* x, const int64_t* topk_idx, int T, int K, int phases, int round_scale,
                DispatchOut o) {
  extern __shared__ int smem[];
  if (phases & kSend) {
    const int epoch = ld_volatile(c.state + kDispSendEpoch);
    const int p = epoch & 1;
    int* s_topk = smem;  // [T*K], then the last block's histogram [E]
    load_topk(c, topk_idx, T, K, s_topk);
    bool any_rdma = false;
    // the last block has no token when the grid outnumbers the tokens: it sends the counts
    if (blockIdx.x == gridDim.x - 1) send_counts(c, p, s_topk, T * K, s_topk + T * K);
    send_tokens<kFp8>(c, p, x, s_topk, T, K, round_scale, &any_rdma, phases & kVariantMask);
    if (any_rdma && threadIdx.x == 0) nvshmem_quiet();
    if (last_block(ticket(c, kTicketDispSend))) {
      signal_ranks(c, c.disp_flag[p], epoch);
      __syncthreads();
      if (threadIdx.x == 0) c.state[kDispSendEpoch] = epoch + 1;
    }
  }
  if (phases & kRecv) {
    __syncthreads();
    receive<kFp8>(c, o, smem, (phases & kCopy8) != 0);
    if (last_block(ticket(c, kTicketDispRecv)) && threadIdx.x == 0)
      c.state[kDispRecvEpoch] = ld_volatile(c.state + kDispRecvEpoch) + 1;
  }
}

template __global__ void dispatch<false>(Ctx, const int4*, const int64_t*, int, int, int, int, DispatchOut);
template __global__ void dispatch<true>(Ctx, const int4*, const int64_t*, int, int, int, int, DispatchOut);

}  // namespace ll
}  // namespace ep
