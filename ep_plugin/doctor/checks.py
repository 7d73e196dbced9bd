"""Verdicts on the facts (probe.py): one Check per subject, ok / warning / error, each with its fix.

Pure functions of a Facts, so that tests can describe any machine without having one.
"""
from __future__ import annotations

import re
from typing import List, Optional

from .probe import MULTICAST_VARS, Facts
from .report import ERROR, OK, WARNING, Check

BUILD = "EP_PLUGIN_BUILD_C=1 pip install --no-build-isolation -e ."
MULTICAST_EXPORT = "export " + " ".join(f"{k}={v}" for k, v in MULTICAST_VARS.items())


def _major(version: Optional[str]) -> Optional[int]:
    return int(version.split(".")[0]) if version else None


def _sm(cap) -> str:
    return f"sm_{cap[0]}{cap[1]}"


def check_torch(f: Facts) -> Check:
    if f.torch_cuda is None:
        return Check("torch", OK, f"torch {f.torch_version} (CPU build), Python {f.python}")
    if not f.cuda_available:
        return Check("torch", WARNING, f"torch {f.torch_version} built for CUDA {f.torch_cuda}, but no GPU is usable"
                     + (f": {f.cuda_error}" if f.cuda_error else ""),
                     "check `nvidia-smi` and the driver; in a container, start it with the GPUs (--gpus all)")
    return Check("torch", OK, f"torch {f.torch_version}, CUDA {f.torch_cuda}, Python {f.python}")


def _cell(f: Facts, a: int, b: int) -> str:
    if a == b:
        return "-"
    link = f.links[a][b] if f.links else None
    if not f.peer[a][b]:
        return "no P2P"
    return link if link else "P2P"


def check_gpus(f: Facts) -> Check:
    if not f.gpus:
        fix = ("the kernel backends need NVIDIA GPUs and a CUDA build of torch" if f.torch_cuda is None
               else "check `nvidia-smi`, CUDA_VISIBLE_DEVICES and the driver")
        return Check("GPUs", WARNING, "none visible: only the torch backend runs here (gloo on CPU)", fix)
    names = sorted({g.name for g in f.gpus})
    g0 = f.gpus[0]
    summary = f"{len(f.gpus)} x {', '.join(names)} ({_sm(g0.capability)}, {g0.memory_gib:.0f} GiB)"
    details = []
    if len(f.gpus) > 1:
        n = len(f.gpus)
        cells = [[_cell(f, a, b) for b in range(n)] for a in range(n)]
        w = max(6, *(len(c) for row in cells for c in row))
        details.append("peer access / link" + ("" if f.links else " (nvidia-smi topo not available)") + ":")
        details.append(" " * 6 + "".join(f"{'GPU' + str(b):>{w + 1}}" for b in range(n)))
        details += [f"GPU{a:<3}" + "".join(f"{c:>{w + 1}}" for c in row) for a, row in enumerate(cells)]
    if not f.all_peer:
        bad = [f"GPU{a}-GPU{b}" for a in range(len(f.gpus)) for b in range(len(f.gpus)) if a < b and not f.peer[a][b]]
        return Check("GPUs", WARNING, summary + f"; no peer access between {', '.join(bad)}",
                     "the nvlink backend needs peer access between all GPUs of a node (auto picks torch "
                     "here); check `nvidia-smi topo -m` and the IOMMU/ACS settings", details)
    return Check("GPUs", OK, summary, details=details)


def check_c(f: Facts) -> Check:
    if not f.c_built:
        how = (f"nvcc is at {f.nvcc}: `bash scripts/setup.sh` (without --light) or {BUILD}" if f.nvcc else
               f"install the CUDA toolkit (nvcc 12.x or 13.x), then {BUILD}")
        # a missing module reads "No module named ..." or, imported from the package, "cannot import name
        # '_C' from partially initialized module" (not a circular import): say only what is wrong
        missing = not f.c_error or "No module named" in f.c_error or "cannot import name '_C'" in f.c_error
        extra = "" if missing else f" (import error: {f.c_error})"
        return Check("_C", WARNING, f"ep_plugin._C is not built{extra}: the kernel backends (nvlink, nvshmem) "
                     "cannot run, the torch backend can", how)
    rt = f"CUDA runtime {f.c_runtime // 1000}.{f.c_runtime % 1000 // 10}" if f.c_runtime else "CUDA runtime ?"
    arch = ", ".join(f.c_arches) if f.c_arches else "arch unknown (no cuobjdump)"
    nvshmem = "with NVSHMEM" if f.c_nvshmem else "without NVSHMEM"
    return Check("_C", OK, f"built for {arch}, {rt}, {nvshmem}")


def _runs_on(arches: List[str], cap) -> bool:
    """A cubin runs on its own major.minor (sm_90a: 9.0 only); PTX is compiled for equal or newer GPUs."""
    num = cap[0] * 10 + cap[1]
    for a in arches:
        m = re.fullmatch(r"(sm|compute)_(\d+)([a-z]?)", a)
        if m and ((m.group(1) == "sm" and int(m.group(2)) == num) or (m.group(1) == "compute" and int(m.group(2)) <= num)):
            return True
    return False


def check_arch(f: Facts) -> Check:
    if not f.c_built:
        return Check("GPU arch", OK, "nothing to compare (_C is not built)")
    if not f.gpus:
        built = ", ".join(f.c_arches) if f.c_arches else "unknown"
        return Check("GPU arch", OK, f"_C holds {built}; no GPU here to compare with")
    caps = sorted({g.capability for g in f.gpus})
    if f.c_arches is None:
        return Check("GPU arch", WARNING, f"GPUs are {', '.join(map(_sm, caps))}; what _C was built for is unknown",
                     "put cuobjdump (CUDA toolkit) on PATH so that it can be read")
    bad = [c for c in caps if not _runs_on(f.c_arches, c)]
    if bad:
        want = f"{bad[0][0]}{bad[0][1]}"
        return Check("GPU arch", ERROR, f"GPUs are {', '.join(map(_sm, bad))} but _C holds {', '.join(f.c_arches)}: "
                     "its kernels cannot load here", f"rebuild for this GPU: EP_PLUGIN_CUDA_ARCH={want} {BUILD}")
    return Check("GPU arch", OK, f"GPUs are {', '.join(map(_sm, caps))}; _C holds {', '.join(f.c_arches)}")


def check_nccl(f: Facts) -> Check:
    if not f.cuda_available:
        return Check("NCCL", OK, "not used without GPUs: process groups run on gloo")
    if f.nccl is None:
        return Check("NCCL", ERROR, "torch has no NCCL: the kernel backends need an NCCL process group",
                     "install a CUDA build of torch (it ships NCCL)")
    return Check("NCCL", OK, f"NCCL {f.nccl}")


def check_nvshmem_wheel(f: Facts) -> Check:
    major = _major(f.torch_cuda)
    found = f.nvshmem_wheels
    names = ", ".join(f"{k} {v}" for k, v in sorted(found.items()))
    want = f"nvidia-nvshmem-cu{major}" if major else None
    if len(found) > 1:
        return Check("NVSHMEM wheel", ERROR, f"{names} are both installed: they write the same files "
                     "(nvidia/nvshmem/lib/...), so the last one installed wins",
                     f"pip uninstall -y {' '.join(sorted(found))} && pip install {want or 'nvidia-nvshmem-cu<torch CUDA major>'}")
    if not found:
        if major is None:
            return Check("NVSHMEM wheel", OK, "not installed (not needed without CUDA)")
        return Check("NVSHMEM wheel", OK, f"not installed; only the nvshmem backend (across nodes) needs it: "
                     f"pip install {want}")
    (name, _), = found.items()
    if major is not None and not name.endswith(f"cu{major}"):
        return Check("NVSHMEM wheel", ERROR, f"{names} does not match torch's CUDA {f.torch_cuda}",
                     f"pip uninstall -y {name} && pip install {want}")
    return Check("NVSHMEM wheel", OK, names + (f", matches torch's CUDA {major}" if major else ""))


def check_rdma(f: Facts) -> Check:
    if not f.rdma:
        return Check("RDMA", OK, "no RDMA devices: one node only (across nodes, nvshmem needs an "
                     "InfiniBand or RoCE NIC)")
    active = [p for p in f.rdma if "ACTIVE" in p.state]
    devices = ", ".join(f"{p.device}/{p.port} {p.link_layer} {p.state.split(':')[-1].strip()}" for p in f.rdma)
    missing = []
    if f.gpus:
        if f.driver_params.get("EnableStreamMemOPs") != "1":
            missing.append("NVreg_EnableStreamMemOPs=1")
        if "PeerMappingOverride=1" not in f.driver_params.get("RegistryDwords", ""):
            missing.append('NVreg_RegistryDwords="PeerMappingOverride=1;"')
        if not f.peermem:
            missing.append("the nvidia_peermem module (GPUDirect RDMA)")
    if not active:
        return Check("RDMA", WARNING, f"{devices}: no port is ACTIVE", "check the cabling and `ibstat`", [])
    if missing:
        return Check("RDMA", WARNING, f"{devices}; IBGDA prerequisites missing: {', '.join(missing)}",
                     'options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords="PeerMappingOverride=1;" in '
                     "/etc/modprobe.d/nvidia.conf, update-initramfs -u, reboot; modprobe nvidia_peermem "
                     "(or use comm.rdma.ibgda: off)")
    return Check("RDMA", OK, f"{devices}; IBGDA prerequisites present")


def check_ipc(f: Facts) -> Check:
    if f.ipc is None:
        return Check("CUDA IPC", OK, f"not tested: {f.ipc_skipped}")
    ok, msg = f.ipc
    if ok:
        return Check("CUDA IPC", OK, msg)
    return Check("CUDA IPC", ERROR, f"fails: {msg}",
                 "processes must share an IPC namespace: docker run --ipc=host (Kubernetes: hostIPC: true); "
                 "until then the nvlink backend cannot run: comm.backend: torch")


def check_multicast(f: Facts) -> Check:
    if not f.gpus:
        return Check("multicast", OK, "no GPUs: the NVLink-multicast variables do not matter here")
    off = {k: v for k, v in MULTICAST_VARS.items() if f.env.get(k) != v}
    if off:
        got = ", ".join(f"{k}={f.env.get(k) if f.env.get(k) is not None else '<unset>'}" for k in off)
        return Check("multicast", WARNING, f"NVLink multicast not switched off: {got}",
                     f"where multicast must stay off (shared GPU hosts), before launching: {MULTICAST_EXPORT}")
    return Check("multicast", OK, "NVLink multicast off (" + ", ".join(f"{k}={v}" for k, v in MULTICAST_VARS.items()) + ")")


def check_frameworks(f: Facts) -> Check:
    parts = [f"{k} {v}" if v else f"{k} not installed" for k, v in f.frameworks.items()]
    return Check("frameworks", OK, ", ".join(parts))


def check_backends(f: Facts) -> Check:
    name, reason = f.auto
    details = [f"{b}: " + ("can run" if why is None else f"cannot: {why}") for b, why in f.backends.items()]
    summary = f"auto for {f.world} ranks: {name} ({reason})"
    why = f.backends.get(name)
    if why is not None:
        return Check("backends", ERROR, summary + f", which cannot run here: {why}",
                     "fix the line above, or set comm.backend: torch", details)
    return Check("backends", OK, summary, details=details)


ALL = (check_torch, check_gpus, check_c, check_arch, check_nccl, check_nvshmem_wheel, check_rdma, check_ipc,
       check_multicast, check_frameworks, check_backends)


def run_checks(f: Facts) -> List[Check]:
    return [check(f) for check in ALL]
