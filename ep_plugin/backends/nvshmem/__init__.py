"""nvshmem backend parts: NVSHMEM symmetric memory from the pip wheel (runtime.py: one NVSHMEM job per
process, bootstrapped over torch.distributed), the low-latency kernels (low_latency.py:
NvshmemLowLatency, the engine behind EPBuffer.low_latency_dispatch/combine) and the rail
(rail.py: NvshmemRail, the internode hop of comm.backend: nvshmem, composed with the nvlink
backend inside nodes in backends/hierarchical/).
"""
