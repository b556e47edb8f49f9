"""A contention-free estimate of one iteration of a Plan, without SimPy.

Every op gets its idle-network duration (compute from `OpCosts`; a point-to-point transfer takes
latency + bytes / path rate, the rate shared with the same send of every other replica, which the
replicas' identical schedules make simultaneous; a ring collective its alpha-beta time [Thakur et
al. 2005]), and
the schedule's dependency graph is evaluated as a critical path: an op starts when the previous op
of its stage ended and its input arrived (`walk.py`, which jumps over the steady rounds of the
schedule in closed form). Data-parallel collectives of a stage run one after
another on one stream. Where no two transfers share a link at the same time this equals the
engine's result; where they do, the engine is slower (contention), which tests can check.

Also the closed forms the tests hold the engine to, for p stages, m micro-batches, v chunks and
free communication [Narayanan et al. SC'21, section 2.2]: 1F1B and GPipe bubble fraction
(p-1)/(m+p-1); interleaved (p-1)/(v m + p-1).
"""

from __future__ import annotations

from dataclasses import dataclass

from holmes_sim.cluster import Cluster
from holmes_sim.cost.collectives import ring_collective_time_s
from holmes_sim.cost.compute import ComputeModel
from holmes_sim.cost.ops import OpCosts
from holmes_sim.cost.paths import group_path, link_capacities, ring_paths
from holmes_sim.plan import GroupKind, Plan
from holmes_sim.walk import OpTable, op_table, walk
from holmes_sim.workload import Workload


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
    """Critical-path estimate of one iteration (see module docstring)."""
    return _Estimator(plan, cluster, workload, compute).run()


_NETWORKS: dict[int, tuple] = {}
"""Per plan (by identity): link capacities, send paths, link loads and rings, which depend on the
placement and groups only, so candidates that share a plan object share them."""


def _network_of(plan: Plan, cluster: Cluster) -> dict:
    got = _NETWORKS.get(id(plan))
    if got is None or got[0] is not plan or got[1] is not cluster:
        if len(_NETWORKS) >= 64:
            _NETWORKS.clear()
        got = _NETWORKS[id(plan)] = (plan, cluster, {
            "caps": link_capacities(cluster), "paths": {}, "loads": {}, "rings": {}, "emb": {}})
    return got[2]


class _Estimator:
    def __init__(self, plan: Plan, cluster: Cluster, workload: Workload, compute: ComputeModel):
        self.plan, self.cluster, self.w = plan, cluster, workload
        self.costs = OpCosts(cluster, workload, compute, plan.tp)
        net = _network_of(plan, cluster)
        self.caps = net["caps"]
        self._paths: dict[tuple, object] = net["paths"]
        self._rings: dict[tuple, tuple | None] = net["rings"]
        self._emb: dict = net["emb"]
        self.schedule = plan.schedule()
        self.nv = self.schedule.num_virtual_stages
        self.groups = {(g.kind, g.ranks): g for g in plan.groups}
        self._forward_pairs = {(j % plan.pp, (j + 1) % plan.pp) for j in range(self.nv - 1)}
        self._p2p_cache: dict[tuple, float] = {}
        self._load_cache: dict[tuple, dict] = net["loads"]
        self.groups_by_first = {(g.kind, g.ranks[0]): g for g in plan.groups}
        self._replica_cache: dict[tuple, list[float]] = {}
        self._ops: OpTable | None = None
        sch = self.schedule
        self._shape = (sch.kind, sch.num_stages, sch.num_microbatches, sch.num_chunks)
        self._hardware: dict[tuple[int, int], tuple] = {}
        self._tail_cache: dict[tuple, float] = {}
        self._op_cache: dict[tuple, float] = {}
        self._bucket_cache: dict[tuple, list[float]] = {}

    def run(self) -> Estimate:
        p = self.plan
        # Each replica's pipeline is independent of the others until the DP sync.
        replicas = [self._replica_clock(d) for d in range(p.dp)]
        ends = [[replicas[d][s] for d in range(p.dp)] for s in range(p.pp)]
        finish = [max(self._tail(s, d, ends[s][d]) for d in range(p.dp)) for s in range(p.pp)]
        return Estimate(max(finish), tuple(max(e) for e in ends))

    def _replica_clock(self, d: int) -> list[float]:
        """Replica d's stage end times; replicas on the same hardware with the same transfer
        times (the usual case) share one evaluation."""
        p = self.plan
        signature = (tuple(self._stage_hardware(s, d) for s in range(p.pp)),
                     tuple(self._p2p_s(j, j + 1, d) for j in range(self.nv - 1)),
                     tuple(self._p2p_s(j + 1, j, d) for j in range(self.nv - 1)))
        got = self._replica_cache.get(signature)
        if got is None:
            got = self._replica_cache[signature] = self._evaluate_replica(d)
        return got

    def _stage_hardware(self, s: int, d: int) -> tuple:
        got = self._hardware.get((s, d))
        if got is None:
            node = self.cluster.node(self.plan.entity_gpus(s, d)[0].node)
            got = self._hardware[(s, d)] = (node.gpu, node.intra_link)
        return got

    def _op_table(self) -> OpTable:
        """The schedule's dependency structure (the same for every replica and every plan with
        this schedule: cached per (kind, p, m, v))."""
        if self._ops is None:
            self._ops = op_table(*self._shape)
        return self._ops

    def _evaluate_replica(self, d: int) -> list[float]:
        """Walk all stages of replica d in dependency order (a ready op runs as early as it can).
        Sends between the same two stages in the same direction queue behind each other (they
        share the path): a send starts when its op ends and the previous one has arrived."""
        p = self.plan
        table = self._op_table()
        # Durations of the few distinct (virtual stage, direction) ops and sends, priced once.
        durs = [[self._op_s(s, d, j, b) for j, b in kinds] for s, kinds in enumerate(table.kinds)]
        sends = [self._p2p_s(a, b, d) for a, b in table.sends]
        start = [self._start_delay(s, d) for s in range(p.pp)]
        # The walk depends on nothing else: plans that differ only in what happens after it
        # (the optimizer, the DP sync) or in placement with equal times share it.
        key = (self._shape, tuple(map(tuple, durs)), tuple(sends), tuple(start))
        got = _WALKS.get(key)
        if got is not None:
            return list(got)
        clock = walk(table, durs, sends, start)
        if len(_WALKS) >= 4096:
            _WALKS.clear()
        _WALKS[key] = tuple(clock)
        return clock


    def _op_s(self, s: int, d: int, j: int, backward: bool) -> float:
        """Compute plus TP communication of virtual stage j's op on replica d's node (cached by
        the node's GPU and link: equal hardware, equal time)."""
        key = (self._stage_hardware(s, d), j, backward)
        got = self._op_cache.get(key)
        if got is None:
            node = self.cluster.node(self.plan.entity_gpus(s, d)[0].node)
            n = self.plan.layers_per_stage[j]
            got = self._op_cache[key] = \
                self.costs.chunk_compute_s(node, n, j == 0, j == self.nv - 1, backward) + \
                self.costs.tp_comm_s(node, n, backward)
        return got

    def _p2p_path(self, a: int, b: int, d: int):
        """Path of the send from stage a to stage b of replica d (the PP group of the pair)."""
        got = self._paths.get((a, b, d))
        if got is None:
            p = self.plan
            fwd = (a, b) if (a, b) in self._forward_pairs else (b, a)
            group = self.groups[(GroupKind.PIPELINE, (p.rank(fwd[0], d, 0), p.rank(fwd[1], d, 0)))]
            got = self._paths[(a, b, d)] = group_path(self.cluster, group.transport,
                                                      p.entity_gpus(a, d), p.entity_gpus(b, d),
                                                      self.caps)
        return got

    def _p2p_s(self, j_from: int, j_to: int, d: int) -> float:
        """Latency + bytes at the path's rate when every replica sends the same message at the
        same time (replicas run the same schedule): a link carrying k replicas' sends gives each
        1/k of its capacity, so 8 GPUs behind one NIC do not each get the whole NIC."""
        a, b = j_from % self.plan.pp, j_to % self.plan.pp
        key = (a, b, d)
        got = self._p2p_cache.get(key)
        if got is None:
            load = self._link_load(a, b)
            path = self._p2p_path(a, b, d)
            rate = min(self.caps[lk] / load[lk] for lk, _ in path.links)
            size = self.w.pp_message_bytes(self.plan.tp) * self.plan.tp
            got = self._p2p_cache[key] = path.latency_s + size / rate
        return got

    def _link_load(self, a: int, b: int) -> dict:
        """Summed link weights of the a -> b sends of all replicas (sent at the same time). Sends
        of other stage pairs that cross the same link are not counted: that keeps the estimate
        on the optimistic side (docs/cost_models.md), and the planner confirms by simulation."""
        got = self._load_cache.get((a, b))
        if got is None:
            got = self._load_cache[(a, b)] = {}
            for d in range(self.plan.dp):
                for lk, w in self._p2p_path(a, b, d).links:
                    got[lk] = got.get(lk, 0.0) + w
        return got

    # ---- data-parallel and optimizer -----------------------------------------------------------
    def _ring(self, kind: GroupKind, s: int, d: int, members: list[tuple[int, int]]):
        key = (kind, tuple(members))
        if key not in self._rings:
            self._rings[key] = self._ring_of(kind, members)
        return self._rings[key]

    def _ring_of(self, kind: GroupKind, members: list[tuple[int, int]]):
        p = self.plan
        group = next((g for (k, _), g in self.groups.items()
                      if k is kind and g.ranks[0] == p.rank(*members[0], 0)), None)
        if group is None:
            return None
        ring = ring_paths(self.cluster, group.transport, [p.entity_gpus(*m) for m in members],
                          self.caps)
        return (len(members), ring.idle_rate_bytes_per_s, ring.step_latency_s)

    def _embedding_ring(self, d: int):
        """The embedding all-reduce ring of replica d at the rate it gets while every replica's
        runs at once (they end their pipelines together): each hop link's capacity is split over
        the summed weights of all replicas' rings."""
        p = self.plan
        if not self._emb:
            rings, load = {}, {}
            for r in range(p.dp):
                group = self.groups_by_first.get((GroupKind.EMBEDDING, p.rank(0, r, 0)))
                if group is not None:
                    rings[r] = ring_paths(self.cluster, group.transport,
                                          [p.entity_gpus(0, r), p.entity_gpus(p.pp - 1, r)], self.caps)
            for ring in rings.values():
                for hop in ring.hops:
                    for lk, w in hop.links:
                        load[lk] = load.get(lk, 0.0) + w
            self._emb.update(rings=rings, load=load)
        ring = self._emb["rings"].get(d)
        if ring is None:
            return None
        rate = min(self.caps[lk] / self._emb["load"][lk] for hop in ring.hops for lk, _ in hop.links)
        return (2, rate, ring.step_latency_s)

    def _bucket_times(self, s: int, kind: str, what: str) -> list[float]:
        """Ring time of each DP bucket of stage s, in release order; `what` is "grad" (gradient
        bytes) or "param" (parameter bytes). Cached: the ring is the stage's, not a replica's."""
        key = (s, kind, what)
        got = self._bucket_cache.get(key)
        if got is not None:
            return got
        out: list[float] = []
        ring = self._ring(GroupKind.DATA, s, 0, [(s, d) for d in range(self.plan.dp)])
        if ring is not None:
            n, rate, lat = ring
            for c in range(self.plan.num_chunks):
                params = self.costs.virtual_stage_params(self.plan.layers_per_stage,
                                                         self.schedule.virtual_stage(s, c))
                k = self.costs.gradient_buckets(params)
                size = self.w.grad_bytes_of(params) if what == "grad" else params * self.w.dtype_bytes
                out += [ring_collective_time_s(kind, n, size / k, rate, lat)] * k
        self._bucket_cache[key] = out
        return out

    def _start_delay(self, s: int, d: int) -> float:
        """Overlapped optimizer: the first forward consumes parameter buckets in order as their
        all-gathers (one stream, back to back) complete; bucket k's share of that forward can
        start only after the first k + 1 all-gathers."""
        if not self.plan.optimizer.overlapped:
            return 0.0
        times = self._bucket_times(s, "all-gather", "param")
        if not times:
            return 0.0
        forward = self._op_s(s, d, self.schedule.virtual_stage(s, 0), False)
        done, delay = 0.0, 0.0
        for k, ag in enumerate(times):
            done += ag
            delay = max(delay, done - forward * k / len(times))
        return delay

    def _backward_window(self, s: int, d: int) -> float:
        """Seconds of one micro-batch's backward over all chunks of stage s."""
        return sum(self._op_s(s, d, self.schedule.virtual_stage(s, c), True)
                   for c in range(self.plan.num_chunks))

    def _released_reduction_tail(self, s: int, d: int, reduce: list[float]) -> float:
        """Gradient buckets released evenly during the last backward, reduced one after another
        on one stream: seconds the last reduction ends after the backward does."""
        if not reduce:
            return 0.0
        window = self._backward_window(s, d)
        t = 0.0
        for k, r in enumerate(reduce):
            t = max(t, window * (k + 1) / len(reduce)) + r
        return max(0.0, t - window)

    def _tail(self, s: int, d: int, end: float) -> float:
        """`end` plus the stage's gradient sync, embedding all-reduce, optimizer step and
        all-gather (the same for replicas on equal hardware with equal embedding rings)."""
        p, w = self.plan, self.w
        emb = self._embedding_ring(d) if p.pp > 1 and s in (0, p.pp - 1) and w.tie_embeddings else None
        key = (s, self._stage_hardware(s, d), emb)
        got = self._tail_cache.get(key)
        if got is None:
            got = self._tail_cache[key] = self._tail_s(s, d, emb)
        return end + got

    def _tail_s(self, s: int, d: int, emb) -> float:
        """Seconds of the work after the stage's last op (see `_tail`)."""
        p, mode, w = self.plan, self.plan.optimizer, self.w
        t = 0.0
        reduce = self._bucket_times(s, mode.gradient_collective, "grad")
        if mode.reduces_every_microbatch:  # m rounds on one stream, each behind one backward at best
            backward = self._backward_window(s, d)
            t += max(reduce[-1] if reduce else 0.0,
                     p.num_microbatches * (sum(reduce) - backward) + backward)
        elif p.releases_gradients_in_backward:
            t += self._released_reduction_tail(s, d, reduce)
        else:
            t += sum(reduce)
        if emb is not None:
            t += ring_collective_time_s("all-reduce", emb[0], w.grad_bytes_of(w.vocab * w.hidden),
                                        emb[1], emb[2])
        node = self.cluster.node(p.entity_gpus(s, d)[0].node)
        params = self.costs.stage_params(p.layers_per_stage, p.pp, s)
        t += self.costs.optimizer_s(node, params / p.tp / (p.dp if mode.sharded else 1))
        if mode.gathers_after_step:
            t += sum(self._bucket_times(s, "all-gather", "param"))
        return t


_WALKS: dict[tuple, tuple[float, ...]] = {}
"""Replica walks by their inputs (exact reuse across the candidates of a search)."""
