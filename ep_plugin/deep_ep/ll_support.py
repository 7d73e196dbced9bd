"""What deep_ep.Buffer's low-latency calls need beside the calls themselves (low_latency.py): the size
hint of the NVSHMEM engine's symmetric memory, the event of an async dispatch followed by the UE8M0
packing, and the packing of power-of-two scales into DeepEP's UE8M0 layout."""
from __future__ import annotations

import torch

# Combine slots per token the size hint counts: the NVSHMEM engine keeps max(moe.topk, 16) (its
# MIN_TOPK_CAPACITY); DeepEP's hint takes no top-k either.
SIZE_HINT_TOPK = 16
_HEADER_BYTES = 16  # per dispatched row: token index and top-k slot, padded to 16


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def low_latency_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                          num_experts: int, topk: int = SIZE_HINT_TOPK) -> int:
    """Bytes of symmetric memory the NVSHMEM low-latency engine allocates per rank for this shape
    (csrc/nvshmem/ll_runtime.cu, every peer reachable over P2P), BF16 rows:

        slot = align16(16 + 2 * H)                       # header + BF16 row (an FP8 row + scales fits)
        half = 3 * align16(8 * W)                        # signal words: dispatch, its counts, combine
             + align16(4 * E)                            # rows per (source, local expert)
             + align16(E * M * slot)                     # dispatch slots: E_l experts x W sources x M
             + align16(2 * H * M * topk)                 # combine rows: M tokens x topk slots
        hint = 2 * half                                  # two parities: calls alternate halves

    E = num_experts, M = num_max_dispatch_tokens_per_rank, W = num_ranks, topk = 16 (the engine keeps
    max(moe.topk, 16) slots; the hint has no top-k argument, as in DeepEP). The torch reference engine
    allocates per call instead. Only a hint: ep_plugin allocates its own memory and ignores
    Buffer(num_rdma_bytes=...).
    """
    M, H, W, E = int(num_max_dispatch_tokens_per_rank), int(hidden), int(num_ranks), int(num_experts)
    for name, v in (("num_max_dispatch_tokens_per_rank", M), ("hidden", H), ("num_ranks", W),
                    ("num_experts", E)):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    if E % W:
        raise ValueError(f"num_experts ({E}) must be divisible by num_ranks ({W})")
    slot = _align16(_HEADER_BYTES + 2 * H)
    half = 3 * _align16(8 * W) + _align16(4 * E) + _align16(E * M * slot) + _align16(2 * H * M * int(topk))
    return 2 * half


class _ThenEvent:
    """An async dispatch's EPEvent followed by work enqueued after it on the same stream (the UE8M0
    packing): waiting on it waits for both."""

    def __init__(self, event, device: torch.device) -> None:
        self._event = event
        self._after = None
        if device.type == "cuda":
            self._after = torch.cuda.Event()
            self._after.record(torch.cuda.current_stream(device))

    def current_stream_wait(self) -> None:
        self._event.current_stream_wait()
        if self._after is not None:
            torch.cuda.current_stream().wait_event(self._after)

    wait = current_stream_wait

    def synchronize(self) -> None:
        self._event.synchronize()
        if self._after is not None:
            self._after.synchronize()


def _ue8m0_target(scales: torch.Tensor) -> torch.Tensor:
    """The int32 `[E_l, N, H/512]` tensor DeepEP returns for UE8M0 scales: the transpose of a
    contiguous `[E_l, H/512, N]`."""
    E_l, N, G = scales.shape
    return torch.empty((E_l, G // 4, N), dtype=torch.int32, device=scales.device).transpose(1, 2)


def _pack_ue8m0(scales: torch.Tensor, packed: torch.Tensor) -> None:
    """Write into `packed` (from _ue8m0_target) the exponent bytes of the power-of-two float32 scales
    `[E_l, N, H/128]`: byte k of int32 [e, t, j] = exponent field of scales[e, t, 4j + k]."""
    E_l, N, G = scales.shape
    exps = scales.transpose(1, 2).contiguous().view(torch.int32)  # [E_l, G, N], a no-op view for the engine's
    dst = packed.transpose(1, 2).view(torch.uint8).view(E_l, G // 4, N, 4)  # contiguous [E_l, G/4, N] int32
    # The shift runs in int32 and the copy keeps each result's low byte (the exponent field, whatever the
    # sign bit). Not one kernel with out=dst: CUDA's shift kernels dispatch on the output's dtype, so the
    # int32 input would be cast to uint8 before the shift (every byte 0); the CPU computes in int32.
    dst.copy_(torch.bitwise_right_shift(exps, 23).view(E_l, G // 4, 4, N).transpose(2, 3))
