"""`ep_plugin doctor --config FILE`: comm.rdma shown as the NVSHMEM variables it becomes (the
mapping itself is tested in test_rdma_env.py)."""
from ep_plugin.doctor import main
from ep_plugin.doctor.rdma_config import rdma_config_check
from ep_plugin.doctor.report import ERROR, OK, WARNING

RDMA = """comm:
  rdma:
    qps_per_peer: 8
    traffic_class: 106
    service_level: 3
    ibgda: true
    nic: [mlx5_0, mlx5_1]
"""


def test_rdma_settings_as_variables_per_local_rank(tmp_path):
    path = tmp_path / "rdma.yaml"
    path.write_text(RDMA)
    c = rdma_config_check(str(path), local_ranks=2, environ={})
    assert c.status == OK, c
    text = "\n".join(c.details)
    for want in ("NVSHMEM_IBGDA_NUM_RC_PER_PE=8", "NVSHMEM_IB_TRAFFIC_CLASS=106", "NVSHMEM_IB_SL=3",
                 "NVSHMEM_IB_ENABLE_IBGDA=1", "local rank 0: ", "NVSHMEM_HCA_LIST=mlx5_0", "local rank 1: ",
                 "NVSHMEM_HCA_LIST=mlx5_1", "NVSHMEM_ENABLE_NIC_PE_MAPPING=1"):
        assert want in text, (want, text)


def test_environment_overrides_are_flagged(tmp_path):
    path = tmp_path / "rdma.yaml"
    path.write_text(RDMA)
    c = rdma_config_check(str(path), local_ranks=1, environ={"NVSHMEM_IB_SL": "5"})
    assert c.status == WARNING and "NVSHMEM_IB_SL=5 (environment; config: 3)" in "\n".join(c.details)


def test_defaults_and_errors(tmp_path):
    c = rdma_config_check("tiny", environ={})  # a preset: comm.rdma defaults
    assert c.status == OK and "qps_per_peer auto" in c.summary
    short = tmp_path / "short.yaml"
    short.write_text(RDMA)
    assert rdma_config_check(str(short), local_ranks=3, environ={}).status == ERROR  # no NIC for local rank 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("comm:\n  rdma:\n    service_levle: 3\n")
    c = rdma_config_check(str(bad), environ={})
    assert c.status == ERROR and "service_lev" in c.summary


def test_doctor_cli_shows_the_check(tmp_path, capsys):
    path = tmp_path / "rdma.yaml"
    path.write_text(RDMA)
    main(["--no-ipc", "--config", str(path), "--local-ranks", "2"])
    out = capsys.readouterr().out
    assert "comm.rdma" in out and "NVSHMEM_IB_TRAFFIC_CLASS=106" in out
