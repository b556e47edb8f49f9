"""Persistent hardware variability applied to a built cluster: per-GPU compute speeds (a seeded
spread and named stragglers) and NICs and uplinks below their rate (`spec.hardware.VariabilitySpec`).

A GPU's speed scales every op it runs (compute time / speed); a NIC's or uplink's factor scales its
bandwidth, so the engine's link capacities, the analytic estimate and the policies all see it.
A seeded spread draws one speed per GPU, node by node in cluster order, from one NumPy
`Generator` seeded with `SeedSequence(seed)`: the same seed gives the same speeds. Entries that
name the same hardware multiply (a slow GPU in a slow spread, a port slowed twice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from holmes_sim.errors import FieldError
from holmes_sim.hardware.cluster import ETHERNET, Cluster, Nic, Node
from holmes_sim.spec.hardware import SlowLinkSpec, VariabilitySpec

_CLIP_SIGMAS = 3.0
"""Normal draws are clipped to this many standard deviations (speeds stay in a sane range)."""


@dataclass(frozen=True, slots=True)
class Straggler:
    """One piece of slow hardware, for reports: what it is and its factor."""

    kind: str
    """"gpu" (compute speed), "nic" or "uplink" (rate), "spread", or "all" (every one together,
    for reports)."""
    where: str
    """Node name (gpu, nic) or "a<->b" (uplink)."""
    what: str
    """GPU indices or NIC names, "" for an uplink."""
    factor: float


def is_uniform(spec: VariabilitySpec) -> bool:
    """Whether `spec` changes nothing (no spread, no slow GPUs, links or uplinks)."""
    return spec.compute_spread == 0 and not (spec.slow_gpus or spec.slow_links or spec.slow_uplinks)


def apply_variability(cluster: Cluster, spec: VariabilitySpec, seed: int) -> Cluster:
    """`cluster` with the speeds and rates of `spec` (`seed`: the spread's seed when the spec
    gives none); the same cluster when `spec` changes nothing.

    Raises:
        FieldError: a named node, GPU, NIC, cluster or uplink that does not exist.
    """
    if is_uniform(spec):
        return cluster
    speeds = _drawn_speeds(cluster, spec, seed if spec.seed is None else spec.seed)
    _apply_slow_gpus(cluster, spec, speeds)
    nic_factors = _nic_factors(cluster, spec)
    nodes = tuple(_node_with(n, speeds[n.name], nic_factors.get(n.name, {})) for n in cluster.nodes)
    uplinks = list(cluster.uplinks)
    for i, u in enumerate(spec.slow_uplinks):
        k = next((k for k, up in enumerate(uplinks) if set(up.clusters) == set(u.clusters)), None)
        if k is None:
            raise FieldError(f"variability.slow_uplinks[{i}].clusters", f"no inter-cluster link "
                             f"joins {u.clusters[0]} and {u.clusters[1]}; name two joined clusters")
        uplinks[k] = replace(uplinks[k], bandwidth_bytes_per_s=uplinks[k].bandwidth_bytes_per_s
                             * u.rate_factor)
    return cluster.with_nodes(nodes, uplinks=tuple(uplinks))


def stragglers(spec: VariabilitySpec) -> list[Straggler]:
    """The slow hardware of `spec`: named GPUs, NICs and uplinks in the order given, then the
    spread (kind "spread", factor: its coefficient of variation) if any."""
    out = [Straggler("gpu", g.node, "all GPUs" if g.gpus is None else
                     "GPU " + ",".join(map(str, g.gpus)), g.speed_factor) for g in spec.slow_gpus]
    out += [Straggler("nic", lk.node or f"cluster {lk.cluster}", lk.nic or lk.fabric or "all NICs",
                      lk.rate_factor) for lk in spec.slow_links]
    out += [Straggler("uplink", "<->".join(u.clusters), "", u.rate_factor)
            for u in spec.slow_uplinks]
    if spec.compute_spread > 0:
        out.append(Straggler("spread", "every GPU", spec.distribution, spec.compute_spread))
    return out


def without(spec: VariabilitySpec, index: int) -> VariabilitySpec:
    """`spec` less its `index`-th item of `stragglers(spec)` (what-if for reports)."""
    parts = {"slow_gpus": list(spec.slow_gpus), "slow_links": list(spec.slow_links),
             "slow_uplinks": list(spec.slow_uplinks)}
    for name, items in parts.items():
        if index < len(items):
            del items[index]
            return replace(spec, **{name: tuple(items)})
        index -= len(items)
    return replace(spec, compute_spread=0.0)


def _drawn_speeds(cluster: Cluster, spec: VariabilitySpec, seed: int) -> dict[str, list[float]]:
    """Node name -> each GPU's speed drawn from the spread (all 1 without one)."""
    total = cluster.num_gpus
    if spec.compute_spread == 0:
        flat = np.ones(total)
    else:
        rng = np.random.default_rng(np.random.SeedSequence(seed))
        if spec.distribution == "normal":
            z = np.clip(rng.standard_normal(total), -_CLIP_SIGMAS, _CLIP_SIGMAS)
        else:  # uniform on [-sqrt(3), sqrt(3)]: standard deviation 1
            z = rng.uniform(-math.sqrt(3), math.sqrt(3), total)
        flat = 1.0 + spec.compute_spread * z
    out, start = {}, 0
    for n in cluster.nodes:
        out[n.name] = [float(v) for v in flat[start:start + n.num_gpus]]
        start += n.num_gpus
    return out


def _apply_slow_gpus(cluster: Cluster, spec: VariabilitySpec, speeds: dict[str, list[float]]) -> None:
    for i, g in enumerate(spec.slow_gpus):
        path = f"variability.slow_gpus[{i}]"
        node = _node(cluster, g.node, f"{path}.node")
        gpus = range(node.num_gpus) if g.gpus is None else g.gpus
        if not gpus or len(set(gpus)) != len(gpus):
            raise FieldError(f"{path}.gpus", "list each slow GPU's local index once, or remove "
                                             "`gpus` for the whole node")
        for k, local in enumerate(gpus):
            if not 0 <= local < node.num_gpus:
                raise FieldError(f"{path}.gpus[{k}]", f"node {node.name} has GPUs 0.."
                                 f"{node.num_gpus - 1}; give a local index in that range")
            speeds[node.name][local] *= g.speed_factor


def _nic_factors(cluster: Cluster, spec: VariabilitySpec) -> dict[str, dict[str, float]]:
    """Node name -> NIC name -> rate factor, for every NIC a `slow_links` entry names."""
    out: dict[str, dict[str, float]] = {}
    for i, lk in enumerate(spec.slow_links):
        path = f"variability.slow_links[{i}]"
        nodes = _link_nodes(cluster, lk, path)
        matched = 0
        for node in nodes:
            for nic in node.nics:
                if (lk.nic is None or nic.name == lk.nic) and (lk.fabric is None or nic.fabric == lk.fabric):
                    factors = out.setdefault(node.name, {})
                    factors[nic.name] = factors.get(nic.name, 1.0) * lk.rate_factor
                    matched += 1
        if not matched:
            raise _no_such_nic(nodes, lk, path)
    return out


def _no_such_nic(nodes: list[Node], lk: SlowLinkSpec, path: str) -> FieldError:
    """The error for a slow link that matches no NIC of `nodes`: the NIC names those nodes
    have, by fabric (RDMA fabrics first, Ethernet last). It blames `fabric` when a NIC of the
    given name exists, else `nic`."""
    names = {nic.name for n in nodes for nic in n.nics}
    field = "nic" if lk.nic is not None and lk.nic not in names else \
        "fabric" if lk.fabric is not None else "nic"
    wanted = " ".join(([f"named {lk.nic}"] if lk.nic is not None else [])
                      + ([f"on fabric {lk.fabric}"] if lk.fabric is not None else []))
    on: dict[str, list[str]] = {}
    for nic in (nic for n in nodes for nic in n.nics):
        if nic.name not in on.setdefault(nic.fabric, []):
            on[nic.fabric].append(nic.name)
    have = ", ".join(f"{', '.join(nics)} (fabric {fabric})"
                     for fabric, nics in sorted(on.items(), key=lambda kv: kv[0] == ETHERNET))
    who = lk.node or f"cluster {lk.cluster}"
    holder = f"{lk.node} has" if lk.node else f"the nodes of cluster {lk.cluster} have"
    return FieldError(f"{path}.{field}", f"no NIC of {who} is {wanted}; {holder} {have}: name "
                                         "one of those NICs or fabrics")


def _link_nodes(cluster: Cluster, lk: SlowLinkSpec, path: str) -> list[Node]:
    if (lk.node is None) == (lk.cluster is None):
        raise FieldError(path, "give exactly one of `node` (one node's NICs) or `cluster` (every "
                               "node of a cluster)")
    if lk.node is not None:
        return [_node(cluster, lk.node, f"{path}.node")]
    nodes = [n for n in cluster.nodes if n.cluster == lk.cluster]
    if not nodes:
        names = ", ".join(dict.fromkeys(n.cluster for n in cluster.nodes))
        raise FieldError(f"{path}.cluster", f"no cluster named '{lk.cluster}' (clusters: {names})")
    return nodes


def _node(cluster: Cluster, name: str, path: str) -> Node:
    try:
        return cluster.node(name)
    except KeyError:
        raise FieldError(path, f"no node named '{name}' (nodes are named <group name or cluster>-"
                               f"<index>, here {_node_names(cluster.nodes)})") from None


_NAMED_GROUPS = 8
"""Node groups an unknown node's error lists; it counts the rest."""


def _node_names(nodes: tuple[Node, ...]) -> str:
    """The nodes' names, each run of one group's consecutive indices as "a-0..a-11", the first
    `_NAMED_GROUPS` runs and a count of the others."""
    runs: list[list] = []  # [prefix, first name, last name, last index]
    for n in nodes:
        prefix, _, index = n.name.rpartition("-")
        k = int(index) if index.isdigit() else None
        last = runs[-1] if runs else None
        if last and k is not None and last[0] == prefix and last[3] is not None and \
                k == last[3] + 1:
            last[2], last[3] = n.name, k
        else:
            runs.append([prefix, n.name, n.name, k])
    names = [a if a == b else f"{a}..{b}" for _, a, b, _ in runs[:_NAMED_GROUPS]]
    if len(runs) > _NAMED_GROUPS:
        names.append(f"and {len(runs) - _NAMED_GROUPS} more groups")
    return ", ".join(names)


def _node_with(node: Node, speeds: list[float], nic_factors: dict[str, float]) -> Node:
    nics = tuple(_slowed(n, nic_factors.get(n.name, 1.0)) for n in node.nics)
    gpu_speeds = () if all(v == 1.0 for v in speeds) else tuple(speeds)
    if not gpu_speeds and not nic_factors:
        return node
    return replace(node, gpu_speeds=gpu_speeds, nics=nics)


def _slowed(nic: Nic, factor: float) -> Nic:
    if factor == 1.0:
        return nic
    return replace(nic, bandwidth_bytes_per_s=nic.bandwidth_bytes_per_s * factor)
