"""A contention-free estimate of one iteration of a Plan, without SimPy.

Every op gets its idle-network duration (compute from `OpCosts`; a point-to-point transfer takes
latency + bytes / path rate, the rate shared with the same send of every other replica, which the
replicas' identical schedules make simultaneous; a ring collective its alpha-beta time [Thakur et
al. 2005]), and
the schedule's dependency graph is evaluated as a critical path: an op starts when the previous op
of its stage ended and its input arrived (`walk.py`, which jumps over the steady rounds of the
schedule in closed form). A buffer's data-parallel collectives run one after another on one
stream, the routed experts' buffer on its own beside the dense one (`data_parallel.py`). Where no
two transfers share a link at the same time this equals the engine's result; where they do, the
engine is slower (contention), which tests can check.

Also the closed forms the tests hold the engine to, for p stages, m micro-batches, v chunks and
free communication [Narayanan et al. SC'21, section 2.2]: 1F1B and GPipe bubble fraction
(p-1)/(m+p-1); interleaved (p-1)/(v m + p-1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import is_

from holmes_sim.hardware.cluster import Cluster
from holmes_sim.cost.compute import ComputeModel
from holmes_sim.cost.expert_parallel import exchanges_per_op, sends_exposed_s
from holmes_sim.cost.ops import chunk_times, node_comm_sms, op_costs
from holmes_sim.estimate.data_parallel import DataParallelPricing, Layout
from holmes_sim.estimate.netview import netview
from holmes_sim.memo import IdentityMemo
from holmes_sim.plan import Plan
from holmes_sim.schedule import ScheduleKind
from holmes_sim.estimate.op_table import op_table
from holmes_sim.estimate.walk import early_receive_walk, released_ends, walked
from holmes_sim.model.workload import Workload


def bubble_fraction_1f1b(p: int, m: int, v: int = 1) -> float:
    """Idle share of a stage with free communication: (p-1)/(v m + p - 1)."""
    return (p - 1) / (v * m + p - 1)


@dataclass(frozen=True, slots=True)
class Estimate:
    """Contention-free iteration time (s) and each stage's compute-stream end time (s)."""

    iteration_s: float
    stage_end_s: tuple[float, ...]


def estimate_iteration(plan: Plan, cluster: Cluster, workload: Workload,
                       compute: ComputeModel, siblings: Siblings | None = None) -> Estimate:
    """Critical-path estimate of one iteration (see module docstring). Kept for these very
    objects: a policy that estimates its plans to pick one (`policies.holmes`) and the planner
    that then estimates the pick share it. `siblings`: prices shared with the estimates of
    other placements of the same plan (`Siblings`)."""
    return _ESTIMATES.get((plan, cluster, workload, compute), (),
                          lambda: _estimator(plan, cluster, workload, compute, siblings).run())


class Siblings:
    """What the estimates of plans that differ only in placement (rank order and groups: the
    class orders Holmes weighs for one layout) share: a stage's op row, its work after its last
    op and its reductions' jobs by the stage, what prices it on a replica (`_Estimator._alike`)
    and its DP topology (with `_tail`'s embedding ring, `_stage`'s kinds), and the reductions'
    tails by jobs and gaps. An estimate keeps its own caches first (by `_alike` alone), so it
    gets what it gets alone. Dense models only: a stage's MoE layers also depend on where its
    chunks start, which `_alike` leaves out."""

    __slots__ = ("stage", "tail", "jobs", "gapped")

    def __init__(self) -> None:
        self.stage: dict[tuple, tuple] = {}
        self.tail: dict[tuple, tuple] = {}
        self.jobs: dict[tuple, tuple] = {}
        self.gapped: dict[tuple, float] = {}


def _estimator(plan: Plan, cluster: Cluster, workload: Workload, compute: ComputeModel,
               siblings: Siblings | None = None) -> _Estimator:
    """The estimator `iteration_floor_s` last made, when it was for these very objects (its
    prices kept), else a new one (sharing `siblings`)."""
    objects = (plan, cluster, workload, compute)
    if _FLOORED and all(map(is_, _FLOORED[0][0], objects)):
        return _FLOORED.pop()[1]
    return _Estimator(*objects, siblings)


def iteration_floor_s(plan: Plan, cluster: Cluster, workload: Workload,
                      compute: ComputeModel, reach: float = math.inf) -> float:
    """A lower bound of `estimate_iteration(...).iteration_s` (s), from the walk's op and send
    durations and stage 0's tail: on a walked replica, a stage's ops run one after another (its m forwards and
    backwards of each chunk back to back); its first op, a forward of virtual stage j >= s,
    waits for that micro-batch's forwards on virtual stages 0..j-1; its last op, a backward
    (each forward's backward follows it on the stage), precedes that micro-batch's backwards
    on virtual stages j-1..0, the last of them on stage 0, each step of both chains after its
    send's idle-path time; the iteration ends no earlier than that plus stage 0's work after
    its last op (its tail, as `estimate_iteration` prices it). The tail is priced only where
    the chains alone stay below `reach` (a caller asking whether the bound reaches it learns
    as much without). The sum here is rounded apart from the walk's, so a caller comparing it
    leaves a margin."""
    estimator = _Estimator(plan, cluster, workload, compute)
    _FLOORED[:] = [((plan, cluster, workload, compute), estimator)]
    return estimator.iteration_floor_s(reach)


_FLOORED: list[tuple[tuple, "_Estimator"]] = []
"""The last estimator of `iteration_floor_s`, with its objects: a caller whose bound does not
reach estimates the same plan next."""
_ESTIMATES: IdentityMemo[Estimate] = IdentityMemo(16)


class _Estimator(DataParallelPricing):
    """One plan's estimate: each class of alike replicas walked once, its ops and sends priced
    here, each stage's data-parallel and optimizer work by `DataParallelPricing`."""

    def __init__(self, plan: Plan, cluster: Cluster, workload: Workload, compute: ComputeModel,
                 siblings: Siblings | None = None):
        self.plan, self.cluster, self.w = plan, cluster, workload
        self._siblings = siblings if workload.moe is None else None
        self.costs = op_costs(cluster, workload, compute, plan.tp)
        self.times = chunk_times(self.costs)
        self.net = netview(cluster, plan.rank_to_gpu, plan.groups, plan.tp, plan.pp, plan.dp,
                           plan.num_chunks, plan.cp, workload.ep_replicas)
        # The schedule's shape only: the walk's table stands for its ops (`op_table.op_table`), and
        # building every op of a long schedule would cost as much as walking it.
        self.nv = plan.pp * plan.num_chunks
        self._shape = (ScheduleKind(plan.schedule_kind), plan.pp, plan.num_microbatches,
                       plan.num_chunks)
        self._message_bytes = workload.pp_message_bytes(plan.tp) * plan.tp
        self._tail_cache: dict[tuple, tuple] = {}
        self._released_cache: dict[tuple, tuple | None] = {}
        self._row_cache: dict[int, tuple] = {}
        self._window_cache: dict[tuple[int, int], float] = {}
        self._bucket_cache: dict[tuple, tuple[tuple[float, float], ...]] = {}
        self._layout_cache: dict[tuple[int, bool], Layout] = {}
        self._cut_cache: dict[int, tuple[tuple, dict[bool, Layout]]] = {}
        self._stage_cache: dict[tuple, tuple[list[float], float]] = {}
        # `_alike` depends on the view and the layers only: estimates of one plan's placement
        # and split (a Megatron plan's optimizers, recompute modes, micro-batch sizes) share it.
        self._alike_cache: dict[tuple[int, int], tuple] = _ALIKES.get(
            (self.net,), (plan.layers_per_stage,), dict)
        # Stage parameter counts depend on the op costs' workload and the layers only: the
        # estimates of one split with one workload (a Megatron plan's optimizers) share them.
        self._params_cache: dict[int, tuple[int, ...]]
        self._split_cache: dict[tuple[int, bool], tuple[int, ...]]
        self._params_cache, self._split_cache = _PARAMS.get(
            (self.costs,), (plan.layers_per_stage, plan.pp), lambda: ({}, {}))
        self._send_cache: dict[tuple[int, int, int], float] = {}
        self._jobs_cache: dict[tuple, tuple] = {}
        self._gapped_cache: dict[tuple, float] = {}

    def run(self) -> Estimate:
        """Each class of alike replicas is walked once (their pipelines are independent until
        the DP sync); a stage ends when its slowest replica's tail does."""
        p, net = self.plan, self.net
        walks = [self._replica(d) for d, _ in net.replica_classes()]
        clocks = [clock for clock, _ in walks]
        # Most stages have one (class, tail) combination, and most plans one class.
        finish = [max(clocks[c][s] + self._stage_tail(s, d, walks[c]) for c, _, d in row)
                  for s, row in enumerate(net.stage_combos(self.w.tie_embeddings))]
        ends = tuple(clocks[0]) if len(clocks) == 1 else \
            tuple(max(clock[s] for clock in clocks) for s in range(p.pp))
        return Estimate(max(finish), ends)

    def iteration_floor_s(self, reach: float) -> float:
        """See the module function."""
        p, walked = self.plan, []
        for d, _ in self.net.replica_classes():
            ops = [self._op_s(j % p.pp, d, j, False) + self._op_s(j % p.pp, d, j, True)
                   for j in range(self.nv)]
            # Virtual stages 0..s-1: a forward and a backward each, and the sends between them
            # (a transfer starts no earlier than its op's end).
            before, best = 0.0, 0.0
            for s in range(p.pp):
                best = max(best, before + p.num_microbatches * sum(ops[s::p.pp]))
                before += ops[s]
                if s + 1 < p.pp:
                    before += self._p2p_s(s, s + 1, d) + self._p2p_s(s + 1, s, d)
            walked.append(best)
        if max(walked) >= reach:
            return max(walked)
        # Each chain ends with virtual stage 0's op on stage 0, whose tail follows (`run`); of
        # the reductions its chunk 0's alone, released in its last op (`_stage_tail`).
        return max(walked[c] + self._tail(0, d, (0.0,) + (None,) * (p.num_chunks - 1)
                                          if self._walked_releases(d) else None)
                   for c, _, d in self.net.stage_combos(self.w.tie_embeddings)[0])

    def _stage_tail(self, s: int, d: int, walk: tuple) -> float:
        """`_tail` of stage s on replica d after its class's `walk` (clocks, and where its
        chunks release gradients each one's releasing backward's end, `_walked_releases`)."""
        clock, ends = walk
        if ends is None:
            return self._tail(s, d)
        return self._tail(s, d, tuple(clock[s] - end for end in ends[s]))

    def _walked_releases(self, d: int) -> bool | None:
        """Whether the walk times each chunk's releasing backward for the tail (several chunks
        whose last backwards release gradient buckets: their reductions overlap the backwards
        between them), with each one a kind of its own (`op_table.full_op_table`'s released
        kinds); False where the table has those kinds only for their extra seconds; None where
        it has none."""
        p = self.plan
        if p.optimizer.reduces_every_microbatch:
            return None
        if p.releases_gradients_in_backward and p.num_chunks > 1:
            return True
        return False if any(self._released_row(d)) else None

    def _virtual(self, s: int, c: int) -> int:
        """Virtual stage of chunk c of stage s (`Schedule.virtual_stage`)."""
        return c * self.plan.pp + s

    def _replica(self, d: int) -> tuple:
        """`_evaluate_replica`, shared by plans whose walk is the same: without parameter
        gathers before the first forward (no floors), a replica's walk depends on its op
        durations (the chunk times, that is the cluster, workload, compute model and TP degree,
        and the placement's view), the layers of each virtual stage, the schedule's shape, the
        releasing backwards' extras (`_released_row`) and whether it times them
        (`_walked_releases`) only; a layout's optimizers then share it."""
        if self.plan.optimizer.gathers_before_forward:
            return self._evaluate_replica(d)
        released = self._released_row(d)
        # Without extras the walk is the plain one whatever the optimizer.
        released = (self.plan.optimizer.reduces_every_microbatch, *released) \
            if any(released) else None
        return _REPLICAS.get((self.times, self.net), (self.plan.layers_per_stage, self._shape, d,
                                                       released, self._walked_releases(d)),
                             lambda: self._evaluate_replica(d))

    def _evaluate_replica(self, d: int) -> tuple:
        """Walk all stages of replica d in dependency order (a ready op runs as early as it can,
        a chunk's first forward no earlier than its floor, `_gather_floors`). A transfer starts
        when its op has ended and the receiver has posted the receive (rendezvous, `walk.py`).
        Returns the stage clocks and, where `_walked_releases`, each stage's releasing
        backwards' ends (`walk.released_ends`), else None."""
        timed = self._walked_releases(d)
        table = op_table(*self._shape, timed is not None)
        durs, floors = [], []
        for s, kinds in enumerate(table.kinds):
            row, chunk_floors = self._stage(s, d, kinds)
            durs.append(row)
            floors.append(None if chunk_floors is None else
                          [chunk_floors[j // self.plan.pp] if not b else -math.inf
                           for j, b in kinds])
        floors = None if all(f is None for f in floors) else \
            [[-math.inf] * len(k) if f is None else f for f, k in zip(floors, table.kinds)]
        sends = [self._p2p_s(a, b, d) for a, b in table.sends]
        # The walk depends on nothing else: plans that differ only in what happens after it
        # (the optimizer, the DP sync) or in placement with equal times share it.
        early = self.w.overlap_p2p_comm and self._shape[0] is ScheduleKind.INTERLEAVED
        key = (self._shape, tuple(map(tuple, durs)), tuple(sends),
               None if floors is None else tuple(map(tuple, floors)), early, timed)
        got = _WALKS.get(key)
        if got is None:
            start = [0.0] * len(durs)
            if early:
                clock, ready, walked_table = early_receive_walk(table, durs, sends, start, floors)
            else:
                state = walked(table, durs, sends, start, floors)
                clock, ready, walked_table = state.clock, state.ready, state.table
            ends = tuple(released_ends(walked_table, clock, ready)) if timed else None
            if len(_WALKS) >= 4096:
                _WALKS.clear()
            got = _WALKS[key] = (tuple(clock), ends)
        return got

    def _alike(self, s: int, d: int) -> tuple:
        """What prices stage s's ops, gather floors and tail on replica d: its node's GPU model
        and intra-node link, its chunks' layers, whether it holds the first or the last virtual
        stage, its DP ring and the SMs its reductions hold (`node_comm_sms`). Most stages of a
        pipeline share it, so they are priced once."""
        got = self._alike_cache.get((s, d))
        if got is None:
            node, pp = self.net.node(s, d), self.plan.pp
            got = self._alike_cache[(s, d)] = (id(node.gpu), id(node.intra_link), node.speed,
                                               tuple(self.plan.layers_per_stage[s::pp]),  # `stage_layers`
                                               s == 0, s == pp - 1, self.net.dp_ring(s),
                                               self.net.cp_send(s, d), self.net.ep_sends(s, d),
                                               self.net.edp_ring(s, d),
                                               node_comm_sms(node, self.net.reduction_transports(s, d)))
        return got

    def _stage(self, s: int, d: int, kinds) -> tuple[list[float], tuple[float, ...] | None]:
        """Durations (s) of stage s's distinct ops (`kinds`: the walk's (virtual stage,
        backward) in its order, chunk by chunk) on replica d, and its chunks' first forwards'
        floors (s, `_gather_floors`); the
        releasing backwards' with their extra seconds (`_released_row`): the released kinds of
        `op_table.full_op_table`, else every backward (a per-micro-batch optimizer's)."""
        key = (self._alike(s, d), len(kinds))
        got = self._stage_cache.get(key)
        if got is None:
            got = self._stage_cache[key] = self._sibling("stage", s, d, kinds,
                                                         lambda: self._new_stage(s, d, kinds))
        return got

    def _new_stage(self, s: int, d: int, kinds) -> tuple[list[float], tuple[float, ...] | None]:
        """`_stage` computed."""
        row, extras, nc = self._ops_s(s, d, kinds), self._released_row(d)[s], self.plan.num_chunks
        if extras is not None:
            row = [t + extras[j // self.plan.pp][0] if b and (k >= 2 * nc or len(kinds) == 2 * nc)
                   else t for k, (t, (j, b)) in enumerate(zip(row, kinds))]
        return row, self._gather_floors(s, d)

    def _ops_s(self, s: int, d: int, kinds) -> list[float]:
        """`_op_s` of each (virtual stage, backward) of `kinds` on stage s of replica d; without
        CP and EP all-to-alls, the chunk times alone (the node found once)."""
        if self.net.cp != 1 or (self.w.ep != 1 and self.w.moe is not None):
            return [self._op_s(s, d, j, b) for j, b in kinds]
        node, layers, last, op_s = self.net.node(s, d), self.plan.layers_per_stage, self.nv - 1, \
            self.times.op_s
        return [op_s(node, layers[j], j == 0, j == last, b) for j, b in kinds]

    def _op_s(self, s: int, d: int, j: int, backward: bool) -> float:
        """Compute plus TP communication of virtual stage j's op on replica d's node (shared by
        equal hardware and across candidates: `cost.ops.ChunkTimes`), plus its CP exchange's
        exposed time at the rate of every CP ring of the stage sending at once, plus its EP
        exchanges (`exchanges_per_op`) at the rates of every EP group of the stage sending at
        once."""
        node, layers = self.net.node(s, d), self.plan.layers_per_stage[j]
        t = self.times.op_s(node, layers, j == 0, j == self.nv - 1, backward)
        send = self.net.cp_send(s, d) if self.net.cp != 1 else None  # none without CP
        if send is not None:
            t += self.costs.cp_exposed_s(node, layers, backward, send[1], send[0])
        if self.w.ep == 1 or self.w.moe is None:  # no all-to-alls (`sends_exposed_s`)
            return t
        local = self.costs.ep_local_s(node, layers)
        return t + exchanges_per_op(self.w, backward) * sends_exposed_s(
            self.w, self.plan.tp, layers, self.net.ep_sends(s, d), local)

    def _p2p_s(self, j_from: int, j_to: int, d: int) -> float:
        """Latency + bytes at the path's rate when every replica sends the same message at the
        same time (replicas run the same schedule): a link carrying k replicas' sends gives each
        1/k of its capacity, so 8 GPUs behind one NIC do not each get the whole NIC
        (`NetView.p2p`). Sends of other stage pairs that cross the same link are not counted:
        that keeps the estimate on the optimistic side (docs/cost_models.md), and the planner
        confirms by simulation."""
        key = (j_from % self.plan.pp, j_to % self.plan.pp, d)  # a stage pair's chunks share it
        got = self._send_cache.get(key)
        if got is None:
            latency, rate = self.net.p2p(*key)
            got = self._send_cache[key] = latency + self._message_bytes / rate
        return got


_PARAMS: IdentityMemo[tuple[dict, dict]] = IdentityMemo(256)
"""`_Estimator._params` and `_split_params` of each stage by op costs, layers per virtual
stage and pipeline degree."""
_ALIKES: IdentityMemo[dict[tuple[int, int], tuple]] = IdentityMemo(256)
"""`_Estimator._alike` of each (stage, replica) by view and layers per virtual stage."""
_REPLICAS: IdentityMemo[tuple] = IdentityMemo(1024)
"""`_Estimator._replica`'s walks by chunk times, view, layers and schedule shape."""
_WALKS: dict[tuple, tuple] = {}
"""Replica walks by their inputs (exact reuse across the candidates of a search)."""
