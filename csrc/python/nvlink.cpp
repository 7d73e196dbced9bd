// ep_plugin._C.NvlinkRuntime: the nvlink backend's host runtime (nvlink/runtime.h).
#include <pybind11/stl.h>

#include "nvlink/runtime.h"
#include "python/bindings.h"

namespace ep {

void bind_nvlink(py::module_& m) {
  using nvl::Runtime;
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
           py::arg("is_in"), py::arg("recv_off"), py::arg("tpe"), py::arg("stream"), py::arg("host_tpe") = 0,
           py::arg("host_recv_off") = 0, py::arg("merge_repeats") = 0)
      .def("stage", &Runtime::stage, py::arg("x"), py::arg("T"), py::arg("row_bytes"), py::arg("scales"),
           py::arg("nscales"), py::arg("topk_idx"), py::arg("weights"), py::arg("K"), py::arg("num_sms"),
           py::arg("stream"), py::arg("merge_repeats") = 0)
      .def("pull", &Runtime::pull, py::arg("out_x"), py::arg("row_bytes"), py::arg("out_scales"),
           py::arg("nscales"), py::arg("out_idx"), py::arg("out_w"), py::arg("K"), py::arg("recv_off"),
           py::arg("recv_src"), py::arg("cached"), py::arg("R_alloc"), py::arg("num_sms"), py::arg("stream"),
           py::arg("out_rows") = 0)
      .def("stage_pull", &Runtime::stage_pull, py::arg("x"), py::arg("T"), py::arg("row_bytes"), py::arg("scales"),
           py::arg("nscales"), py::arg("topk_idx"), py::arg("weights"), py::arg("K"), py::arg("out_x"),
           py::arg("out_scales"), py::arg("out_idx"), py::arg("out_w"), py::arg("recv_off"), py::arg("recv_src"),
           py::arg("cached"), py::arg("R_alloc"), py::arg("num_sms"), py::arg("stream"), py::arg("out_rows") = 0)
      .def("notify_stage_pull", &Runtime::notify_stage_pull, py::arg("topk_idx"), py::arg("T"), py::arg("K"),
           py::arg("send_pos"), py::arg("is_in"), py::arg("recv_off"), py::arg("tpe"), py::arg("host_tpe"),
           py::arg("host_recv_off"), py::arg("x"), py::arg("row_bytes"), py::arg("scales"), py::arg("nscales"),
           py::arg("weights"), py::arg("out_x"), py::arg("out_scales"), py::arg("out_idx"), py::arg("out_w"),
           py::arg("recv_src"), py::arg("R_alloc"), py::arg("num_sms"), py::arg("stream"),
           "notify + stage_pull of a fresh rank-major worst-case dispatch in one launch (notify inside block 0)")
      .def("stage_pull_contract_fits", &Runtime::stage_pull_contract_fits, py::arg("row_bytes"), py::arg("nodes"))
      .def("stage_pull_contract", &Runtime::stage_pull_contract, py::arg("x"), py::arg("T"), py::arg("row_bytes"),
           py::arg("scales"), py::arg("nscales"), py::arg("topk_idx"), py::arg("weights"), py::arg("K"),
           py::arg("out_x"), py::arg("out_scales"), py::arg("out_idx"), py::arg("out_w"), py::arg("recv_off"),
           py::arg("recv_src"), py::arg("R_alloc"), py::arg("nodes"), py::arg("to_contract"), py::arg("counts"),
           py::arg("num_sms"), py::arg("stream"), py::arg("send_pos") = 0, py::arg("is_in") = 0, py::arg("tpe") = 0,
           py::arg("host_tpe") = 0, py::arg("host_recv_off") = 0,
           "the contract-order stage_pull; with notify's outputs (tpe, ...) notify inside it")
      .def("stage_begin", &Runtime::stage_begin, py::arg("x"), py::arg("T"), py::arg("row_bytes"), py::arg("scales"),
           py::arg("nscales"), py::arg("topk_idx"), py::arg("weights"), py::arg("K"), py::arg("stream"),
           "the copy-engine stage's wait and copies on a side stream forked off `stream` (before notify)")
      .def("stage_fork", &Runtime::stage_fork, py::arg("stream"),
           "marks `stream`'s current point as the next stage_begin's fork (call it before notify's launch)")
      .def("stage_end", &Runtime::stage_end, py::arg("stream"),
           "its release behind what `stream` has queued (notify), then `stream` joined to it")
      .def_property("stage_copy_engine", &Runtime::stage_copy_engine, &Runtime::set_stage_copy_engine,
                    "the separate stage launch moves rank-major rows by the copy engine (no SM held); False: a kernel")
      .def_property("tma", &Runtime::tma, &Runtime::set_tma,
                    "the pulls move rows by bulk copies (TMA; rows too large for the ring: registers); False: registers")
      .def_property_readonly("tma_supported", &Runtime::tma_supported,
                             "whether this build (EP_PLUGIN_CUDA_ARCH >= 90) and this GPU run the bulk-copy pulls")
      .def_property("pull_stage_slots", &Runtime::pull_stage_slots, &Runtime::set_pull_stage_slots,
                    "the pull combine's stager ring: its shared-memory rows (3..12; the loads get the rest)")
      .def_property("pull_diag", &Runtime::pull_diag, &Runtime::set_pull_diag,
                    "benchmarks only: 1 times the pull combine's stage alone, 2 its loads alone (y is wrong); +4 "
                    "prints its loader's and stager's wait cycles")
      .def_property("pull_variant", &Runtime::pull_variant, &Runtime::set_pull_variant,
                    "the pull combine's variant for A/B runs (same y): +1 / +2 stager moves half / quarter rows, "
                    "+4 load slots from a free mask, +8 contiguous spans per block, +16 x read L2 evict_first (the default: "
                    "16; 0 is the kernel as measured before session 5)")
      .def("combine", &Runtime::combine, py::arg("x"), py::arg("send_pos"), py::arg("recv_off"), py::arg("recv_src"),
           py::arg("y"), py::arg("T"), py::arg("num_sms"), py::arg("mode"), py::arg("stream"), py::arg("x_rows") = 0,
           py::arg("y_blocks") = 0, py::arg("block_tokens") = 0)
      .def_property("combine_copy_rounds", &Runtime::combine_copy_rounds, &Runtime::set_combine_copy_rounds,
                    "the copy-engine combine stage's pieces per owner, a release behind each round (1..64)")
      .def_property_readonly("combine_copy_calls", &Runtime::combine_copy_calls,
                             "combines that ran combine_copy_engine (which path ran, for tests and benches)")
      .def_property_readonly("combine_copy_engine_fits", &Runtime::combine_copy_engine_fits,
                             "whether combine_copy_engine applies (the bulk-copy pull kernel without its stager)")
      .def("combine_copy_engine", &Runtime::combine_copy_engine, py::arg("x"), py::arg("send_pos"),
           py::arg("recv_off"), py::arg("y"), py::arg("T"), py::arg("num_sms"), py::arg("stream"),
           py::arg("recv_off_host"),
           "the pull combine, its stage by the copy engines on a side stream (recv_off_host: W + 1 offsets)")
      .def("expert_pull", &Runtime::expert_pull, py::arg("out_x"), py::arg("row_bytes"), py::arg("out_scales"),
           py::arg("nscales"), py::arg("out_idx"), py::arg("out_w"), py::arg("K"), py::arg("recv_off"),
           py::arg("recv_src"), py::arg("positions"), py::arg("cached"), py::arg("R_alloc"), py::arg("alignment"),
           py::arg("scratch"), py::arg("offsets"), py::arg("counts"), py::arg("num_sms"), py::arg("stream"))
      .def("expert_scratch_ints", &Runtime::expert_scratch_ints, py::arg("num_sms"))
      .def("combine_expert", &Runtime::combine_expert, py::arg("x"), py::arg("positions"), py::arg("K"),
           py::arg("send_pos"), py::arg("recv_off"), py::arg("y"), py::arg("T"), py::arg("num_sms"), py::arg("stream"))
      .def_property_readonly("combine_expert_staged_calls", &Runtime::combine_expert_staged_calls,
                             "expert-major combines that ran combine_expert_staged (which path ran, for tests and benches)")
      .def("combine_expert_staged", &Runtime::combine_expert_staged, py::arg("x"), py::arg("positions"), py::arg("K"),
           py::arg("send_pos"), py::arg("recv_off"), py::arg("y"), py::arg("T"), py::arg("num_sms"), py::arg("stream"),
           "combine of expert-major rows: the pull kernel on num_sms SMs, the expert sum staging its rows beside it")
      .def("expert_sum", &Runtime::expert_sum, py::arg("x"), py::arg("positions"), py::arg("K"), py::arg("recv_off"),
           py::arg("rows"), py::arg("blocks"), py::arg("stream"),
           "each received row's local experts summed into rank-major rows (then any combine kernel takes them)")
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
      .def("take_bad_expert_ids", &Runtime::take_bad_expert_ids,
           "1 if a notify since the last call saw a topk id outside [-1, E) (then clears it), else 0")
      .def("epochs", &Runtime::epochs)
      .def_property_readonly("buffer_bytes", &Runtime::buffer_bytes);

  // The limits and names Python reports (ep_plugin/backends/nvlink/limits.py), read from here so that
  // the two sides cannot drift apart.
  m.attr("NVLINK_MAX_RANKS") = nvl::kMaxRanks;
  m.attr("NVLINK_MAX_TOPK") = nvl::kMaxTopk;
  py::dict names;
  for (int id = nvl::K_NOTIFY; id < nvl::K_NUM; ++id) names[py::int_(id)] = nvl::kKernelNames[id];
  m.attr("NVLINK_KERNEL_NAMES") = names;
}

}  // namespace ep
