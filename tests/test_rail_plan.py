"""The NVSHMEM rail's auto choices (blocks and QPs per peer) from the cost model, and the QPs reaching
NVSHMEM's environment. CPU only."""
import os

import pytest

from ep_plugin.backends.nvshmem import rdma_env, runtime
from ep_plugin.backends.nvshmem.rail_plan import AUTO_BLOCKS, NIC_PORTS, plan_rail
from ep_plugin.config import load_config
from ep_plugin.plan.cost_model import Hardware, fanout, predict, suggest

H, T, E, K = 7168, 4096, 256, 8


def cfg(num_sms="auto", qps="auto", **moe):
    return load_config({"moe": {"num_experts": E, "topk": K, **moe},
                        "comm": {"backend": "nvshmem", "num_sms": num_sms, "rdma": {"qps_per_peer": qps}}})


@pytest.mark.parametrize("nodes,groups", [(2, None), (4, None), (8, None), (4, (4, 2)), (8, (8, 4))])
def test_across_hosts_auto_follows_the_cost_model(nodes, groups):
    moe = {"num_groups": groups[0], "group_topk": groups[1]} if groups else {}
    plan = plan_rail(cfg(**moe), nodes, 8, T, H, E, fp8=False, sm_count=132, one_host=False)
    s = suggest(nodes, 8, T, H, K, E, *(groups or (None, None)), sm_count=132, nic_ports=NIC_PORTS)
    assert plan.num_blocks == s["num_sms"] and plan.auto_qps == s["qps_per_peer"] == max(s["num_sms"], NIC_PORTS)
    assert "rail blocks" in plan.why and "bound" in plan.why
    # not only "the same as suggest()": the choice has the property suggest() documents, checked with the
    # model's per-stage times (predict): the fewest even SMs (at least 4, at most a quarter of the GPU)
    # whose forwarding stage keeps up with the slower of RDMA and NVLink
    hw = Hardware(nvlink_gbps=478.0, nic_gbps=400.0, nic_efficiency=0.9, latency_us=20.0, sm_gbps=13.0,
                  sm_count=132)
    fan = fanout(nodes, 8, K, E, *(groups or (None, None)))
    n = plan.num_blocks
    assert n % 2 == 0 and 4 <= n <= 132 // 4, n

    def keeps_up(sms):
        t = predict(nodes, 8, T, H, fan, hw, "bf16", sms)
        return t["sms_us"] <= max(t["rdma_us"], t["nvlink_us"]) + 1e-9

    assert keeps_up(n) or n == 32, n  # 32: the cap, even when it cannot keep up
    assert n == 4 or not keeps_up(n - 2), n


def test_fp8_rows_plan_with_fp8_bytes():
    bf16 = plan_rail(cfg(), 8, 8, T, H, E, fp8=False, sm_count=132, one_host=False)
    fp8 = plan_rail(cfg(), 8, 8, T, H, E, fp8=True, sm_count=132, one_host=False)
    s = suggest(8, 8, T, H, K, E, dispatch_dtype="fp8", sm_count=132)
    assert fp8.num_blocks == s["num_sms"] and fp8.num_blocks <= bf16.num_blocks


def test_explicit_settings_win():
    plan = plan_rail(cfg(num_sms=16), 4, 8, T, H, E, fp8=False, sm_count=132, one_host=False)
    assert plan.num_blocks == 16 and plan.auto_qps == 16  # one QP per block that writes to a peer
    plan = plan_rail(cfg(num_sms=16, qps=3), 4, 8, T, H, E, fp8=False, sm_count=132, one_host=False)
    assert plan.num_blocks == 16 and plan.auto_qps is None  # comm.rdma.qps_per_peer: 3 goes through rdma_env
    assert plan_rail(cfg(num_sms=200), 4, 8, T, H, E, False, 132, False).num_blocks == 132


def test_one_host_keeps_the_p2p_default_and_sets_no_qps():
    plan = plan_rail(cfg(), 2, 1, T, H, E, fp8=False, sm_count=132, one_host=True)
    assert plan.num_blocks == AUTO_BLOCKS and plan.auto_qps is None and "one host" in plan.why
    assert plan_rail(cfg(num_sms=8), 2, 1, T, H, E, False, 132, True).num_blocks == 8


def test_planned_qps_reach_nvshmem_only_when_auto(monkeypatch):
    for var in list(os.environ):
        if var.startswith("NVSHMEM_"):
            monkeypatch.delenv(var)
    auto = cfg().comm.rdma
    env = runtime.environment(1 << 20, False, auto, local_rank=0, world=32, auto_qps=10)
    assert env[rdma_env.QPS_PROXY] == "10"  # no IBGDA asked: the CPU proxy's QP variable
    assert rdma_env.QPS_PROXY not in runtime.environment(1 << 20, False, auto, 0, 32)  # no plan: NVSHMEM's
    fixed = cfg(qps=3).comm.rdma
    assert runtime.environment(1 << 20, False, fixed, 0, 32, auto_qps=10)[rdma_env.QPS_PROXY] == "3"
    assert not set(runtime.environment(1 << 20, True, auto, 0, 32, auto_qps=10)) & set(rdma_env.VARIABLES)
