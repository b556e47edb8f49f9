"""Which transport a communication group can use, and which NIC each member sends through.

Holmes' automatic NIC selection (arXiv 2312.03549, section 3.3): a group uses RDMA on a fabric
every member reaches; a group whose members share no RDMA fabric (IB and RoCE cannot talk RDMA to
each other) falls back to TCP over Ethernet. Megatron-LM launched with one NCCL configuration for
the whole job picks one transport for every inter-node group: RDMA only when one fabric reaches
every node of the job, TCP otherwise (`job_wide_transport`).
"""

from __future__ import annotations

from collections.abc import Sequence

from holmes_sim.hardware.cluster import ETHERNET, Cluster, Node
from holmes_sim.errors import PlanError
from holmes_sim.plan import GpuRef, Transport, TransportKind

LOCAL = Transport(TransportKind.LOCAL)


def best_shared_transport(cluster: Cluster, gpus: Sequence[GpuRef]) -> Transport:
    """The fastest transport every member of a group can use (NIC-aware selection). It depends
    on the NICs of the members' nodes only (in order of first appearance), so it is chosen
    once per sequence of NIC layouts and kept with the cluster (`Cluster.derived`): the few
    kinds of node stand for the many nodes."""
    nodes = _nodes(cluster, gpus)
    if len(nodes) == 1:
        return LOCAL
    key = tuple(id(n.nics) for n in nodes)  # the NIC tuples live as long as the cluster
    chosen = cluster.derived(("best shared transport",), dict)
    got = chosen.get(key)
    if got is None:
        common = _common_rdma_fabrics(nodes)
        got = chosen[key] = Transport(
            TransportKind.RDMA, max(common, key=lambda f: _slowest_member_rate(nodes, f))) \
            if common else _tcp(nodes)
    return got


def job_wide_fabric(cluster: Cluster, all_gpus: Sequence[GpuRef]) -> str | None:
    """The RDMA fabric reaching every node of the job, or None (then the job runs on TCP)."""
    common = _common_rdma_fabrics(_nodes(cluster, all_gpus))
    return common[0] if common else None


def job_wide_transport(cluster: Cluster, gpus: Sequence[GpuRef], fabric: str | None) -> Transport:
    """Megatron-LM's choice: one setting for the whole job (see module docstring); `fabric` is
    `job_wide_fabric` of the job."""
    nodes = _nodes(cluster, gpus)
    if len(nodes) == 1:
        return LOCAL
    return Transport(TransportKind.RDMA, fabric) if fabric else _tcp(nodes)


def tcp_transport(cluster: Cluster, gpus: Sequence[GpuRef]) -> Transport:
    """TCP over Ethernet (LOCAL when all members share a node): the all-ethernet reference."""
    nodes = _nodes(cluster, gpus)
    return LOCAL if len(nodes) == 1 else _tcp(nodes)


def member_nics(cluster: Cluster, gpus: Sequence[GpuRef], transport: Transport) -> tuple[str, ...]:
    """The node-local NIC name each member sends through ("" for LOCAL)."""
    if transport.kind is TransportKind.LOCAL:
        return tuple("" for _ in gpus)
    out = []
    for g in gpus:
        nic = cluster.nic_of_gpu(g.node, g.local_index, transport.fabric or ETHERNET)
        assert nic is not None, f"{g} has no NIC on {transport.fabric}"
        out.append(nic.name)
    return tuple(out)


def _nodes(cluster: Cluster, gpus: Sequence[GpuRef]) -> list[Node]:
    names = list(dict.fromkeys(g.node for g in gpus))
    return [cluster.node(n) for n in names]


def _common_rdma_fabrics(nodes: list[Node]) -> list[str]:
    common = list(nodes[0].rdma_fabrics)
    for n in nodes[1:]:
        common = [f for f in common if f in n.rdma_fabrics]
    return common


def _slowest_member_rate(nodes: list[Node], fabric: str) -> float:
    return min(sum(nic.effective_bandwidth_bytes_per_s for nic in n.nics_on(fabric)) for n in nodes)


def _tcp(nodes: list[Node]) -> Transport:
    missing = [n for n in nodes if not n.nics_on(ETHERNET)]
    if missing:
        raise _no_fallback(missing)
    return Transport(TransportKind.TCP, ETHERNET)


def _no_fallback(missing: list[Node]) -> PlanError:
    """The error for a group whose `missing` nodes share no RDMA fabric with the rest and have
    no Ethernet NIC: the nodes and their node groups, the first group's NICs as its field."""
    groups = list(dict.fromkeys(n.group_path for n in missing if n.group_path))
    names = _some(n.name for n in missing)
    where = f" (node groups {_some(groups)})" if len(groups) > 1 else ""
    whose = "each of those node groups" if len(groups) > 1 else "their node group"
    return PlanError(f"nodes {names}{where} share no RDMA fabric with the rest of their group "
                     "and have no Ethernet NIC to fall back to TCP; add `- {type: ethernet, "
                     f"model: eth-100g}}` to the nics of {whose}",
                     field=f"{groups[0]}.nics" if groups else None)


def _some(items, shown: int = 4) -> str:
    """The first `shown` of `items`, comma-separated, and how many more."""
    items = list(items)
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more
