// Shared helpers for ep_plugin._C: error checking that surfaces as Python exceptions.
#pragma once
#include <cuda_runtime.h>
#include <stdexcept>
#include <string>

namespace ep {

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("ep_plugin._C: ") + what + ": " + cudaGetErrorString(err));
  }
}

}  // namespace ep

#define EP_CUDA_CHECK(expr) ::ep::check_cuda((expr), #expr)
