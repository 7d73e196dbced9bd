// NVSHMEM host runtime and the one device kernel (see runtime.h for the protocol). Compiled with
// -rdc=true and device-linked, with libnvshmem_device, into a single dlink object: NVSHMEM's device
// state (nvshmemi_device_state_d) is a __device__ global, so two device-link units that each pulled
// in libnvshmem_device would hold two copies and one of them would never be initialized. Host-side
// init must live here too: nvshmemx_init_attr is an inline that calls nvshmemi_init_thread from
// libnvshmem_device.a, which registers this module's device state with libnvshmem_host.so.3.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstring>
#include <stdexcept>

#include "common/error.h"
#include "nvshmem/runtime.h"

namespace ep::shmem {
namespace {

bool g_initialized = false;

void require_init(const char* what) {
  if (!g_initialized) throw std::runtime_error(std::string("nvshmem ") + what + ": call nvshmem_init first");
}

// One thread issues the whole put: the payload is a handful of ints and quiet() must follow the put
// on the same thread to order it.
__global__ void put_ints_kernel(int* dst, const int* src, int n, int peer) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    nvshmem_int_put(dst, src, static_cast<size_t>(n), peer);
    nvshmem_quiet();
  }
}

}  // namespace

size_t unique_id_size() { return sizeof(nvshmemx_uniqueid_t); }

std::string unique_id() {
  nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (nvshmemx_get_uniqueid(&uid) != 0) throw std::runtime_error("nvshmemx_get_uniqueid failed");
  return std::string(reinterpret_cast<const char*>(&uid), sizeof(uid));
}

void init(int rank, int world, const std::string& uid_bytes) {
  if (g_initialized) throw std::runtime_error("nvshmem_init: already initialized (call nvshmem_finalize first)");
  if (uid_bytes.size() != sizeof(nvshmemx_uniqueid_t))
    throw std::invalid_argument("nvshmem_init: uid must be " + std::to_string(sizeof(nvshmemx_uniqueid_t)) +
                                " bytes from nvshmem_unique_id(), got " + std::to_string(uid_bytes.size()));
  if (world <= 0 || rank < 0 || rank >= world)
    throw std::invalid_argument("nvshmem_init: need 0 <= rank < world");
  nvshmemx_uniqueid_t uid;
  std::memcpy(&uid, uid_bytes.data(), sizeof(uid));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(rank, world, &uid, &attr) != 0)
    throw std::runtime_error("nvshmemx_set_attr_uniqueid_args failed");
  if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0) throw std::runtime_error("nvshmemx_init_attr failed");
  g_initialized = true;
}

void finalize() {
  if (!g_initialized) return;
  nvshmem_finalize();
  g_initialized = false;
}

bool initialized() { return g_initialized; }

int my_pe() {
  require_init("my_pe");
  return nvshmem_my_pe();
}

int n_pes() {
  require_init("n_pes");
  return nvshmem_n_pes();
}

uintptr_t malloc_symmetric(size_t bytes) {
  require_init("malloc");
  void* p = nvshmem_malloc(bytes);
  if (p == nullptr && bytes != 0)
    throw std::runtime_error("nvshmem_malloc(" + std::to_string(bytes) + ") failed (raise NVSHMEM_SYMMETRIC_SIZE?)");
  return reinterpret_cast<uintptr_t>(p);
}

void free_symmetric(uintptr_t ptr) {
  require_init("free");
  nvshmem_free(reinterpret_cast<void*>(ptr));
}

void put_ints(uintptr_t dst, uintptr_t src, int n, int peer, uintptr_t stream) {
  require_init("put_ints");
  if (n < 0 || peer < 0 || peer >= nvshmem_n_pes()) throw std::invalid_argument("nvshmem put_ints: bad n or peer");
  put_ints_kernel<<<1, 1, 0, reinterpret_cast<cudaStream_t>(stream)>>>(reinterpret_cast<int*>(dst),
                                                                       reinterpret_cast<const int*>(src), n, peer);
  EP_CUDA_CHECK(cudaGetLastError());
}

void barrier_all_on_stream(uintptr_t stream) {
  require_init("barrier_all_on_stream");
  nvshmemx_barrier_all_on_stream(reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace ep::shmem
