// EPGroupedMLP's weighted SwiGLU over the rows in use only (rows before the last expert's end, read on the device).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace ep {

// h: [rows, 2F] BF16 (gate | linear), w: [rows] float32 (the rows' probs), y: [rows, F] BF16; F a multiple of 8,
// every pointer 16-byte aligned except w (4). ends: [groups] int32 on the device. Rows r < min(ends[groups - 1], rows):
// y[r] = bf16(bf16(bf16(silu(gate)) * linear) * w[r]), the rounding steps of megatron's weighted_swiglu in eager
// torch. Rows past them are not written.
void launch_swiglu_rows_fwd(const void* h, const float* w, void* y, int64_t rows, int F, const int* ends, int groups,
                            int max_blocks, cudaStream_t stream);

// g: [rows, F] BF16 (y's gradient). Rows in use: dh [rows, 2F] BF16 and dw [rows] float32 as megatron's
// weighted_swiglu_back computes them (its BF16 roundings, its float32 products in its order; dw summed per row in
// another order). Rows past them: dh not written (the grouped GEMMs' backward reads no such row), dw = 0.
void launch_swiglu_rows_bwd(const void* g, const void* h, const float* w, void* dh, float* dw, int64_t rows, int F,
                            const int* ends, int groups, int max_blocks, cudaStream_t stream);

}  // namespace ep
