"""The Holmes policy (arXiv 2312.03549) and its ablations, composed from four switchable parts:

1. NIC-aware rank order (section 3.1, `nic_aware_order`): nodes are ordered by NIC class
   (their RDMA fabric, or Ethernet only; a node on two fabrics at the boundary of their
   classes), so each pipeline stage's TP x DP ranks lie on one fabric; inside a class, slower
   nodes (GPU model, `scenario.variability`) come first, so a GPU model's nodes and the
   stragglers share stages; a CP group's ranks are consecutive (TP x CP of them, `plan`), so
   its ring stays on a node's NVLink or, spanning nodes, on one RDMA fabric, as TP stays on
   NVLink; so are an EP group's (EP x expert TP of them, Megatron-Core's expert order,
   `policies.groups`), which keeps its all-to-alls in one NIC class.
2. Automatic NIC selection (section 3.3): each group uses the best transport all its members share,
   so DP groups run on RDMA and only pipeline (and embedding) traffic crosses fabrics on Ethernet.
3. Self-adapting pipeline partition (section 3.2): layers per stage by search (`partition.py`),
   kept only where the schedule's critical path (`analytic.estimate_iteration`) says it beats
   the equal split: the search prices stages one by one and cannot see a pipeline send waiting
   for its receiver (on `mixed_ib_eth` its 20 + 16 layers estimate 7.68 s, 18 + 18 7.49 s).
4. Overlapped distributed optimizer (section 3.4): bucketed reduce-scatter during the last
   backward, parameter all-gather overlapped with the next forward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from holmes_sim.estimate.analytic import estimate_iteration, iteration_floor_s
from holmes_sim.hardware.cluster import ETHERNET, Cluster, Node
from holmes_sim.cost.transport import best_shared_transport, job_wide_transport
from holmes_sim.memo import IdentityMemo
from holmes_sim.plan import GpuRef, OptimizerMode, Plan
from holmes_sim.policies.base import (
    PlanRequest,
    build_groups,
    check_tp_within_nodes,
    job_fabric,
    equal_partition,
    rank_order,
)
from holmes_sim.policies.groups import TransportChooser
from holmes_sim.policies.partition import StageTimer, adaptive_partition


@dataclass(frozen=True)
class HolmesPolicy:
    """Holmes with each mechanism switchable (all on: the full policy)."""

    name: str = "holmes"
    description: str = "Holmes: NIC-aware order, per-group NIC selection, adaptive partition, overlap"
    nic_aware_order: bool = True
    nic_selection: bool = True
    adaptive_partition: bool = True
    overlapped_optimizer: bool = True

    def cluster_view(self, cluster: Cluster) -> Cluster:
        return cluster

    def plan(self, request: PlanRequest) -> Plan:
        nodes, rank_to_gpu = rank_order(request.cluster, "nic-aware", nic_aware_order) \
            if self.nic_aware_order else rank_order(request.cluster, "listing", list)
        check_tp_within_nodes(rank_to_gpu, request.tp)
        optimizer = OptimizerMode.DISTRIBUTED_OVERLAPPED if self.overlapped_optimizer \
            else OptimizerMode.DISTRIBUTED
        # The chooser depends on the policy's switches and the cluster only: key it by the policy.
        groups = build_groups(request.cluster, rank_to_gpu, request.tp, request.pp, request.dp,
                              request.num_chunks, request.workload.tie_embeddings,
                              self.chooser(request, rank_to_gpu), chooser_key=self, cp=request.cp,
                              ep=request.workload.ep,
                              etp=request.workload.expert_tp(request.tp))
        equal = tuple(equal_partition(request.workload.num_layers, request.pp * request.num_chunks))
        notes = _NOTES.get((nodes,), (request.tp, request.pp, request.dp, request.cp,
                                      request.workload.ep, request.workload.ep_replicas),
                           lambda: _notes(nodes, request))

        def plan_with(layers: tuple[int, ...]) -> Plan:
            return Plan(self.name, request.tp, request.pp, request.dp, rank_to_gpu, layers,
                        request.schedule_kind, request.num_microbatches, request.num_chunks,
                        optimizer, groups, notes, cp=request.cp)

        if not self.adaptive_partition:
            return plan_with(equal)
        adaptive = plan_with(tuple(adaptive_partition(StageTimer(request, rank_to_gpu, groups,
                                                                 optimizer))))
        if adaptive.layers_per_stage == equal:
            return adaptive
        even = plan_with(equal)
        priced = (request.cluster, request.workload, request.compute)
        best = estimate_iteration(adaptive, *priced).iteration_s
        # The equal split loses when its iteration's lower bound reaches the adaptive split's
        # iteration (ties keep the adaptive split); the margin covers the two sums' rounding.
        reach = best / (1.0 - _MARGIN)
        if iteration_floor_s(even, *priced, reach=reach) * (1.0 - _MARGIN) >= best:
            return adaptive
        return even if estimate_iteration(even, *priced).iteration_s < best else adaptive

    def chooser(self, request: PlanRequest, rank_to_gpu: Sequence[GpuRef]) -> TransportChooser:
        cluster = request.cluster
        if self.nic_selection:
            return lambda gpus: best_shared_transport(cluster, gpus)
        fabric = job_fabric(cluster, rank_to_gpu)
        return lambda gpus: job_wide_transport(cluster, gpus, fabric)


def nic_classes(nodes: Sequence[Node]) -> list[str]:
    """Each node's NIC class: its RDMA fabric, or Ethernet when it has none; a node on several
    fabrics takes the one that reaches the most GPUs (ties: the first by name), whatever order
    it lists its NICs in."""
    reach: Counter[str] = Counter()
    for n in nodes:
        reach.update(dict.fromkeys(n.rdma_fabrics, n.num_gpus))
    return [max(sorted(n.rdma_fabrics), key=reach.__getitem__) if n.rdma_fabrics else ETHERNET
            for n in nodes]


def nic_aware_order(nodes: Sequence[Node]) -> list[Node]:
    """Nodes grouped by NIC class (`_class_order`). Inside a class, a node that is also on the
    previous class's fabric comes first and one on the next class's last, so a stage that
    straddles the boundary can keep its DP groups on a fabric all its nodes share; then slower
    nodes first (`compute_rate`: the GPU model's and `scenario.variability`'s), else stable: a
    model's nodes stay together and stragglers share the class's first pipeline stage, whose
    layers the adaptive partition can cut, instead of slowing several stages (a pipeline runs
    at its slowest stage), whichever order the scenario lists them in."""
    classes = nic_classes(nodes)
    order = _class_order(nodes, classes)
    place = {c: i for i, c in enumerate(order)}

    def key(k: int) -> tuple:
        i, fabrics = place[classes[k]], nodes[k].rdma_fabrics
        side = 0 if i > 0 and order[i - 1] in fabrics else \
            2 if i + 1 < len(order) and order[i + 1] in fabrics else 1
        return i, side, compute_rate(nodes[k]), k

    return [nodes[k] for k in sorted(range(len(nodes)), key=key)]


def _class_order(nodes: Sequence[Node], classes: Sequence[str]) -> list[str]:
    """The NIC classes, those whose GPU count has the largest power-of-two factor first, then
    those with more GPUs, then in order of first appearance: a stage's GPU count is mostly a
    power of two, so class boundaries then fall on stage boundaries where they can, and fewer
    stages span classes. The class after each is one that a node of either class on both
    fabrics links it to, where there is one."""
    size: Counter[str] = Counter()
    for n, c in zip(nodes, classes):
        size[c] += n.num_gpus
    ranked = sorted(dict.fromkeys(classes), key=lambda c: (-(size[c] & -size[c]), -size[c]))
    links = {frozenset((c, f)) for n, c in zip(nodes, classes) for f in n.rdma_fabrics if f != c}
    order = [ranked.pop(0)] if ranked else []
    while ranked:
        last = order[-1]
        order.append(next((c for c in ranked if frozenset((last, c)) in links), ranked[0]))
        ranked.remove(order[-1])
    return order


def compute_rate(node: Node) -> float:
    """The sustained dense FLOP/s of one of the node's GPUs at its speed (`Node.speed`)."""
    return node.gpu.peak_flop_per_s * node.gpu.compute_efficiency * node.speed


_MARGIN = 1e-9
"""Relative margin of `iteration_floor_s` below the estimate: far above the rounding of a sum
of a few thousand durations (about 1e-13), far below the splits' differences."""


_NOTES: IdentityMemo[tuple[str, ...]] = IdentityMemo()


def _notes(nodes: Sequence[Node], request: PlanRequest) -> tuple[str, ...]:
    """Say which stages span NIC classes with no RDMA fabric common to all their nodes (their DP
    groups then leave RDMA), and which CP and EP groups do (their rings and all-to-alls)."""
    per_stage, ring = request.tp * request.dp, request.tp * request.cp
    ep = request.tp * request.workload.ep_replicas  # an EP group's ranks: ep x etp
    gpus = [k for k, n in enumerate(nodes) for _ in range(n.num_gpus)]
    classes = nic_classes(nodes)
    fabrics = [frozenset(n.rdma_fabrics) for n in nodes]

    def apart(a: int, b: int) -> list[str]:
        """The NIC classes of ranks a..b-1 when their nodes share no RDMA fabric, else []."""
        held = set(gpus[a:b])
        spanned = sorted({classes[k] for k in held})
        return spanned if len(spanned) > 1 and not frozenset.intersection(
            *(fabrics[k] for k in held)) else []

    notes = []
    for s in range(request.pp):
        first, end = s * per_stage, (s + 1) * per_stage
        if spanned := apart(first, end):
            notes.append(f"stage {s} spans NIC classes {', '.join(spanned)}")
        split = [k for k in range(first, end, ring) if apart(k, k + ring)] \
            if request.cp > 1 else []
        if split:
            notes.append(f"stage {s}: {len(split)} CP group(s) span NIC classes (from rank "
                         f"{split[0]}); their rings leave RDMA")
        split = [k for k in range(first, end, ep) if apart(k, k + ep)] \
            if request.workload.ep > 1 else []
        if split:
            notes.append(f"stage {s}: {len(split)} EP group(s) span NIC classes (from rank "
                         f"{split[0]}); their all-to-alls leave RDMA")
    return tuple(notes)
