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
