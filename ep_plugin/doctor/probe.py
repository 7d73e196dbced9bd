"""Facts about this machine, gathered once for the checks (checks.py turns them into verdicts).

Each probe answers from what torch, the files under /sys and /proc, and a few tools (cuobjdump,
nvidia-smi) say, and none of them raises: what cannot be read is None ("unknown"). `gather` is the
only function that starts anything (the two-process CUDA IPC test, with 2+ GPUs).
"""
from __future__ import annotations

import importlib.metadata as md
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

import torch

MULTICAST_VARS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
NVSHMEM_WHEELS = ("nvidia-nvshmem-cu12", "nvidia-nvshmem-cu13")
FRAMEWORKS = ("megatron-core", "deepspeed")


@dataclass
class Gpu:
    index: int
    name: str
    capability: Tuple[int, int]
    memory_gib: float


@dataclass
class RdmaPort:
    device: str
    port: str
    state: str        # e.g. "4: ACTIVE"
    link_layer: str   # InfiniBand | Ethernet (RoCE)


@dataclass
class Facts:
    python: str
    torch_version: str
    torch_cuda: Optional[str]            # torch.version.cuda; None for a CPU build
    cuda_available: bool
    cuda_error: Optional[str]            # why a CUDA build sees no GPU, when torch says
    gpus: List[Gpu]
    peer: List[List[bool]]               # [a][b]: a can access b's memory (diagonal True)
    links: Optional[List[List[str]]]     # nvidia-smi topo -m cells (NV18, SYS, PIX...), None = unknown
    c_built: bool
    c_error: Optional[str]
    c_path: Optional[str]
    c_runtime: Optional[int]             # CUDA runtime _C was built with (e.g. 13000)
    c_arches: Optional[List[str]]        # sm_XX cubins (and compute_XX PTX) in _C; None = unknown
    c_nvshmem: bool
    nvcc: Optional[str]
    nvshmem_wheels: Dict[str, str]
    nccl: Optional[str]
    rdma: List[RdmaPort]
    peermem: bool                        # nvidia_peermem loaded (GPUDirect RDMA)
    driver_params: Dict[str, str]        # /proc/driver/nvidia/params
    env: Dict[str, Optional[str]]
    frameworks: Dict[str, Optional[str]]
    world: int
    ipc: Optional[Tuple[bool, str]] = None   # None = not tested
    ipc_skipped: str = ""
    auto: Tuple[str, str] = ("torch", "")
    backends: Dict[str, Optional[str]] = field(default_factory=dict)  # name -> why it cannot run, None = can

    @property
    def all_peer(self) -> bool:
        n = len(self.gpus)
        return all(self.peer[a][b] for a in range(n) for b in range(n))


# ------------------------------------------------------------------------------- torch and GPUs
def cuda_error() -> Optional[str]:
    if torch.version.cuda is None or torch.cuda.is_available():
        return None
    try:
        torch.cuda.init()
    except Exception as exc:  # torch's own words: no driver, driver too old, no device...
        return str(exc).splitlines()[0]
    return None


def gpus() -> List[Gpu]:
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append(Gpu(i, torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)),
                       props.total_memory / 2**30))
    return out


def peer_matrix(n: int) -> List[List[bool]]:
    return [[a == b or bool(torch.cuda.can_device_access_peer(a, b)) for b in range(n)] for a in range(n)]


def link_matrix(n: int) -> Optional[List[List[str]]]:
    """The GPU-to-GPU cells of `nvidia-smi topo -m` (NV# = NVLink with # links), or None."""
    tool = shutil.which("nvidia-smi")
    if tool is None or n == 0:
        return None
    try:
        text = subprocess.run([tool, "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_topo(text, n)


def parse_topo(text: str, n: int) -> Optional[List[List[str]]]:
    """Rows GPU0..GPU{n-1} of `nvidia-smi topo -m`, first n cells each ("-" on the diagonal)."""
    rows = {}
    for line in text.splitlines():
        cells = re.sub(r"\x1b\[[0-9;]*m", "", line).split()  # colour codes, when a terminal asked
        if cells and re.fullmatch(r"GPU\d+", cells[0]) and len(cells) > n:
            rows[int(cells[0][3:])] = ["-" if c == "X" else c for c in cells[1:n + 1]]
    return [rows[i] for i in range(n)] if all(i in rows for i in range(n)) else None


# ------------------------------------------------------------------------------- the compiled module
def find_cuobjdump() -> Optional[str]:
    found = shutil.which("cuobjdump")
    if found:
        return found
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(str(Path(nvcc).resolve().parent.parent))
    spec = importlib.util.find_spec("triton")  # triton wheels ship one; found without importing triton
    extra = [Path(p) / "backends" / "nvidia" / "bin" for p in (spec.submodule_search_locations or [])] if spec else []
    for d in [Path(h) / "bin" for h in homes if h] + extra:
        if (d / "cuobjdump").is_file():
            return str(d / "cuobjdump")
    return None


def so_arches(path: str) -> Optional[List[str]]:
    """sm_XX of the cubins in `path` and compute_XX of its PTX, from cuobjdump; None = unknown."""
    tool = find_cuobjdump()
    if tool is None:
        return None
    found = set()
    try:
        for flag, pattern in (("--list-elf", r"\.(sm_\d+[a-z]?)\.cubin"), ("--list-ptx", r"\.(sm_\d+[a-z]?)\.ptx")):
            out = subprocess.run([tool, flag, path], capture_output=True, text=True, timeout=30)
            for arch in re.findall(pattern, out.stdout):
                found.add(arch if flag == "--list-elf" else arch.replace("sm_", "compute_"))
    except (OSError, subprocess.SubprocessError):
        return None
    return sorted(found) or None


def c_module() -> dict:
    from .. import _ext

    info = {"c_built": _ext.has_c(), "c_error": None, "c_path": None, "c_runtime": None, "c_arches": None,
            "c_nvshmem": False}
    if not _ext.has_c():
        err = getattr(_ext, "_IMPORT_ERROR", None)
        info["c_error"] = str(err) if err is not None else None
        return info
    c = _ext.get_c()
    info["c_path"] = getattr(c, "__file__", None)
    try:
        info["c_runtime"] = int(c.cuda_runtime_version())
    except Exception:
        pass
    if info["c_path"]:
        info["c_arches"] = so_arches(info["c_path"])
    if hasattr(c, "HAS_NVSHMEM"):  # every _C since issue 11 says whether it was built with NVSHMEM
        info["c_nvshmem"] = bool(c.HAS_NVSHMEM)
    elif info["c_path"]:  # older builds: look for the host library in the .so
        try:
            info["c_nvshmem"] = b"libnvshmem_host" in Path(info["c_path"]).read_bytes()
        except OSError:
            pass
    return info


def nvcc() -> Optional[str]:
    found = shutil.which("nvcc")
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if found is None and home and (Path(home) / "bin" / "nvcc").is_file():
        found = str(Path(home) / "bin" / "nvcc")
    return found


# ------------------------------------------------------------------------------- packages
def versions(names) -> Dict[str, Optional[str]]:
    out = {}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def nccl_version() -> Optional[str]:
    try:
        import torch.distributed as dist

        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            return None
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:
        return None


# ------------------------------------------------------------------------------- RDMA
def rdma_ports(root: str = "/") -> List[RdmaPort]:
    base = Path(root) / "sys" / "class" / "infiniband"
    ports = []
    for dev in sorted(base.glob("*")) if base.is_dir() else []:
        for port in sorted((dev / "ports").glob("*")):
            read = lambda name: (port / name).read_text().strip() if (port / name).is_file() else "?"  # noqa: E731
            ports.append(RdmaPort(dev.name, port.name, read("state"), read("link_layer")))
    return ports


def driver_params(root: str = "/") -> Dict[str, str]:
    path = Path(root) / "proc" / "driver" / "nvidia" / "params"
    out = {}
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            out[key.strip()] = value.strip().strip('"')
    except OSError:
        pass
    return out


# ------------------------------------------------------------------------------- everything
def backend_verdicts(f: Facts) -> Dict[str, Optional[str]]:
    """Why each backend cannot run `f.world` ranks here (None = it can), for `comm.backend: <name>`."""
    from ..backends.registry import backend_unavailable

    out: Dict[str, Optional[str]] = {"torch": None}
    for name in ("nvlink", "nvshmem"):
        if not f.cuda_available:
            why = "needs CUDA GPUs and an NCCL process group"
        else:
            why = backend_unavailable(name, f.world)
        if why is None and name == "nvlink":
            if f.world > len(f.gpus):
                why = f"needs all {f.world} ranks on one node; this machine has {len(f.gpus)} GPU(s)"
            elif not f.all_peer:
                why = "GPUs of this node lack peer access"
            elif f.ipc is not None and not f.ipc[0]:
                why = "CUDA IPC fails here (see 'CUDA IPC')"
        out[name] = why
    return out


def auto_pick(f: Facts) -> Tuple[str, str]:
    """What `comm.backend: auto` would pick for f.world ranks on machines like this one."""
    from ..backends.registry import auto_choice, backend_unavailable

    pg = "nccl" if f.cuda_available and f.nccl is not None else "gloo"
    per_node = max(1, len(f.gpus))
    return auto_choice(pg, f.cuda_available, f.c_built, f.world, lambda: math.ceil(f.world / per_node),
                       lambda: f.all_peer, lambda name: backend_unavailable(name, f.world))


def gather(world: Optional[int] = None, ipc: bool = True, root: str = "/",
           environ: Optional[Mapping[str, str]] = None) -> Facts:
    from . import ipc as ipc_test

    environ = os.environ if environ is None else environ
    found = gpus()
    n = len(found)
    f = Facts(
        python=sys.version.split()[0], torch_version=torch.__version__, torch_cuda=torch.version.cuda,
        cuda_available=torch.cuda.is_available(), cuda_error=cuda_error(), gpus=found, peer=peer_matrix(n),
        links=link_matrix(n), **c_module(), nvcc=nvcc(), nvshmem_wheels={k: v for k, v in versions(NVSHMEM_WHEELS).items() if v},
        nccl=nccl_version(), rdma=rdma_ports(root), peermem=(Path(root) / "sys" / "module" / "nvidia_peermem").is_dir(),
        driver_params=driver_params(root), env={k: environ.get(k) for k in MULTICAST_VARS},
        frameworks=versions(FRAMEWORKS), world=world or (n if n else 2))
    if n < 2:
        f.ipc_skipped = f"needs 2 GPUs, this machine has {n}"
    elif not ipc:
        f.ipc_skipped = "skipped (--no-ipc)"
    else:
        f.ipc = ipc_test.probe()
    f.backends = backend_verdicts(f)
    f.auto = auto_pick(f)
    return f
