// Low-latency dispatch into the output sets in the heap (ll_device.cuh, "Output sets"): every source
// sends its rows per expert to every rank first, waits for those of the lower ranks (they place its
// rows), then writes each (token, expert) row with its token and combine slot straight into the
// owner's set, and signals each rank. The receive half is one block: it waits for the signals and
// writes recv_count and layout_range. Nothing is copied on the receiving side.
//
// Variant bits of `phases` (ll_device.cuh; every rank of a call passes the same bits), each one a
// change to A/B against the code without it (benchmarks/ll_device.sh pair):
// - kCountWords: each count is a u64 word tagged with the epoch, so a (token, k) waits only for the
//   words of its own expert from the lower ranks, with no fence and no cnt_flag round behind them. A
//   word that times out is recorded against its source and drops that row only; the abort word then
//   ends the other waits of the call.
// - kPackedInfo: token and combine slot leave in one 8-byte remote store to the set's info region;
//   the receive half splits the received rows' words into src_info and row_slot (local memory).
// - kScalesRowMajor (FP8): a row's scales gather in shared memory and leave as 16-byte stores (H % 512
//   == 0) into the row-major region [EL][W*M][H/128], 4*H/128 contiguous bytes per row and destination,
//   instead of H/128 scattered 4-byte stores into the transposed array; the receive half transposes
//   the received rows' scales into the contract's [EL][H/128][W*M].
// - kFp8Wide (FP8): a thread casts two adjacent BF16 units and stores 16 FP8 bytes at once.
// - kPreload: a token's first round of row loads is issued before its slots and the wait for the
//   lower ranks' counts, so the row is in registers when its destinations are known. With kEarlyRow
//   the block's first token's loads are issued at entry, before the routing loads (load_topk), so
//   those two latencies overlap as well.
// - kLeanStores: each (token, k) makes its row's address in the owner's set once (shared memory),
//   instead of every unit's store multiplying it out again (64-bit); with FP8, a 128-channel
//   group's scale (the same in all its lanes after the amax shuffles) is stored by the group's
//   lanes, lane i to destination i, at an address also made once. Without it one lane of the group
//   stores the scale to every destination in turn, taking each address apart with a 64-bit
//   division on the way, while the warp waits for that lane before its next cast. The same stores
//   to the same places: the outputs are bit-identical.
// - kLeanRouting: the rank mask read once per block into shared memory while the ids are in flight (not a
//   dependent load per id), and a token's slots counted by a warp per pick (one barrier, no atomics).
//   The same slots: bit-identical outputs.
// - kArrivalOrder: no row waits for another rank. The last block reserves each (this rank, expert) block of
//   rows at the owner with one atomicAdd on a per-expert counter (reserve_blocks) and hands the begins to
//   this rank's other blocks through local memory; the owner's receive half writes layout_range from the
//   (begin, count) words and zeroes the counters. Rows stay packed from 0; the sources' order within an
//   expert is their arrival order (as DeepEP's), not rank order. Same rows, same sums: only where each
//   source's block starts differs.
// - kLightTickets: the send half's ticket behind fence.acq_rel.sys (a release pattern: rows, fence, ticket;
//   the last block's fence, then the signal) instead of fence.sc.sys, the receive half's without a fence.
// With kPackedInfo, or kScalesRowMajor on an FP8 call, every block takes a share of the receive
// half's fix-ups (per local expert, the rows below its count), after the same signals that cover
// the rows; otherwise the receive half stays block 0's.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "nvshmem/ll_device.cuh"
#include "nvshmem/ll_kernels.h"
#include "nvshmem/ll_send.cuh"

namespace ep {
namespace ll {
namespace {

__device__ __forceinline__ int* cnt_all_at(const Ctx& c, char* base, int p, int s, int e) {
  return reinterpret_cast<int*>(base + c.cnt_all[p]) + static_cast<long long>(s) * c.num_experts + e;
}

__device__ __forceinline__ unsigned long long* cnt_word_at(const Ctx& c, char* base, int p, int s, int e) {
  return reinterpret_cast<unsigned long long*>(base + c.cnt_word[p]) + static_cast<long long>(s) * c.num_experts + e;
}

__device__ __forceinline__ unsigned long long* arr_word_at(const Ctx& c, char* base, int p, int s, int e) {
  return reinterpret_cast<unsigned long long*>(base + c.arr_word[p]) + static_cast<long long>(s) * c.num_experts + e;
}

// Source s's rows for global expert e, once its counts are known to be here (the receive half, after
// s's signal: the words came before it).
__device__ __forceinline__ int source_count(const Ctx& c, int p, int s, int e, int flags) {
  if (flags & kCountWords) return static_cast<int>(ld_volatile_u64(cnt_word_at(c, c.heap, p, s, e)) & 0xffffffffull);
  return ld_volatile(cnt_all_at(c, c.heap, p, s, e));
}

// kCountWords: source s's rows for global expert e, waited for by their epoch tag (a 64-bit store is
// single-copy atomic: tag and count arrive together); -1 when s timed out or another wait of the call
// did (the row is not sent: its place is unknown).
__device__ int wait_count_word(const Ctx& c, int p, int s, int e, int epoch) {
  const unsigned long long* w = cnt_word_at(c, c.heap, p, s, e);
  const unsigned target = static_cast<unsigned>(epoch + 1);
  const unsigned long long deadline = globaltimer() + c.timeout_ns;
  for (unsigned it = 1;; ++it) {
    const unsigned long long v = ld_volatile_u64(w);
    // wrapping: an older call's word of this parity carries a smaller tag, never a larger one (a peer
    // cannot reach this parity's next dispatch before this rank's combine of this call)
    if (static_cast<int>(static_cast<unsigned>(v >> 32) - target) >= 0) return static_cast<int>(v & 0xffffffffull);
    if ((it & 127u) == 0) {
      if (ld_volatile(c.aborted)) return -1;
      if (globaltimer() > deadline) {
        record_timeout(c, s, kKernelDispatch);
        return -1;
      }
    }
  }
}

// This rank's rows per global expert -> every rank not left out: cnt_all[p][rank][*] then cnt_flag,
// or (kCountWords) the tagged words cnt_word[p][rank][*] alone.
__device__ void broadcast_counts(const Ctx& c, int p, int epoch, const int* s_topk, int TK, int* s_hist, int flags) {
  const int E = c.num_experts;
  expert_histogram(s_topk, TK, E, s_hist);
  if (flags & kCountWords) {
    const unsigned long long tag = static_cast<unsigned long long>(static_cast<unsigned>(epoch + 1)) << 32;
    for (int i = threadIdx.x; i < c.world * E; i += blockDim.x) {
      const int d = i / E, e = i % E;
      if (!left_out(c, d))
        *reinterpret_cast<volatile unsigned long long*>(cnt_word_at(c, c.peer[d], p, c.rank, e)) =
            tag | static_cast<unsigned>(s_hist[e]);
    }
    __syncthreads();  // s_hist is the caller's shared memory
    return;
  }
  for (int i = threadIdx.x; i < c.world * E; i += blockDim.x) {
    const int d = i / E, e = i % E;
    if (!left_out(c, d)) *cnt_all_at(c, c.peer[d], p, c.rank, e) = s_hist[e];
  }
  __syncthreads();
  for (int d = threadIdx.x; d < c.world; d += blockDim.x) {
    if (left_out(c, d)) continue;
    __threadfence_system();
    st_release_sys(flag_word(c.peer[d], c.cnt_flag[p], c.rank), epoch + 1);
  }
}

// kArrivalOrder, the last block: this rank's rows per global expert e take a block [begin, begin + n) of
// the owner's set with one atomicAdd on the owner's counter for e (so sources land in arrival order, and
// no row waits for another rank's launch); the begins go to this rank's arr_begin[p] for its other blocks
// (behind arr_ready[p] = epoch + 1), and (begin << 32) | n to the owner's arr_word[p][rank][e], which its
// receive half reads after this rank's signal.
__device__ void reserve_blocks(const Ctx& c, int p, int epoch, const int* s_topk, int TK, int* s_hist) {
  const int E = c.num_experts, EL = c.local_experts;
  expert_histogram(s_topk, TK, E, s_hist);
  int* begins = reinterpret_cast<int*>(c.heap + c.arr_begin[p]);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int d = e / EL, n = s_hist[e];
    if (left_out(c, d)) continue;
    const int begin = n > 0 ? atomicAdd(reinterpret_cast<int*>(c.peer[d] + c.arr_resv[p]) + e % EL, n) : 0;
    begins[e] = begin;
    *reinterpret_cast<volatile unsigned long long*>(arr_word_at(c, c.peer[d], p, c.rank, e)) =
        (static_cast<unsigned long long>(static_cast<unsigned>(begin)) << 32) | static_cast<unsigned>(n);
  }
  __threadfence();  // the begins before the flag, for this rank's other blocks
  __syncthreads();
  if (threadIdx.x == 0) st_release_sys(reinterpret_cast<int*>(c.heap + c.arr_ready[p]), epoch + 1);
}

// kOwnerReduce: token t's record at every rank not left out -- for each k, the row of (t, k) in that rank's
// set, or -1 where k is not that rank's -- so that the owner's combine can sum a token's rows before
// sending. A repeated expert (load_topk made it -1 in s_topk) gets the row of its first k: combine weights
// each pick with it. Behind the same signal as the rows.
__device__ __forceinline__ void write_records(const Ctx& c, int set, int t, int K, const int* s_topk,
                                              const int64_t* topk_idx, const int* s_own, const long long* s_at) {
  const int EL = c.local_experts, E = c.num_experts;
  for (int i = threadIdx.x; i < c.world * K; i += blockDim.x) {
    const int d = i / K, k = i - d * K;
    if (left_out(c, d)) continue;
    int entry = -1;
    if (s_topk[t * K + k] >= 0) {
      if (s_own[k] == d) entry = static_cast<int>(s_at[k]);
    } else {
      const long long id = topk_idx[static_cast<long long>(t) * K + k];  // a repeat, or routed nowhere
      if (id >= 0 && id < E && static_cast<int>(id) / EL == d)
        for (int q = 0; q < k; ++q)
          if (s_topk[t * K + q] == static_cast<int>(id)) {
            if (s_own[q] == d) entry = static_cast<int>(s_at[q]);
            break;
          }
    }
    int* rec = reinterpret_cast<int*>(c.peer[d] + c.out_set[set] + c.set_rec) + c.world;
    rec[(static_cast<long long>(c.rank) * c.max_tokens + t) * c.max_topk + k] = entry;
  }
}

// The rows of this block's tokens. s_low[s] (s < rank): source s's counts are in (0: left out);
// unused with kCountWords, where each (token, k) waits for its expert's words.
// early: the first round of the block's first token (blockIdx.x) when kEarlyRow loaded it at entry.
template <bool kFp8>
__device__ void send_rows(const Ctx& c, int p, int epoch, int set, const int4* x, const int* s_topk, int T, int K,
                          int round_scale, const int* s_low, int* self_pos, int flags,
                          const int4 (&early)[kRowInFlight], bool have_early, const int64_t* topk_idx) {
  __shared__ int s_slot[32];
  __shared__ char* s_dst[32];      // the owner's set, or nullptr (nowhere)
  __shared__ long long s_at[32];   // el * W*M + row in that set
  __shared__ char* s_row[32];      // kLeanStores: the row of (token, k) in the owner's set, or nullptr
  __shared__ float* s_sc[32];      // kLeanStores: group 0's scale of (token, k) in the owner's set; group g at + g * W*M
  __shared__ int s_own[32];        // kOwnerReduce: the rank that holds (token, k)'s row, or -1
  __shared__ __align__(16) float s_scale[kMaxScaleGroups];  // kScalesRowMajor: the row's scales
  const int EL = c.local_experts, WM = c.world * c.max_tokens, S = c.hidden / 128;
  const int n16 = c.hidden / 8;
  const long long row_bytes = kFp8 ? c.hidden : 2ll * c.hidden;
  const bool rm = kFp8 && (flags & kScalesRowMajor);
  const bool wide = kFp8 && (flags & kFp8Wide), preload = (flags & kPreload) != 0;
  const bool lean = (flags & kLeanStores) != 0, lanes = kFp8 && !rm && lean;
  int4 pre[kRowInFlight] = {};
  const bool records = (flags & kOwnerReduce) != 0;
  if (records && blockIdx.x == 0)  // every rank learns this rank's token count, the records' extent
    for (int d = threadIdx.x; d < c.world; d += blockDim.x)
      if (!left_out(c, d)) reinterpret_cast<int*>(c.peer[d] + c.out_set[set] + c.set_rec)[c.rank] = T;
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    const int4* src = x + static_cast<long long>(t) * n16;
    if (preload) {  // in flight through the slots and the count wait
      if (have_early && t == static_cast<int>(blockIdx.x)) {
#pragma unroll
        for (int u = 0; u < kRowInFlight; ++u) pre[u] = early[u];
      } else {
        load_first_round(src, n16, wide, pre);
      }
    }
    if (flags & kLeanRouting)
      token_slots_by_warps(s_topk, t, K, s_slot);
    else
      token_slots(s_topk, t, K, s_slot);
    if (threadIdx.x < K) {
      const int k = threadIdx.x, e = s_topk[t * K + k];
      char* dst = nullptr;
      float* sc = nullptr;
      long long at = 0;
      if (e >= 0) {
        int row = s_slot[k];
        bool placed = true;
        if (flags & kArrivalOrder) row += ld_volatile(reinterpret_cast<const int*>(c.heap + c.arr_begin[p]) + e);
        for (int s = 0; s < c.rank && placed && !(flags & kArrivalOrder); ++s) {
          if (flags & kCountWords) {
            if (left_out(c, s)) continue;
            const int n = wait_count_word(c, p, s, e, epoch);
            placed = n >= 0;
            row += n;
          } else if (s_low[s]) {
            row += ld_volatile(cnt_all_at(c, c.heap, p, s, e));
          }
        }
        if (placed && row < WM) {  // always (a source gives an expert at most M rows): a guard, never past the set
          dst = c.peer[e / EL] + c.out_set[set];
          at = static_cast<long long>(e % EL) * WM + row;
          sc = reinterpret_cast<float*>(dst + c.set_scales) + static_cast<long long>(e % EL) * S * WM + row;
          const int slot = (c.rank * c.max_tokens + t) * c.max_topk + k;
          if (flags & kPackedInfo) {
            reinterpret_cast<int2*>(dst + c.set_info)[at] = make_int2(t, slot);
          } else {
            reinterpret_cast<int*>(dst + c.set_src_info)[at] = t;
            reinterpret_cast<int*>(dst + c.set_row_slot)[at] = slot;
          }
          if (e / EL == c.rank && self_pos != nullptr) self_pos[t * c.max_topk + k] = static_cast<int>(at);
        }
      }
      s_dst[k] = dst;
      s_at[k] = at;
      s_sc[k] = sc;
      s_own[k] = dst == nullptr ? -1 : e / EL;
      s_row[k] = dst == nullptr ? nullptr : dst + at * row_bytes;
    }
    __syncthreads();
    if (t == static_cast<int>(blockIdx.x)) stamp(c, kStampDispatch, kDsPlaced);
    // an FP8 unit's scale: into shared memory (sent whole below), or straight into the transposed array
    auto put_scale = [&](int g, float scale) {
      if (rm) {
        s_scale[g] = scale;
        return;
      }
      for (int k = 0; k < K; ++k) {
        char* d = s_dst[k];
        if (d == nullptr) continue;
        const long long el = s_at[k] / WM, row = s_at[k] % WM;  // scales are [EL][S][W*M]
        reinterpret_cast<float*>(d + c.set_scales)[(el * S + g) * WM + row] = scale;
      }
    };
    // the row of (token, k) in its owner's set, or nullptr
    auto row_of = [&](int k) -> char* {
      if (lean) return s_row[k];
      return s_dst[k] == nullptr ? nullptr : s_dst[k] + s_at[k] * row_bytes;
    };
    auto bf16_store = [&](int j, const int4& v) {
      for (int k = 0; k < K; ++k)
        if (char* r = row_of(k)) st_na_v4(reinterpret_cast<int4*>(r) + j, v);
    };
    // kLeanStores: lane i of a group of `width` lanes stores the group's scale to destinations i, i + width, ...
    auto lane_scales = [&](int j, int width, float scale) {
      const long long g = j / width;
      for (int k = j % width; k < K; k += width)
        if (s_sc[k] != nullptr) s_sc[k][g * WM] = scale;
    };
    auto fp8_store = [&](int j, const uint2& q, float scale, bool first) {
      for (int k = 0; k < K; ++k)
        if (char* r = row_of(k)) reinterpret_cast<uint2*>(r)[j] = q;
      if (lanes)
        lane_scales(j, 16, scale);
      else if (first)
        put_scale(j / 16, scale);
    };
    auto fp8_wide_store = [&](int j, const int4& q, float scale, bool first) {
      for (int k = 0; k < K; ++k)
        if (char* r = row_of(k)) st_na_v4(reinterpret_cast<int4*>(r) + j, q);
      if (lanes)
        lane_scales(j, 8, scale);
      else if (first)
        put_scale(j / 8, scale);
    };
    if (wide) {
      if (preload)
        stream_row_fp8_wide<true>(src, n16, round_scale, pre, fp8_wide_store);
      else
        stream_row_fp8_wide<false>(src, n16, round_scale, pre, fp8_wide_store);
    } else if (preload) {
      stream_row_from<kFp8, true>(src, n16, round_scale, pre, bf16_store, fp8_store);
    } else {
      stream_row<kFp8>(src, n16, round_scale, bf16_store, fp8_store);
    }
    if (rm) {
      __syncthreads();
      // 16-byte stores where a row's S * 4 bytes are whole 16-byte units (H % 512 == 0, and then every
      // row starts on one); else one float per store
      const int width = S % 4 == 0 ? 4 : 1, units = S / width;
      for (int i = threadIdx.x; i < K * units; i += blockDim.x) {
        const int k = i / units, u = i - k * units;
        if (s_dst[k] == nullptr) continue;
        float* row = reinterpret_cast<float*>(s_dst[k] + c.set_scales_rm) + s_at[k] * S;
        if (width == 4)
          st_na_v4(reinterpret_cast<int4*>(row) + u, reinterpret_cast<const int4*>(s_scale)[u]);
        else
          row[u] = s_scale[u];
      }
    }
    if (records) write_records(c, set, t, K, s_topk, topk_idx, s_own, s_at);
    __syncthreads();
  }
  stamp(c, kStampDispatch, kDsRowsOut);
}

// The receive half: every source's signal; block 0 writes recv_count, layout_range and the stats from
// the counts (already here: they came before the rows). With fix-ups (direct_recv_rows) every block
// then takes local experts blockIdx.x, + gridDim.x, ... and, for the rows below each one's count,
// splits the info words and transposes the row-major scales; the last block moves the epoch on.
template <bool kFp8>
__device__ void receive(const Ctx& c, const DispatchOut& o, int set, int flags) {
  const int W = c.world, EL = c.local_experts, WM = W * c.max_tokens;
  const bool fixups = direct_recv_rows(kFp8, flags);
  if (!fixups && blockIdx.x != 0) return;
  const int epoch = ld_volatile(c.state + kDispRecvEpoch);
  const int p = epoch & 1;
  __shared__ int s_ok[kMaxRanks];
  __shared__ int s_rows;
  for (int s = threadIdx.x; s < W; s += blockDim.x)
    s_ok[s] = !left_out(c, s) && wait_signal(c, c.disp_flag[p], s, epoch + 1, kKernelDispatch);
  __syncthreads();
  stamp(c, kStampDispatch, kDsSignalsIn);
  if (blockIdx.x == 0) {
    for (int el = threadIdx.x; el < EL; el += blockDim.x) {
      int begin = 0;
      for (int s = 0; s < W; ++s) {
        if (flags & kArrivalOrder) {  // each source's block where its reservation put it
          const unsigned long long w = s_ok[s] ? ld_volatile_u64(arr_word_at(c, c.heap, p, s, c.rank * EL + el)) : 0ull;
          const int b = static_cast<int>(w >> 32), n = min(static_cast<int>(w & 0xffffffffull), max(WM - b, 0));
          o.layout_range[el * W + s] = (static_cast<long long>(b) << 32) | static_cast<long long>(n);
          begin += n;
          continue;
        }
        const int n = s_ok[s] ? min(source_count(c, p, s, c.rank * EL + el, flags), WM - begin) : 0;
        o.layout_range[el * W + s] = (static_cast<long long>(begin) << 32) | static_cast<long long>(n);
        begin += n;
      }
      o.recv_count[el] = begin;
      if (o.recv_stats != nullptr) o.recv_stats[el] += begin;
      // the counter back to 0 for this parity's next dispatch (no sender reaches it before this rank's
      // combine of this call, which follows this receive on the stream)
      if (flags & kArrivalOrder) reinterpret_cast<int*>(c.heap + c.arr_resv[p])[el] = 0;
    }
  }
  if (!fixups) {
    __syncthreads();
    if (threadIdx.x == 0) c.state[kDispRecvEpoch] = epoch + 1;
    stamp(c, kStampDispatch, kDsDone);
    return;
  }
  char* base = c.heap + c.out_set[set];
  const int S = c.hidden / 128;
  for (int el = blockIdx.x; el < EL; el += gridDim.x) {
    __syncthreads();  // s_rows of the previous expert has been read
    if (threadIdx.x == 0) {
      int begin = 0;
      for (int s = 0; s < W; ++s) {
        if (!s_ok[s]) continue;
        if (flags & kArrivalOrder) {
          const unsigned long long w = ld_volatile_u64(arr_word_at(c, c.heap, p, s, c.rank * EL + el));
          begin += min(static_cast<int>(w & 0xffffffffull), max(WM - static_cast<int>(w >> 32), 0));
        } else {
          begin += min(source_count(c, p, s, c.rank * EL + el, flags), WM - begin);
        }
      }
      s_rows = begin;
    }
    __syncthreads();
    const int n = s_rows;
    const long long first = static_cast<long long>(el) * WM;
    if (flags & kPackedInfo) {
      const int2* info = reinterpret_cast<const int2*>(base + c.set_info) + first;
      int* src_info = reinterpret_cast<int*>(base + c.set_src_info) + first;
      int* row_slot = reinterpret_cast<int*>(base + c.set_row_slot) + first;
      for (int r = threadIdx.x; r < n; r += blockDim.x) {
        const int2 v = __ldcg(info + r);  // written by peers: past L1
        src_info[r] = v.x;
        row_slot[r] = v.y;
      }
    }
    if (kFp8 && (flags & kScalesRowMajor)) {
      const float* rm = reinterpret_cast<const float*>(base + c.set_scales_rm) + first * S;
      float* tr = reinterpret_cast<float*>(base + c.set_scales) + first * S;  // [S][W*M] of this expert
      for (int i = threadIdx.x; i < n * S; i += blockDim.x) {
        const int g = i / n, r = i - g * n;  // consecutive threads: consecutive rows of one group (coalesced writes)
        tr[static_cast<long long>(g) * WM + r] = __ldcg(rm + static_cast<long long>(r) * S + g);
      }
    }
  }
  // kLightTickets: the fix-ups reach later kernels by stream order; the ticket only moves the epoch on
  const bool last = (flags & kLightTickets) ? last_block<TicketFence::kNone>(ticket(c, kTicketDispRecv))
                                            : last_block(ticket(c, kTicketDispRecv));
  if (last && threadIdx.x == 0) c.state[kDispRecvEpoch] = epoch + 1;
  stamp(c, kStampDispatch, kDsDone);
}

}  // namespace

template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1)
    dispatch_direct(Ctx c, const int4* x, const int64_t* topk_idx, int T, int K, int phases, int round_scale,
                    int set, DispatchOut o) {
  extern __shared__ int smem[];
  const int flags = phases & kVariantMask;
  if (phases & kSend) {
    stamp(c, kStampDispatch, kDsEntry);
    const int epoch = ld_volatile(c.state + kDispSendEpoch);
    const int p = epoch & 1;
    int* s_topk = smem;  // [T*K], then the last block's histogram [E]
    // kEarlyRow (with kPreload): this block's first row loads go out before the routing's
    int4 early[kRowInFlight] = {};
    const bool have_early = (flags & kPreload) && (flags & kEarlyRow) && static_cast<int>(blockIdx.x) < T;
    if (have_early)
      load_first_round(x + static_cast<long long>(blockIdx.x) * (c.hidden / 8), c.hidden / 8, kFp8 && (flags & kFp8Wide),
                       early);
    load_topk(c, topk_idx, T, K, s_topk, (flags & kLeanRouting) != 0);
    stamp(c, kStampDispatch, kDsRouting);
    // the last block has no token when the grid outnumbers the tokens: it sends the counts (or reserves)
    const bool arrival = (flags & kArrivalOrder) != 0;
    if (blockIdx.x == gridDim.x - 1) {
      if (arrival)
        reserve_blocks(c, p, epoch, s_topk, T * K, s_topk + T * K);
      else
        broadcast_counts(c, p, epoch, s_topk, T * K, s_topk + T * K, flags);
    }
    __shared__ int s_low[kMaxRanks];
    __shared__ int s_lost;
    if (threadIdx.x == 0) {
      s_lost = 0;
      // kArrivalOrder: a block with tokens waits for its rank's begins (local: the last block's atomics)
      if (arrival && blockIdx.x != gridDim.x - 1 && static_cast<int>(blockIdx.x) < T) {
        const unsigned long long deadline = globaltimer() + c.timeout_ns;
        if (wait_geq(reinterpret_cast<const int*>(c.heap + c.arr_ready[p]), epoch + 1, deadline, c.aborted) != kArrived)
          s_lost = 1;
      }
    }
    __syncthreads();
    if (!(flags & kCountWords) && !arrival) {
      for (int s = threadIdx.x; s < c.rank; s += blockDim.x) {
        const bool in = !left_out(c, s);
        const bool got = in && wait_signal(c, c.cnt_flag[p], s, epoch + 1, kKernelDispatch);
        s_low[s] = got;
        if (in && !got) s_lost = 1;
      }
      __syncthreads();
    }
    // without a lower rank's counts this rank's rows have no place: none is sent (the timeout is recorded)
    if (!s_lost) send_rows<kFp8>(c, p, epoch, set, x, s_topk, T, K, round_scale, s_low, o.self_pos, flags, early,
                                 have_early, topk_idx);
    const bool last = (flags & kLightTickets) ? last_block<TicketFence::kAcqRel>(ticket(c, kTicketDispSend))
                                              : last_block(ticket(c, kTicketDispSend));
    stamp(c, kStampDispatch, kDsFenced);
    if (last) {
      signal_ranks(c, c.disp_flag[p], epoch);
      __syncthreads();
      if (threadIdx.x == 0) c.state[kDispSendEpoch] = epoch + 1;
      stamp(c, kStampDispatch, kDsSignal);
    }
  }
  if (phases & kRecv) {
    __syncthreads();
    receive<kFp8>(c, o, set, flags);
  }
}

template __global__ void dispatch_direct<false>(Ctx, const int4*, const int64_t*, int, int, int, int, int, DispatchOut);
template __global__ void dispatch_direct<true>(Ctx, const int4*, const int64_t*, int, int, int, int, int, DispatchOut);

}  // namespace ll
}  // namespace ep
