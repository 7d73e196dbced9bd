"""nvshmem backend (internode RDMA + NVLink forwarding, low-latency kernels): not built yet.

Importing this module raises BackendUnavailableError, so `comm.backend: auto` falls back to another
backend (the registry catches it) and an explicit `comm.backend: nvshmem` says why.
"""
from ...errors import BackendUnavailableError

raise BackendUnavailableError(
    "the nvshmem backend is not available in this build (its internode kernels are not implemented yet); "
    "use comm.backend: nvlink for ranks within one node, or torch")
