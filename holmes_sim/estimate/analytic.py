"""A contention-free estimate of one iteration of a Plan, without SimPy.

Every op gets its idle-network duration (compute from `OpCosts`; a point-to-point transfer takes
latency + bytes / path rate, the rate shared with the same send of every other replica, which the
replicas' identical schedules make simultaneous; a ring collective its alpha-beta time [Thakur et
al. 2005]), and
the schedule's dependency graph is evaluated as a critical path: an op starts when the previous op
of its stage ended and its input arrived (`walk.py`, which jumps over the steady rounds of the
schedule in closed form). Data-parallel collectives of a stage run one after
another on one stream, the routed experts' with the dense ones (`merged_delay_s`). Where no
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
from holmes_sim.cost.collectives import ring_collective_time_s
from holmes_sim.cost.nccl_algorithms import collective_time_s
from holmes_sim.cost.compute import ComputeModel
from holmes_sim.cost.expert_parallel import sends_exposed_s
from holmes_sim.cost.ops import (chunk_times, node_comm_sms, op_costs, released_chunks,
                                 released_points, stage_bucket_layout)
from holmes_sim.estimate.netview import netview
from holmes_sim.memo import IdentityMemo
from holmes_sim.plan import Plan
from holmes_sim.schedule import ScheduleKind
from holmes_sim.estimate.walk import op_table, walk, walk_early_receive
from holmes_sim.model.bucket_layout import shape_token as bucket_shape_token
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
                       compute: ComputeModel) -> Estimate:
    """Critical-path estimate of one iteration (see module docstring). Kept for these very
    objects: a policy that estimates its plans to pick one (`policies.holmes`) and the planner
    that then estimates the pick share it."""
    return _ESTIMATES.get((plan, cluster, workload, compute), (),
                          lambda: _estimator(plan, cluster, workload, compute).run())


def _estimator(plan: Plan, cluster: Cluster, workload: Workload,
               compute: ComputeModel) -> _Estimator:
    """The estimator `iteration_floor_s` last made, when it was for these very objects (its
    prices kept), else a new one."""
    objects = (plan, cluster, workload, compute)
    if _FLOORED and all(map(is_, _FLOORED[0][0], objects)):
        return _FLOORED.pop()[1]
    return _Estimator(*objects)


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


_Layout = tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]
"""A stage's DP buckets in release order as columns: gradient bytes, parameter bytes, ready
point 0..1 of the stage's backward window (`_Estimator._layout`)."""
_FLOORED: list[tuple[tuple, "_Estimator"]] = []
"""The last estimator of `iteration_floor_s`, with its objects: a caller whose bound does not
reach estimates the same plan next."""
_ESTIMATES: IdentityMemo[Estimate] = IdentityMemo(16)
_BUCKETS: IdentityMemo[tuple] = IdentityMemo(4096)
"""`_Estimator._layout` by what the cut depends on (the workload's shape, not its micro-batch),
`_Estimator._buckets` by the layout (held) and what its timing depends on, and each ring's and
collective's times by bucket size: candidates of a search with equal stages (and rings) share
them."""


class _Estimator:
    def __init__(self, plan: Plan, cluster: Cluster, workload: Workload, compute: ComputeModel):
        self.plan, self.cluster, self.w = plan, cluster, workload
        self.costs = op_costs(cluster, workload, compute, plan.tp)
        self.times = chunk_times(self.costs)
        self.net = netview(cluster, plan.rank_to_gpu, plan.groups, plan.tp, plan.pp, plan.dp,
                           plan.num_chunks, plan.cp, workload.ep_replicas)
        # The schedule's shape only: the walk's table stands for its ops (`walk.op_table`), and
        # building every op of a long schedule would cost as much as walking it.
        self.nv = plan.pp * plan.num_chunks
        self._shape = (ScheduleKind(plan.schedule_kind), plan.pp, plan.num_microbatches,
                       plan.num_chunks)
        self._message_bytes = workload.pp_message_bytes(plan.tp) * plan.tp
        self._tail_cache: dict[tuple, float] = {}
        self._released_cache: dict[tuple, tuple | None] = {}
        self._row_cache: dict[int, tuple] = {}
        self._window_cache: dict[tuple[int, int], float] = {}
        self._bucket_cache: dict[tuple, tuple[tuple[float, float], ...]] = {}
        self._layout_cache: dict[tuple[int, bool], _Layout] = {}
        self._cut_cache: dict[int, tuple[tuple, dict[bool, _Layout]]] = {}
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

    def run(self) -> Estimate:
        """Each class of alike replicas is walked once (their pipelines are independent until
        the DP sync); a stage ends when its slowest replica's tail does."""
        p, net, tail = self.plan, self.net, self._tail
        clocks = [self._replica(d) for d, _ in net.replica_classes()]
        # Most stages have one (class, tail) combination, and most plans one class.
        finish = [clocks[row[0][0]][s] + tail(s, row[0][2]) if len(row) == 1 else
                  max(clocks[c][s] + tail(s, d) for c, _, d in row)
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
        # Each chain ends with virtual stage 0's op on stage 0, whose tail follows (`run`).
        return max(walked[c] + self._tail(0, d)
                   for c, _, d in self.net.stage_combos(self.w.tie_embeddings)[0])

    def _virtual(self, s: int, c: int) -> int:
        """Virtual stage of chunk c of stage s (`Schedule.virtual_stage`)."""
        return c * self.plan.pp + s

    def _replica(self, d: int) -> list[float]:
        """`_evaluate_replica`, shared by plans whose walk is the same: without parameter
        gathers before the first forward (no start delays), a replica's walk depends on its op
        durations (the chunk times, that is the cluster, workload, compute model and TP degree,
        and the placement's view), the layers of each virtual stage, the schedule's shape and
        the releasing backwards' extras (`_released_row`) only; a layout's optimizers then share it."""
        if self.plan.optimizer.gathers_before_forward:
            return self._evaluate_replica(d)
        released = self._released_row(d)
        # Without extras the walk is the plain one whatever the optimizer.
        released = (self.plan.optimizer.reduces_every_microbatch, *released) \
            if any(released) else None
        return list(_REPLICAS.get((self.times, self.net), (self.plan.layers_per_stage,
                                                            self._shape, d, released),
                                  lambda: tuple(self._evaluate_replica(d))))

    def _evaluate_replica(self, d: int) -> list[float]:
        """Walk all stages of replica d in dependency order (a ready op runs as early as it can).
        A transfer starts when its op has ended and the receiver has posted the receive
        (rendezvous, `walk.py`)."""
        released = not self.plan.optimizer.reduces_every_microbatch and \
            any(self._released_row(d))
        table = op_table(*self._shape, released)
        durs, start = [], []
        for s, kinds in enumerate(table.kinds):
            row, delay = self._stage(s, d, kinds)
            durs.append(row)
            start.append(delay)
        sends = [self._p2p_s(a, b, d) for a, b in table.sends]
        # The walk depends on nothing else: plans that differ only in what happens after it
        # (the optimizer, the DP sync) or in placement with equal times share it.
        early = self.w.overlap_p2p_comm and self._shape[0] is ScheduleKind.INTERLEAVED
        key = (self._shape, tuple(map(tuple, durs)), tuple(sends), tuple(start), early, released)
        got = _WALKS.get(key)
        if got is not None:
            return list(got)
        clock = (walk_early_receive if early else walk)(table, durs, sends, start)
        if len(_WALKS) >= 4096:
            _WALKS.clear()
        _WALKS[key] = tuple(clock)
        return clock

    def _alike(self, s: int, d: int) -> tuple:
        """What prices stage s's ops, start delay and tail on replica d: its node's GPU model
        and intra-node link, its chunks' layers, whether it holds the first or the last virtual
        stage, and its DP ring. Most stages of a pipeline share it, so they are priced once."""
        got = self._alike_cache.get((s, d))
        if got is None:
            node, pp = self.net.node(s, d), self.plan.pp
            got = self._alike_cache[(s, d)] = (id(node.gpu), id(node.intra_link), node.speed,
                                               tuple(self.plan.layers_per_stage[s::pp]),  # `stage_layers`
                                               s == 0, s == pp - 1, self.net.dp_ring(s),
                                               self.net.cp_send(s, d), self.net.ep_sends(s, d),
                                               self.net.edp_ring(s, d), node_comm_sms(node))
        return got

    def _params(self, s: int) -> tuple[int, ...]:
        """Parameters (whole TP group) of stage s's chunks, with the embedding or head."""
        got = self._params_cache.get(s)
        if got is None:
            p = self.plan
            got = self._params_cache[s] = tuple(
                self.costs.virtual_stage_params(p.layers_per_stage, self._virtual(s, c))
                for c in range(p.num_chunks))
        return got

    def _split_params(self, s: int, expert: bool) -> tuple[int, ...]:
        """Of `_params(s)`, the routed experts' (reduced over the expert-data-parallel group,
        `Workload.expert_layer_params`) or the dense rest."""
        got = self._split_cache.get((s, expert))
        if got is None:
            p = self.plan
            experts = tuple(self.costs.virtual_stage_expert_params(p.layers_per_stage,
                                                                   self._virtual(s, c))
                            for c in range(p.num_chunks))
            got = self._split_cache[(s, expert)] = experts if expert else \
                tuple(a - b for a, b in zip(self._params(s), experts))
        return got

    def _stage(self, s: int, d: int, kinds) -> tuple[list[float], float]:
        """Durations (s) of stage s's distinct ops (`kinds`: the walk's (virtual stage,
        backward) in its order, chunk by chunk) on replica d, and its start delay (s); the
        releasing backwards' with their extra seconds (`_released_row`): the released kinds of
        `walk.full_op_table`, else every backward (a per-micro-batch optimizer's)."""
        key = (self._alike(s, d), len(kinds))
        got = self._stage_cache.get(key)
        if got is None:
            row, extras, nc = self._ops_s(s, d, kinds), self._released_row(d)[s], self.plan.num_chunks
            if extras is not None:
                row = [t + extras[j // self.plan.pp][0] if b and (k >= 2 * nc or len(kinds) == 2 * nc)
                       else t for k, (t, (j, b)) in enumerate(zip(row, kinds))]
            got = self._stage_cache[key] = (row, self._start_delay(s, d))
        return got

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
        all-to-alls at the rates of every EP group of the stage sending at once."""
        node, layers = self.net.node(s, d), self.plan.layers_per_stage[j]
        t = self.times.op_s(node, layers, j == 0, j == self.nv - 1, backward)
        send = self.net.cp_send(s, d) if self.net.cp != 1 else None  # none without CP
        if send is not None:
            t += self.costs.cp_exposed_s(node, layers, backward, send[1], send[0])
        if self.w.ep == 1 or self.w.moe is None:  # no all-to-alls (`sends_exposed_s`)
            return t
        local = self.costs.ep_local_s(node, layers)
        return t + sends_exposed_s(self.w, self.plan.tp, layers, self.net.ep_sends(s, d), local)

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

    # ---- data-parallel and optimizer -----------------------------------------------------------
    def _buckets(self, s: int, kind: str, what: str, d: int | None = None
                 ) -> tuple[tuple[float, float], ...]:
        """Stage s's DP buckets in release order as (ring time s, ready point 0..1 of the
        stage's backward window): `_layout`'s buckets timed on the ring (the algorithm and
        protocol NCCL picks, `cost.nccl_algorithms`); `what` is "grad" (gradient bytes) or
        "param" (parameter bytes). With `d` the routed experts' buckets on replica d's
        expert-data-parallel ring, else the dense ones on the DP ring (`sim.gradient_buckets`).
        Empty without the ring (without expert parallelism there are no expert-data-parallel
        groups, `policies.groups`)."""
        if d is not None and self.w.ep == 1:
            return ()
        ring = self.net.dp_ring(s) if d is None else self.net.edp_ring(s, d)
        if ring is None:
            return ()
        topology = self.net.dp_topology(s) if d is None else self.net.edp_topology(s, d)
        # The view holds its topologies while this estimator lives: their ids are theirs.
        key = (id(topology), s, kind, what, d is None)
        got = self._bucket_cache.get(key)
        if got is None:
            layout = self._layout(s, d is not None)
            got = self._bucket_cache[key] = _BUCKETS.get(
                (layout,), (topology, kind, what),
                lambda: _timed_buckets(layout, _BUCKETS.get((), (topology, kind), dict),
                                       topology, kind, what == "grad"))
        return got

    def _layout(self, s: int, expert: bool) -> _Layout:
        """Stage s's dense (or routed experts') DP buckets in release order as columns (gradient
        bytes, parameter bytes, ready point 0..1 of the stage's backward window) of its cut
        (`_cut`, which keeps it): `cost.ops.stage_bucket_layout`."""
        got = self._layout_cache.get((s, expert))
        if got is None:
            runs, layouts = self._cut(s)
            got = layouts.get(expert)
            if got is None:
                got = layouts[expert] = stage_bucket_layout(runs, self._params(s), expert)
            self._layout_cache[(s, expert)] = got
        return got

    def _cut(self, s: int) -> tuple[tuple, dict[bool, _Layout]]:
        """Stage s's chunks' `OpCosts.bucket_runs` and its layouts by `expert` (`_layout`),
        shared through `_BUCKETS` by what the cut depends on: the workload's shape and bytes,
        not its micro-batch; each chunk's layers and, with MoE layers, where they start; whether
        the stage holds the embedding or the head; the sharding, bucket sizes, TP degree."""
        got = self._cut_cache.get(s)
        if got is None:
            p, w = self.plan, self.costs.workload
            js = range(s, self.nv, p.pp)  # `_virtual(s, c)` of its chunks
            numels = tuple(p.bucket_numel(j, w.given_bucket_numel) for j in js)
            starts = tuple(sum(p.layers_per_stage[:j]) for j in js) if w.moe is not None else ()
            key = (bucket_shape_token(w), w.grad_bytes, w.dtype_bytes, p.layers_per_stage[s::p.pp],
                   starts, s == 0, s == p.pp - 1, p.optimizer.sharded, numels, p.tp)
            got = self._cut_cache[s] = _BUCKETS.get((), key, lambda: (tuple(
                self.costs.bucket_runs(p.layers_per_stage, j, p.optimizer.sharded, numel)
                for j, numel in zip(js, numels, strict=True)), {}))
        return got

    def _start_delay(self, s: int, d: int) -> float:
        """Overlapped optimizer: the first forward consumes parameter buckets in forward order as
        their all-gathers (one stream, back to back, in that order) complete; a bucket's share
        of that forward can start only after its own all-gather (`gather_delay_s`)."""
        if not self.plan.optimizer.gathers_before_forward:
            return 0.0
        dense, expert = (self._buckets(s, "all-gather", "param", e) for e in (None, d))
        if not dense + expert:
            return 0.0
        forward = self._op_s(s, d, self._virtual(s, 0), False)
        if expert:  # both buffers' gathers, consumed in forward order
            return merged_delay_s(dense, expert, forward, gathers=True)
        return gather_delay_s(dense, forward)

    def _backward_window(self, s: int, d: int) -> float:
        """Seconds of one micro-batch's backward over all chunks of stage s (`_released_row` in)."""
        got = self._window_cache.get((s, d))
        if got is None:
            got = self._window_cache[(s, d)] = sum(self._op_s(s, d, self._virtual(s, c), True)
                                                   for c in range(self.plan.num_chunks)) + \
                sum(e for e, _, _ in self._released_row(d)[s] or ())
        return got

    def _released_row(self, d: int) -> tuple[tuple[tuple[float, float, float], ...] | None, ...]:
        """`cost.ops.released_chunks` of each stage on replica d, where its backwards release
        (all None where the plan releases nothing)."""
        got = self._row_cache.get(d)
        if got is None:
            pp = self.plan.pp
            got = self._row_cache[d] = tuple(self._stage_released(s, d) for s in range(pp)) \
                if self.plan.releases_gradients_in_backward else (None,) * pp
        return got

    def _stage_released(self, s: int, d: int) -> tuple[tuple[float, float, float], ...] | None:
        """`_released_row`'s stage s computed, once per alike stages (`_alike`, whose last item
        is `node_comm_sms`)."""
        key = self._alike(s, d)
        if key not in self._released_cache:
            p = self.plan
            self._released_cache[key] = None if self.net.dp_ring(s) is None else released_chunks(
                self.costs, self.net.node(s, d), key[-1], p.layers_per_stage[s::p.pp],
                s == p.pp - 1, self._cut(s)[0], self.w.ep != 1 and self.net.edp_ring(s, d) is not None)
        return self._released_cache[key]

    def _slowed(self, s: int, d: int, buckets: tuple[tuple[float, float], ...]
                ) -> tuple[tuple[float, float], ...]:
        """`cost.ops.released_points` of `buckets` where stage s's backwards release them."""
        extras = self._released_row(d)[s] if buckets else None  # most have no expert buckets
        return buckets if extras is None else \
            released_points(buckets, self._params(s), extras, self._backward_window(s, d))

    def _every_microbatch_tail_s(self, s: int, d: int, reduce) -> float:
        """Buckets reduced in every micro-batch's backward, m rounds on one stream (one chunk:
        the optimizers that do this run no interleaved schedule). A saturated stream ends m
        rounds after the first bucket's release; from its first backward the stage computes m
        backwards and the forwards of its steady phase (1F1B: m - warmup - 1 with warmup
        p - s - 1, Megatron's `num_warmup_microbatches`; GPipe: none). Otherwise the last
        backward's buckets end it (`released_reduction_tail_s`)."""
        p, m = self.plan, self.plan.num_microbatches
        backward = self._backward_window(s, d)
        forward = sum(self._op_s(s, d, self._virtual(s, c), False) for c in range(p.num_chunks))
        warmup = m if self._shape[0] is ScheduleKind.GPIPE else min(p.pp - s - 1, m)
        window = m * backward + max(0, m - warmup - 1) * forward
        first_release = backward * min(point for _, point in reduce)
        return max(released_reduction_tail_s(reduce, backward),
                   first_release + m * _total_s(reduce) - window)

    def _tail(self, s: int, d: int) -> float:
        """Seconds of stage s's gradient sync, embedding all-reduce, optimizer step and
        all-gather after its last op, on replica d; priced once per alike stages (`_alike`)
        with equal embedding rings."""
        emb = self.net.embedding_ring(d) if self.w.tie_embeddings and self.plan.pp > 1 and \
            s in (0, self.plan.pp - 1) else None
        key = (self._alike(s, d), emb)  # alike stages with the same embedding ring (or none)
        got = self._tail_cache.get(key)
        if got is None:
            got = self._tail_cache[key] = self._tail_s(s, d, emb)
        return got

    def _tail_s(self, s: int, d: int, emb) -> float:
        """Seconds of the work after the stage's last op (see `_tail`)."""
        p, mode, w = self.plan, self.plan.optimizer, self.w
        # The deferred output-layer weight gradients run first; buckets released in the
        # backward reduce meanwhile, the others after them (`engine._deferred_wgrad`).
        deferred = p.num_microbatches * self.costs.deferred_wgrad_s(self.net.node(s, d)) \
            if s == p.pp - 1 else 0.0
        t = 0.0
        dense, expert = (self._buckets(s, mode.gradient_collective, "grad", e) for e in (None, d)) \
            if mode.reduces_gradients else ((), ())
        dense, expert = self._slowed(s, d, dense), self._slowed(s, d, expert)
        reduce = dense + expert
        if mode.reduces_every_microbatch:
            t += self._every_microbatch_tail_s(s, d, reduce) if reduce else 0.0
        elif p.releases_gradients_in_backward and expert:
            t += merged_delay_s(dense, expert, self._backward_window(s, d), gathers=False)
        elif p.releases_gradients_in_backward:
            t += released_reduction_tail_s(reduce, self._backward_window(s, d)) if reduce else 0.0
        else:
            t += _total_s(reduce)
        t = max(t, deferred) if p.releases_gradients_in_backward else t + deferred
        if emb is not None:
            t += ring_collective_time_s("all-reduce", emb[0], w.grad_bytes_of(w.vocab * w.hidden),
                                        emb[1], emb[2])
        node = self.net.node(s, d)
        params, expert = sum(self._params(s)), sum(self._split_params(s, expert=True))
        if expert == 0:  # `OpCosts.stage_params`
            t += self.costs.optimizer_s(node, params / p.tp / (p.dp if mode.sharded else 1))
        else:  # the experts' state sharded over their expert-data-parallel group
            edp = p.dp // self.w.ep_replicas if mode.sharded else 1
            t += self.costs.optimizer_s(node, (params - expert) / p.tp / (p.dp if mode.sharded else 1)
                                        + expert / p.tp / edp)
        if mode.gathers_after_step:
            t += _total_s(self._stage_buckets(s, d, "all-gather", "param"))
        return t

    def _stage_buckets(self, s: int, d: int, kind: str, what: str
                       ) -> tuple[tuple[float, float], ...]:
        """`_buckets` of the dense parameters, then of replica d's routed experts: the engine
        runs the two on their own streams at once, but both rings leave every member by the
        same link (its NIC, or its NVLink port inside a node), so their times add up as on one
        stream (`merged_delay_s` where their order matters)."""
        return self._buckets(s, kind, what) + self._buckets(s, kind, what, d)


def _timed_buckets(layout: _Layout, times: dict[float, float], topology, kind: str,
                   grad: bool) -> tuple[tuple[float, float], ...]:
    """(ring time s, ready point) of each bucket of `layout` (`_Estimator._layout`'s columns):
    its gradient (`grad`) or parameter bytes' `kind` collective on `topology`, the algorithm
    and protocol NCCL picks (`cost.nccl_algorithms`), kept in `times` by size."""
    sizes = layout[0] if grad else layout[1]
    for size in dict.fromkeys(sizes):  # each distinct size once (most buckets are full)
        if size not in times:
            times[size] = collective_time_s(topology, kind, size)
    return tuple(zip(map(times.__getitem__, sizes), layout[2]))


def _total_s(buckets: tuple[tuple[float, float], ...]) -> float:
    """Seconds of (time s, ready point) buckets back to back on one stream."""
    return sum(r for r, _ in buckets)


def gather_delay_s(buckets: tuple[tuple[float, float], ...], forward_s: float) -> float:
    """How long the first forward (`forward_s` s) must wait to consume the buckets ((time s,
    ready point p of the backward) in release order) in forward order, the reverse, as their
    all-gathers complete back to back in that order (Megatron-Core's
    `next_param_gather_bucket_group`): bucket i's share of the forward starts at 1 - p_i (the
    last released at 0), so the delay is max(0, max over i of (end of gather i) - forward_s
    (1 - p_i))."""
    best, done, last = 0.0, 0.0, len(buckets) - 1
    for i in range(last, -1, -1):
        r, point = buckets[i]
        done += r
        wait = done - forward_s * (0.0 if i == last else 1.0 - point)
        if wait > best:  # `max(best, wait)`
            best = wait
    return best


def released_reduction_tail_s(buckets: tuple[tuple[float, float], ...], window_s: float) -> float:
    """Gradient buckets ((reduction time s, ready point p) in release order) released during
    the last backward (bucket i at window_s p_i) and reduced one after another on one stream:
    seconds the last reduction ends after the backward does."""
    t = 0.0
    for r, point in buckets:
        release = window_s * point
        t = (release if release > t else t) + r  # `max(t, release) + r`
    return max(0.0, t - window_s)


def merged_delay_s(dense: tuple[tuple[float, float], ...], expert: tuple[tuple[float, float], ...],
                   window_s: float, gathers: bool) -> float:
    """Dense and expert buckets ((time s, ready point) each) in the engine's order
    (`sim.gradient_buckets`: both buffers' buckets by ready point, the last ending the pass),
    each buffer's on its own stream, the two sharing the link that both rings leave every
    member by (`shared_link_ends`). gathers=False: reductions released at their points of a
    `window_s` backward; seconds the last ends after it (`released_reduction_tail_s`).
    gathers=True: all-gathers from the start in forward order (the reverse), each bucket's
    share of the forward, from 1 - its point, waiting for its own; the forward's delay
    (`gather_delay_s`)."""
    marks = sorted([(point, False, r) for r, point in dense] +
                   [(point, True, r) for r, point in expert], key=lambda m: (m[0], m[1]))
    if gathers:
        marks = [(1.0 if k == len(marks) - 1 else m[0], m[1], m[2]) for k, m in enumerate(marks)]
        marks.reverse()
    jobs: tuple[list, list] = ([], [])
    order = []
    for point, is_expert, r in marks:
        jobs[is_expert].append((0.0 if gathers else window_s * point, r))
        order.append((is_expert, len(jobs[is_expert]) - 1, 1.0 - point))
    ends = shared_link_ends(jobs)
    if gathers:
        return max(0.0, max(ends[e][k] - window_s * start for e, k, start in order))
    return max(0.0, max(e[-1] for e in ends if e) - window_s)


def shared_link_ends(jobs: tuple[list[tuple[float, float]], ...]) -> list[list[float]]:
    """End times (s) of each stream's jobs ((release s, seconds alone) in stream order): a
    stream runs its jobs one after another, each from its release or its predecessor's end,
    and the streams running at a moment share their common bottleneck link equally (the flow
    network's max-min share of one link: processor sharing)."""
    ends: list[list[float]] = [[] for _ in jobs]
    left: list[float | None] = [None] * len(jobs)
    now = 0.0
    while any(len(e) < len(j) for e, j in zip(ends, jobs)):
        pending = [i for i, j in enumerate(jobs) if len(ends[i]) < len(j)]
        active = [i for i in pending if jobs[i][len(ends[i])][0] <= now]
        if not active:
            now = min(jobs[i][len(ends[i])][0] for i in pending)
            continue
        for i in active:
            if left[i] is None:
                left[i] = jobs[i][len(ends[i])][1]
        share = len(active)
        finish = min(left[i] * share for i in active)
        releases = [jobs[i][len(ends[i])][0] - now for i in pending if i not in active]
        step = min([finish] + releases)
        for i in active:
            if step == finish and left[i] * share == finish:
                ends[i].append(now + step)
                left[i] = None
            else:
                left[i] -= step / share
        now += step
    return ends


_PARAMS: IdentityMemo[tuple[dict, dict]] = IdentityMemo(256)
"""`_Estimator._params` and `_split_params` of each stage by op costs, layers per virtual
stage and pipeline degree."""
_ALIKES: IdentityMemo[dict[tuple[int, int], tuple]] = IdentityMemo(256)
"""`_Estimator._alike` of each (stage, replica) by view and layers per virtual stage."""
_REPLICAS: IdentityMemo[tuple[float, ...]] = IdentityMemo(1024)
"""`_Estimator._replica`'s walks by chunk times, view, layers and schedule shape."""
_WALKS: dict[tuple, tuple[float, ...]] = {}
"""Replica walks by their inputs (exact reuse across the candidates of a search)."""
