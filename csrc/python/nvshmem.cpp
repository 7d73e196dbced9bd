// ep_plugin._C's NVSHMEM functions (nvshmem/runtime.h). setup.py compiles this file only when it
// builds the NVSHMEM part (EP_WITH_NVSHMEM), so a build without the wheel has none of these names.
#include <pybind11/stl.h>

#include <vector>

#include "nvshmem/low_latency.h"
#include "nvshmem/runtime.h"
#include "python/bindings.h"

namespace ep {

void bind_nvshmem(py::module_& m) {
  namespace s = shmem;
  m.def("nvshmem_unique_id", [] { return py::bytes(s::unique_id()); },
        "nvshmemx_get_uniqueid as bytes: rank 0 makes it, every rank passes it to nvshmem_init");
  m.def("nvshmem_unique_id_size", &s::unique_id_size, "Size in bytes of an NVSHMEM unique id");
  m.def("nvshmem_init", [](int rank, int world, const py::bytes& uid) { s::init(rank, world, std::string(uid)); },
        py::arg("rank"), py::arg("world"), py::arg("uid"),
        "Join the NVSHMEM job (unique-id bootstrap); the rank's GPU must be current");
  m.def("nvshmem_finalize", &s::finalize, "Leave the NVSHMEM job (free symmetric buffers first)");
  m.def("nvshmem_initialized", &s::initialized);
  m.def("nvshmem_my_pe", &s::my_pe);
  m.def("nvshmem_n_pes", &s::n_pes);
  m.def("nvshmem_malloc", &s::malloc_symmetric, py::arg("bytes"),
        "Collective symmetric allocation; returns the device pointer as an integer");
  m.def("nvshmem_free", &s::free_symmetric, py::arg("ptr"), "Collective free of an nvshmem_malloc pointer");
  m.def("nvshmem_put_ints", &s::put_ints, py::arg("dst"), py::arg("src"), py::arg("n"), py::arg("peer"),
        py::arg("stream"), "Put n int32 from local src to symmetric dst on peer, then quiet (a test kernel)");
  m.def("nvshmem_barrier_all_on_stream", &s::barrier_all_on_stream, py::arg("stream"));

  using LL = ll::Runtime;
  py::class_<LL>(m, "LowLatencyRuntime",
                 "The low-latency kernels' buffers and launches (csrc/nvshmem/low_latency.h); collective to build")
      .def(py::init<int, int, int, int, int, int, double, int>(), py::arg("rank"), py::arg("world"),
           py::arg("num_experts"), py::arg("max_tokens"), py::arg("max_topk"), py::arg("hidden"),
           py::arg("timeout_s"), py::arg("num_blocks"))
      .def_static("heap_bytes", &LL::heap_bytes, py::arg("world"), py::arg("num_experts"), py::arg("max_tokens"),
                  py::arg("max_topk"), py::arg("hidden"))
      .def("dispatch", &LL::dispatch, py::arg("x"), py::arg("topk_idx"), py::arg("T"), py::arg("K"),
           py::arg("use_fp8"), py::arg("round_scale"), py::arg("phases"), py::arg("out_x"), py::arg("out_scales"),
           py::arg("recv_count"), py::arg("src_info"), py::arg("layout_range"), py::arg("row_slot"),
           py::arg("recv_stats"), py::arg("stream"))
      .def("combine", &LL::combine, py::arg("x"), py::arg("row_slot"), py::arg("recv_count"), py::arg("topk_idx"),
           py::arg("weights"), py::arg("T"), py::arg("K"), py::arg("phases"), py::arg("y"), py::arg("stream"))
      .def("set_mask", &LL::set_mask, py::arg("left_out"))
      .def("error", &LL::error)
      .def("error_kernel", &LL::error_kernel)
      .def("missing_ranks", &LL::missing_ranks)
      .def("take_bad_expert_ids", &LL::take_bad_expert_ids)
      .def_property_readonly("all_p2p", &LL::all_p2p)
      .def_property_readonly("bytes", &LL::bytes)
      .def("destroy", &LL::destroy, py::arg("collective") = true);
}

}  // namespace ep
