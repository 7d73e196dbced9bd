// The pull combine's stage by the copy engines (Runtime::combine_copy_engine; the nvlink backend's
// combine_stage_copy_engine, off by default): each holder's rows for owner o are contiguous in x (rank-major receive
// order) and in its own combine area (slot [o][position]),
// so the stage is one cudaMemcpyAsync per owner and piece, and the pull kernel (combine_pull_tma.cu, diag
// kDiagStagedByCopies) runs no stager: every slot of its shared-memory ring loads.
//
// Why: the kernel's stager is one thread per block issuing bulk copies beside the block's loads; with every rank
// started together it runs ahead of them, but a rank that starts late stages late while its own loaders run flat out,
// and every peer waits on its rows -- one late rank cost the others 1.5x (24 SMs) to 2.3x (48 SMs) its delay at EP4
// (benchmarks/NOTES_nvlink.md, session 7). The copy engines stage 159 MB (EP4) in ~130 us without an SM.
//
// Protocol, at combine epoch ce = epochs[E_COMBINE] + 1, as the stager's:
//   snap (one block, on the call's stream before the pull kernel): wait REDUCE_DONE[p] >= ce - 1 for every peer p
//     (p no longer reads this rank's area), then record ce in combine_ce -- the pull kernel sets epochs[E_COMBINE]
//     at its end, possibly before the last release below has run, so the releases read ce from there;
//   copies (a side stream forked after the snap): round j moves piece j of every owner's rows, owners in the
//     stager's order (me + 1, me + 2, ...), pieces whole sub-chunks of kCombineSub positions;
//   release (one block behind each round): COMBINE_READY[me][sub] = ce at each owner for the round's sub-chunks,
//     after a system fence (the copies completed before the kernel began: stream order); nothing once the call
//     was aborted (a timeout), as the stager publishes nothing after a failed wait.
#include "common/error.h"
#include "nvlink/device.cuh"
#include "nvlink/kernels.h"

namespace ep {
namespace nvl {
namespace {

struct ReleaseRound {  // the sub-chunks [sub0[i], sub1[i]) of owner[i] staged by one round, i < n
  int n;
  int owner[kMaxRanks], sub0[kMaxRanks], sub1[kMaxRanks];
};

__global__ void combine_snap_kernel(Ctx c) {
  __shared__ int s_fail;
  const int ce = c.epochs[E_COMBINE] + 1;
  if (block_wait_peers(c, F_REDUCE_DONE, ce - 1, c.rank, K_SEND, globaltimer() + c.timeout_ns, &s_fail)) return;
  if (threadIdx.x == 0) *c.combine_ce = ce;
}

__global__ void combine_release_kernel(Ctx c, ReleaseRound r) {
  if (ld_volatile(c.aborted)) return;
  const int ce = *c.combine_ce;
  __threadfence_system();
  for (int i = 0; i < r.n; ++i)
    for (int sub = r.sub0[i] + static_cast<int>(threadIdx.x); sub < r.sub1[i]; sub += blockDim.x)
      st_release_sys(combine_ready_at(c, r.owner[i], c.rank, sub), ce);
}

}  // namespace

void launch_combine_snap(const Ctx& c, cudaStream_t stream) {
  combine_snap_kernel<<<1, 32, 0, stream>>>(c);
  EP_CUDA_CHECK(cudaGetLastError());
}

void launch_combine_stage_copies(const Ctx& c, const char* x, const int* recv_off_host, int rounds,
                                 cudaStream_t stream) {
  const size_t row_bytes = static_cast<size_t>(c.hidden) * 2;
  char* area = c.peers[c.rank] + c.off_combine;
  for (int j = 0; j < rounds; ++j) {
    ReleaseRound r{};
    for (int k = 0; k + 1 < c.world; ++k) {
      const int o = (c.rank + 1 + k) % c.world, cnt = recv_off_host[o + 1] - recv_off_host[o];
      const int subs = (cnt + kCombineSub - 1) / kCombineSub;
      const int s0 = static_cast<int>(static_cast<long long>(subs) * j / rounds);
      const int s1 = static_cast<int>(static_cast<long long>(subs) * (j + 1) / rounds);
      if (s0 >= s1) continue;
      const int q0 = s0 * kCombineSub, q1 = s1 * kCombineSub < cnt ? s1 * kCombineSub : cnt;
      EP_CUDA_CHECK(cudaMemcpyAsync(area + (static_cast<size_t>(o) * c.max_tokens + q0) * row_bytes,
                                    x + static_cast<size_t>(recv_off_host[o] + q0) * row_bytes,
                                    static_cast<size_t>(q1 - q0) * row_bytes, cudaMemcpyDeviceToDevice, stream));
      r.owner[r.n] = o;
      r.sub0[r.n] = s0;
      r.sub1[r.n] = s1;
      ++r.n;
    }
    if (r.n == 0) continue;
    combine_release_kernel<<<1, 128, 0, stream>>>(c, r);
    EP_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace nvl
}  // namespace ep
