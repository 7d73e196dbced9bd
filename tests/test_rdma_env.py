"""comm.rdma: validation, presets, and the mapping into NVSHMEM's environment (CPU; no NIC needed)."""
import dataclasses
import os
from pathlib import Path

import pytest
import yaml

from ep_plugin.backends.nvshmem import rdma_env
from ep_plugin.backends.nvshmem.rdma_env import rdma_environment
from ep_plugin.config import ConfigError, load_config, preset_path
from ep_plugin.config.schema import RdmaConfig

REPO = Path(__file__).resolve().parents[1]
PRESETS = ["deepseek_v3", "mixtral", "qwen_moe", "tiny"]


def rdma(**kw) -> RdmaConfig:
    return load_config({"comm": {"rdma": kw}}).comm.rdma


def env_of(cfg, local_rank=0, world=16, environ=None, **kw):
    return rdma_environment(cfg, local_rank, world, environ={} if environ is None else environ, **kw)


# ------------------------------------------------------------------------------- knob -> variable

def test_defaults_set_only_traffic_class_and_service_level():
    # auto everywhere else: NVSHMEM's defaults; TC and SL are plain ints (0 = NVSHMEM's default too)
    assert env_of(RdmaConfig()) == {"NVSHMEM_IB_TRAFFIC_CLASS": "0", "NVSHMEM_IB_SL": "0"}


@pytest.mark.parametrize("knobs,expected", [
    ({"traffic_class": 106}, {"NVSHMEM_IB_TRAFFIC_CLASS": "106"}),
    ({"traffic_class": 255}, {"NVSHMEM_IB_TRAFFIC_CLASS": "255"}),
    ({"service_level": 3}, {"NVSHMEM_IB_SL": "3"}),
    ({"service_level": 15}, {"NVSHMEM_IB_SL": "15"}),
    ({"ibgda": True}, {"NVSHMEM_IB_ENABLE_IBGDA": "1"}),
    ({"ibgda": False}, {"NVSHMEM_IB_ENABLE_IBGDA": "0"}),
    # QPs go to the transport that carries the GPU's traffic: IBGDA, else the CPU proxy (NVSHMEM's default)
    ({"qps_per_peer": 8, "ibgda": True}, {"NVSHMEM_IBGDA_NUM_RC_PER_PE": "8", "NVSHMEM_IB_ENABLE_IBGDA": "1"}),
    ({"qps_per_peer": 4, "ibgda": False}, {"NVSHMEM_IB_NUM_RC_PER_DEVICE": "4", "NVSHMEM_IB_ENABLE_IBGDA": "0"}),
    ({"qps_per_peer": 2}, {"NVSHMEM_IB_NUM_RC_PER_DEVICE": "2"}),
    ({"nic": "mlx5_0:1"}, {"NVSHMEM_HCA_LIST": "mlx5_0:1", "NVSHMEM_ENABLE_NIC_PE_MAPPING": "1"}),
    ({"nic": "mlx5_bond_0"}, {"NVSHMEM_HCA_LIST": "mlx5_bond_0", "NVSHMEM_ENABLE_NIC_PE_MAPPING": "1"}),
    ({"nic": "^mlx5_4, mlx5_5"}, {"NVSHMEM_HCA_LIST": "^mlx5_4,mlx5_5", "NVSHMEM_ENABLE_NIC_PE_MAPPING": "1"}),
    ({"gid_index": 3}, {"NVSHMEM_IB_GID_INDEX": "3"}),
    ({"gid_index": 0}, {"NVSHMEM_IB_GID_INDEX": "0"}),
    ({"roce_version": 1}, {"NVSHMEM_IB_ROCE_VERSION_NUM": "1"}),
])
def test_each_knob_sets_its_variable(knobs, expected):
    got = env_of(rdma(**knobs))
    base = {"NVSHMEM_IB_TRAFFIC_CLASS": "0", "NVSHMEM_IB_SL": "0"}
    assert got == {**base, **expected}
    assert set(got) <= set(rdma_env.VARIABLES)


def test_auto_sets_nothing():
    auto = rdma(qps_per_peer="auto", ibgda="auto", nic="auto", gid_index="auto", roce_version="auto")
    got = env_of(auto)
    for var in ("NVSHMEM_IBGDA_NUM_RC_PER_PE", "NVSHMEM_IB_NUM_RC_PER_DEVICE", "NVSHMEM_IB_ENABLE_IBGDA",
                "NVSHMEM_HCA_LIST", "NVSHMEM_ENABLE_NIC_PE_MAPPING", "NVSHMEM_IB_GID_INDEX",
                "NVSHMEM_IB_ROCE_VERSION_NUM"):
        assert var not in got


def test_auto_qps_resolved_by_a_backend():
    # a backend that knows its channel count resolves qps_per_peer: auto (cost_model.suggest)
    assert env_of(rdma(ibgda=True), auto_qps=12)["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "12"
    assert env_of(rdma(), auto_qps=12)["NVSHMEM_IB_NUM_RC_PER_DEVICE"] == "12"
    # an explicit value is not replaced
    assert env_of(rdma(qps_per_peer=3, ibgda=True), auto_qps=12)["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "3"


def test_nic_list_and_mapping_by_local_rank():
    nics = [f"mlx5_{i}:1" for i in range(8)]
    for lr in range(8):
        got = env_of(rdma(nic=nics), local_rank=lr)
        assert got["NVSHMEM_HCA_LIST"] == f"mlx5_{lr}:1" and got["NVSHMEM_ENABLE_NIC_PE_MAPPING"] == "1"
    # two GPUs per NIC: repeat the entry
    shared = ["mlx5_0", "mlx5_0", "mlx5_1", "mlx5_1"]
    assert [env_of(rdma(nic=shared), local_rank=r, world=4)["NVSHMEM_HCA_LIST"] for r in range(4)] == shared
    # a mapping, keys as YAML ints or JSON strings
    mapping = rdma(nic={0: "mlx5_0:1", "1": "mlx5_0:2"})
    assert mapping.nic == {0: "mlx5_0:1", 1: "mlx5_0:2"}
    assert env_of(mapping, local_rank=1)["NVSHMEM_HCA_LIST"] == "mlx5_0:2"


def test_nic_list_too_short_names_the_key():
    cfg = rdma(nic=["mlx5_0", "mlx5_1"])
    with pytest.raises(ValueError, match=r"comm\.rdma\.nic.*local rank 2"):
        env_of(cfg, local_rank=2)
    with pytest.raises(ValueError, match=r"comm\.rdma\.nic.*local rank 5"):
        env_of(rdma(nic={0: "mlx5_0"}), local_rank=5)
    # every rank can check the whole host before any collective, and fail alike
    rdma_env.check_local_ranks(cfg, 2)
    with pytest.raises(ValueError, match="local rank 2"):
        rdma_env.check_local_ranks(cfg, 8)
    rdma_env.check_local_ranks(rdma(nic="mlx5_0"), 8)


def test_bad_rank_arguments():
    for lr, world in ((-1, 4), (4, 4), (0, 0), (True, 4)):
        with pytest.raises(ValueError, match="local_rank"):
            rdma_environment(RdmaConfig(), lr, world, environ={})


def test_no_section_sets_nothing():
    assert env_of(None) == {}


# ---------------------------------------------------------------------------------- user env wins

def test_user_environment_wins():
    cfg = rdma(qps_per_peer=8, traffic_class=106, service_level=3, ibgda=True, gid_index=3)
    user = {"NVSHMEM_IB_TRAFFIC_CLASS": "41", "NVSHMEM_IB_GID_INDEX": "1"}
    got = env_of(cfg, environ=user)
    assert "NVSHMEM_IB_TRAFFIC_CLASS" not in got and "NVSHMEM_IB_GID_INDEX" not in got
    assert got["NVSHMEM_IB_SL"] == "3" and got["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "8"
    shadow = rdma_env.shadowed(cfg, 0, 16, environ=user)
    assert shadow["NVSHMEM_IB_TRAFFIC_CLASS"] == ("106", "41")
    assert shadow["NVSHMEM_IB_GID_INDEX"] == ("3", "1")


def test_user_ibgda_decides_where_qps_go():
    # the user's NVSHMEM_IB_ENABLE_IBGDA wins over ibgda, and the QPs follow the transport in effect
    got = env_of(rdma(qps_per_peer=6, ibgda=False), environ={"NVSHMEM_IB_ENABLE_IBGDA": "1"})
    assert got.get("NVSHMEM_IBGDA_NUM_RC_PER_PE") == "6" and "NVSHMEM_IB_ENABLE_IBGDA" not in got
    got = env_of(rdma(qps_per_peer=6), environ={"NVSHMEM_IB_ENABLE_IBGDA": "false"})
    assert got.get("NVSHMEM_IB_NUM_RC_PER_DEVICE") == "6"
    assert rdma_env.nvshmem_bool("true") and not rdma_env.nvshmem_bool("0") and not rdma_env.nvshmem_bool("No")


@pytest.mark.parametrize("user_var", ["NVSHMEM_HCA_LIST", "NVSHMEM_HCA_PE_MAPPING", "NVSHMEM_ENABLE_NIC_PE_MAPPING"])
def test_user_nic_choice_wins_as_a_group(user_var):
    got = env_of(rdma(nic=["mlx5_0", "mlx5_1"]), environ={user_var: "mlx5_3:1:8" if "MAPPING" in user_var else "1"})
    assert not set(got) & set(rdma_env.NIC_VARS)


def test_default_environ_is_os_environ(monkeypatch):
    monkeypatch.setenv("NVSHMEM_IB_SL", "7")
    monkeypatch.delenv("NVSHMEM_IB_TRAFFIC_CLASS", raising=False)
    got = rdma_environment(rdma(service_level=2, traffic_class=104), 0, 2)
    assert "NVSHMEM_IB_SL" not in got and got["NVSHMEM_IB_TRAFFIC_CLASS"] == "104"
    assert os.environ["NVSHMEM_IB_SL"] == "7"  # read, never written


# -------------------------------------------------------------------------- runtime.environment

def test_runtime_environment_merges_across_hosts_only(monkeypatch):
    from ep_plugin.backends.nvshmem import runtime

    for var in list(os.environ):
        if var.startswith("NVSHMEM_"):
            monkeypatch.delenv(var)
    cfg = rdma(qps_per_peer=4, ibgda=True, nic=["mlx5_0", "mlx5_1"], traffic_class=104)
    one = runtime.environment(1 << 20, True, cfg, local_rank=1, world=4)
    assert one["NVSHMEM_REMOTE_TRANSPORT"] == "none"
    assert not set(one) & set(rdma_env.VARIABLES)  # one host: no NIC, no RDMA variables
    many = runtime.environment(1 << 20, False, cfg, local_rank=1, world=4)
    assert "NVSHMEM_REMOTE_TRANSPORT" not in many and many["NVSHMEM_DISABLE_NVLS"] == "1"
    assert many["NVSHMEM_HCA_LIST"] == "mlx5_1" and many["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "4"
    assert many["NVSHMEM_IB_ENABLE_IBGDA"] == "1" and many["NVSHMEM_IB_TRAFFIC_CLASS"] == "104"
    # the old call still works: no config, no RDMA variables
    assert not set(runtime.environment(1 << 20, False)) & set(rdma_env.VARIABLES)
    monkeypatch.setenv("NVSHMEM_IB_TRAFFIC_CLASS", "96")
    assert "NVSHMEM_IB_TRAFFIC_CLASS" not in runtime.environment(1 << 20, False, cfg, 0, 4)


# ----------------------------------------------------------------------------------- validation

ERRORS = [
    ({"qps_per_peer": 0}, "comm.rdma.qps_per_peer", ["positive int", "auto"]),
    ({"qps_per_peer": "many"}, "comm.rdma.qps_per_peer", ["auto"]),
    ({"qps_per_peer": True}, "comm.rdma.qps_per_peer", ["wrong type"]),
    ({"traffic_class": 256}, "comm.rdma.traffic_class", ["0..255", "out of range"]),
    ({"traffic_class": -1}, "comm.rdma.traffic_class", ["0..255"]),
    ({"traffic_class": "auto"}, "comm.rdma.traffic_class", ["0..255", "wrong type"]),
    ({"service_level": 16}, "comm.rdma.service_level", ["0..15"]),
    ({"service_level": 1.0}, "comm.rdma.service_level", ["wrong type"]),
    ({"ibgda": "on"}, "comm.rdma.ibgda", ["true | false | auto"]),
    ({"ibgda": 1}, "comm.rdma.ibgda", ["true | false | auto"]),
    ({"nic": "mlx5 0"}, "comm.rdma.nic", ["device[:port]", "mlx5_0:1"]),
    ({"nic": "mlx5_0:x"}, "comm.rdma.nic", ["device[:port]"]),
    ({"nic": []}, "comm.rdma.nic", ["empty list"]),
    ({"nic": ["mlx5_0", 3]}, "comm.rdma.nic", ["entry [1]"]),
    ({"nic": {"zero": "mlx5_0"}}, "comm.rdma.nic", ["local rank"]),
    ({"nic": {0: "mlx5_0", "0": "mlx5_1"}}, "comm.rdma.nic", ["twice"]),
    ({"nic": 0}, "comm.rdma.nic", ["wrong type"]),
    ({"gid_index": -1}, "comm.rdma.gid_index", ["auto or an int >= 0"]),
    ({"roce_version": 3}, "comm.rdma.roce_version", ["1..2"]),
    ({"roce_version": 2, "gid_index": 3}, "comm.rdma.roce_version", ["gid_index"]),
    ({"qp_per_peer": 2}, "comm.rdma.qp_per_peer", ["did you mean 'qps_per_peer'", "traffic_class"]),
]


@pytest.mark.parametrize("body,key,fragments", ERRORS, ids=[f"{e[1]}-{i}" for i, e in enumerate(ERRORS)])
def test_validation_errors_name_the_key(body, key, fragments):
    with pytest.raises(ConfigError) as ei:
        load_config({"comm": {"rdma": body}})
    msg = str(ei.value)
    assert msg.startswith(f"<dict>: {key}:"), msg
    for frag in fragments:
        assert frag in msg, (frag, msg)


def test_validation_error_in_a_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("comm:\n  rdma:\n    service_level: 20\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: comm\.rdma\.service_level: out of range"):
        load_config(p)
    p.write_text("comm:\n  rdma: 3\n")
    with pytest.raises(ConfigError, match=r"comm\.rdma: must be a mapping"):
        load_config(p)


def test_overrides_and_round_trip():
    c = load_config("tiny", {"comm.rdma": {"qps_per_peer": 4, "nic": ["mlx5_0", "mlx5_1"]}})
    assert c.comm.rdma.qps_per_peer == 4 and c.comm.rdma.nic == ["mlx5_0", "mlx5_1"]
    assert load_config(c.to_dict()) == c
    with pytest.raises(ConfigError, match=r"\(overrides\): comm\.rdma\.ibgda"):
        load_config("tiny", {"comm.rdma": {"ibgda": "yes please"}})


# -------------------------------------------------------------------------------------- presets

@pytest.mark.parametrize("name", PRESETS)
def test_presets_load_with_rdma(name):
    c = load_config(name)
    assert c.comm.rdma == RdmaConfig()  # every preset leaves the fabric to the site (auto / 0)
    raw = yaml.safe_load(preset_path(name).read_text())
    assert set(raw["comm"]["rdma"]) == {f.name for f in dataclasses.fields(RdmaConfig)}
    text = preset_path(name).read_text()
    for key in raw["comm"]["rdma"]:
        line = next(l for l in text.splitlines() if l.strip().startswith(f"{key}:"))
        assert "#" in line and "NVSHMEM_" in line, line
    assert load_config(REPO / "configs" / f"{name}.yaml") == c


def test_docs_name_every_variable():
    doc = (REPO / "docs" / "RDMA.md").read_text()
    for var in rdma_env.VARIABLES:
        assert var in doc, var
    assert "compiled, not run here" in doc
