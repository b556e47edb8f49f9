"""Reference policies that bound Holmes on the same cluster:

- all-ib (upper bound): every node's RDMA NICs become InfiniBand NICs on one fabric reaching all
  nodes (the scenario's fastest IB NIC, else HDR), so every group can use RDMA.
- all-ethernet (lower bound): every inter-node group uses TCP over Ethernet.
Both plan as Holmes does (its candidate rank orders, each kept or not by their own estimate,
partition search and overlapped optimizer), so they differ from it only in the network.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from holmes_sim.hardware.catalog import NICS
from holmes_sim.hardware.cluster import ETHERNET, Cluster, Nic, Node
from holmes_sim.cost.transport import tcp_transport
from holmes_sim.plan import GpuRef
from holmes_sim.policies.base import PlanRequest
from holmes_sim.policies.groups import TransportChooser
from holmes_sim.policies.holmes import HolmesPolicy

ALL_IB_FABRIC = "all-ib"


@dataclass(frozen=True)
class AllIbReference(HolmesPolicy):
    name: str = "all-ib"
    description: str = "reference: the same nodes, all on one InfiniBand fabric"

    def cluster_view(self, cluster: Cluster) -> Cluster:
        template = _fastest_ib(cluster)
        most = max(sum(1 for n in node.nics if n.type != ETHERNET) for node in cluster.nodes)
        nodes = tuple(_on_one_fabric(node, template, most or 1) for node in cluster.nodes)
        fabrics = {ALL_IB_FABRIC: "ib", ETHERNET: ETHERNET}
        return cluster.with_nodes(nodes, fabrics)


@dataclass(frozen=True)
class AllEthernetReference(HolmesPolicy):
    name: str = "all-ethernet"
    description: str = "reference: every inter-node group over TCP/Ethernet"

    def chooser(self, request: PlanRequest, rank_to_gpu: Sequence[GpuRef]) -> TransportChooser:
        return lambda gpus: tcp_transport(request.cluster, gpus)


def _fastest_ib(cluster: Cluster) -> Nic:
    ib = [n for node in cluster.nodes for n in node.nics if n.type == "ib"]
    if ib:
        return max(ib, key=lambda n: n.effective_bandwidth_bytes_per_s)
    m = NICS["ib-hdr"]
    return Nic("ib0", "ib", ALL_IB_FABRIC, m.bandwidth_bytes_per_s, m.latency_s, m.efficiency, ())


def _on_one_fabric(node: Node, template: Nic, default_count: int) -> Node:
    count = sum(1 for n in node.nics if n.type != ETHERNET) or default_count
    ib = tuple(replace(template, name=f"ib{k}", fabric=ALL_IB_FABRIC,
                       gpus=tuple(g for g in range(node.num_gpus) if g * count // node.num_gpus == k)
                       or (k * node.num_gpus // count,))
               for k in range(count))
    return replace(node, nics=ib + tuple(n for n in node.nics if n.type == ETHERNET))
