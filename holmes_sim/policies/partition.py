"""Holmes' self-adapting pipeline partition (arXiv 2312.03549, section 3.2), done by search.

The released Holmes code takes a user ratio (its example gives an IB stage 26 of 48 layers and a
RoCE stage 22). Here the counts are chosen to minimise the slowest pipeline stage's time, where a
stage's time is its compute for all micro-batches (forward, backward, TP all-reduces) plus its
exposed data-parallel and embedding communication, priced on an idle network (`stage_time_s`).

With per-stage times that grow with each added layer, adding layers one at a time to the virtual
stage whose stage stays cheapest is optimal for the min-max objective (greedy on separable
increasing costs). A split must also fit each stage's GPU memory as the report counts it
(`estimate.memory.memory_report`: the first stage's embedding, the last stage's output layer,
the schedule's in-flight micro-batches): where the fastest split does not, the same greedy runs
with each stage capped at the most layers it holds in memory, which keeps it optimal among the
splits that fit (a stage's memory grows with its layers).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from holmes_sim.hardware.cluster import Node
from holmes_sim.cost.collectives import ring_collective_time_s
from holmes_sim.cost.nccl_algorithms import (CollectiveTopology, collective_time_s, gradient_op,
                                             with_nvls)
from holmes_sim.cost.ops import chunk_times, op_costs
from holmes_sim.errors import PlanError
from holmes_sim.memo import IdentityMemo
from holmes_sim.estimate.memory import MemoryReport, memory_report
from holmes_sim.estimate.netview import netview
from holmes_sim.plan import GpuRef, Group, GroupKind, OptimizerMode, Plan
from holmes_sim.policies.base import PlanRequest


@dataclass(frozen=True, slots=True)
class _Ring:
    """Idle-network ring: members, bottleneck rate (bytes/s) and per-step latency (s); with a
    topology, its collectives run as NCCL picks (`cost.nccl_algorithms`), as the estimate's do."""

    members: int
    rate: float
    latency_s: float
    topology: CollectiveTopology | None = None
    times: dict[tuple[str, float, str], float] = field(default_factory=dict, compare=False,
                                                       hash=False, repr=False)
    """NCCL's times by (kind, size, reduction op), kept: the trials of the candidates sharing
    the ring ask for the same sizes again, and a look-up here skips hashing the topology."""

    def time_s(self, kind: str, size_bytes: float, op: str = "sum") -> float:
        if self.members < 2 or size_bytes <= 0:
            return 0.0
        if self.topology is not None:
            got = self.times.get((kind, size_bytes, op))
            if got is None:
                if len(self.times) >= 4096:
                    self.times.clear()
                got = self.times[(kind, size_bytes, op)] = collective_time_s(
                    self.topology, kind, size_bytes, op)
            return got
        return ring_collective_time_s(kind, self.members, size_bytes, self.rate, self.latency_s)


class StageTimer:
    """Prices a stage's time for a given layer split; reused across the partition search."""

    def __init__(self, request: PlanRequest, rank_to_gpu: Sequence[GpuRef],
                 groups: Sequence[Group], optimizer: OptimizerMode):
        self.r = request
        self.optimizer = optimizer
        self.gpus, self.groups = rank_to_gpu, groups
        self.costs = op_costs(request.cluster, request.workload, request.compute, request.tp)
        self.times = chunk_times(self.costs)
        # Rings and alike replicas come from the placement's shared view (`netview`).
        self.net = netview(request.cluster, rank_to_gpu, groups, request.tp, request.pp,
                           request.dp, request.num_chunks)
        nvls = request.workload.nvls_enable
        self.dp_ring, self.emb_ring, self.nodes, self._alike, self._ends = _TIMER_FACTS.get(
            (self.net,), (nvls,), lambda: _placement_facts(self.net, request.pp,
                                                           request.num_chunks, nvls))
        # The optimizer's properties `_dp_exposed_s` reads on every trial, read once.
        self._flags = (optimizer.reduces_gradients, optimizer.gradient_collective,
                       optimizer.sharded, optimizer.gathers_before_forward, optimizer.overlapped,
                       optimizer.reduces_every_microbatch)
        self._bytes = (request.workload.grad_bytes, request.workload.dtype_bytes)
        self._op = gradient_op(request.workload.average_in_collective)  # the gradients' reduction
        # The stages that all-reduce the tied embeddings: the first and the last.
        self._embedding_stages = (0, request.pp - 1) if request.pp > 1 and \
            request.workload.tie_embeddings else ()
        # Chunk prices depend on the chunk times (cluster, compute model, workload, TP degree)
        # only: the searches of a workload's other pipelines and schedules share them.
        self._chunks: dict[tuple, list] = _CHUNKS.get((self.times,), (), dict)
        self._stage_times: dict[tuple, float] = {}
        self._emb_s: float | None = None

    def stage_time_s(self, s: int, chunk_layers: Sequence[int]) -> float:
        """Compute of all micro-batches plus exposed DP and embedding sync of stage `s` (s),
        priced once per kind of stage and layer split."""
        key = (self._alike[s], tuple(chunk_layers))
        got = self._stage_times.get(key)
        if got is None:
            nodes = self.nodes[s]
            got = self._stage_times[key] = self._replica_time_s(s, nodes[0], chunk_layers) \
                if len(nodes) == 1 else max(self._replica_time_s(s, node, chunk_layers)
                                            for node in nodes)
        return got

    def trial(self, s: int) -> Callable[[int], float]:
        """`stage_time_s` of stage s with `total` layers split evenly over its chunks (`_even`),
        as a function of `total`: what a trial reads of the stage (its node, chunk ends,
        embedding and deferred output-layer gradient) found once, for the partition search's
        many trials. The same sums in the same order as `_replica_time_s`."""
        nodes, v = self.nodes[s], self.r.num_chunks
        if len(nodes) > 1:
            return lambda total: self.stage_time_s(s, _even(total, v))
        node, ends, alike, cache = nodes[0], self._ends[s], self._alike[s], self._stage_times
        rows, chunk, exposed = self._rows(node, s), self._chunk, self._exposed(s)
        m = self.r.num_microbatches
        embedding = self._embedding_s() if s in self._embedding_stages else None
        deferred = self.costs.deferred_wgrad_s(node) if s == self.r.pp - 1 else None

        def price(total: int) -> float:
            layers = _even(total, v)
            got = cache.get((alike, layers))
            if got is None:
                fwd = bwd = 0.0
                params = 0
                for row, end, n in zip(rows, ends, layers):
                    got = row[n] or chunk(node, n, *end)
                    fwd += got[0]
                    bwd += got[1]
                    params += got[2]
                extra = exposed(params, fwd, bwd)
                if embedding is not None:
                    extra += embedding
                if deferred is not None:
                    fwd += deferred
                got = cache[(alike, layers)] = m * (fwd + bwd) + extra
            return got
        return price

    def memory(self, layers: tuple[int, ...]) -> MemoryReport:
        """The report's per-stage peak memory (`memory_report`) of the plan with these layers
        per virtual stage."""
        r = self.r
        plan = Plan("partition", r.tp, r.pp, r.dp, self.gpus, layers, r.schedule_kind,
                    r.num_microbatches, r.num_chunks, self.optimizer, self.groups, cp=r.cp)
        return memory_report(plan, r.cluster, r.workload, self.costs)

    def _exposed(self, s: int) -> Callable[[int, float, float], float]:
        """`_dp_exposed_s` of stage s as a function of (parameters, forward s, backward s): for
        the overlapped distributed optimizer on a ring with NCCL's times (Holmes' own), the same
        sums with the times looked up directly (`_Ring.time_s`)."""
        ring = self.dp_ring[s]
        if self._flags != _OVERLAPPED or ring.topology is None or ring.members < 2:
            return lambda params, fwd_s, bwd_s: self._dp_exposed_s(s, params, fwd_s, bwd_s)
        times, time_s, (grad_bytes, dtype_bytes) = ring.times, ring.time_s, self._bytes
        op = self._op

        def exposed(params: int, fwd_s: float, bwd_s: float) -> float:
            size = params * grad_bytes
            reduce = times.get(("reduce-scatter", size, op))
            if reduce is None:
                reduce = time_s("reduce-scatter", size, op)
            size = params * dtype_bytes
            gather = times.get(("all-gather", size, "sum"))
            if gather is None:
                gather = time_s("all-gather", size)
            gather -= fwd_s  # hidden behind one micro-batch's forward, then the reduction
            reduce -= bwd_s  # behind its backward: `max(0.0, ...)` of each
            return (reduce if reduce > 0.0 else 0.0) + (gather if gather > 0.0 else 0.0)
        return exposed

    def _replica_time_s(self, s: int, node: Node, chunk_layers: Sequence[int]) -> float:
        r = self.r
        fwd = bwd = 0.0
        params = 0
        for row, end, n in zip(self._rows(node, s), self._ends[s], chunk_layers, strict=True):
            got = (row[n] if n < len(row) else None) or self._chunk(node, n, *end)
            fwd += got[0]
            bwd += got[1]
            params += got[2]
        exposed = self._dp_exposed_s(s, params, fwd, bwd)
        if s in self._embedding_stages:
            exposed += self._embedding_s()
        if s == r.pp - 1:  # the deferred output-layer weight gradients are its compute too
            fwd += self.costs.deferred_wgrad_s(node)
        return r.num_microbatches * (fwd + bwd) + exposed

    def _embedding_s(self) -> float:
        """The tied embeddings' all-reduce on the embedding ring (s), priced once."""
        if self._emb_s is None:
            w = self.r.workload
            self._emb_s = self.emb_ring.time_s("all-reduce", w.grad_bytes_of(w.vocab * w.hidden))
        return self._emb_s

    def _rows(self, node: Node, s: int) -> list[list]:
        """For each chunk of stage s on `node`, `_chunk`'s prices by layer count (None: not
        priced yet), shared by the chunks of equal ends (first, last virtual stage); a row
        holds the model's layers and one more (a trial adds a layer to a stage)."""
        return [self._chunks.get((id(node), *end)) or self._row(node, *end) for end in self._ends[s]]

    def _row(self, node: Node, first: bool, last: bool) -> list:
        got = self._chunks[(id(node), first, last)] = [None] * (self.r.workload.num_layers + 2)
        return got

    def _chunk(self, node: Node, n: int, first: bool, last: bool) -> tuple[float, float, int]:
        """Forward and backward seconds (compute + TP) and parameters of a chunk of n layers on
        `node`, priced once per chunk times (stages, trials and searches share chunks)."""
        times, row = self.times, self._chunks[(id(node), first, last)]
        row += [None] * (n + 1 - len(row))  # none but past the model's layers
        got = row[n] = (times.op_s(node, n, first, last, False),
                        times.op_s(node, n, first, last, True), self.costs.chunk_params(n, first, last))
        return got

    def _dp_exposed_s(self, s: int, params: int, fwd_s: float, bwd_s: float) -> float:
        ring = self.dp_ring[s]
        reduces, collective, sharded, gathers_first, overlapped, every = self._flags
        grad_bytes, dtype_bytes = self._bytes  # `Workload.grad_bytes_of`'s factor, dtype_bytes
        reduce = ring.time_s(collective, params * grad_bytes, self._op) if reduces else 0.0
        gather = ring.time_s("all-gather", params * dtype_bytes) if sharded else 0.0
        if gathers_first:  # hidden behind one micro-batch's forward
            gather = max(0.0, gather - fwd_s)
        if overlapped:  # hidden behind one micro-batch's backward
            return max(0.0, reduce - bwd_s) + gather
        if every:  # each micro-batch's behind its backward
            return self.r.num_microbatches * max(0.0, reduce - bwd_s) + gather
        return reduce + gather


_OVERLAPPED = (True, "reduce-scatter", True, True, True, False)
"""`StageTimer._flags` of the overlapped distributed optimizer."""


def _placement_facts(net, pp: int, num_chunks: int, nvls: bool) -> tuple:
    """What a `StageTimer` needs of its placement's view, the same for every candidate of it:
    each stage's DP ring (NVLS as `nvls`: `Workload.nvls_enable`) and the embedding ring, each
    stage's distinct nodes, which stages are priced alike, and whether each of a stage's chunks
    is the first or the last virtual stage."""
    dp_ring = [_ring(net.idle_ring(GroupKind.DATA, s), with_nvls(net.dp_topology(s), nvls))
               for s in range(pp)]
    # The embedding group pairs stage 0 with the last stage; it is keyed by its stage-0 rank.
    emb_ring = _ring(net.idle_ring(GroupKind.EMBEDDING, 0))
    # Replicas on identical hardware cost the same: keep one node per distinct (GPU, link).
    nodes = [net.stage_nodes(s) for s in range(pp)]
    # Stages priced alike: the same hardware, DP ring, and first or last place (the
    # embedding, head and embedding ring); most stages of a pipeline share one.
    alike: dict[tuple, int] = {}
    kinds = [alike.setdefault((tuple((id(n.gpu), id(n.intra_link), n.speed) for n in nodes[s]),
                               dp_ring[s], s == 0, s == pp - 1), len(alike)) for s in range(pp)]
    nv = pp * num_chunks
    ends = [[(c * pp + s == 0, c * pp + s == nv - 1) for c in range(num_chunks)]
            for s in range(pp)]
    return dp_ring, emb_ring, nodes, kinds, ends


_TIMER_FACTS: IdentityMemo[tuple] = IdentityMemo(64)
"""`_placement_facts` by view (`estimate.netview`: one per placement and chunk count)."""
_CHUNKS: IdentityMemo[dict[tuple, list]] = IdentityMemo(64)
"""`StageTimer._chunk`'s prices by chunk times (`cost.ops.chunk_times`), each by (id of the
node, first, last virtual stage) a list by layer count: the nodes are the chunk times'
cluster's."""


def adaptive_partition(timer: StageTimer) -> tuple[int, ...]:
    """Layers per virtual stage minimising the slowest stage's time among the splits that fit
    in memory (see module docstring); the fastest split when none fits.

    The search assigns layers to pipeline stages; a stage's layers are split evenly over its
    model chunks (the interleaved schedule wants chunks of equal length). The fastest split
    depends on the placement, the model and batch, the compute model, the optimizer and the
    micro-batch count only, so it is kept for the next candidate that shares them (e.g. the
    same layout with another schedule of equal chunk count); whether it fits depends on the
    schedule too (its in-flight micro-batches)."""
    r = timer.r
    if r.workload.num_layers < r.pp * r.num_chunks:
        raise PlanError(f"{r.workload.num_layers} layers cannot fill {r.pp * r.num_chunks} "
                        "pipeline stages")
    fastest = _PARTITIONS.get((timer.net, r.compute, r.workload),
                              (timer.optimizer, r.num_microbatches), lambda: _greedy(timer))
    return _FITTING.get((timer.net, r.compute, r.workload),
                        (timer.optimizer, r.num_microbatches, r.schedule_kind, fastest),
                        lambda: _fitting(timer, fastest))


_PARTITIONS: IdentityMemo[tuple[int, ...]] = IdentityMemo()
_FITTING: IdentityMemo[tuple[int, ...]] = IdentityMemo()


def _fitting(timer: StageTimer, fastest: tuple[int, ...]) -> tuple[int, ...]:
    """`fastest` if it fits; else the greedy under each stage's layer cap (`_layer_caps`), a
    stage still over its memory (an MoE stage's experts depend on where its layers lie) capped
    below its layers and the greedy run again; `fastest` when the caps leave too few layers
    (or one stage holds every layer)."""
    r = timer.r
    if r.pp == 1 or timer.memory(fastest).fits:
        return fastest
    v, pp = r.num_chunks, r.pp
    caps = _layer_caps(timer)
    while min(caps) >= v and sum(caps) >= r.workload.num_layers:
        split = _greedy(timer, caps)
        mem = timer.memory(split)
        if mem.fits:
            return split
        for s, (need, have) in enumerate(zip(mem.per_stage_bytes, mem.capacity_bytes,
                                             strict=True)):
            if need > have:
                caps[s] = sum(split[s::pp]) - 1
    return fastest


def _layer_caps(timer: StageTimer) -> list[int]:
    """Per stage, the most layers (split evenly over its chunks) that fit its GPUs' memory, by
    bisection on the report's memory of splits giving every stage the same count (a stage's
    memory depends on its own layers and place only); num_chunks - 1 when none fits. When no
    stage holds its share of the layers, no split fits: caps below the share, unsearched."""
    r = timer.r
    v, pp, n = r.num_chunks, r.pp, r.workload.num_layers
    over: dict[int, list[bool]] = {}

    def too_big(total: int, s: int) -> bool:
        if total not in over:
            per_chunk = _even(total, v)
            mem = timer.memory(tuple(per_chunk[j // pp] for j in range(pp * v)))
            over[total] = [need > have for need, have in zip(mem.per_stage_bytes,
                                                             mem.capacity_bytes, strict=True)]
        return over[total][s]

    share = -(-n // pp)  # some stage holds this many in any split
    if all(too_big(share, s) for s in range(pp)):
        return [share - 1] * pp
    caps = []
    for s in range(pp):
        lo, hi = (v - 1, share - 1) if too_big(share, s) else (share, n - (pp - 1) * v)
        while lo < hi:  # lo layers fit stage s (or lie below its chunks), hi + 1 do not
            mid = (lo + hi + 1) // 2
            lo, hi = (lo, mid - 1) if too_big(mid, s) else (mid, hi)
        caps.append(lo)
    return caps


def _greedy(timer: StageTimer, caps: Sequence[int] | None = None) -> tuple[int, ...]:
    """Add layers one at a time to the stage whose time with one more stays smallest (ties: the
    lower stage), never past a stage's cap (layers; None: no caps). Only the stage that got the
    layer has a new trial time."""
    r = timer.r
    v = r.num_chunks
    if r.pp == 1:  # every layer goes to the one stage
        return tuple(_even(r.workload.num_layers, v))
    totals = [v] * r.pp
    price = [timer.trial(s) for s in range(r.pp)]
    if caps is not None:  # a stage at its cap takes no more
        price = [_capped(p, cap) for p, cap in zip(price, caps, strict=True)]
    # Each stage's trial time once, in a heap of (trial, stage): its top is the smallest trial,
    # the lowest stage among equal ones.
    trials = [(price[s](v + 1), s) for s in range(r.pp)]
    heapq.heapify(trials)
    replace = heapq.heapreplace
    for _ in range(r.workload.num_layers - r.pp * v):
        best = trials[0][1]
        totals[best] += 1
        replace(trials, (price[best](totals[best] + 1), best))
    per_stage = [_even(t, v) for t in totals]
    return tuple(per_stage[j % r.pp][j // r.pp] for j in range(r.pp * v))


def _capped(price: Callable[[int], float], cap: int) -> Callable[[int], float]:
    """`price` up to `cap` layers, infinite past it."""
    return lambda total: price(total) if total <= cap else math.inf


def _even(total: int, parts: int) -> tuple[int, ...]:
    """`total` split into `parts` near-equal counts, the larger ones first (kept: the search
    asks for a few splits many times)."""
    got = _EVEN.get((total, parts))
    if got is None:
        base, extra = divmod(total, parts)
        if len(_EVEN) >= 4096:
            _EVEN.clear()
        got = _EVEN[(total, parts)] = tuple(base + (1 if c < extra else 0) for c in range(parts))
    return got


_EVEN: dict[tuple[int, int], tuple[int, ...]] = {}


def _ring(ring: tuple[int, float, float] | None,
          topology: CollectiveTopology | None = None) -> _Ring:
    """A `NetView` ring (with its topology: NCCL's pick), or one member (no communication) when
    there is no group. One per topology object and ring: the views of a placement with other
    chunk counts share their topologies (`NetView`), and so NCCL's times (`_Ring.times`)."""
    if ring is None:
        return _Ring(1, 1.0, 0.0)
    if topology is None:
        return _Ring(*ring)
    return _RINGS.get((topology,), ring, lambda: _Ring(*ring, topology))


_RINGS: IdentityMemo[_Ring] = IdentityMemo(1024)
