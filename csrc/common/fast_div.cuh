// Division by a divisor fixed for a whole kernel (experts per rank), as a multiply-high and a shift.
// notify's single block finds the rank of every (token, pick) this way: 25.8 us for 4096 tokens x 8
// picks against 31.6 us with a 32-bit `/` (2x H200, 2026-11-23; benchmarks/nvlink_phases.py).
#pragma once
#include <cstdint>

namespace ep {

struct FastDiv {
  uint32_t magic = 0;
  uint32_t shift = 0;

  // d >= 1. l = ceil(log2 d), magic = floor(2^32 (2^l - d) / d) + 1 (Granlund and Montgomery).
  __host__ __device__ explicit FastDiv(uint32_t d) {
    while ((uint64_t{1} << shift) < d) ++shift;
    magic = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1);
  }

  // n / d for any 32-bit n: the sum is taken in 64 bits, so it cannot overflow.
  __device__ __forceinline__ uint32_t div(uint32_t n) const {
    return static_cast<uint32_t>((static_cast<uint64_t>(__umulhi(n, magic)) + n) >> shift);
  }
};

}  // namespace ep
