"""The Holmes policy (arXiv 2312.03549) and its ablations, composed from four switchable parts:

1. NIC-aware rank order (section 3.1, `nic_aware_order`): nodes are ordered by NIC class
   (their RDMA fabric, or Ethernet only; a node on two fabrics at the boundary of their
   classes), so each pipeline stage's TP x DP ranks lie on one fabric; inside a class, slower
   nodes (GPU model, `scenario.variability`) come first, so a GPU model's nodes and the
   stragglers share stages; a CP group's ranks are consecutive (TP x CP of them, `plan`), so
   its ring stays on a node's NVLink or, spanning nodes, on one RDMA fabric, as TP stays on
   NVLink; so are an EP group's (EP x expert TP of them, Megatron-Core's expert order,
   `policies.groups`), which keeps its all-to-alls in one NIC class. A stage that spans
   classes cannot keep both its EP groups and its expert-DP groups (the same place in every
   EP group) on RDMA: there the order keeps the expert-DP groups instead (`expert_columns`)
   where the analytic estimate of the iteration says their gradient reductions cost more.
2. Automatic NIC selection (section 3.3): each group uses the best transport all its members share,
   so DP groups run on RDMA and only pipeline (and embedding) traffic crosses fabrics on Ethernet.
3. Self-adapting pipeline partition (section 3.2): layers per stage by search (`partition.py`),
   kept only where the schedule's critical path (`analytic.estimate_iteration`) says it beats
   the equal split, or where only it fits in memory: the search prices stages one by one and
   cannot see a pipeline send waiting for its receiver (on `mixed_ib_eth` its 20 + 16 layers
   estimate 7.63 s, 18 + 18 7.45 s).
4. Overlapped distributed optimizer (section 3.4): bucketed reduce-scatter during the last
   backward, parameter all-gather overlapped with the next forward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from holmes_sim.estimate.analytic import estimate_iteration, iteration_floor_s
from holmes_sim.hardware.cluster import ETHERNET, Cluster, Node
from holmes_sim.cost.transport import best_shared_transport, job_wide_transport
from holmes_sim.memo import IdentityMemo
from holmes_sim.plan import GpuRef, OptimizerMode, Plan
from holmes_sim.policies.base import (
    MEGATRON_SCHEDULES,
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
    schedules: tuple[str, ...] = MEGATRON_SCHEDULES
    """The Holmes fork's (Megatron-LM's, `Policy.schedules`); the references keep them."""

    def cluster_view(self, cluster: Cluster) -> Cluster:
        return cluster

    def plan(self, request: PlanRequest) -> Plan:
        nodes, rank_to_gpu = self.order(request)
        plan_with = self._layout(request, nodes, rank_to_gpu)
        equal = tuple(equal_partition(request.workload.num_layers, request.pp * request.num_chunks))
        first = plan_with(equal)
        if not self.adaptive_partition:
            return first
        groups, optimizer = first.groups, first.optimizer
        timer = StageTimer(request, rank_to_gpu, groups, optimizer)
        adaptive = plan_with(tuple(adaptive_partition(timer)))
        if adaptive.layers_per_stage == equal:
            return adaptive
        even = first
        priced = (request.cluster, request.workload, request.compute)
        best = estimate_iteration(adaptive, *priced).iteration_s
        # The equal split loses when its iteration's lower bound reaches the adaptive split's
        # iteration (ties keep the adaptive split); the margin covers the two sums' rounding.
        reach = best / (1.0 - _MARGIN)
        if iteration_floor_s(even, *priced, reach=reach) * (1.0 - _MARGIN) >= best:
            return adaptive
        if estimate_iteration(even, *priced).iteration_s >= best:
            return adaptive
        # A faster equal split that does not fit loses to an adaptive split that does.
        keep_even = timer.memory(equal).fits or not timer.memory(adaptive.layers_per_stage).fits
        return even if keep_even else adaptive

    def order(self, request: PlanRequest) -> tuple[tuple[Node, ...], tuple[GpuRef, ...]]:
        """The nodes and their GPUs in rank order: the listing's, or `nic_aware_order` with
        each stage that spans NIC classes laid out for its expert-DP groups instead
        (`expert_columns`) where the estimate says the iteration is faster."""
        if not self.nic_aware_order:
            return rank_order(request.cluster, "listing", list)
        best = rank_order(request.cluster, "nic-aware", nic_aware_order)
        best_s, spread = None, ()
        for s in _split_stages(best[0], request):
            nodes = expert_columns(best[0], request, s)
            if nodes is None:
                continue
            name = f"nic-aware, expert columns {_degrees(request)} {(*spread, s)}"
            tried = rank_order(request.cluster, name, lambda _, nodes=nodes: nodes)
            if best_s is None:
                best_s = self._equal_s(request, *best)
            tried_s = self._equal_s(request, *tried)
            # Only a clear gain moves nodes; the margin covers the sums' rounding.
            if tried_s < best_s * (1.0 - _MARGIN):
                best, best_s, spread = tried, tried_s, (*spread, s)
        return best

    def _equal_s(self, request: PlanRequest, nodes: tuple[Node, ...],
                 rank_to_gpu: tuple[GpuRef, ...]) -> float:
        """The estimated iteration of this rank order's plan with the equal split."""
        layers = equal_partition(request.workload.num_layers, request.pp * request.num_chunks)
        plan = self._layout(request, nodes, rank_to_gpu)(tuple(layers))
        return estimate_iteration(plan, request.cluster, request.workload,
                                  request.compute).iteration_s

    def _layout(self, request: PlanRequest, nodes: tuple[Node, ...],
                rank_to_gpu: tuple[GpuRef, ...]) -> Callable[[tuple[int, ...]], Plan]:
        """The plan of this rank order for a layer split: groups, optimizer and notes."""
        check_tp_within_nodes(rank_to_gpu, request.tp)
        optimizer = OptimizerMode.DISTRIBUTED_OVERLAPPED if self.overlapped_optimizer \
            else OptimizerMode.DISTRIBUTED
        # The chooser depends on the policy's switches and the cluster only: key it by the policy.
        groups = build_groups(request.cluster, rank_to_gpu, request.tp, request.pp, request.dp,
                              request.num_chunks, request.workload.tie_embeddings,
                              self.chooser(request, rank_to_gpu), chooser_key=self, cp=request.cp,
                              ep=request.workload.ep,
                              etp=request.workload.expert_tp(request.tp))
        notes = _NOTES.get((nodes,), _degrees(request), lambda: _notes(nodes, request))

        def plan_with(layers: tuple[int, ...]) -> Plan:
            return Plan(self.name, request.tp, request.pp, request.dp, rank_to_gpu, layers,
                        request.schedule_kind, request.num_microbatches, request.num_chunks,
                        optimizer, groups, notes, cp=request.cp)
        return plan_with

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


def expert_columns(nodes: Sequence[Node], request: PlanRequest, s: int
                   ) -> tuple[Node, ...] | None:
    """`nodes` with stage s's nodes laid out for its expert-DP groups, or None where that
    changes nothing (or the stage does not hold whole nodes of one GPU count).

    Stage-local rank r = j + etp (e + ep k) (`groups.GroupBuilder._expert_rank`): an EP group
    is a block of B = ep x etp consecutive ranks, m = B / G nodes of G GPUs, and an expert-DP
    group takes the same place in each of the stage's edp blocks, so it holds the nodes at one
    offset c < m of every block. `nic_aware_order` fills blocks class by class (EP groups on one
    fabric); here the stage's nodes, in that order, fill the offsets column by column (node
    c edp + k at block k, offset c), so each expert-DP group is on one fabric where every class
    holds a multiple of edp of the stage's nodes, and the EP groups then span classes."""
    bounds = _stage_bounds(nodes, request.tp * request.dp)
    if bounds is None or request.workload.ep == 1:
        return None
    a, b = bounds[s], bounds[s + 1]
    gpus = {n.num_gpus for n in nodes[a:b]}
    block = request.workload.ep * request.workload.expert_tp(request.tp)
    m = block // min(gpus)
    if len(gpus) > 1 or block % min(gpus) or m <= 1 or (b - a) == m:
        return None
    edp = (b - a) // m
    stage = nodes[a:b]
    return (*nodes[:a], *(stage[c * edp + k] for k in range(edp) for c in range(m)), *nodes[b:])


def _stage_bounds(nodes: Sequence[Node], per_stage: int) -> list[int] | None:
    """The index of each stage's first node and of the end, or None when a node holds ranks of
    two stages."""
    bounds, ranks = [0], 0
    for k, n in enumerate(nodes):
        ranks += n.num_gpus
        if ranks % per_stage == 0:
            bounds.append(k + 1)
        if ranks // per_stage != len(bounds) - 1:
            return None
    return bounds


def _split_stages(nodes: Sequence[Node], request: PlanRequest) -> list[int]:
    """The stages whose nodes share no RDMA fabric (their DP groups, and some of their EP or
    expert-DP groups, leave RDMA), when the model has expert-DP groups (ep > 1, edp > 1)."""
    w = request.workload
    per_stage = request.tp * request.dp
    if w.ep == 1 or per_stage // (w.ep * w.expert_tp(request.tp)) == 1:
        return []
    bounds = _stage_bounds(nodes, per_stage)
    if bounds is None:
        return []
    return [s for s in range(len(bounds) - 1) if not frozenset.intersection(
        *(frozenset(n.rdma_fabrics) for n in nodes[bounds[s]:bounds[s + 1]]))]


def _degrees(request: PlanRequest) -> tuple[int, ...]:
    """What a rank order's stages, groups and notes depend on besides the order."""
    return (request.tp, request.pp, request.dp, request.cp, request.workload.ep,
            request.workload.ep_replicas)


def compute_rate(node: Node) -> float:
    """The sustained dense FLOP/s of one of the node's GPUs at its speed (`Node.speed`)."""
    return node.gpu.peak_flop_per_s * node.gpu.compute_efficiency * node.speed


_MARGIN = 1e-9
"""Relative margin of `iteration_floor_s` below the estimate: far above the rounding of a sum
of a few thousand durations (about 1e-13), far below the splits' differences."""


_NOTES: IdentityMemo[tuple[str, ...]] = IdentityMemo()


def _notes(nodes: Sequence[Node], request: PlanRequest) -> tuple[str, ...]:
    """Say which stages span NIC classes with no RDMA fabric common to all their nodes (their DP
    groups then leave RDMA), which CP and EP groups do (their rings and all-to-alls), and which
    expert-DP groups (their expert-gradient reductions)."""
    per_stage, ring, w = request.tp * request.dp, request.tp * request.cp, request.workload
    ep = request.tp * w.ep_replicas  # an EP group's ranks: ep x etp
    edp = per_stage // ep
    gpus = [k for k, n in enumerate(nodes) for _ in range(n.num_gpus)]
    classes = nic_classes(nodes)
    fabrics = [frozenset(n.rdma_fabrics) for n in nodes]

    def apart(ranks: Iterable[int]) -> list[str]:
        """The NIC classes of these ranks when their nodes share no RDMA fabric, else []."""
        held = {gpus[r] for r in ranks}
        spanned = sorted({classes[k] for k in held})
        return spanned if len(spanned) > 1 and not frozenset.intersection(
            *(fabrics[k] for k in held)) else []

    notes = []
    for s in range(request.pp):
        first, end = s * per_stage, (s + 1) * per_stage
        if spanned := apart(range(first, end)):
            notes.append(f"stage {s} spans NIC classes {', '.join(spanned)}")
        split = [k for k in range(first, end, ring) if apart(range(k, k + ring))] \
            if request.cp > 1 else []
        if split:  # a block of tp x cp ranks holds tp CP groups, each over the block's nodes
            notes.append(f"stage {s}: {len(split) * request.tp} CP group(s) span NIC classes "
                         f"(from rank {split[0]}); their rings leave RDMA")
        split = [k for k in range(first, end, ep) if apart(range(k, k + ep))] \
            if w.ep > 1 else []
        if split:  # a block of ep x etp ranks holds etp EP groups, each over its nodes
            notes.append(f"stage {s}: {len(split) * w.expert_tp(request.tp)} EP group(s) span "
                         f"NIC classes (from rank {split[0]}); their all-to-alls leave RDMA")
        # An expert-DP group: the ranks at one offset of every EP block (`expert_columns`).
        split = [k for k in range(first, first + ep) if apart(range(k, end, ep))] \
            if w.ep > 1 and edp > 1 else []
        if split:
            notes.append(f"stage {s}: {len(split)} expert-DP group(s) span NIC classes (from "
                         f"rank {split[0]}); their expert-gradient reductions leave RDMA")
    return tuple(notes)
