"""A contention-free estimate of one iteration of a Plan, without SimPy.

Every op gets its idle-network duration (compute from `OpCosts`; a point-to-point transfer takes
latency + bytes / idle path rate; a ring collective its alpha-beta time [Thakur et al. 2005]), and
the schedule's dependency graph is evaluated as a critical path: an op starts when the previous op
of its stage ended and its input arrived. Data-parallel collectives of a stage run one after
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


class _Estimator:
    def __init__(self, plan: Plan, cluster: Cluster, workload: Workload, compute: ComputeModel):
        self.plan, self.cluster, self.w = plan, cluster, workload
        self.costs = OpCosts(cluster, workload, compute, plan.tp)
        self.caps = link_capacities(cluster)
        self.schedule = plan.schedule()
        self.nv = self.schedule.num_virtual_stages
        self.groups = {(g.kind, g.ranks): g for g in plan.groups}

    def run(self) -> Estimate:
        p = self.plan
        # Each replica's pipeline is independent of the others until the DP sync.
        replicas = [self._evaluate_replica(d) for d in range(p.dp)]
        ends = [[replicas[d][s] for d in range(p.dp)] for s in range(p.pp)]
        finish = [max(self._tail(s, d, ends[s][d]) for d in range(p.dp)) for s in range(p.pp)]
        return Estimate(max(finish), tuple(max(e) for e in ends))

    def _evaluate_replica(self, d: int) -> list[float]:
        """Walk all stages of replica d in dependency order (a ready op runs as early as it can)."""
        p = self.plan
        ops = self.schedule.stage_ops
        pos, clock = [0] * p.pp, [self._start_delay(s, d) for s in range(p.pp)]
        ready: dict[tuple, float] = {}
        remaining = sum(len(o) for o in ops)
        while remaining:
            progressed = False
            for s in range(p.pp):
                while pos[s] < len(ops[s]):
                    op = ops[s][pos[s]]
                    j = self.schedule.virtual_stage(s, op.chunk)
                    need = self._input_key(op, j, d)
                    if need is not None and need not in ready:
                        break
                    start = max(clock[s], ready.get(need, 0.0))
                    clock[s] = start + self._op_s(s, d, j, op.kind == "B")
                    self._emit(op, j, d, clock[s], ready)
                    pos[s] += 1
                    remaining -= 1
                    progressed = True
            assert progressed, "schedule deadlock"
        return clock

    def _input_key(self, op, j: int, d: int):
        if (op.kind == "F" and j == 0) or (op.kind == "B" and j == self.nv - 1):
            return None
        return (op.kind, j, op.microbatch)

    def _emit(self, op, j: int, d: int, end: float, ready: dict) -> None:
        if op.kind == "F" and j < self.nv - 1:
            ready[("F", j + 1, op.microbatch)] = end + self._p2p_s(j, j + 1, d)
        elif op.kind == "B" and j > 0:
            ready[("B", j - 1, op.microbatch)] = end + self._p2p_s(j, j - 1, d)

    def _op_s(self, s: int, d: int, j: int, backward: bool) -> float:
        node = self.cluster.node(self.plan.entity_gpus(s, d)[0].node)
        n = self.plan.layers_per_stage[j]
        return self.costs.chunk_compute_s(node, n, j == 0, j == self.nv - 1, backward) + \
            self.costs.tp_comm_s(node, n, backward)

    def _p2p_s(self, j_from: int, j_to: int, d: int) -> float:
        p = self.plan
        a, b = j_from % p.pp, j_to % p.pp
        fwd = (a, b) if j_to > j_from else (b, a)
        group = self.groups[(GroupKind.PIPELINE, (p.rank(fwd[0], d, 0), p.rank(fwd[1], d, 0)))]
        path = group_path(self.cluster, group.transport, p.entity_gpus(a, d), p.entity_gpus(b, d),
                          self.caps)
        size = self.w.pp_message_bytes(p.tp) * p.tp
        return path.latency_s + size / path.idle_rate_bytes_per_s

    # ---- data-parallel and optimizer -----------------------------------------------------------
    def _ring(self, kind: GroupKind, s: int, d: int, members: list[tuple[int, int]]):
        p = self.plan
        group = next((g for (k, _), g in self.groups.items()
                      if k is kind and g.ranks[0] == p.rank(*members[0], 0)), None)
        if group is None:
            return None
        ring = ring_paths(self.cluster, group.transport, [p.entity_gpus(*m) for m in members],
                          self.caps)
        return (len(members), ring.idle_rate_bytes_per_s, ring.step_latency_s)

    def _bucket_times(self, s: int, kind: str, bytes_of) -> list[float]:
        ring = self._ring(GroupKind.DATA, s, 0, [(s, d) for d in range(self.plan.dp)])
        if ring is None:
            return []
        n, rate, lat = ring
        out = []
        for c in range(self.plan.num_chunks):
            params = self.costs.virtual_stage_params(self.plan.layers_per_stage,
                                                     self.schedule.virtual_stage(s, c))
            k = self.costs.gradient_buckets(params)
            out += [ring_collective_time_s(kind, n, bytes_of(params) / k, rate, lat)] * k
        return out

    def _start_delay(self, s: int, d: int) -> float:
        """Overlapped optimizer: the first bucket's all-gather gates the first forward."""
        if not self.plan.optimizer.overlapped:
            return 0.0
        times = self._bucket_times(s, "all-gather", lambda n: n * self.w.dtype_bytes)
        return times[0] if times else 0.0

    def _tail(self, s: int, d: int, end: float) -> float:
        """Gradient sync, embedding all-reduce, optimizer step and all-gather after `end`."""
        p, mode, w = self.plan, self.plan.optimizer, self.w
        grads = w.grad_bytes_of
        t = end
        reduce = self._bucket_times(s, mode.gradient_collective, grads)
        if mode.reduces_every_microbatch:  # m reductions on one stream, behind the backwards
            # m rounds of reductions on one stream, each hidden behind one backward at best
            backward = sum(self._op_s(s, d, self.schedule.virtual_stage(s, c), True)
                           for c in range(p.num_chunks))
            t += max(reduce[-1] if reduce else 0.0,
                     p.num_microbatches * (sum(reduce) - backward) + backward)
        elif p.releases_gradients_in_backward:  # the last bucket is reduced after the backward ends
            t += reduce[-1] if reduce else 0.0
        else:
            t += sum(reduce)
        if p.pp > 1 and s in (0, p.pp - 1) and w.tie_embeddings:
            ring = self._ring(GroupKind.EMBEDDING, 0, d, [(0, d), (p.pp - 1, d)])
            if ring is not None:
                t += ring_collective_time_s("all-reduce", ring[0],
                                            w.grad_bytes_of(w.vocab * w.hidden), ring[1], ring[2])
        node = self.cluster.node(p.entity_gpus(s, d)[0].node)
        params = self.costs.stage_params(p.layers_per_stage, p.pp, s)
        t += self.costs.optimizer_s(node, params / p.tp / (p.dp if mode.sharded else 1))
        if mode.gathers_after_step:
            t += sum(self._bucket_times(s, "all-gather", lambda n: n * w.dtype_bytes))
        return t
