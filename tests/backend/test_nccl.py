"""Per-group NCCL settings for real clusters (the NCCL path itself needs GPUs; this CI has none)."""

from __future__ import annotations

from holmes_sim.backend.nccl import _environment, nccl_settings
from holmes_sim.plan import Group, GroupKind, Transport, TransportKind


def test_rdma_group_gets_ib_transport_on_its_hcas():
    g = Group(GroupKind.DATA, (0, 1), Transport(TransportKind.RDMA, "roce"), ("roce0", "roce1"))
    assert nccl_settings(g, {"roce0": "mlx5_2", "roce1": "mlx5_3"}) == {
        "NCCL_NET": "IB", "NCCL_IB_HCA": "=mlx5_2,mlx5_3"}


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
    import os

    with _environment({"NCCL_NET": "IB", "NCCL_IB_HCA": "=mlx5_0"}):
        assert os.environ["NCCL_NET"] == "IB" and os.environ["NCCL_IB_HCA"] == "=mlx5_0"
    assert os.environ["NCCL_NET"] == "Socket" and "NCCL_IB_HCA" not in os.environ


def test_roce_group_gets_its_gid_index_and_rdma_groups_bootstrap_on_ethernet():
    from holmes_sim.backend.nccl import nccl_settings as settings

    roce = Group(GroupKind.DATA, (0, 1), Transport(TransportKind.RDMA, "lab-roce"), ("roce0", "roce1"))
    ib = Group(GroupKind.DATA, (2, 3), Transport(TransportKind.RDMA, "lab-ib"), ("ib0", "ib0"))
    types = {"lab-roce": "roce", "lab-ib": "ib"}
    assert settings(roce, {}, types, "ens1f0", roce_gid_index=5) == {
        "NCCL_NET": "IB", "NCCL_IB_HCA": "=roce0,roce1", "NCCL_IB_GID_INDEX": "5",
        "NCCL_SOCKET_IFNAME": "=ens1f0"}
    assert settings(ib, {"ib0": "mlx5_0"}, types, "ens1f0") == {
        "NCCL_NET": "IB", "NCCL_IB_HCA": "=mlx5_0", "NCCL_SOCKET_IFNAME": "=ens1f0"}


def test_gid_index_does_not_leak_into_the_next_group(monkeypatch):
    import os

    monkeypatch.delenv("NCCL_IB_GID_INDEX", raising=False)
    with _environment({"NCCL_NET": "IB", "NCCL_IB_GID_INDEX": "3"}):
        assert os.environ["NCCL_IB_GID_INDEX"] == "3"
    with _environment({"NCCL_NET": "IB", "NCCL_IB_HCA": "=mlx5_0"}):
        assert "NCCL_IB_GID_INDEX" not in os.environ


def test_a_rank_on_the_wrong_node_or_gpu_is_refused():
    import pytest

    from holmes_sim.backend.nccl import check_placement
    from holmes_sim.errors import TestbedError

    check_placement("ib-0", 3, {"ib-0": "gpu17"}, "gpu17.cluster.local", 3)
    with pytest.raises(TestbedError, match="runs on 'gpu18'"):
        check_placement("ib-0", 3, {"ib-0": "gpu17"}, "gpu18", 3)
    with pytest.raises(TestbedError, match="LOCAL_RANK is 2"):
        check_placement("ib-0", 3, {}, "anything", 2)


def test_nccl_world_is_lazy_barriers_run_on_gloo_and_placement_is_checked(monkeypatch):
    """No device_id: torch would otherwise build the world communicator eagerly and split the
    plan's groups from it, with the world's NCCL settings."""
    import pytest
    import torch

    import holmes_sim.backend.groups as groups
    import holmes_sim.backend.worker as worker
    from holmes_sim.errors import TestbedError
    from holmes_sim.plan import GpuRef, Plan

    calls = {}
    monkeypatch.setattr(worker, "DEVICE", worker.DEVICE)  # restored after the test
    monkeypatch.setattr(worker, "BARRIER_GROUP", None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(worker.dist, "init_process_group", lambda *a, **k: calls.update(init=(a, k)))
    monkeypatch.setattr(worker.dist, "new_group", lambda **k: calls.setdefault("barrier", k) and "G")
    monkeypatch.setattr(groups, "build_nccl_groups", lambda *a, **k: calls.update(groups=a) or [])
    plan = Plan("hand", 1, 1, 2, (GpuRef("n0", 0), GpuRef("n0", 1)), (4,), None, 1, 1, None, ())
    cfg = worker.RunConfig(backend="nccl", node_hostnames={})
    monkeypatch.setenv("LOCAL_RANK", "1")
    worker._init_nccl(plan, cfg, 1)
    args, kwargs = calls["init"]
    assert args == ("nccl",) and "device_id" not in kwargs
    assert calls["barrier"]["backend"] == "gloo" and "groups" in calls
    calls.clear()
    monkeypatch.setenv("LOCAL_RANK", "0")  # rank 1 is planned on GPU 1
    with pytest.raises(TestbedError, match="LOCAL_RANK is 0"):
        worker._init_nccl(plan, cfg, 1)
    assert "init" not in calls
