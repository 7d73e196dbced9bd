// NVSHMEM host runtime for ep_plugin._C (issue #11, deliverable 1: the build; the nvshmem backend's
// kernels come later). Protocol: rank 0 calls unique_id() and shares the bytes with every rank
// (torch.distributed broadcast in Python); each rank then calls init(rank, world, uid) with its GPU
// already current, malloc()s the same sizes in the same order on every rank (symmetric heap: the
// same offset is valid on every peer), and finalize()s after freeing. put_ints() is a tiny device
// kernel that exists so that the -rdc / device-link path against libnvshmem_device is exercised.
//
// This header names no NVSHMEM type, so the bindings compile with the plain C++ compiler and
// without the wheel's include directory; only runtime.cu (nvcc -rdc) sees nvshmem.h.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace ep::shmem {

std::string unique_id();                                  // nvshmemx_get_uniqueid, as raw bytes
void init(int rank, int world, const std::string& uid);   // nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID)
void finalize();
bool initialized();
int my_pe();
int n_pes();
uintptr_t malloc_symmetric(size_t bytes);                 // collective: every PE, same size, same order
void free_symmetric(uintptr_t ptr);                       // collective as well
// Copies n ints from local src to symmetric dst on peer, then quiets (the put is complete on return
// of the kernel); barrier_all_on_stream() makes it visible to the peer's later kernels.
void put_ints(uintptr_t dst, uintptr_t src, int n, int peer, uintptr_t stream);
void barrier_all_on_stream(uintptr_t stream);
size_t unique_id_size();

}  // namespace ep::shmem
