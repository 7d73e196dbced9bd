// What an NVSHMEM kernel tells the host through host-mapped memory, and the host side of reading it:
// a wait that ran past its deadline (which peers were missing, in which kernel) and expert ids outside
// [-1, E). The low-latency and rail engines each keep one; only the peer count differs. The layout
// (err, err_kernel, missing[], bad_ids) is what the device-side wait (common/wait.cuh) writes.
#pragma once
#include <cuda_runtime.h>

#include <cstring>
#include <vector>

#include "common/error.h"

namespace ep {

template <int kPeers>
struct HostReport {
  int err;
  int err_kernel;
  int missing[kPeers];
  int bad_ids;  // a send half saw topk_idx outside [-1, E) (treated as routed nowhere)
};

namespace host_report {

template <class R>
int error(const R* r) { return r ? static_cast<const volatile R*>(r)->err : 0; }

template <class R>
int error_kernel(const R* r) { return r ? static_cast<const volatile R*>(r)->err_kernel : 0; }

template <class R>
int take_bad_ids(R* r) {  // 1 if flagged since the last call; clears it
  if (r == nullptr) return 0;
  volatile R* v = r;
  const int bad = v->bad_ids;
  if (bad) v->bad_ids = 0;
  return bad;
}

// The report in zeroed host-mapped memory: (host pointer, its device alias for the kernels).
template <class R>
void allocate(R*& host, R*& device_alias) {
  EP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host), sizeof(R), cudaHostAllocMapped));
  std::memset(host, 0, sizeof(R));
  EP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_alias), host, 0));
}

// Installs a new mask (one word per peer + the abort word) once the device is idle, and forgets what
// was reported: the engine goes on without the masked peers.
template <class R>
void set_mask(int* device_words, const std::vector<int>& mask, R* r) {
  EP_CUDA_CHECK(cudaDeviceSynchronize());
  EP_CUDA_CHECK(cudaMemcpy(device_words, mask.data(), sizeof(int) * mask.size(), cudaMemcpyHostToDevice));
  std::memset(r, 0, sizeof(R));
}

}  // namespace host_report
}  // namespace ep
