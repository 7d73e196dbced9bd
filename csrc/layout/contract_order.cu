// contract_order in one launch: the torch version is ~17 small ops (searchsorted, a scatter_add for the
// counts, two cumsums, ...) issued after the inner dispatch, and on the GPU host they kept the stream
// waiting: the fresh 2x2 dispatch's reorder stage took 721 us of host for 478 of GPU (4x H100, 2026-11-26,
// docs/INTERNODE.md). One block: the counts are W integers and the rows a few tens of thousands.
#include "layout/contract_order.h"

#include "common/error.h"

namespace ep {
namespace {

constexpr int kThreads = 1024;
constexpr int kMaxRanks = 1024;  // W; shared memory holds W + 1 counts and shifts

__device__ __forceinline__ long long floor_div(long long v, long long d) { return v >= 0 ? v / d : -((-v + d - 1) / d); }

__global__ void __launch_bounds__(kThreads, 1)
contract_order_kernel(const int* __restrict__ recv_off, const int* __restrict__ recv_src, int N, int P, int M,
                      int rows, int64_t* __restrict__ counts_out, int64_t* __restrict__ pos) {
  const int W = N * P;
  __shared__ int s_off[kMaxRanks + 1];
  __shared__ int s_count[kMaxRanks + 1];
  __shared__ long long s_delta[kMaxRanks + 1];
  for (int i = threadIdx.x; i <= W; i += blockDim.x) s_count[i] = 0;
  for (int i = threadIdx.x; i <= P; i += blockDim.x) s_off[i] = recv_off[i];
  __syncthreads();
  // pass 1: each row's source rank (W for rows past the valid ones, or whatever recv_src holds after an
  // inner timeout, clamped), kept in pos until pass 2; the counts
  for (int i = threadIdx.x; i < rows; i += blockDim.x) {
    int fwd = 0;  // forwarder l with off[l] <= i < off[l + 1]: the number of l with off[l + 1] <= i
    while (fwd < P && s_off[fwd + 1] <= i) ++fwd;
    int src = W;
    if (fwd < P) {
      const long long g = fwd + floor_div(recv_src[i], M) * P;  // any int32 (garbage after a timeout)
      src = static_cast<int>(g < 0 ? 0 : (g > W ? W : g));
    }
    pos[i] = src;
    atomicAdd(&s_count[src], 1);
  }
  __syncthreads();
  // the shift of each source rank g = n*P + l: contract start - first inner row of (l, n) =
  // cumsum(c)[g] - (sum over nodes m <= n of c[m*P + l]) - off[l] (inclusive sums: the c[g] cancel)
  if (threadIdx.x == 0) {
    long long total = 0;
    for (int g = 0; g < W; ++g) {
      total += s_count[g];
      s_delta[g] = total;
    }
    s_delta[W] = 0;
  }
  __syncthreads();
  if (threadIdx.x < P) {
    const int l = threadIdx.x;
    long long column = 0;
    for (int n = 0; n < N; ++n) {
      column += s_count[n * P + l];
      s_delta[n * P + l] -= column + s_off[l];
    }
  }
  for (int g = threadIdx.x; g < W; g += blockDim.x) counts_out[g] = s_count[g];
  __syncthreads();
  const long long last = rows > 0 ? rows - 1 : 0;
  for (int i = threadIdx.x; i < rows; i += blockDim.x) {
    const long long p = s_delta[pos[i]] + i;
    pos[i] = p < 0 ? 0 : (p > last ? last : p);
  }
}

}  // namespace

void launch_contract_order(const int* recv_off, const int* recv_src, int nodes, int per_node, int max_tokens,
                           int rows, int64_t* counts, int64_t* pos, cudaStream_t stream) {
  EP_CHECK_ARG(nodes >= 1 && per_node >= 1 && nodes * per_node <= kMaxRanks && max_tokens >= 1 && rows >= 0,
               "contract_order: nodes %d, per_node %d (at most %d ranks), max_tokens %d, rows %d", nodes, per_node,
               kMaxRanks, max_tokens, rows);
  contract_order_kernel<<<1, kThreads, 0, stream>>>(recv_off, recv_src, nodes, per_node, max_tokens, rows, counts, pos);
  EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ep
