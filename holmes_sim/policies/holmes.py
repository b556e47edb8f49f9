"""The Holmes policy (arXiv 2312.03549) and its ablations, composed from four switchable parts:

1. NIC-aware rank order (section 3.1, `nic_aware_order`): nodes are ordered by NIC class
   (their RDMA fabric, or Ethernet only; a node on two fabrics at the boundary of their
   classes), so each pipeline stage's TP x DP ranks lie on one fabric where an order of the
   classes allows (`_Classes.best_orders`: the orders with the fewest stages and CP and EP
   blocks off RDMA, then across clusters; `plan` keeps the one it estimates fastest); inside
   a class, slower nodes (GPU model, `scenario.variability`) come first, so a GPU model's
   nodes and the stragglers share stages; a CP group's ranks are consecutive (TP x CP of
   them, `plan`), so its ring stays on a node's NVLink or, spanning nodes, on one RDMA
   fabric, as TP stays on NVLink; so are an EP group's (EP x expert TP of them,
   Megatron-Core's expert order, `policies.groups`), which keeps its all-to-alls in one NIC
   class. A stage that spans
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

from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import permutations

from holmes_sim.estimate.analytic import Siblings, estimate_iteration, iteration_floor_s
from holmes_sim.estimate.memory import memory_report
from holmes_sim.hardware.cluster import ETHERNET, Cluster, Node
from holmes_sim.cost.ops import op_costs
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
        """Of the plans of the candidate rank orders (`orders`; past `_PARTITIONED` of them,
        those whose equal split leads, `_leading`), those that fit in GPU memory (all when none
        does), the one the analytic estimate of the iteration prices fastest (ties, within the
        sums' rounding: the first)."""
        orders = self.orders(request)
        if len(orders) == 1:
            return self._plan(request, *orders[0])[0]
        priced = (request.cluster, request.workload, request.compute)
        costs = op_costs(*priced, request.tp)

        def fits(plan: Plan) -> bool:
            return memory_report(plan, request.cluster, request.workload, costs).fits
        # The orders' plans of one split differ only in placement: their estimates share
        # prices (`analytic.Siblings`).
        siblings: dict[tuple[int, ...], Siblings] = {}
        firsts: list = [None] * len(orders)
        if len(orders) > _PARTITIONED:
            orders, firsts = self._leading(request, orders, fits, siblings)
        planned = [self._plan(request, *ranks, first, siblings)
                   for ranks, first in zip(orders, firsts)]
        planned = [(p, s) for p, s in planned if fits(p)] or planned
        best, best_s = None, 0.0
        for plan, plan_s in planned:
            if plan_s is None:
                plan_s = estimate_iteration(plan, *priced, siblings.setdefault(
                    plan.layers_per_stage, Siblings())).iteration_s
            if best is None or plan_s < best_s * (1.0 - _MARGIN):
                best, best_s = plan, plan_s
        return best

    def _leading(self, request: PlanRequest, orders: list, fits: Callable[[Plan], bool],
                 siblings: dict[tuple[int, ...], Siblings]
                 ) -> tuple[list, list[tuple[Plan, float | None]]]:
        """The `_PARTITIONED` of `orders` whose plans with the equal split lead: those that
        `fits` first, then by the analytic estimate (ties keep their order), so that only they
        pay the partition search; with each one's equal-split plan and its estimate (s; None
        where the ranking needed none: a group of orders, fitting or not, kept whole).
        `siblings`: the estimates' shared prices by split."""
        equal = tuple(equal_partition(request.workload.num_layers, request.pp * request.num_chunks))
        plans = [self._layout(request, *ranks)(equal) for ranks in orders]
        fit = [fits(plan) for plan in plans]
        estimates: list[float | None] = [None] * len(orders)
        kept, slots = [], _PARTITIONED
        for group in ([k for k in range(len(orders)) if fit[k]],
                      [k for k in range(len(orders)) if not fit[k]]):
            if len(group) <= slots:
                kept, slots = kept + group, slots - len(group)
                continue
            if slots:  # only a group the cut splits is ranked by estimate
                shared = siblings.setdefault(equal, Siblings())
                for k in group:
                    estimates[k] = estimate_iteration(plans[k], request.cluster, request.workload,
                                                      request.compute, shared).iteration_s
                kept += sorted(group, key=estimates.__getitem__)[:slots]
            break
        kept.sort()
        return [orders[k] for k in kept], [(plans[k], estimates[k]) for k in kept]

    def _plan(self, request: PlanRequest, nodes: tuple[Node, ...],
              rank_to_gpu: tuple[GpuRef, ...], first: tuple[Plan, float | None] | None = None,
              siblings: dict[tuple[int, ...], Siblings] | None = None
              ) -> tuple[Plan, float | None]:
        """The plan of this rank order, its layer split searched (`adaptive_partition`) or
        equal, with its estimated iteration (s) where it was priced (else None). `first`: the
        order's plan with the equal split and its estimate (None: not yet priced), when made;
        `siblings`: the prices its estimates share with other orders' plans, by split."""
        plan_with = self._layout(request, nodes, rank_to_gpu)
        equal = tuple(equal_partition(request.workload.num_layers, request.pp * request.num_chunks))
        even, even_s = first if first is not None else (plan_with(equal), None)
        if not self.adaptive_partition:
            return even, even_s
        timer = StageTimer(request, rank_to_gpu, even.groups, even.optimizer)
        layers = tuple(adaptive_partition(timer))
        if layers == equal:
            return even, even_s
        adaptive = plan_with(layers)
        priced = (request.cluster, request.workload, request.compute)
        shared = {} if siblings is None else siblings
        best = estimate_iteration(adaptive, *priced,
                                  shared.setdefault(layers, Siblings())).iteration_s
        if even_s is None:
            # The equal split loses when its iteration's lower bound reaches the adaptive
            # split's iteration (ties keep the adaptive split); the margin covers the two sums'
            # rounding.
            reach = best / (1.0 - _MARGIN)
            if iteration_floor_s(even, *priced, reach=reach) * (1.0 - _MARGIN) >= best:
                return adaptive, best
            even_s = estimate_iteration(even, *priced,
                                        shared.setdefault(equal, Siblings())).iteration_s
        if even_s >= best:
            return adaptive, best
        # A faster equal split that does not fit loses to an adaptive split that does.
        keep_even = timer.memory(equal).fits or not timer.memory(layers).fits
        return (even, even_s) if keep_even else (adaptive, best)

    def orders(self, request: PlanRequest) -> list[tuple[tuple[Node, ...], tuple[GpuRef, ...]]]:
        """The candidate rank orders (nodes and their GPUs): the listing's, or each of
        `nic_aware_ranks` with each stage that spans NIC classes laid out for its expert-DP
        groups instead (`expert_columns`) where the estimate says the iteration is faster."""
        if not self.nic_aware_order:
            return [rank_order(request.cluster, "listing", list)]
        return [self._expert_columns(request, name, ranks)
                for name, ranks in nic_aware_ranks(request)]

    def _expert_columns(self, request: PlanRequest, name: str,
                        best: tuple[tuple[Node, ...], tuple[GpuRef, ...]]
                        ) -> tuple[tuple[Node, ...], tuple[GpuRef, ...]]:
        """Rank order `best` (called `name`) with `expert_columns` applied stage by stage
        where the estimate of the equal split gains."""
        best_s, spread = None, ()
        for s in _split_stages(best[0], request):
            nodes = expert_columns(best[0], request, s)
            if nodes is None:
                continue
            columns = f"{name}, expert columns {_degrees(request)} {(*spread, s)}"
            tried = rank_order(request.cluster, columns, lambda _, nodes=nodes: nodes)
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


def nic_aware_ranks(request: PlanRequest
                    ) -> list[tuple[str, tuple[tuple[Node, ...], tuple[GpuRef, ...]]]]:
    """The candidate NIC-aware rank orders of the request (`_Classes.best_orders` for its
    stages and CP and EP blocks), each named and made once per cluster (`base.rank_order`)."""
    shape = _shape(request)
    classes = request.cluster.derived(("nic classes",), lambda: _Classes(request.cluster.nodes))
    out = []
    for order in classes.best_orders(*shape):
        name = f"nic-aware {shape} {order}"
        out.append((name, rank_order(request.cluster, name,
                                     lambda _, order=order: classes.arrange(order))))
    return out


def _shape(request: PlanRequest) -> tuple[int, tuple[int, ...]]:
    """A stage's ranks (TP x DP) and the sizes of the blocks of consecutive ranks that form
    CP groups (TP x CP) and EP groups (ep x etp), where there are such groups."""
    w = request.workload
    blocks = ((request.tp * request.cp,) if request.cp > 1 else ()) + \
        ((w.ep * w.expert_tp(request.tp),) if w.ep > 1 else ())
    return request.tp * request.dp, blocks


def nic_classes(nodes: Sequence[Node]) -> list[str]:
    """Each node's NIC class: its RDMA fabric, or Ethernet when it has none; a node on several
    fabrics takes the one that reaches the most GPUs (ties: the first by name), whatever order
    it lists its NICs in."""
    reach: Counter[str] = Counter()
    for n in nodes:
        reach.update(dict.fromkeys(n.rdma_fabrics, n.num_gpus))
    return [max(sorted(n.rdma_fabrics), key=reach.__getitem__) if n.rdma_fabrics else ETHERNET
            for n in nodes]


def nic_aware_order(nodes: Sequence[Node], per_stage: int | None = None,
                    blocks: Sequence[int] = ()) -> list[Node]:
    """Nodes grouped by NIC class, the classes in the first of `_Classes.best_orders` for
    stages of `per_stage` ranks (None: one stage) and CP and EP blocks of `blocks` ranks."""
    classes = _Classes(nodes)
    return classes.arrange(classes.best_orders(per_stage or classes.gpus, tuple(blocks))[0])


class _Classes:
    """The NIC classes of some nodes, their candidate orders and the node order of each."""

    def __init__(self, nodes: Sequence[Node]):
        self.nodes, self.of = nodes, nic_classes(nodes)
        self.gpus = sum(n.num_gpus for n in nodes)
        size: Counter[str] = Counter()
        rate: Counter[str] = Counter()
        for n, c in zip(nodes, self.of):
            size[c] += n.num_gpus
            rate[c] += n.num_gpus * n.gpu.peak_flop_per_s * n.gpu.compute_efficiency
        # Slower GPU models first (per GPU, without `Node.speed`, so noise does not reorder
        # classes), then the largest power of two dividing the GPU count, more GPUs, the name.
        self.names = sorted(size, key=lambda c: (rate[c] / size[c], -(size[c] & -size[c]),
                                                 -size[c], c))
        self._members: dict[tuple, list[int]] = {}
        self._runs: dict[tuple, list[_Run]] = {}
        self._best: dict[tuple, list[tuple[str, ...]]] = {}

    def best_orders(self, per_stage: int, blocks: tuple[int, ...]) -> list[tuple[str, ...]]:
        """The class orders of least `_cost` (up to `_CANDIDATES`, one for a single stage, in
        `names`' order) of every order of up to `_PERMUTED` classes; else one, built class by
        class with the class whose placement next (the rest after it in `names`' order) costs
        least."""
        got = self._best.get((per_stage, blocks))
        if got is not None:
            return got

        def cost(order: Sequence[str]) -> tuple[int, ...]:
            return _cost(self.runs(order), per_stage, blocks)
        if len(self.names) <= _PERMUTED:
            costs = {order: cost(order) for order in permutations(self.names)}
            least = min(costs.values())
            # One stage: every order's DP groups span all nodes, and `_cost` weighs the blocks.
            kept = _CANDIDATES if per_stage < self.gpus else 1
            got = [o for o, c in costs.items() if c == least][:kept]
        else:
            order: list[str] = []
            rest = list(self.names)
            while rest:
                order.append(min(rest, key=lambda c: cost([*order, c, *(r for r in rest
                                                                        if r != c)])))
                rest.remove(order[-1])
            got = [tuple(order)]
        self._best[(per_stage, blocks)] = got
        return got

    def arrange(self, order: Sequence[str]) -> list[Node]:
        """The nodes class by class in `order` (`members`)."""
        return [self.nodes[k] for i in range(len(order))
                for k in self.members(*_around(order, i))]

    def members(self, c: str, before: str | None, after: str | None) -> list[int]:
        """Class c's node indices between classes `before` and `after`: a node also on the
        fabric of `before` first, of `after` last, so a stage that straddles the boundary can
        keep its DP groups on a fabric all its nodes share; then slower nodes first
        (`compute_rate`: the GPU model's and `scenario.variability`'s), else in listing order:
        a model's nodes stay together and stragglers share the class's first pipeline stage,
        whose layers the adaptive partition can cut, instead of slowing several stages (a
        pipeline runs at its slowest stage), whichever order the scenario lists them in."""
        key = (c, before, after)
        got = self._members.get(key)
        if got is None:
            nodes = self.nodes

            def rank(k: int) -> tuple:
                fabrics = nodes[k].rdma_fabrics
                return 0 if before in fabrics else 2 if after in fabrics else 1, \
                    compute_rate(nodes[k]), k
            got = self._members[key] = sorted((k for k, o in enumerate(self.of) if o == c),
                                              key=rank)
        return got

    def runs(self, order: Sequence[str]) -> list[_Run]:
        """The nodes of this class order as runs of alike nodes (`_Run`), from rank 0."""
        out: list[_Run] = []
        for i in range(len(order)):
            key = _around(order, i)
            runs = self._runs.get(key)
            if runs is None:
                runs = self._runs[key] = _runs_of([self.nodes[k] for k in self.members(*key)])
            start = out[-1][1] if out else 0
            out += [(start + a, start + b, *rest) for a, b, *rest in runs]
        return out


def _around(order: Sequence[str], i: int) -> tuple[str, str | None, str | None]:
    """Class i of `order`, the class before it and the class after it (None: none)."""
    return order[i], order[i - 1] if i else None, order[i + 1] if i + 1 < len(order) else None


_PERMUTED = 6
"""Up to this many NIC classes (720 orders) `_Classes.best_orders` tries every order."""

_CANDIDATES = 6
"""At most this many class orders of least cost are planned and priced (`HolmesPolicy.plan`)."""

_PARTITIONED = 2
"""At most this many of them are planned with the partition search; past it, the candidates are
ranked by their plans with the equal split (`_leading`)."""

_Run = tuple[int, int, int, frozenset[str], str]
"""Consecutive nodes alike for `_cost`: their first rank, the end, GPUs per node, RDMA
fabrics, cluster."""


def _runs_of(nodes: Sequence[Node]) -> list[_Run]:
    """These nodes, from rank 0, as runs of nodes alike (`_Run`)."""
    runs: list[_Run] = []
    start = 0
    for n in nodes:
        tag = (n.num_gpus, frozenset(n.rdma_fabrics), n.cluster)
        if runs and runs[-1][2:] == tag:
            runs[-1] = (runs[-1][0], start + n.num_gpus, *tag)
        else:
            runs.append((start, start + n.num_gpus, *tag))
        start += n.num_gpus
    return runs


def _cost(runs: Sequence[_Run], per_stage: int, blocks: tuple[int, ...]) -> tuple[int, ...]:
    """What a rank order costs, least first: its stages whose DP groups leave RDMA (their
    nodes, more than one, share no RDMA fabric), its CP and EP blocks of consecutive ranks
    whose nodes share none, and its stages that span clusters."""
    starts = [r[0] for r in runs]
    end = runs[-1][1]
    stages = -(-end // per_stage)
    tcp = across = 0
    for s in range(stages):
        lo, hi = s * per_stage, min(end, (s + 1) * per_stage)
        held = runs[bisect_right(starts, lo) - 1:bisect_left(starts, hi)]
        a, _, gpus, fabrics, _ = held[0]
        if len(held) > 1:
            fabrics = frozenset.intersection(*(r[3] for r in held))
            across += len({r[4] for r in held}) > 1
        elif (lo - a) // gpus == (hi - 1 - a) // gpus:
            continue  # one node: its DP groups stay on NVLink
        tcp += not fabrics
    split = 0
    for size in blocks:
        for lo in sorted({x - x % size for x in starts[1:] if x % size}):
            held = runs[bisect_right(starts, lo) - 1:bisect_left(starts, lo + size)]
            split += not frozenset.intersection(*(r[3] for r in held))
    return tcp, split, across


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
