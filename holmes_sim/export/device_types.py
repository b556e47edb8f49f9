"""The Holmes fork's device types of a plan's nodes and stages: the fork runs each pipeline
stage on one device type and sets each group's NCCL environment from its members' types
(`launch.holmes_config`), so a node's type must be the fabric its stage's groups run on."""

from __future__ import annotations

from holmes_sim.hardware.cluster import Cluster, Node
from holmes_sim.plan import Plan
from holmes_sim.policies.holmes import nic_classes


def device_types(plan: Plan, cluster: Cluster) -> tuple[dict[str, str], list[str] | str]:
    """Each node's device type for the Holmes fork (node name -> an RDMA fabric or Ethernet) and
    each pipeline stage's, or why a stage has none.

    A node's type is its NIC class (`policies.holmes.nic_classes`: its fabric that reaches the
    most GPUs); a stage whose nodes are of several classes but share an RDMA fabric runs its DP
    groups on it (the plan's NIC selection), so its nodes all take that fabric (of several, the
    class of most of the stage's GPUs, then the first by name). A stage whose nodes share none,
    or a node holding stages of two types, cannot be expressed."""
    types = dict(zip((n.name for n in cluster.nodes), nic_classes(cluster.nodes)))
    per_stage = len(plan.rank_to_gpu) // plan.pp
    stages: list[str] = []
    fixed: dict[str, tuple[str, int]] = {}  # node -> (type, first stage that set it)
    for s in range(plan.pp):
        held = [cluster.node(n) for n in dict.fromkeys(
            g.node for g in plan.rank_to_gpu[s * per_stage:(s + 1) * per_stage])]
        kind = _stage_type(held, types)
        if kind is None:
            spanned = sorted({types[n.name] for n in held})
            return types, f"pipeline stage {s} spans device types {', '.join(spanned)}"
        for n in held:
            other, t = fixed.setdefault(n.name, (kind, s))
            if other != kind:
                return types, (f"node {n.name} holds pipeline stages {t} ({other}) and {s} "
                               f"({kind}) of different device types")
        stages.append(kind)
    types.update((name, kind) for name, (kind, _) in fixed.items())
    return types, stages


def _stage_type(held: list[Node], types: dict[str, str]) -> str | None:
    """The device type of a stage of these nodes (`device_types`), or None."""
    classes = {types[n.name] for n in held}
    if len(classes) == 1:
        return classes.pop()
    shared = frozenset.intersection(*(frozenset(n.rdma_fabrics) for n in held))
    if not shared:
        return None
    return max(sorted(shared), key=lambda f: sum(n.num_gpus for n in held if types[n.name] == f))
