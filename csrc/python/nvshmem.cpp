// ep_plugin._C's NVSHMEM functions (nvshmem/runtime.h). setup.py compiles this file only when it
// builds the NVSHMEM part (EP_WITH_NVSHMEM), so a build without the wheel has none of these names.
#include <pybind11/stl.h>

#include <vector>

#include "nvshmem/low_latency.h"
#include "nvshmem/rail.h"
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
      .def(py::init<int, int, int, int, int, int, double, int, int>(), py::arg("rank"), py::arg("world"),
           py::arg("num_experts"), py::arg("max_tokens"), py::arg("max_topk"), py::arg("hidden"),
           py::arg("timeout_s"), py::arg("num_blocks"), py::arg("output_sets") = 0)
      .def_static("heap_bytes", &LL::heap_bytes, py::arg("world"), py::arg("num_experts"), py::arg("max_tokens"),
                  py::arg("max_topk"), py::arg("hidden"), py::arg("output_sets") = 0)
      .def("dispatch", &LL::dispatch, py::arg("x"), py::arg("topk_idx"), py::arg("T"), py::arg("K"),
           py::arg("use_fp8"), py::arg("round_scale"), py::arg("phases"), py::arg("out_x"), py::arg("out_scales"),
           py::arg("recv_count"), py::arg("src_info"), py::arg("layout_range"), py::arg("row_slot"),
           py::arg("recv_stats"), py::arg("stream"), py::arg("out_set") = -1, py::arg("self_pos") = 0)
      .def_property_readonly("sets", &LL::sets)
      .def("set_pointers", &LL::set_pointers, py::arg("i"))
      .def("combine", &LL::combine, py::arg("x"), py::arg("row_slot"), py::arg("recv_count"), py::arg("topk_idx"),
           py::arg("weights"), py::arg("T"), py::arg("K"), py::arg("phases"), py::arg("y"), py::arg("stream"),
           py::arg("self_pos") = 0, py::arg("rec") = 0)
      .def("set_stamps", &LL::set_stamps, py::arg("stamps"),
           "Phase stamps (benchmarks): a device pointer to 2*1024*8 uint64, or 0 for none")
      .def("set_mask", &LL::set_mask, py::arg("left_out"))
      .def("error", &LL::error)
      .def("error_kernel", &LL::error_kernel)
      .def("missing_ranks", &LL::missing_ranks)
      .def("take_bad_expert_ids", &LL::take_bad_expert_ids)
      .def_property_readonly("all_p2p", &LL::all_p2p)
      .def_property_readonly("bytes", &LL::bytes)
      .def_property("num_blocks", &LL::num_blocks, &LL::set_num_blocks)
      .def("destroy", &LL::destroy, py::arg("collective") = true);

  using Rail = rail::Runtime;
  py::class_<Rail>(m, "RailRuntime",
                   "The rail (internode RDMA) kernels' buffers and launches (csrc/nvshmem/rail.h); collective to build")
      .def(py::init<int, int, int, int, int, int, int, int, double, int, int>(), py::arg("rank"), py::arg("world"),
           py::arg("ranks_per_node"), py::arg("num_experts"), py::arg("max_tokens"), py::arg("max_topk"),
           py::arg("hidden"), py::arg("fp8"), py::arg("timeout_s"), py::arg("num_blocks"), py::arg("force_puts") = 0)
      .def_static("heap_bytes", &Rail::heap_bytes, py::arg("world"), py::arg("ranks_per_node"), py::arg("num_experts"),
                  py::arg("max_tokens"), py::arg("max_topk"), py::arg("hidden"), py::arg("fp8"), py::arg("stage"))
      .def("dispatch", &Rail::dispatch, py::arg("x"), py::arg("scales"), py::arg("topk_idx"), py::arg("weights"),
           py::arg("T"), py::arg("K"), py::arg("phases"), py::arg("stream"))
      .def("combine", &Rail::combine, py::arg("y_f"), py::arg("slot_valid"), py::arg("topk_idx"), py::arg("T"),
           py::arg("K"), py::arg("phases"), py::arg("y"), py::arg("stream"), py::arg("y_rows") = 0, py::arg("placed") = 0,
           py::arg("pull") = 0)
      .def("combine_targets", &Rail::combine_targets, py::arg("parity"),
           "[N] addresses where combine's send half of `parity` puts this node's rows at each rail peer (row of slot "
           "s*M + t at [s] + t * 2H); empty unless every rail peer is P2P")
      .def("combine_own_targets", &Rail::combine_own_targets, py::arg("parity"),
           "[N] addresses in this rank's own combine rows of `parity` where the pulled combine keeps the row of slot "
           "s*M + t (at [s] + t * 2H) for rank (s, l) to read; empty unless every rail peer is P2P")
      .def("next_combine_parity", &Rail::next_combine_parity, "The parity of the next combine's send half")
      .def(
          "buffers",
          [](const Rail& r, int parity) {
            const rail::Buffers b = r.buffers(parity);
            return py::make_tuple(b.xf, b.sf, b.topk_f, b.wf);
          },
          py::arg("parity"), "(xf, sf, topk_f, wf) addresses of parity's dispatch outputs (sf 0 unless FP8)")
      .def("next_dispatch_parity", &Rail::next_dispatch_parity,
           "The parity whose buffers the next dispatch's receive half completes")
      .def("set_mask", &Rail::set_mask, py::arg("left_out"))
      .def("error", &Rail::error)
      .def("error_kernel", &Rail::error_kernel)
      .def("missing_ranks", &Rail::missing_ranks)
      .def("take_bad_expert_ids", &Rail::take_bad_expert_ids)
      .def_property_readonly("all_p2p", &Rail::all_p2p)
      .def_property_readonly("bytes", &Rail::bytes)
      .def("destroy", &Rail::destroy, py::arg("collective") = true);
}

}  // namespace ep
