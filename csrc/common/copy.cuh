// The 16-byte copy loops. Bandwidth over NVLink comes from many loads in flight per thread, so both
// loops issue U loads before the first store.
#pragma once
#include "common/ptx.cuh"

namespace ep {

// A warp copies a batch of up to 32 rows of n16 vectors as one flat stream of `total` vectors, so a
// short row leaves no bubble before the next. The caller places vector vi (row j = vi / n16 of the
// batch) in two steps: src(j) / dst(j) run on every lane in step, so they may __shfl_sync row j's
// metadata from lane j; each returns an address function at(vi) that is called only where
// vi < total, so nothing is computed for lanes past the end. A contiguous copy ignores j (the row
// arithmetic then compiles away).
template <int U, typename Src, typename Dst>
__device__ __forceinline__ void warp_copy_rows(int total, int n16, int lane, Src src, Dst dst) {
  for (int v0 = 0; v0 < total; v0 += 32 * U) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int vi = v0 + u * 32 + lane;
      const auto at = src(min(vi / n16, 31));
      if (vi < total) v[u] = ld_nc_v4(at(vi));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int vi = v0 + u * 32 + lane;
      const auto at = dst(min(vi / n16, 31));
      if (vi < total) st_na_v4(at(vi), v[u]);
    }
  }
}

// The address functions of a contiguous run of vectors starting at p.
template <typename T>
__device__ __forceinline__ auto contiguous(T* p) {
  return [p](int) { return [p](int vi) { return p + vi; }; };
}

// The whole grid copies n contiguous vectors: U rounds of the grid in flight per thread, then the
// tail one round at a time.
template <int U>
__device__ __forceinline__ void grid_copy(const int4* src, int4* dst, size_t n, size_t gtid,
                                          size_t gsize) {
  size_t i = gtid;
  for (; i + (U - 1) * gsize < n; i += U * gsize) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = ld_nc_v4(src + i + u * gsize);
#pragma unroll
    for (int u = 0; u < U; ++u) st_na_v4(dst + i + u * gsize, v[u]);
  }
  for (; i < n; i += gsize) st_na_v4(dst + i, ld_nc_v4(src + i));
}

}  // namespace ep
