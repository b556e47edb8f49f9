"""Per-group NCCL settings for real clusters (the NCCL path itself needs GPUs; this CI has none)."""

from __future__ import annotations

import os
import socket

import pytest

from holmes_sim.backend.nccl import _environment, check_placement, nccl_settings
from holmes_sim.errors import TestbedError
from holmes_sim.plan import Group, GroupKind, Transport, TransportKind


def test_rdma_group_gets_ib_transport_on_its_hcas():
    g = Group(GroupKind.DATA, (0, 1), Transport(TransportKind.RDMA, "roce"), ("roce0", "roce1"))
    assert nccl_settings(g, {"roce0": "mlx5_2", "roce1": "mlx5_3"}) == {
        "NCCL_NET": "IB", "NCCL_IB_HCA": "=mlx5_2,mlx5_3", "NCCL_IB_GID_INDEX": "3"}


def test_tcp_group_gets_socket_on_its_interfaces():
    g = Group(GroupKind.PIPELINE, (3, 7), Transport(TransportKind.TCP, "ethernet"), ("eth0", "eth0"))
    assert nccl_settings(g, {"eth0": "ens1f0"}) == {"NCCL_NET": "Socket",
                                                    "NCCL_SOCKET_IFNAME": "=ens1f0"}


def test_local_group_needs_no_network():
    g = Group(GroupKind.TENSOR, (0, 1), Transport(TransportKind.LOCAL), ("", ""))
    assert nccl_settings(g, {}) == {}


def test_settings_apply_only_while_the_group_is_created(monkeypatch):
    monkeypatch.setenv("NCCL_NET", "Socket")
    monkeypatch.delenv("NCCL_IB_HCA", raising=False)

    with _environment({"NCCL_NET": "IB", "NCCL_IB_HCA": "=mlx5_0"}):
        assert os.environ["NCCL_NET"] == "IB" and os.environ["NCCL_IB_HCA"] == "=mlx5_0"
    assert os.environ["NCCL_NET"] == "Socket" and "NCCL_IB_HCA" not in os.environ


def test_roce_groups_get_the_gid_index_and_ib_groups_do_not():
    roce = Group(GroupKind.DATA, (0, 1), Transport(TransportKind.RDMA, "roce"), ("roce0", "roce0"))
    ib = Group(GroupKind.DATA, (2, 3), Transport(TransportKind.RDMA, "ib"), ("ib0", "ib0"))
    assert nccl_settings(roce, {}, gid_index=5)["NCCL_IB_GID_INDEX"] == "5"
    assert "NCCL_IB_GID_INDEX" not in nccl_settings(ib, {})
    # An explicit RoCE list overrides the name rule.
    assert nccl_settings(ib, {}, roce_fabrics=["ib"])["NCCL_IB_GID_INDEX"] == "3"
    assert "NCCL_IB_GID_INDEX" not in nccl_settings(roce, {}, roce_fabrics=["other"])
    with pytest.raises(TestbedError, match="GID"):
        nccl_settings(roce, {}, gid_index=-1)


def test_rdma_groups_bootstrap_on_the_given_interface_tcp_groups_on_their_own():
    ib = Group(GroupKind.DATA, (0, 1), Transport(TransportKind.RDMA, "ib"), ("ib0", "ib0"))
    tcp = Group(GroupKind.PIPELINE, (0, 1), Transport(TransportKind.TCP, "ethernet"),
                ("eth0", "eth0"))
    assert nccl_settings(ib, {}, bootstrap_ifname="mgmt0")["NCCL_SOCKET_IFNAME"] == "=mgmt0"
    assert "NCCL_SOCKET_IFNAME" not in nccl_settings(ib, {})
    assert nccl_settings(tcp, {}, bootstrap_ifname="mgmt0")["NCCL_SOCKET_IFNAME"] == "=eth0"


def test_gid_index_is_restored_after_creation(monkeypatch):
    monkeypatch.delenv("NCCL_IB_GID_INDEX", raising=False)
    with _environment({"NCCL_IB_GID_INDEX": "3"}):
        assert os.environ["NCCL_IB_GID_INDEX"] == "3"
    assert "NCCL_IB_GID_INDEX" not in os.environ


def test_placement_check_refuses_a_rank_on_the_wrong_node_or_gpu(plan_factory):
    plan = plan_factory(pp=2)  # both ranks on node "n0", GPUs 0 and 1
    check_placement(plan, 1, "n0", 1, {})
    check_placement(plan, 0, "host7.site", 0, {"n0": "host7"})
    with pytest.raises(TestbedError, match="host 'other'"):
        check_placement(plan, 0, "other", 0, {})
    with pytest.raises(TestbedError, match="LOCAL_RANK 0"):
        check_placement(plan, 1, "n0", 0, {})


def test_nccl_init_builds_no_world_communicator_and_barriers_on_gloo(monkeypatch, plan_factory):
    # No GPU here: record what _init_nccl asks torch for.
    import holmes_sim.backend.groups as groups
    import holmes_sim.backend.worker as worker
    from holmes_sim.backend.run_config import RunConfig

    calls: dict = {}
    monkeypatch.setattr(worker.dist, "init_process_group",
                        lambda backend, **kw: calls.update(world=(backend, kw)))
    monkeypatch.setattr(worker.dist, "new_group",
                        lambda **kw: calls.setdefault("barrier", kw) and "barrier-pg")
    monkeypatch.setattr(worker.torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(groups, "build_nccl_groups",
                        lambda *a, **kw: calls.update(groups=kw) or [])
    monkeypatch.setattr(worker, "BARRIER_GROUP", None)
    monkeypatch.setattr(worker, "DEVICE", worker.DEVICE)
    monkeypatch.setenv("LOCAL_RANK", "0")
    # setenv first so that teardown restores the variable's absence: _init_nccl sets it, and a
    # leaked value would send later tests' gloo ranks to an interface that does not exist.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "placeholder")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    cfg = RunConfig(backend="nccl", node_hosts={"n0": socket.gethostname()},
                    bootstrap_ifname="mgmt0", roce_gid_index=4)
    worker._init_nccl(plan_factory(pp=2), cfg, 0)
    backend, kw = calls["world"]
    assert backend == "nccl" and "device_id" not in kw
    assert calls["barrier"]["backend"] == "gloo" and worker.BARRIER_GROUP == "barrier-pg"
    assert calls["groups"] == {"roce_fabrics": [], "gid_index": 4, "bootstrap_ifname": "mgmt0"}
    assert os.environ["GLOO_SOCKET_IFNAME"] == "mgmt0"
