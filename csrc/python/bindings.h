// The seam between Python and the kernels: each transport adds its functions and classes to
// ep_plugin._C here. Tensors cross as raw device pointers and streams as integers, so that this
// module never links libtorch and one build serves every torch version.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>

namespace ep {
namespace py = pybind11;

void bind_nvlink(py::module_& m);  // nvlink.cpp (module.cpp binds the module entry and the layout)
#ifdef EP_WITH_NVSHMEM
void bind_nvshmem(py::module_& m);  // nvshmem.cpp, compiled only in a build with the NVSHMEM wheel
#endif

}  // namespace ep
