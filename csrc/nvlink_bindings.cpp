// pybind11 bindings of the nvlink backend runtime (ep_plugin._C.NvlinkRuntime).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "nvlink.h"

namespace py = pybind11;

void ep_bind_nvlink(py::module_& m) {
  using ep::nvl::Runtime;
  py::class_<Runtime>(m, "NvlinkRuntime",
                      "CUDA-IPC intranode transport: one cudaMalloc buffer per rank, peers opened by handle")
      .def(py::init<int, int, int, int, int, int, double>(), py::arg("device"), py::arg("rank"),
           py::arg("world"), py::arg("max_tokens"), py::arg("hidden"), py::arg("num_experts"),
           py::arg("timeout_s"))
      .def("ipc_handle", [](const Runtime& r) { return py::bytes(r.ipc_handle()); })
      .def("open_peers", [](Runtime& r, const std::vector<py::bytes>& hs) {
        std::vector<std::string> v;
        for (auto& h : hs) v.emplace_back(std::string(h));
        r.open_peers(v);
      })
      .def("close", &Runtime::close)
      .def("notify", &Runtime::notify, py::arg("topk_idx"), py::arg("T"), py::arg("K"), py::arg("send_pos"),
           py::arg("is_in"), py::arg("recv_off"), py::arg("tpe"), py::arg("stream"))
      .def("stage", &Runtime::stage, py::arg("x"), py::arg("T"), py::arg("row_bytes"), py::arg("scales"),
           py::arg("nscales"), py::arg("topk_idx"), py::arg("weights"), py::arg("K"), py::arg("num_sms"),
           py::arg("stream"))
      .def("pull", &Runtime::pull, py::arg("out_x"), py::arg("row_bytes"), py::arg("out_scales"),
           py::arg("nscales"), py::arg("out_idx"), py::arg("out_w"), py::arg("K"), py::arg("recv_off"),
           py::arg("recv_src"), py::arg("cached"), py::arg("R_alloc"), py::arg("num_sms"), py::arg("stream"))
      .def("combine", &Runtime::combine, py::arg("x"), py::arg("send_pos"), py::arg("recv_off"), py::arg("recv_src"),
           py::arg("y"), py::arg("T"), py::arg("num_sms"), py::arg("fused"), py::arg("stream"))
      .def("results",
           [](const Runtime& r) {
             return py::make_tuple(r.num_recv(), r.send_counts(), r.recv_counts(), r.tokens_per_expert(),
                                   r.error());
           },
           "(num_recv, send_counts, recv_counts, tokens_per_expert, error) after a notify completed")
      .def("num_recv", &Runtime::num_recv)
      .def("recv_counts", &Runtime::recv_counts)
      .def("send_counts", &Runtime::send_counts)
      .def("tokens_per_expert", &Runtime::tokens_per_expert)
      .def("error", &Runtime::error)
      .def("error_kernel", &Runtime::error_kernel)
      .def("missing_ranks", &Runtime::missing_ranks)
      .def("epochs", &Runtime::epochs)
      .def_property_readonly("buffer_bytes", &Runtime::buffer_bytes);
}
