"""`python -m ep_plugin doctor` on this machine, and on machines described by faking torch.cuda and
the probes: each line's verdict and fix, JSON for scripts, and the `auto` rule it shares with the
registry."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from ep_plugin.backends import registry
from ep_plugin.doctor import checks, probe, refuse
from ep_plugin.doctor.report import ERROR, OK, WARNING

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ["torch", "GPUs", "_C", "GPU arch", "NCCL", "NVSHMEM wheel", "RDMA", "CUDA IPC", "multicast",
         "frameworks", "backends"]


def by_name(result):
    return {c.name: c for c in result}


def test_cli_json_on_this_machine():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="" if not torch.cuda.is_available() else os.environ.get(
        "CUDA_VISIBLE_DEVICES", ""))
    out = subprocess.run([sys.executable, "-m", "ep_plugin", "doctor", "--json", "--world", "3", "--no-ipc"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    report = json.loads(out.stdout)
    assert [c["name"] for c in report["checks"]] == NAMES
    assert all(c["status"] in (OK, WARNING, ERROR) for c in report["checks"])
    assert out.returncode == (1 if report["counts"]["error"] else 0), out.stderr
    assert report["world"] == 3 and "torch" in report["can_run"]
    if not torch.cuda.is_available():
        assert report["auto"]["backend"] == "torch" and "gloo" in report["auto"]["reason"]
        assert by_name([SimpleNamespace(**c) for c in report["checks"]])["GPUs"].status == WARNING


def test_cli_text_is_one_screen():
    out = subprocess.run([sys.executable, "-m", "ep_plugin", "doctor", "--no-ipc"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ep_plugin") and lines[-1].startswith("can run here: torch")
    assert len(lines) < 40
    for name in NAMES:
        assert any(line.split()[:1] in ([OK], [WARNING], [ERROR]) and f" {name} " in line for line in lines), name


@pytest.fixture
def two_a100s(monkeypatch):
    """A CUDA 12 torch seeing two sm_80 GPUs with NVLink, _C built for sm_90, both NVSHMEM wheels, a
    container where CUDA IPC fails, and no multicast variables set."""
    c = torch.cuda
    monkeypatch.setattr(c, "is_available", lambda: True)
    monkeypatch.setattr(c, "device_count", lambda: 2)
    monkeypatch.setattr(c, "get_device_name", lambda i=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(c, "get_device_capability", lambda i=None: (8, 0))
    monkeypatch.setattr(c, "get_device_properties", lambda i=None: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(c, "can_device_access_peer", lambda a, b: True)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(probe, "nccl_version", lambda: "2.21.5")
    monkeypatch.setattr(probe, "link_matrix", lambda n: [["-", "NV12"], ["NV12", "-"]])
    monkeypatch.setattr(probe, "c_module", lambda: dict(c_built=True, c_error=None, c_path="/x/_C.so",
                                                        c_runtime=12040, c_arches=["sm_90"], c_nvshmem=False))
    monkeypatch.setattr(probe, "versions", lambda names: {n: ("3.2.5" if "nvshmem" in n else "1.0") for n in names})
    # what the registry answers where _C is built (so that the test does not depend on this box's build)
    monkeypatch.setattr(registry, "backend_unavailable", lambda name, world: None if name == "nvlink" and world <= 8
                        else "the nvshmem backend is not available in this build")
    calls = []
    monkeypatch.setattr("ep_plugin.doctor.ipc.probe", lambda: calls.append(1) or (False, "RuntimeError: CUDA error: invalid device context"))
    for var in probe.MULTICAST_VARS:
        monkeypatch.delenv(var, raising=False)
    return calls


def test_fake_two_gpus_explains_each_problem(two_a100s, capsys):
    from ep_plugin.doctor import main

    facts = probe.gather(world=2)
    got = by_name(checks.run_checks(facts))
    assert two_a100s == [1]  # the IPC test ran: two GPUs
    assert got["GPUs"].status == OK and "2 x NVIDIA A100" in got["GPUs"].summary
    assert any("NV12" in d for d in got["GPUs"].details)
    arch = got["GPU arch"]
    assert arch.status == ERROR and "sm_80" in arch.summary and "EP_PLUGIN_CUDA_ARCH=80" in arch.fix
    wheel = got["NVSHMEM wheel"]
    assert wheel.status == ERROR and "both installed" in wheel.summary and "nvidia-nvshmem-cu12" in wheel.fix
    assert got["CUDA IPC"].status == ERROR and "--ipc=host" in got["CUDA IPC"].fix
    assert got["multicast"].status == WARNING and "NCCL_NVLS_ENABLE=0" in got["multicast"].fix
    assert got["NCCL"].status == OK and "2.21.5" in got["NCCL"].summary
    # auto follows the registry's rule (nvlink: one node, peer access, _C built) but nvlink cannot run
    assert facts.auto[0] == "nvlink"
    assert got["backends"].status == ERROR and "CUDA IPC" in got["backends"].summary
    assert main(["--json", "--world", "2"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["auto"]["backend"] == "nvlink" and report["can_run"] == ["torch"]


def test_fake_gpus_across_nodes_and_fixed_machine(two_a100s, monkeypatch):
    monkeypatch.setattr(probe, "c_module", lambda: dict(c_built=True, c_error=None, c_path="/x/_C.so",
                                                        c_runtime=12040, c_arches=["sm_80"], c_nvshmem=False))
    monkeypatch.setattr(probe, "versions", lambda names: {n: ("3.2.5" if n.endswith("cu12") else None) for n in names})
    monkeypatch.setattr("ep_plugin.doctor.ipc.probe", lambda: (True, "ok"))
    for var, value in probe.MULTICAST_VARS.items():
        monkeypatch.setenv(var, value)
    got = by_name(checks.run_checks(probe.gather(world=2)))
    assert {n: c.status for n, c in got.items() if c.status != OK} == {}
    assert "nvlink" in got["backends"].summary
    far = probe.gather(world=4, ipc=False)  # 4 ranks, 2 GPUs per node: two nodes
    assert far.auto == ("torch", "group spans 2 nodes and the nvshmem backend is not built")
    assert "one node" in far.backends["nvlink"] and far.ipc is None


def test_wheel_and_arch_rules():
    base = probe.gather(world=2, ipc=False)
    base.torch_cuda, base.nvshmem_wheels = "13.0", {"nvidia-nvshmem-cu12": "3.3.9"}
    wheel = checks.check_nvshmem_wheel(base)
    assert wheel.status == ERROR and "pip install nvidia-nvshmem-cu13" in wheel.fix
    base.nvshmem_wheels = {"nvidia-nvshmem-cu13": "3.3.9"}
    assert checks.check_nvshmem_wheel(base).status == OK
    assert checks._runs_on(["sm_90a"], (9, 0)) and not checks._runs_on(["sm_90"], (10, 0))
    assert checks._runs_on(["compute_80"], (9, 0)) and not checks._runs_on(["compute_90"], (8, 0))
    base.c_built, base.c_arches = False, None
    base.c_error, base.nvcc = None, None
    assert checks.check_c(base).status == WARNING and "nvcc" in checks.check_c(base).fix


def test_nvlink_matrix_from_nvidia_smi():
    text = ("\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
            "GPU0\t X \tNV18\tPXB\t0-31\t0\t\tN/A\n"
            "GPU1\tNV18\t X \tSYS\t0-31\t0\t\tN/A\n"
            "NIC0\tPXB\tSYS\t X \n\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n")
    assert probe.parse_topo(text, 2) == [["-", "NV18"], ["NV18", "-"]]
    assert probe.parse_topo(text, 3) is None  # a GPU the tool did not list: unknown, not guessed


def test_rdma_and_ibgda_from_sysfs(tmp_path):
    port = tmp_path / "sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("InfiniBand\n")
    params = tmp_path / "proc" / "driver" / "nvidia"
    params.mkdir(parents=True)
    (params / "params").write_text('EnableStreamMemOPs: 0\nRegistryDwords: ""\n')
    facts = probe.gather(world=2, ipc=False)
    facts.rdma, facts.driver_params = probe.rdma_ports(str(tmp_path)), probe.driver_params(str(tmp_path))
    facts.peermem = False
    facts.gpus = [probe.Gpu(0, "H100", (9, 0), 80.0)]
    rdma = checks.check_rdma(facts)
    assert rdma.status == WARNING and "mlx5_0/1 InfiniBand ACTIVE" in rdma.summary
    assert "NVreg_EnableStreamMemOPs=1" in rdma.summary and "nvidia_peermem" in rdma.summary
    (params / "params").write_text('EnableStreamMemOPs: 1\nRegistryDwords: "PeerMappingOverride=1;"\n')
    facts.driver_params, facts.peermem = probe.driver_params(str(tmp_path)), True
    assert checks.check_rdma(facts).status == OK


def test_auto_rule_is_shared_and_lazy():
    asked = []

    def nodes():
        asked.append("nodes")
        return 1

    never = lambda *a: pytest.fail("asked past the rule's answer")  # noqa: E731
    assert registry.auto_choice("gloo", True, True, 2, never, never, never)[0] == "torch"
    assert registry.auto_choice("nccl", True, False, 2, never, never, never) == ("torch", "ep_plugin._C is not built")
    assert registry.auto_choice("nccl", True, True, 2, nodes, lambda: False, never)[0] == "torch"
    assert registry.auto_choice("nccl", True, True, 2, nodes, lambda: True, lambda n: None)[0] == "nvlink"
    assert registry.auto_choice("nccl", True, True, 4, lambda: 2, never, lambda n: "not built")[0] == "torch"
    assert registry.auto_choice("nccl", True, True, 4, lambda: 2, never, lambda n: None)[0] == "nvshmem"
    assert asked == ["nodes", "nodes"]


def test_refuse_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        refuse(RuntimeError("comm.backend: nvlink needs CUDA GPUs\nmore"), rank=0)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ep_plugin: cannot start: comm.backend: nvlink needs CUDA GPUs (`python -m ep_plugin doctor` "
                   "says what this machine can run)"]


def test_main_commands(capsys):
    from ep_plugin.__main__ import main

    assert main(["--help"]) == 0 and "doctor" in capsys.readouterr().out
    assert main(["bogus"]) == 2 and "unknown command" in capsys.readouterr().err
