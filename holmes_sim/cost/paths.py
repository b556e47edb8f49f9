"""Links of the flow-level network, and the path a group of GPUs' transfer takes over them.

Links (capacities in bytes/s, each direction separately, so NICs are full duplex):
- ("gpu", node, local_gpu, "tx" | "rx"): the GPU's intra-node link (NVLink or PCIe) x efficiency;
- ("nic", node, nic, "tx" | "rx"): a NIC, line rate x efficiency of its transport;
- ("uplink", cluster_a, cluster_b): the Ethernet uplink from cluster a to b.

A transfer between two TP groups (t GPUs on one node each, GPU i sending 1/t of the bytes to GPU i)
is one flow whose path puts weight 1/t on each member GPU's link; members that share a NIC add up,
so the t GPUs of a node that share one NIC share its bandwidth. GPUs on the same node always talk
over their intra-node link, whatever the group's network transport (NCCL's P2P/SHM transports
inside a node, its NET transport only between nodes).

Rings are built as NCCL builds them (`ring_paths`; NCCL's topology search, src/graph/search.cc and
rings.cc): the members of a node are consecutive on the ring, so intra-node hops use NVLink/PCIe
and each node is entered and left once per channel; NCCL runs several channels and gives each its
own NIC (the one closest to the GPU that leaves the node: "rails"), so a node's exit traffic is
spread over the NICs of its member GPUs. A ring all-reduce of N bytes then takes
2(p-1)/p x N / busbw with busbw = min(intra-node link, sum of a node's member NICs): nccl-tests'
bus bandwidth (doc/PERFORMANCE.md in NVIDIA/nccl-tests).

This module builds them as `Path` and `Ring` objects, the engine's form; `link_uses` gives the
analytic estimate the same links, weights and latencies as bare uses, from `nic_side` (a node's
NIC side of a transfer, kept with the cluster) and, where a transfer has no NIC sides,
`group_path` and `node_exit_path`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from holmes_sim.cost.nccl_algorithms import CollectiveTopology, intra_hw, leaves_node, topology_of
from holmes_sim.hardware.cluster import ETHERNET, Cluster
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
    share = 1.0 / len(src)
    fabric = transport.fabric or ETHERNET
    a, b = src[0].node, dst[0].node
    if a != b and all(g.node == a for g in src) and all(g.node == b for g in dst):
        # One node to another (a TP group's send): each side's NIC links from the cluster's.
        out, lat_out, step_out = nic_side(cluster, fabric, 0, a,
                                          tuple(g.local_index for g in src), share)
        into, lat_in, step_in = nic_side(cluster, fabric, 1, b,
                                         tuple(g.local_index for g in dst), share)
        # In first use, member by member (send, then receive), as the loop below adds them.
        weights = {link: w for _, _, link, w in sorted(out + into)}
        latency, step = max(lat_out, lat_in), max(step_out, step_in)
        uplink = _add_uplink(cluster, transport, src[0], dst[0], weights)
        return _path(weights, capacities, latency + uplink, step + uplink)
    weights: dict[LinkId, float] = {}
    get = weights.get
    latency = step = 0.0
    nics = cluster.derived(("nic links", fabric), dict)
    for s, d in zip(src, dst, strict=True):
        if s.node == d.node:  # over the GPUs' intra-node links
            for link in (("gpu", s.node, s.local_index, "tx"), ("gpu", d.node, d.local_index, "rx")):
                weights[link] = get(link, 0.0) + share
            link = cluster.node(s.node).intra_link
            latency, step = max(latency, link.latency_s), max(step, link.step_latency_s)
        else:
            for gpu, out in ((s, 0), (d, 1)):
                nic = nics.get((gpu.node, gpu.local_index)) or _nic_links(cluster, gpu, fabric)
                link = nic[out]
                weights[link] = get(link, 0.0) + share
                if nic[2] > latency:
                    latency = nic[2]
                if nic[3] > step:
                    step = nic[3]
    uplink = _add_uplink(cluster, transport, src[0], dst[0], weights)
    return _path(weights, capacities, latency + uplink, step + uplink)


@dataclass(frozen=True, slots=True)
class Ring:
    """An NCCL ring over group members: `order[k]` is the member index at ring position k and
    `hops[k]` the path from position k to position k + 1 (mod p)."""

    order: tuple[int, ...]
    hops: tuple[Path, ...]
    topology: CollectiveTopology | None = None
    """What NCCL's algorithm choice sees of the ring (`cost.nccl_algorithms`)."""

    @property
    def idle_rate_bytes_per_s(self) -> float:
        """Bus bandwidth of the ring on an idle network: its slowest hop (bytes/s)."""
        return min(h.idle_rate_bytes_per_s for h in self.hops)

    @property
    def step_latency_s(self) -> float:
        """Latency of one ring step: its slowest hop's (s)."""
        return max(h.step_latency_s for h in self.hops)


def ring_paths(cluster: Cluster, transport: Transport, members: Sequence[Sequence[GpuRef]],
               capacities: dict[LinkId, float]) -> Ring:
    """The ring NCCL builds over `members` (each a TP group's GPUs, all on one node; member m's
    GPU i belongs to the ring of TP rank i, so a member stands for its t parallel rings).

    Members are ordered node by node (first appearance); a hop inside a node uses the GPU links;
    the hop leaving a node spreads over the NICs of every member GPU on that node (channels by
    rail) and enters the next node over its members' NICs the same way."""
    by_node: dict[str, list[int]] = {}
    for m, gpus in enumerate(members):
        by_node.setdefault(gpus[0].node, []).append(m)
    order = tuple(m for ms in by_node.values() for m in ms)
    hops = []
    for k, m in enumerate(order):
        nxt = order[(k + 1) % len(order)]
        src, dst = members[m], members[nxt]
        if src[0].node == dst[0].node:
            hops.append(group_path(cluster, transport, src, dst, capacities))
        else:
            hops.append(node_exit_path(cluster, transport, [members[i] for i in by_node[src[0].node]],
                                       [members[i] for i in by_node[dst[0].node]], capacities))
    return Ring(order, tuple(hops), ring_topology(
        cluster, by_node, [(leaves_node(h.links), h.idle_rate_bytes_per_s, h.step_latency_s)
                           for h in hops], len(members[0])))


def ring_topology(cluster: Cluster, nodes: Sequence[str], hops, lanes: int) -> CollectiveTopology:
    """`nccl_algorithms.topology_of` a ring over `nodes` with `hops` (leaves a node, rate bytes/s,
    step latency s) and `lanes` GPUs per member: NVLS only when every node's GPU link has NVLink
    SHARP; the lowest compute capability of the nodes' GPUs (None if one is not known)."""
    links = [cluster.node(n).intra_link for n in nodes]
    nvls = [lk.nvls_efficiency for lk in links]
    ccs = [cluster.node(n).gpu.compute_capability for n in nodes]
    return topology_of(hops, len(links), intra_hw(links), None if None in nvls else min(nvls),
                       lanes, None if None in ccs else min(ccs))


def node_exit_path(cluster: Cluster, transport: Transport, src_members: Sequence[Sequence[GpuRef]],
                   dst_members: Sequence[Sequence[GpuRef]], capacities: dict[LinkId, float]) -> Path:
    """The hop from one node to the next on a ring: the bytes of a member's share leave over the
    NICs of all the node's member GPUs in equal parts, and enter the next node the same way."""
    fabric = transport.fabric or ETHERNET
    sides = []
    for group, out in ((src_members, 0), (dst_members, 1)):
        gpus = [g for member in group for g in member]
        node = gpus[0].node
        if any(g.node != node for g in gpus):
            break
        sides.append(nic_side(cluster, fabric, out, node, tuple(g.local_index for g in gpus),
                              1.0 / len(gpus)))
    else:  # each node's NIC links from the cluster's: the sending node's, then the receiving
        (out, lat_out, step_out), (into, lat_in, step_in) = sides
        weights = {link: w for _, _, link, w in out + into}
        latency, step = max(lat_out, lat_in), max(step_out, step_in)
        uplink = _add_uplink(cluster, transport, src_members[0][0], dst_members[0][0], weights)
        return _path(weights, capacities, latency + uplink, step + uplink)
    weights: dict[LinkId, float] = {}
    get = weights.get
    latency = step = 0.0
    nics = cluster.derived(("nic links", fabric), dict)
    for group, out in ((src_members, 0), (dst_members, 1)):
        gpus = [g for member in group for g in member]
        share = 1.0 / len(gpus)
        for gpu in gpus:
            nic = nics.get((gpu.node, gpu.local_index)) or _nic_links(cluster, gpu, fabric)
            link = nic[out]
            weights[link] = get(link, 0.0) + share
            if nic[2] > latency:
                latency = nic[2]
            if nic[3] > step:
                step = nic[3]
    uplink = _add_uplink(cluster, transport, src_members[0][0], dst_members[0][0], weights)
    return _path(weights, capacities, latency + uplink, step + uplink)


def nic_side(cluster: Cluster, fabric: str, out: int, node: str, gpus: tuple[int, ...],
             share: float) -> tuple[tuple, float, float]:
    """GPUs `gpus` of `node` each sending (out 0) or receiving (out 1) `share` of a transfer
    over their NICs on `fabric`: ((first member, out, link, summed weight) in order of first
    use, latency s, ring-step latency s), the weights summed member by member as the paths'
    loops sum them; kept with the cluster (`Cluster.derived`). Nodes with equal NICs have the
    same sides but for their name in the links: one is found per NIC kind (`nic_kind`), the
    others are it renamed."""
    key = (node, gpus, out, share)
    table = cluster.derived(("nic sides", fabric), dict)
    got = table.get(key)
    if got is None:
        kinds = cluster.derived(("nic side kinds", fabric), dict)
        kind_key = (nic_kind(cluster, node), gpus, out, share)
        model = kinds.get(kind_key)
        if model is None:
            got = kinds[kind_key] = _new_nic_side(cluster, fabric, out, node, gpus, share)
        else:
            entries, latency, step = model
            got = (tuple([(i, o, (lk[0], node, lk[2], lk[3]), w) for i, o, lk, w in entries]),
                   latency, step)
        table[key] = got
    return got


def _new_nic_side(cluster: Cluster, fabric: str, out: int, node: str, gpus: tuple[int, ...],
                  share: float) -> tuple[tuple, float, float]:
    """`nic_side` found link by link."""
    nics = cluster.derived(("nic links", fabric), dict)
    weights: dict[LinkId, float] = {}
    first: dict[LinkId, int] = {}
    latency = step = 0.0
    for i, local in enumerate(gpus):
        nic = nics.get((node, local)) or _nic_links(cluster, GpuRef(node, local), fabric)
        link = nic[out]
        first.setdefault(link, i)
        weights[link] = weights.get(link, 0.0) + share
        latency, step = max(latency, nic[2]), max(step, nic[3])
    return tuple((first[lk], out, lk, w) for lk, w in weights.items()), latency, step


def nic_kind(cluster: Cluster, node: str) -> int:
    """A small id per distinct NIC set (`Node.nics`, equal values), kept with the cluster per
    node and per NIC tuple object (a node group's nodes share theirs): the NIC links of nodes
    of one kind differ only by the node's name, and their latencies and capacities are equal."""
    by_node = cluster.derived(("nic kind of node",), dict)
    got = by_node.get(node)
    if got is None:
        nics = cluster.node(node).nics
        by_object = cluster.derived(("nic kind of nics object",), dict)
        seen = by_object.get(id(nics))
        if seen is not None and seen[0] is nics:
            got = seen[1]
        else:
            by_value = cluster.derived(("nic kind of nics",), dict)
            got = by_value.setdefault(nics, len(by_value))
            by_object[id(nics)] = (nics, got)
        by_node[node] = got
    return got


def _nic_links(cluster: Cluster, gpu: GpuRef, fabric: str) -> tuple[LinkId, LinkId, float, float]:
    """(tx link, rx link, latency s, ring-step latency s) of the NIC `gpu` uses on `fabric`,
    kept with the cluster (`Cluster.derived`)."""
    nic = cluster.nic_of_gpu(gpu.node, gpu.local_index, fabric)
    assert nic is not None, f"{gpu} has no NIC on {fabric}"
    got = (("nic", gpu.node, nic.name, "tx"), ("nic", gpu.node, nic.name, "rx"), nic.latency_s,
           nic.step_latency_s)
    cluster.derived(("nic links", fabric), dict)[(gpu.node, gpu.local_index)] = got
    return got


def _path(weights: dict[LinkId, float], capacities: dict[LinkId, float], latency_s: float,
          step_s: float) -> Path:
    links = tuple(weights.items())
    rate = min([capacities[lk] / w for lk, w in links])
    return Path(links, latency_s, rate, step_s)


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
