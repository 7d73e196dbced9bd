// notify's protocol (notify.cu) as a device function of a group of kN threads: a whole block (the notify
// kernel) or the stage half of block 0 of a stage_pull launch that runs notify inside (stage_pull_tma.cu,
// Runtime::notify_stage_pull), so that the other blocks stage while the layout is computed.
//
// Why inside: on 2x H200 (4096 tokens, hidden 7168, top-8 of 256) notify took 41 us of a 273 us fresh
// dispatch at 24 SMs (26 us alone), and nothing of the stage needs it -- only the pull waits for the lists
// and the receive offsets. Inside, it also releases what the separate launch order gave for free:
// LISTS[me] = e at every rank once the send lists are built, and the local NOTIFIED word = e once
// recv_off is written, which the pull halves of every block acquire before reading it.
#pragma once
#include "common/fast_div.cuh"
#include "nvlink/device.cuh"

namespace ep {
namespace nvl {

constexpr int kKeepChunks = 16;  // chunks of 32 tokens per warp whose rank masks (a byte per lane) stay in registers

// The threads that run notify: kN of them, tid in [0, kN); barrier: a named barrier's id, or -1 for
// __syncthreads (the group is the whole block).
template <int kN>
struct NotifyGroup {
  int tid;
  int barrier;
  __device__ __forceinline__ void sync() const {
    if (barrier < 0) __syncthreads();
    else named_barrier(barrier, kN);
  }
};

// block_wait_peers for a group: every thread of it waits for flag[kind][p] >= target at this rank (thread
// p for peer p). *s_fail is the group's own (another group of the block may fail on its own at any time;
// a flag shared with it could send the group's threads different ways past a named barrier).
template <int kN>
__device__ inline bool group_wait_peers(const Ctx& c, const NotifyGroup<kN>& g, int kind, int target, int skip,
                                        int kernel_id, unsigned long long deadline, int* s_fail) {
  if (g.tid == 0 && ld_volatile(c.aborted)) *s_fail = 1;
  g.sync();
  // Every thread goes through every barrier whatever it reads: a waiter may set *s_fail between the first
  // barrier and a slower thread's read, and the next call's thread 0 may set it before a slower thread has
  // read this call's verdict; an early return on either read sends one thread away from the rest.
  if (*s_fail == 0 && g.tid < c.world && g.tid != skip) {
    const int r = wait_geq(flag_at(c, c.rank, kind, g.tid), target, deadline, c.aborted);
    if (r == kTimedOut) record_timeout(c, g.tid, kernel_id);
    if (r != kArrived) *s_fail = 1;
  }
  g.sync();
  const bool failed = *s_fail != 0;
  g.sync();
  return failed;
}

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

// notify.cu's protocol, steps 0-4, by the group g. Shared memory: s_ecnt [num_experts], s_wsum [kN/32][kMaxRanks],
// s_total [kMaxRanks], s_fail (the group's own, 0 on entry). inside_e > 0: run inside stage_pull's dispatch epoch
// inside_e -- release LISTS[me] = inside_e at every rank after the send lists, and NOTIFIED = inside_e after recv_off.
// Returns true when a wait failed (recorded; every thread of the group returns true).
template <bool kMerge, int kN>
__device__ inline bool notify_group(const Ctx& c, const NotifyGroup<kN>& g, const int64_t* __restrict__ topk_idx, int T,
                                    int K, const NotifyOut& o, int* s_ecnt, int (*s_wsum)[kMaxRanks], int* s_total,
                                    int* s_fail, int inside_e) {
  constexpr int nwarps = kN / 32;
  static_assert(kN % 32 == 0 && nwarps <= 32, "a group of whole warps, at most 32");
  const int tid = g.tid, lane = tid & 31, warp = tid >> 5;
  const int W = c.world, me = c.rank, EL = c.local_experts, E = c.num_experts;
  const FastDiv ediv(static_cast<uint32_t>(EL));
  const int n = c.epochs[E_NOTIFY] + 1;
  const int e_prev = c.epochs[E_DISPATCH];
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  for (int i = tid; i < E; i += kN) s_ecnt[i] = 0;

  // Pass 1 reads only this rank's own input: it runs before the waits, while peers may still be
  // reading the previous dispatch's send list. Warp w owns a contiguous range of tokens, taken in
  // chunks of 32 with lane l on the chunk's l-th token: a chunk's loads and stores are contiguous
  // across lanes (a range per thread made every warp load touch 32 cache lines), and ballots order
  // the tokens within a chunk.
  const int per_warp = ((T + nwarps - 1) / nwarps + 31) / 32 * 32;
  const int w0 = min(T, warp * per_warp), w1 = min(T, w0 + per_warp);
  const int nchunks = (w1 - w0 + 31) / 32;  // the same in every lane of a warp
  const bool vec = K % 2 == 0 && (reinterpret_cast<uintptr_t>(topk_idx) & 15) == 0;
  g.sync();  // s_ecnt zeroed
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
  g.sync();
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
  if (group_wait_peers(c, g, F_META_ACK, n - 1, me, K_NOTIFY, deadline, s_fail)) return true;
  if (group_wait_peers(c, g, F_PULL_DONE, e_prev, me, K_NOTIFY, deadline, s_fail)) return true;

  // Counts to every rank first (the peers wait on them): meta[me] at rank p = {rows for p,
  // per-expert counts of p's experts}.
  const int stride = 1 + EL;
  for (int i = tid; i < W * stride; i += kN) {
    const int p = i / stride, j = i % stride;
    const int v = j == 0 ? s_total[p] : s_ecnt[p * EL + j - 1];
    volatile int* dst = reinterpret_cast<int*>(c.peers[p] + c.off_meta) + me * stride + j;
    *dst = v;
  }
  // One system fence per peer, behind a group barrier, makes every thread's meta stores visible
  // before the flag (a fence in each of the 32 warps costs more than the whole exchange).
  g.sync();
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
          o.send_pos[static_cast<size_t>(t) * W + r] = in ? p : -1;
          o.is_in[static_cast<size_t>(t) * W + r] = in;
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
  if (inside_e > 0) {  // the send lists are complete: the peers' pulls may read them (the launch order's job apart)
    g.sync();
    if (tid < W) {
      __threadfence_system();
      st_release_sys(flag_at(c, tid, F_LISTS, me), inside_e);
    }
  }

  if (group_wait_peers(c, g, F_COUNT, n, me, K_NOTIFY, deadline, s_fail)) return true;
  const int* meta = reinterpret_cast<const int*>(c.peers[me] + c.off_meta);
  if (tid == 0) {
    int acc = 0;
    for (int s = 0; s < W; ++s) {
      const int v = ld_volatile(meta + s * stride);
      o.recv_off[s] = acc;
      if (o.host_recv_off) o.host_recv_off[s] = acc;
      c.host->recv_counts[s] = v;
      acc += v;
    }
    o.recv_off[W] = acc;
    if (o.host_recv_off) o.host_recv_off[W] = acc;
    c.host->num_recv = acc;
    if (inside_e > 0) {  // recv_off before NOTIFIED: the pull halves of every block read it after acquiring that
      __threadfence();
      st_release_sys(c.notified, inside_e);
    }
  }
  for (int j = tid; j < EL; j += kN) {
    int sum = 0;
    for (int s = 0; s < W; ++s) sum += ld_volatile(meta + s * stride + 1 + j);
    o.tpe[j] = sum;
    if (o.host_tpe) o.host_tpe[j] = sum;
    c.host->tokens_per_expert[j] = sum;
  }
  if (tid < W) c.host->send_counts[tid] = s_total[tid];
  if (bad_id) c.host->bad_expert_ids = 1;
  g.sync();
  if (tid < W && tid != me) st_release_sys(flag_at(c, tid, F_META_ACK, me), n);
  if (tid == 0) c.epochs[E_NOTIFY] = n;
  return false;
}

}  // namespace nvl
}  // namespace ep
