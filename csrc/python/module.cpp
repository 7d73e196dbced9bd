// ep_plugin._C: the module entry point and the bindings of the layout kernels and of EPGroupedMLP's helpers (each
// file of pybind11 bindings costs seconds of build time, so the small ones share this one).
#include <cuda_runtime.h>

#include "common/error.h"
#include "layout/contract_order.h"
#include "layout/layout.h"
#include "layout/local_pack.h"
#include "layout/merge_repeats.h"
#include "experts/swiglu_rows.h"
#include "experts/zero_tail.h"
#include "python/bindings.h"

namespace {

int runtime_version() {
  int v = 0;
  EP_CUDA_CHECK(cudaRuntimeGetVersion(&v));
  return v;
}

template <typename T>
T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

}  // namespace

PYBIND11_MODULE(_C, m) {
  namespace py = pybind11;
  m.doc() = "ep_plugin compiled kernels (raw pointers + cudaStream_t as integers)";
  m.def("cuda_runtime_version", &runtime_version, "CUDA runtime version this module was built with");
  m.def(
      "dispatch_layout",
      [](uintptr_t topk_idx, int num_tokens, int num_topk, int num_ranks, int num_experts,
         uintptr_t tokens_per_rank, uintptr_t tokens_per_expert, uintptr_t is_token_in_rank,
         uintptr_t stream) {
        ep::launch_dispatch_layout(ptr<const int64_t>(topk_idx), num_tokens, num_topk, num_ranks, num_experts,
                                   ptr<int>(tokens_per_rank), ptr<int>(tokens_per_expert),
                                   ptr<bool>(is_token_in_rank), reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_ranks"),
      py::arg("num_experts"), py::arg("tokens_per_rank"), py::arg("tokens_per_expert"),
      py::arg("is_token_in_rank"), py::arg("stream"),
      "Count tokens per rank/expert and mark is_token_in_rank from int64 topk_idx (int32/bool outputs)");
  m.def(
      "merge_repeats",
      [](uintptr_t topk_idx, uintptr_t topk_weights, uintptr_t out_idx, uintptr_t out_weights, int num_tokens,
         int num_topk, uintptr_t stream) {
        ep::launch_merge_repeats(ptr<const int64_t>(topk_idx), ptr<const float>(topk_weights), ptr<int64_t>(out_idx),
                                 ptr<float>(out_weights), num_tokens, num_topk, reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("topk_idx"), py::arg("topk_weights"), py::arg("out_idx"), py::arg("out_weights"), py::arg("num_tokens"),
      py::arg("num_topk"), py::arg("stream"),
      "A later slot naming an earlier slot's expert -> -1; weights summed per expert (0 pointers: no weights)");
  m.def(
      "contract_order",
      [](uintptr_t recv_off, uintptr_t recv_src, int nodes, int per_node, int max_tokens, int rows, uintptr_t counts,
         uintptr_t pos, uintptr_t stream) {
        ep::launch_contract_order(ptr<const int>(recv_off), ptr<const int>(recv_src), nodes, per_node, max_tokens, rows,
                                  ptr<int64_t>(counts), ptr<int64_t>(pos), reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("recv_off"), py::arg("recv_src"), py::arg("nodes"), py::arg("per_node"), py::arg("max_tokens"),
      py::arg("rows"), py::arg("counts"), py::arg("pos"), py::arg("stream"),
      "The internode contract order: rows per source rank (int64 [nodes*per_node]) and each row's position (int64 "
      "[rows]) from the inner dispatch's recv_off (int32 [per_node + 1]) and recv_src (int32 [rows])");
  m.def(
      "local_pack",
      [](uintptr_t topk, int slots, int topk_n, int experts, int max_tokens, uintptr_t valid, uintptr_t order,
         uintptr_t place, uintptr_t num, uintptr_t per_expert, uintptr_t node_counts, uintptr_t stream) {
        ep::launch_local_pack(ptr<const int64_t>(topk), slots, topk_n, experts, max_tokens, ptr<bool>(valid),
                              ptr<int64_t>(order), ptr<int64_t>(place), ptr<int64_t>(num), ptr<int64_t>(per_expert),
                              ptr<int64_t>(node_counts), reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("topk"), py::arg("slots"), py::arg("topk_n"), py::arg("experts"), py::arg("max_tokens"), py::arg("valid"),
      py::arg("order"), py::arg("place"), py::arg("num"), py::arg("per_expert"), py::arg("node_counts"),
      py::arg("stream"),
      "The one-rank node's packing of the rail's slots: valid, order, place, num, per-expert and per-node counts "
      "from the node-local ids (int64 [slots, topk])");
  m.def(
      "zero_rows_from",
      [](uintptr_t base, int64_t rows, int64_t row_bytes, uintptr_t ends, int groups, int max_blocks, uintptr_t stream) {
        ep::launch_zero_rows_from(ptr<void>(base), rows, row_bytes, ptr<const int>(ends), groups, max_blocks,
                                  reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("base"), py::arg("rows"), py::arg("row_bytes"), py::arg("ends"), py::arg("groups"), py::arg("max_blocks"),
      py::arg("stream"),
      "Zero the rows past the last group's end (ends: int32 [groups] on the device), writing those rows only");
  m.def(
      "swiglu_rows_fwd",
      [](uintptr_t h, uintptr_t w, uintptr_t y, int64_t rows, int F, uintptr_t ends, int groups, int max_blocks,
         uintptr_t stream) {
        ep::launch_swiglu_rows_fwd(ptr<const void>(h), ptr<const float>(w), ptr<void>(y), rows, F, ptr<const int>(ends),
                                   groups, max_blocks, reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("h"), py::arg("w"), py::arg("y"), py::arg("rows"), py::arg("F"), py::arg("ends"), py::arg("groups"),
      py::arg("max_blocks"), py::arg("stream"),
      "Weighted SwiGLU of the rows before the last group's end: y [rows, F] BF16 from h [rows, 2F] BF16, w [rows] f32");
  m.def(
      "swiglu_rows_bwd",
      [](uintptr_t g, uintptr_t h, uintptr_t w, uintptr_t dh, uintptr_t dw, int64_t rows, int F, uintptr_t ends,
         int groups, int max_blocks, uintptr_t stream) {
        ep::launch_swiglu_rows_bwd(ptr<const void>(g), ptr<const void>(h), ptr<const float>(w), ptr<void>(dh),
                                   ptr<float>(dw), rows, F, ptr<const int>(ends), groups, max_blocks,
                                   reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("g"), py::arg("h"), py::arg("w"), py::arg("dh"), py::arg("dw"), py::arg("rows"), py::arg("F"),
      py::arg("ends"), py::arg("groups"), py::arg("max_blocks"), py::arg("stream"),
      "Its backward: dh [rows, 2F] BF16 and dw [rows] f32 of the rows in use (dw 0 past them; dh not written there)");
  ep::bind_nvlink(m);
  // Always present, so Python (and the doctor) can ask without probing names or the .so's bytes.
#ifdef EP_WITH_NVSHMEM
  m.attr("HAS_NVSHMEM") = true;
  ep::bind_nvshmem(m);
#else
  m.attr("HAS_NVSHMEM") = false;
#endif
}
