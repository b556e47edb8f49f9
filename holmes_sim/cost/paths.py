"""Links of the flow-level network, and the path a group of GPUs' transfer takes over them.

Links (capacities in bytes/s, each direction separately, so NICs are full duplex):
- ("gpu", node, local_gpu, "tx" | "rx"): the GPU's intra-node link (NVLink or PCIe) x efficiency;
- ("nic", node, nic, "tx" | "rx"): a NIC, line rate x efficiency of its transport;
- ("uplink", cluster_a, cluster_b): the Ethernet uplink from cluster a to b.

A transfer between two TP groups (t GPUs on one node each, GPU i sending 1/t of the bytes to GPU i)
is one flow whose path puts weight 1/t on each member GPU's link; members that share a NIC add up,
so the t GPUs of a node that share one NIC share its bandwidth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from holmes_sim.cluster import ETHERNET, Cluster
from holmes_sim.plan import GpuRef, Transport, TransportKind

LinkId = tuple
PathUse = tuple[tuple[LinkId, float], ...]


@dataclass(frozen=True, slots=True)
class Path:
    """A flow's links with weights, its latency (s), the latency of one ring-collective step over
    it (s), and its idle-network rate (bytes/s)."""

    links: PathUse
    latency_s: float
    idle_rate_bytes_per_s: float
    step_latency_s: float = 0.0


def link_capacities(cluster: Cluster) -> dict[LinkId, float]:
    """Capacity in bytes/s of every link of the cluster."""
    caps: dict[LinkId, float] = {}
    for node in cluster.nodes:
        gpu_bw = node.intra_link.bandwidth_bytes_per_s * node.intra_link.efficiency
        for g in range(node.num_gpus):
            caps[("gpu", node.name, g, "tx")] = gpu_bw
            caps[("gpu", node.name, g, "rx")] = gpu_bw
        for nic in node.nics:
            caps[("nic", node.name, nic.name, "tx")] = nic.effective_bandwidth_bytes_per_s
            caps[("nic", node.name, nic.name, "rx")] = nic.effective_bandwidth_bytes_per_s
    for up in cluster.uplinks:
        a, b = up.clusters
        caps[("uplink", a, b)] = up.bandwidth_bytes_per_s
        caps[("uplink", b, a)] = up.bandwidth_bytes_per_s
    return caps


def group_path(cluster: Cluster, transport: Transport, src: Sequence[GpuRef],
               dst: Sequence[GpuRef], capacities: dict[LinkId, float]) -> Path:
    """The path of a transfer from GPUs `src` to GPUs `dst` (same length) using `transport`."""
    weights: dict[LinkId, float] = {}
    share = 1.0 / len(src)
    latency = step = 0.0
    local = transport.kind is TransportKind.LOCAL
    for s, d in zip(src, dst, strict=True):
        for gpu, direction in ((s, "tx"), (d, "rx")):
            node = cluster.node(gpu.node)
            if local:
                link = ("gpu", node.name, gpu.local_index, direction)
                latency = max(latency, node.intra_link.latency_s)
                step = max(step, node.intra_link.latency_s)
            else:
                nic = node.nic_of_gpu(gpu.local_index, transport.fabric or ETHERNET)
                assert nic is not None, f"{gpu} has no NIC on {transport.fabric}"
                link = ("nic", node.name, nic.name, direction)
                latency = max(latency, nic.latency_s)
                step = max(step, nic.step_latency_s)
            weights[link] = weights.get(link, 0.0) + share
    uplink = _add_uplink(cluster, transport, src[0], dst[0], weights)
    links = tuple(weights.items())
    rate = min(capacities[lk] / w for lk, w in links)
    return Path(links, latency + uplink, rate, step + uplink)


def _add_uplink(cluster: Cluster, transport: Transport, src: GpuRef, dst: GpuRef,
                weights: dict[LinkId, float]) -> float:
    """Ethernet traffic between clusters crosses their uplink; returns its latency (s)."""
    if transport.kind is not TransportKind.TCP:
        return 0.0
    a, b = cluster.node(src.node).cluster, cluster.node(dst.node).cluster
    up = cluster.uplink(a, b)
    if up is None:
        return 0.0
    weights[("uplink", a, b)] = 1.0
    return up.latency_s
