// Host-side checks. pybind11 turns std::invalid_argument into ValueError (the caller passed something
// wrong) and std::runtime_error into RuntimeError (the system failed); every message carries the
// values that broke the rule, so that one log line is enough to act on.
#pragma once
#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

namespace ep {

// printf-style, so that the compiler checks every format against its values.
__attribute__((format(printf, 1, 2))) inline std::string format_message(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  va_list again;
  va_copy(again, args);
  const int n = std::vsnprintf(nullptr, 0, fmt, args);
  va_end(args);
  std::string s(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) std::vsnprintf(&s[0], s.size() + 1, fmt, again);
  va_end(again);
  return s;
}

// The source path from csrc/ on: nvcc and setup.py pass absolute paths, which say nothing more.
inline const char* source_path(const char* file) {
  const char* at = std::strstr(file, "csrc/");
  return at ? at : file;
}

inline void check_cuda(cudaError_t err, const char* call, const char* file, int line) {
  if (err != cudaSuccess) {
    throw std::runtime_error(format_message("ep_plugin._C: %s: %s (%s, %s:%d)", call, cudaGetErrorString(err),
                                            cudaGetErrorName(err), source_path(file), line));
  }
}

}  // namespace ep

// EP_CHECK_ARG(cond, fmt, values...): bad input, ValueError in Python.
#define EP_CHECK_ARG(cond, ...)                                                   \
  do {                                                                            \
    if (!(cond)) throw std::invalid_argument(::ep::format_message(__VA_ARGS__));  \
  } while (0)

// EP_CHECK(cond, fmt, values...): a state the call cannot proceed from, RuntimeError in Python.
#define EP_CHECK(cond, ...)                                                       \
  do {                                                                            \
    if (!(cond)) throw std::runtime_error(::ep::format_message(__VA_ARGS__));     \
  } while (0)

// Names the failing call and where it is; the message keeps the "ep_plugin._C: <call>: <error>" start.
#define EP_CUDA_CHECK(expr) ::ep::check_cuda((expr), #expr, __FILE__, __LINE__)
