"""nvshmem backend: NVSHMEM symmetric memory from the pip wheel (runtime.py: one NVSHMEM job per
process, bootstrapped over torch.distributed) and the low-latency kernels (low_latency.py:
NvshmemLowLatency, the engine behind EPBuffer.low_latency_dispatch/combine).

The internode high-throughput backend (comm.backend: nvshmem) is not built yet: asking the registry
for NvshmemBackend raises BackendUnavailableError, so `comm.backend: auto` falls back to another
backend and an explicit `comm.backend: nvshmem` says why.
"""
from ...errors import BackendUnavailableError


def __getattr__(name):
    if name == "NvshmemBackend":
        raise BackendUnavailableError(
            "the nvshmem high-throughput backend is not available in this build (its internode kernels "
            "are not implemented yet); use comm.backend: nvlink for ranks within one node, or torch")
    raise AttributeError(name)
