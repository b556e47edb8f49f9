"""Holmes' self-adapting pipeline partition (arXiv 2312.03549, section 3.2), done by search.

The released Holmes code takes a user ratio (its example gives an IB stage 26 of 48 layers and a
RoCE stage 22). Here the counts are chosen to minimise the slowest pipeline stage's time, where a
stage's time is its compute for all micro-batches (forward, backward, TP all-reduces) plus its
exposed data-parallel and embedding communication, priced on an idle network (`stage_time_s`).

With per-stage times that grow with each added layer, adding layers one at a time to the virtual
stage whose stage stays cheapest is optimal for the min-max objective (greedy on separable
increasing costs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from holmes_sim.cluster import Node
from holmes_sim.cost.collectives import ring_collective_time_s
from holmes_sim.cost.ops import OpCosts
from holmes_sim.cost.paths import link_capacities, ring_paths
from holmes_sim.errors import PlanError
from holmes_sim.plan import GpuRef, Group, GroupKind, OptimizerMode
from holmes_sim.policies.base import PlanRequest


@dataclass(frozen=True, slots=True)
class _Ring:
    """Idle-network ring: members, bottleneck rate (bytes/s) and per-step latency (s)."""

    members: int
    rate: float
    latency_s: float

    def time_s(self, kind: str, size_bytes: float) -> float:
        if self.members < 2 or size_bytes <= 0:
            return 0.0
        return ring_collective_time_s(kind, self.members, size_bytes, self.rate, self.latency_s)


class StageTimer:
    """Prices a stage's time for a given layer split; reused across the partition search."""

    def __init__(self, request: PlanRequest, rank_to_gpu: Sequence[GpuRef],
                 groups: Sequence[Group], optimizer: OptimizerMode):
        self.r = request
        self.optimizer = optimizer
        self.costs = OpCosts(request.cluster, request.workload, request.compute, request.tp)
        caps = link_capacities(request.cluster)
        by_rank = _groups_by_rank(groups)
        self.dp_ring = [self._ring(s, by_rank, GroupKind.DATA, rank_to_gpu, caps)
                        for s in range(request.pp)]
        # The embedding group pairs stage 0 with the last stage; it is keyed by its stage-0 rank.
        self.emb_ring = self._ring(0, by_rank, GroupKind.EMBEDDING, rank_to_gpu, caps)
        # Replicas on identical hardware cost the same: keep one node per distinct (GPU, link).
        self.nodes = [list({(n.gpu, n.intra_link): n for n in (
            request.cluster.node(rank_to_gpu[self._rank(s, d)].node) for d in range(request.dp))
        }.values()) for s in range(request.pp)]

    def _rank(self, s: int, d: int) -> int:
        return s * self.r.dp * self.r.tp + d * self.r.tp

    def _ring(self, s: int, by_rank: dict, kind: GroupKind, rank_to_gpu: Sequence[GpuRef],
              caps: dict) -> _Ring:
        group = by_rank.get((kind, self._rank(s, 0)))
        if group is None:
            return _Ring(1, 1.0, 0.0)
        tp = self.r.tp
        entities = [tuple(rank_to_gpu[r + i] for i in range(tp)) for r in group.ranks]
        ring = ring_paths(self.r.cluster, group.transport, entities, caps)
        return _Ring(len(entities), ring.idle_rate_bytes_per_s, ring.step_latency_s)

    def stage_time_s(self, s: int, chunk_layers: Sequence[int]) -> float:
        """Compute of all micro-batches plus exposed DP and embedding sync of stage `s` (s)."""
        return max(self._replica_time_s(s, node, chunk_layers) for node in self.nodes[s])

    def _replica_time_s(self, s: int, node: Node, chunk_layers: Sequence[int]) -> float:
        r = self.r
        nv = r.pp * r.num_chunks
        fwd = bwd = 0.0
        params = 0
        for c, n in enumerate(chunk_layers):
            j = c * r.pp + s
            first, last = j == 0, j == nv - 1
            fwd += self.costs.chunk_compute_s(node, n, first, last, False) + \
                self.costs.tp_comm_s(node, n, False)
            bwd += self.costs.chunk_compute_s(node, n, first, last, True) + \
                self.costs.tp_comm_s(node, n, True)
            params += self.costs.chunk_params(n, first, last)
        exposed = self._dp_exposed_s(s, params, fwd, bwd)
        if s in (0, r.pp - 1) and r.pp > 1 and r.workload.tie_embeddings:
            emb = r.workload.grad_bytes_of(r.workload.vocab * r.workload.hidden)
            exposed += self.emb_ring.time_s("all-reduce", emb)
        return r.num_microbatches * (fwd + bwd) + exposed

    def _dp_exposed_s(self, s: int, params: int, fwd_s: float, bwd_s: float) -> float:
        w, ring = self.r.workload, self.dp_ring[s]
        reduce = ring.time_s(self.optimizer.gradient_collective, w.grad_bytes_of(params))
        gather = ring.time_s("all-gather", params * w.dtype_bytes) if self.optimizer.sharded else 0.0
        if self.optimizer.overlapped:  # hidden behind one micro-batch's backward / forward
            return max(0.0, reduce - bwd_s) + max(0.0, gather - fwd_s)
        if self.optimizer.reduces_every_microbatch:  # each micro-batch's behind its backward
            return self.r.num_microbatches * max(0.0, reduce - bwd_s) + gather
        return reduce + gather


def adaptive_partition(timer: StageTimer) -> tuple[int, ...]:
    """Layers per virtual stage minimising the slowest stage's time (see module docstring).

    The search assigns layers to pipeline stages; a stage's layers are split evenly over its
    model chunks (the interleaved schedule wants chunks of equal length)."""
    r = timer.r
    v = r.num_chunks
    if r.workload.num_layers < r.pp * v:
        raise PlanError(f"{r.workload.num_layers} layers cannot fill {r.pp * v} pipeline stages")
    totals = [v] * r.pp
    for _ in range(r.workload.num_layers - r.pp * v):
        trials = [timer.stage_time_s(s, _even(totals[s] + 1, v)) for s in range(r.pp)]
        best = min(range(r.pp), key=lambda s: (trials[s], s))
        totals[best] += 1
    per_stage = [_even(t, v) for t in totals]
    return tuple(per_stage[j % r.pp][j // r.pp] for j in range(r.pp * v))


def _even(total: int, parts: int) -> list[int]:
    """`total` split into `parts` near-equal counts, the larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if c < extra else 0) for c in range(parts)]


def _groups_by_rank(groups: Sequence[Group]) -> dict[tuple[GroupKind, int], Group]:
    out: dict[tuple[GroupKind, int], Group] = {}
    for g in groups:
        out.setdefault((g.kind, g.ranks[0]), g)
    return out
