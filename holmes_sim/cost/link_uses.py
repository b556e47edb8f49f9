"""The paths of `cost.paths` as link uses, for the analytic estimate (`estimate.netview`).

A use is what the estimate needs of a path to share its links among replicas: its links with
their weights (`PathUse`, in another order than the `Path`'s) and its latency (s), and for a
ring hop its ring-step latency (s) and idle rate (bytes/s), built without `Path` objects. A TP
group's send between two nodes and a ring hop leaving a node are their two nodes' NIC sides
(kept with the cluster) and the uplink they cross; any other transfer is `paths.group_path`'s or
`paths.node_exit_path`'s. The links, weights and latencies are those of the engine's paths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from holmes_sim.cost.nccl_algorithms import leaves_node
from holmes_sim.cost.paths import (LinkId, PathUse, group_path, link_capacities, nic_kind,
                                   nic_side, node_exit_path)
from holmes_sim.hardware.cluster import ETHERNET, Cluster
from holmes_sim.plan import GpuRef, Transport, TransportKind


def send_uses(cluster: Cluster, transport: Transport, src: Sequence[GpuRef],
              dst: Sequence[GpuRef]) -> tuple[PathUse, float]:
    """`group_path`'s links with their weights (as a mapping; in another order) and latency
    (s), without its idle rate: what the estimate needs to share links among replicas
    (`netview`). A TP group's send to another node is its two NIC sides and the uplink
    (`_send_sides`); anything else is `group_path`'s."""
    sides = _send_sides(cluster, transport, src, dst)
    if sides is None:
        path = group_path(cluster, transport, src, dst, _capacities(cluster))
        return path.links, path.latency_s
    return side_links(sides)


def side_links(sides: tuple[tuple, tuple, tuple[LinkId, float] | None]) -> tuple[PathUse, float]:
    """`send_uses` of a send given as its NIC sides and uplink (`node_send_sides`): its links
    with their weights, and its latency (s)."""
    out, into, up = sides
    links, latency = out[0] + into[0], max(out[1], into[1])
    if up is None:
        return links, latency
    return links + ((up[0], 1.0),), latency + up[1]


def _send_sides(cluster: Cluster, transport: Transport, src: Sequence[GpuRef],
                dst: Sequence[GpuRef]) -> tuple[tuple, tuple, tuple[LinkId, float] | None] | None:
    """A TP group's send to another node as its sending and its receiving node's NIC sides
    (`_side_uses`: links with weights, latency s, ring-step latency s, the smallest capacity /
    weight in bytes/s; kept with the cluster) and the uplink it crosses ((link, latency s) or
    None); None for any other send."""
    return node_send_sides(cluster, transport, on_one_node(src), on_one_node(dst))


def on_one_node(gpus: Sequence[GpuRef]) -> tuple[str, tuple[int, ...]] | None:
    """(node, each GPU's local index) when all of `gpus` are on one node, else None."""
    node = gpus[0].node
    if any(g.node != node for g in gpus):
        return None
    return node, tuple(g.local_index for g in gpus)


def node_send_sides(cluster: Cluster, transport: Transport, src: tuple[str, tuple[int, ...]] | None,
                    dst: tuple[str, tuple[int, ...]] | None
                    ) -> tuple[tuple, tuple, tuple[LinkId, float] | None] | None:
    """`_send_sides` of members given as `on_one_node` gives them (None: not on one node)."""
    if src is None or dst is None or src[0] == dst[0]:
        return None
    share = 1.0 / len(src[1])
    fabric = transport.fabric or ETHERNET
    return (_side_uses(cluster, fabric, 0, src[0], src[1], share),
            _side_uses(cluster, fabric, 1, dst[0], dst[1], share),
            _uplink_use(cluster, transport, src[0], dst[0]))


def pair_send_sides(cluster: Cluster, transports: Sequence[Transport],
                    ends: Sequence[tuple]) -> list[tuple | None]:
    """`node_send_sides` of each send (its transport; its ends as `on_one_node` gives them),
    kept with the cluster by transport and ends."""
    tables: dict[int, dict] = {}  # by transport object, for this call
    got = []
    for transport, (src, dst) in zip(transports, ends, strict=True):
        if src is None or dst is None or src[0] == dst[0]:
            got.append(None)
            continue
        table = tables.get(id(transport))
        if table is None:
            table = tables[id(transport)] = cluster.derived(("node send sides", transport), dict)
        sides = table.get((src, dst))
        if sides is None:
            sides = table[(src, dst)] = node_send_sides(cluster, transport, src, dst)
        got.append(sides)
    return got


def pair_send_facts(cluster: Cluster, transports: Sequence[Transport],
                    ends: Sequence[tuple]) -> list[tuple]:
    """Of each send of `pair_send_sides` (its transport; its ends as `on_one_node` gives them,
    on two different nodes), its sending and its receiving side's (latency s, smallest
    capacity / weight bytes/s) and its uplink ((link, latency s) or None): the figures
    `node_send_sides` gives, without the sides' links. Kept with the cluster by transport and
    ends; the sides' figures are found once per NIC kind (`_side_figures`)."""
    tables: dict[int, dict] = {}  # by transport object, for this call
    got = []
    for transport, (src, dst) in zip(transports, ends, strict=True):
        table = tables.get(id(transport))
        if table is None:
            table = tables[id(transport)] = cluster.derived(("node send facts", transport), dict)
        facts = table.get((src, dst))
        if facts is None:
            fabric, share = transport.fabric or ETHERNET, 1.0 / len(src[1])
            out_latency, _, out_rate = _side_figures(cluster, fabric, 0, src[0], src[1], share)
            in_latency, _, in_rate = _side_figures(cluster, fabric, 1, dst[0], dst[1], share)
            facts = table[(src, dst)] = ((out_latency, out_rate), (in_latency, in_rate),
                                         _uplink_use(cluster, transport, src[0], dst[0]))
        got.append(facts)
    return got


def _side_figures(cluster: Cluster, fabric: str, out: int, node: str, gpus: tuple[int, ...],
                  share: float) -> tuple[float, float, float]:
    """`nic_side`'s latency (s), ring-step latency (s) and smallest capacity / weight over its
    links (bytes/s), found once per NIC kind (`paths.nic_kind`: the same NICs, so the same latencies
    and capacities)."""
    table = cluster.derived(("nic side figures", fabric), dict)
    key = (nic_kind(cluster, node), gpus, out, share)
    got = table.get(key)
    if got is None:
        entries, latency, step = nic_side(cluster, fabric, out, node, gpus, share)
        caps = _capacities(cluster)
        got = table[key] = (latency, step, min(caps[lk] / w for _, _, lk, w in entries))
    return got


def ring_uses(cluster: Cluster, transport: Transport, members: Sequence[Sequence[GpuRef]]
              ) -> list[tuple[PathUse, float, float]]:
    """Each hop of `paths.ring_paths`' ring as (links with weights in another order, ring-step
    latency s, idle rate bytes/s), without building its paths: a hop that leaves a node is its
    two nodes' NIC sides (each node's GPUs found once; the sides kept with the cluster) and the
    uplink; a hop inside a node is `group_path`'s. The rates use the cluster's link capacities
    (`link_capacities`)."""
    return _ring_hops(cluster, transport, members, _exit_uses, _hop_uses)


def ring_hop_facts(cluster: Cluster, transport: Transport, members: Sequence[Sequence[GpuRef]]
                   ) -> list[tuple[bool, float, float]]:
    """Each hop of `ring_uses` as (whether it leaves a node, `nccl_algorithms.leaves_node`;
    ring-step latency s; idle rate bytes/s): what an idle ring's rate, step latency and
    topology need. A hop leaving a node for another, each node holding all its members' GPUs,
    is priced from its NIC sides' kinds (`_side_figures`) and the uplink, without its links."""
    return _ring_hops(cluster, transport, members, _exit_facts, _hop_facts)


def _hop_uses(hop: tuple[PathUse, float, float]) -> tuple[PathUse, float, float]:
    """`ring_uses`' form of a (links, step latency s, rate bytes/s) hop: itself."""
    return hop


def _hop_facts(hop: tuple[PathUse, float, float]) -> tuple[bool, float, float]:
    """`ring_hop_facts`' form of a (links, step latency s, rate bytes/s) hop."""
    return leaves_node(hop[0]), hop[1], hop[2]


def _ring_hops(cluster: Cluster, transport: Transport, members: Sequence[Sequence[GpuRef]],
               exit_hop: Callable, other_hop: Callable) -> list:
    """The hops of `ring_uses`: `exit_hop(cluster, transport, fabric, a, side of a, b, side of
    b)` of a hop leaving node a for node b, each holding all its members' GPUs (side: those
    GPUs' local indices and share), else `other_hop` of the (links, step, rate) hop; a hop
    inside a node as `other_hop` gives it is kept with the cluster too."""
    by_node: dict[str, list[int]] = {}
    for m, gpus in enumerate(members):
        by_node.setdefault(gpus[0].node, []).append(m)
    order = [m for ms in by_node.values() for m in ms]
    fabric = transport.fabric or ETHERNET
    # A hop leaving a node spreads over the NICs of all its members' GPUs
    # (`node_exit_path`): each node's GPUs and share, or None when its members are not all on it.
    spread = {}
    for node, ms in by_node.items():
        gpus = [g for i in ms for g in members[i]]
        spread[node] = None if any(g.node != node for g in gpus) else \
            (tuple(g.local_index for g in gpus), 1.0 / len(gpus))
    # A hop leaving a node depends only on its two nodes and sides: kept with the cluster.
    exits = cluster.derived(("ring exit hops", exit_hop, transport), dict)
    inner = cluster.derived(("ring hops inside a node", other_hop), dict)
    hops = []
    for k, m in enumerate(order):
        src, dst = members[m], members[order[(k + 1) % len(order)]]
        a, b = src[0].node, dst[0].node
        if a == b and spread[a] is not None:  # both TP groups on one node
            key = (a, _local(src), _local(dst))
            got = inner.get(key)
            if got is None:
                got = inner[key] = other_hop(_intra_node_hop(cluster, a, src, dst))
            hops.append(got)
            continue
        if a == b or spread[a] is None or spread[b] is None:
            caps = _capacities(cluster)
            path = group_path(cluster, transport, src, dst, caps) if a == b else node_exit_path(
                cluster, transport, [members[i] for i in by_node[a]],
                [members[i] for i in by_node[b]], caps)
            hops.append(other_hop((path.links, path.step_latency_s, path.idle_rate_bytes_per_s)))
            continue
        key = (a, spread[a], b, spread[b])
        got = exits.get(key)
        if got is None:
            got = exits[key] = exit_hop(cluster, transport, fabric, a, spread[a], b, spread[b])
        hops.append(got)
    return hops


def _exit_uses(cluster: Cluster, transport: Transport, fabric: str, a: str,
               side_a: tuple[tuple[int, ...], float], b: str, side_b: tuple[tuple[int, ...], float]
               ) -> tuple[PathUse, float, float]:
    """`ring_uses`' hop from node a to node b: their NIC sides' links and the uplink's, ring-step
    latency (s) and idle rate (bytes/s)."""
    out_links, _, out_step, out_rate = _side_uses(cluster, fabric, 0, a, *side_a)
    in_links, _, in_step, in_rate = _side_uses(cluster, fabric, 1, b, *side_b)
    links, step, rate = out_links + in_links, max(out_step, in_step), min(out_rate, in_rate)
    up = _uplink_use(cluster, transport, a, b)
    if up is not None:
        links += ((up[0], 1.0),)
        step += up[1]
        rate = min(rate, _capacities(cluster)[up[0]])
    return links, step, rate


def _exit_facts(cluster: Cluster, transport: Transport, fabric: str, a: str,
                side_a: tuple[tuple[int, ...], float], b: str,
                side_b: tuple[tuple[int, ...], float]) -> tuple[bool, float, float]:
    """`ring_hop_facts`' hop from node a to node b: it leaves a node (its sending side's links
    are NIC links), and `_exit_uses`' step latency and rate, from the sides' kinds."""
    _, out_step, out_rate = _side_figures(cluster, fabric, 0, a, *side_a)
    _, in_step, in_rate = _side_figures(cluster, fabric, 1, b, *side_b)
    step, rate = max(out_step, in_step), min(out_rate, in_rate)
    up = _uplink_use(cluster, transport, a, b)
    if up is not None:
        step += up[1]
        rate = min(rate, _capacities(cluster)[up[0]])
    return True, step, rate


def _local(gpus: Sequence[GpuRef]) -> tuple[int, ...]:
    """Each GPU's index on its node."""
    return tuple([g.local_index for g in gpus])


def _intra_node_hop(cluster: Cluster, node: str, src: Sequence[GpuRef], dst: Sequence[GpuRef]
                    ) -> tuple[PathUse, float, float]:
    """`group_path`'s hop from `src` to `dst`, all their GPUs on `node` (each GPU i sends 1/t of
    the bytes over its intra-node link to GPU i; no NIC, no uplink): (links with weights, ring-step
    latency s, idle rate bytes/s), kept with the cluster."""
    key = (node, _local(src), _local(dst))
    table = cluster.derived(("intra-node hops",), dict)
    got = table.get(key)
    if got is None:
        share = 1.0 / len(src)
        weights: dict[LinkId, float] = {}
        for a, b in zip(key[1], key[2], strict=True):
            for link in (("gpu", node, a, "tx"), ("gpu", node, b, "rx")):
                weights[link] = weights.get(link, 0.0) + share
        links, caps = tuple(weights.items()), _capacities(cluster)
        got = table[key] = (links, max(0.0, cluster.node(node).intra_link.step_latency_s),
                            min(caps[lk] / w for lk, w in links))
    return got


def _side_uses(cluster: Cluster, fabric: str, out: int, node: str, gpus: tuple[int, ...],
               share: float) -> tuple[PathUse, float, float, float]:
    """`nic_side` as (links with summed weights, latency s, ring-step latency s, the smallest
    capacity / weight over its links in bytes/s, `_side_figures`'), kept with the cluster."""
    key = (node, gpus, out, share)
    table = cluster.derived(("nic side uses", fabric), dict)
    got = table.get(key)
    if got is None:
        entries, latency, step = nic_side(cluster, fabric, out, node, gpus, share)
        links = tuple([(lk, w) for _, _, lk, w in entries])
        rate = _side_figures(cluster, fabric, out, node, gpus, share)[2]
        got = table[key] = (links, latency, step, rate)
    return got


def _uplink_use(cluster: Cluster, transport: Transport, a: str, b: str) -> tuple[LinkId, float] | None:
    """(uplink from node a's cluster to node b's, its latency s) when the transfer crosses one
    (as `group_path` adds it), else None."""
    if transport.kind is not TransportKind.TCP:
        return None
    table = cluster.derived(("uplink uses",), dict)  # by node pair, kept with the cluster
    if (a, b) not in table:
        ca, cb = cluster.node(a).cluster, cluster.node(b).cluster
        up = cluster.uplink(ca, cb)
        table[(a, b)] = None if up is None else (("uplink", ca, cb), up.latency_s)
    return table[(a, b)]


def _capacities(cluster: Cluster) -> dict[LinkId, float]:
    """`link_capacities` of the cluster, kept with it."""
    return cluster.derived(("link capacities",), lambda: link_capacities(cluster))
