"""Durations of the ops a plan runs, on an idle machine: compute of a model chunk, its tensor-parallel
communication, and parameter counts. One source for the engine, the analytic estimate and the
policies' partition search, so all three price an op the same way."""

from __future__ import annotations

from dataclasses import dataclass, field

from holmes_sim.hardware.cluster import ETHERNET, Cluster, Node
from holmes_sim.cost.collectives import ring_collective_time_s
from holmes_sim.cost.compute import ComputeModel
from holmes_sim.cost.context_parallel import CpPass, cp_passes, op_exposed_s
from holmes_sim.cost.expert_parallel import local_exposed_s
from holmes_sim.cost.nccl_algorithms import (CollectiveTopology, collective_time_s, intra_hw,
                                             topology_of)
from holmes_sim.cost.moe import tp_comm_factor
from holmes_sim.cost.transformer import nccl_comm_sms
from holmes_sim.memo import IdentityMemo
from holmes_sim.model.bucket_layout import BucketRun, chunk_bucket_runs
from holmes_sim.model.workload import Workload
from holmes_sim.plan import Transport, TransportKind

Bucketed = tuple[float, float, float]
"""A DP bucket: (gradient bytes, parameter bytes, ready point of its chunk's backward, 0..1)."""


@dataclass(frozen=True, slots=True)
class ChunkParts:
    """What a chunk's compute on one node adds up, for one direction (forward or backward):
    the framework's per-op overhead, one layer's, the embedding's and the head's kernel times
    at full speed, the node's speed and the deferred output-layer weight gradients (s; 0 in
    the forward). See `OpCosts.chunk_compute_s`."""

    overhead_s: float
    layer_s: float
    speed: float
    embedding_s: float
    head_s: float
    deferred_s: float

    def compute_s(self, layers: int, first: bool, last: bool) -> float:
        """`OpCosts.chunk_compute_s` of a chunk of `layers` layers (s)."""
        speed = self.speed
        t = self.overhead_s + layers * self.layer_s / speed
        if first:
            t += self.embedding_s / speed
        if last:
            t += self.head_s / speed
            t -= self.deferred_s
        return t


@dataclass(frozen=True, slots=True)
class OpCosts:
    """Prices ops of `workload` on `cluster` with `compute`. Times in seconds, per micro-batch."""

    cluster: Cluster
    workload: Workload
    compute: ComputeModel
    tp: int
    _layer_params: int = field(default=0, init=False, repr=False, compare=False)
    _released: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """`held_sm_loss_s`'s per-layer losses by GPU model and SMs held: a search's estimate asks
    for them for every stage of a candidate."""
    _cp_exposed: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """`cp_exposed_s` by the GPU model (held, so its id stays its own), layers, direction, rate
    and latency: the estimate asks for it at every op of every candidate, with a few rates."""

    def __post_init__(self) -> None:
        # `Workload.layer_params` once: `chunk_params` prices every chunk with it.
        object.__setattr__(self, "_layer_params", self.workload.layer_params)

    def chunk_compute_s(self, node: Node, layers: int, first: bool, last: bool,
                        backward: bool) -> float:
        """Compute of a chunk of `layers` layers (plus the embedding on the first virtual stage
        and the logits/loss on the last) for one micro-batch on one GPU of the TP group: the
        GPU model's kernel time over the node's speed (`Node.speed`), plus the framework's
        per-op overhead (host time, not scaled)."""
        return self.chunk_parts(node, backward).compute_s(layers, first, last)

    def chunk_parts(self, node: Node, backward: bool) -> ChunkParts:
        """The per-micro-batch times `chunk_compute_s` adds up for a chunk on `node`, which
        do not depend on its layer count (s)."""
        c, w, g = self.compute, self.workload, node.gpu
        return ChunkParts(c.op_overhead_s(g), c.layer_s(g, w, self.tp, backward), node.speed,
                          c.embedding_s(g, w, self.tp, backward), c.head_s(g, w, self.tp, backward),
                          self.deferred_wgrad_s(node) if backward else 0.0)

    def deferred_wgrad_s(self, node: Node) -> float:
        """The output layer's weight-gradient GEMM of one micro-batch that
        `--defer-embedding-wgrad-compute` moves out of the last stage's backward into the
        pipeline flush (Megatron-Core `finish_embedding_wgrad_compute`, called after the last
        backward, before the gradient sync), seconds; 0 without the flag."""
        w = self.workload
        if not w.defer_embedding_wgrad:
            return 0.0
        return self.compute.head_wgrad_s(node.gpu, w, self.tp) / node.speed

    def tp_comm_s(self, node: Node, layers: int, backward: bool) -> float:
        """Exposed TP all-reduces (with sequence parallelism, all-gathers and reduce-scatters) of
        a chunk on the intra-node link, each the collective NCCL picks (`tp_topology`)
        [Narayanan et al. SC'21, section 3.2]; with `async_tp_allreduce` the backward's two per
        layer less the weight-gradient GEMMs they overlap [Korthikanti et al. 2022, section 6.2];
        with `tp_comm_overlap` what each all-gather and reduce-scatter leaves exposed beside its
        GEMM (`userbuffer_exposed_s`). Overlaps use the kernel model only (a measured profile has
        no GEMM shapes). Zero when tp == 1."""
        return layers * self.tp_comm_layer_s(node, backward)

    def tp_comm_layer_s(self, node: Node, backward: bool) -> float:
        """`tp_comm_s` of one layer (s); a chunk's is its layer count times this."""
        if self.tp == 1:
            return 0.0
        return self._tp_collectives_layer_s(node, backward) + self.amax_reductions_s(node, backward)

    def amax_reductions_s(self, node: Node, backward: bool) -> float:
        """FP8 current scaling under sequence parallelism: the inputs of the column-parallel
        linears (QKV, fc1; forward) and the output gradients of the row-parallel ones
        (projection, fc2; backward) are cast before their all-gather, so each first all-reduces
        its amax (4 bytes) over the TP group and the cast waits for it (Transformer Engine v2.8
        on: `set_quantizer_amax_reduction_group` in pytorch/module/linear.py and
        layernorm_linear.py, `amax_reduction_group->allreduce(...)->wait()` in
        pytorch/csrc/quantizer.cpp). Two per pass, the recomputed forward's two more, each
        the one-node all-reduce NCCL picks for 4 bytes (`nccl_algorithms.collective_time_s`:
        ring LL on NVLink, 7.4 us at TP 8 on NVLink 4) (s)."""
        w = self.workload
        if not (w.fp8_current_scaling and w.sequence_parallel) or self.tp == 1:
            return 0.0
        one = collective_time_s(self.tp_topology(node), "all-reduce", 4.0)
        return one * (4 if backward and w.full_recompute else 2)

    def tp_topology(self, node: Node) -> CollectiveTopology:
        """The TP group as NCCL's algorithm choice sees it: `tp` GPUs on `node`'s GPU link, its
        NVLink SHARP unless the job turns NVLS off (`Workload.nvls_enable`)."""
        link = node.intra_link
        hop = (False, link.bandwidth_bytes_per_s * link.efficiency, link.step_latency_s)
        nvls = link.nvls_efficiency if self.workload.nvls_enable else None
        return topology_of([hop] * self.tp, 1, intra_hw([link]), nvls, 1,
                           node.gpu.compute_capability)

    def _tp_collectives_layer_s(self, node: Node, backward: bool) -> float:
        """The TP all-reduces, all-gathers and reduce-scatters of one layer pass, exposed (s):
        through NCCL (`torch.distributed` on the TP group: Megatron-Core's
        `tensor_parallel/mappings.py`), each the collective NCCL picks; under `tp_comm_overlap`
        the layer's own four through Transformer Engine's userbuffers, TE's ring kernels over
        the link (alpha-beta), not NCCL."""
        w, link = self.workload, node.intra_link
        size, topology = w.tp_allreduce_bytes(), self.tp_topology(node)
        pair = collective_time_s(topology, "all-gather", size) + \
            collective_time_s(topology, "reduce-scatter", size)
        one = pair if w.sequence_parallel else collective_time_s(topology, "all-reduce", size)
        if w.tp_comm_overlap and w.sequence_parallel:
            rate = link.bandwidth_bytes_per_s * link.efficiency
            half = tuple(ring_collective_time_s(k, self.tp, size, rate, link.step_latency_s)
                         for k in ("all-gather", "reduce-scatter"))
            per_layer = self.userbuffer_exposed_s(node, backward, half)
            if backward and w.full_recompute:
                per_layer += self.userbuffer_exposed_s(node, False, half)
            # MoE dispatchers' extra gathered rows: through NCCL, not userbuffer-overlapped
            # (`cost.moe`); with fewer collectives than a dense layer (expert TP below TP) the
            # overlapped ones shrink in proportion
            passes, factor = w.tp_allreduces_per_layer(backward) // 2, tp_comm_factor(w, self.tp)
            scale = min(1.0, factor) if w.tp_per_etp > 1 else 1.0
            per_layer = per_layer * scale + passes * (factor - scale) * 2 * pair
            return per_layer
        per_layer = w.tp_allreduces_per_layer(backward) * one * tp_comm_factor(w, self.tp)
        if backward and w.async_tp_allreduce:
            # The backward's two input-gradient all-reduces each hide behind their linear's
            # weight-gradient GEMM; the recomputed forward's stay exposed.
            per_layer -= sum(min(one, window / node.speed) for window in
                             self.compute.tp_overlap_windows_s(node.gpu, w, self.tp))
        return per_layer

    def userbuffer_exposed_s(self, node: Node, backward: bool, half: tuple[float, float]) -> float:
        """Exposed seconds of one layer pass's two all-gathers and two reduce-scatters (`half`:
        their idle-link times, s) under Transformer Engine's userbuffer overlap, each beside its
        GEMM of W s (`ComputeModel.tp_userbuffer_windows_s`). A pipelined overlap splits the
        GEMM into t chunks around t - 1 ring steps, so one chunk's GEMM has no communication
        beside it: exposed max(0, c - W (t - 1) / t) (TE `CommOverlapP2P`, the forward's four
        and the backward's data-gradient all-gathers); the backward's reduce-scatters run in
        bulk beside a whole weight-gradient GEMM: max(0, c - W) (TE `CommOverlap` bulk)."""
        windows = self.compute.tp_userbuffer_windows_s(node.gpu, self.workload, self.tp, backward)
        if not windows:
            return 2 * sum(half)
        split = (self.tp - 1) / self.tp
        shares = (split, 1.0, split, 1.0) if backward else (split,) * 4
        return sum(max(0.0, half[i % 2] - window / node.speed * share)
                   for i, (window, share) in enumerate(zip(windows, shares, strict=True)))
    def cp_passes(self, node: Node, backward: bool) -> tuple[CpPass, ...]:
        """One layer's CP exchanges in a forward or backward on one GPU (`cost.context_parallel`;
        empty without CP)."""
        return cp_passes(node.gpu, self.workload, self.tp, backward)

    def cp_exposed_s(self, node: Node, layers: int, backward: bool, rate_bytes_per_s: float,
                     latency_s: float) -> float:
        """Seconds a chunk's CP exchanges add to its op when the TP group's transfer to its CP
        neighbour runs at `rate_bytes_per_s` (its t GPUs' bytes together, as a pipeline send's)
        with `latency_s` per step (`cost.context_parallel.op_exposed_s`)."""
        gpu = node.gpu
        key = (id(gpu), layers, backward, rate_bytes_per_s, latency_s)
        got = self._cp_exposed.get(key)
        if got is None:
            if len(self._cp_exposed) >= 4096:
                self._cp_exposed.clear()
            got = self._cp_exposed[key] = (gpu, op_exposed_s(
                gpu, self.workload, self.tp, layers, backward, rate_bytes_per_s / self.tp,
                latency_s))
        return got[1]

    def ep_local_s(self, node: Node, layers: int) -> float:
        """Seconds a chunk's all-to-alls take to each GPU's EP peers inside its own TP group on
        the node's intra-node link (expert TP below TP; `cost.expert_parallel.local_exposed_s`)."""
        link = node.intra_link
        return local_exposed_s(self.workload, self.tp, layers,
                               link.bandwidth_bytes_per_s * link.efficiency, link.step_latency_s)

    def chunk_params(self, layers: int, first: bool, last: bool) -> int:
        """Parameters of a chunk across its whole TP group (embedding on the first virtual
        stage; the output head, or its tied copy, on the last)."""
        w = self.workload
        n = layers * self._layer_params
        if first:
            n += w.embedding_params
        if last:
            # With tied embeddings and one stage, the head reuses the input embedding.
            n += w.norm_params if (first and w.tie_embeddings) else w.head_params
        return n

    def virtual_stage_params(self, layers_per_stage: tuple[int, ...], j: int) -> int:
        """Parameters of virtual stage j (whole TP group), with its embedding or head."""
        return self.chunk_params(layers_per_stage[j], j == 0, j == len(layers_per_stage) - 1)

    def stage_params(self, layers_per_stage: tuple[int, ...], pp: int, pp_rank: int) -> int:
        """Parameters of every chunk pipeline rank `pp_rank` holds (whole TP group)."""
        return sum(self.virtual_stage_params(layers_per_stage, j)
                   for j in range(pp_rank, len(layers_per_stage), pp))

    def virtual_stage_expert_params(self, layers_per_stage: tuple[int, ...], j: int) -> int:
        """Of `virtual_stage_params`, the routed experts' parameters reduced over the
        expert-data-parallel group (`Workload.expert_layer_params`; 0 for a dense model)."""
        return layers_per_stage[j] * self.workload.expert_layer_params

    def stage_expert_params(self, layers_per_stage: tuple[int, ...], pp: int, pp_rank: int) -> int:
        """Of `stage_params`, the routed experts' parameters (`virtual_stage_expert_params`)."""
        return sum(self.virtual_stage_expert_params(layers_per_stage, j)
                   for j in range(pp_rank, len(layers_per_stage), pp))

    def gradient_buckets(self, layers_per_stage: tuple[int, ...], j: int, sharded: bool,
                         numel: int | None) -> tuple[tuple[Bucketed, ...], tuple[Bucketed, ...]]:
        """Virtual stage j's DP buckets as Megatron-Core cuts them (`model.bucket_layout`):
        (dense, routed experts') per buffer in release order, each bucket's (gradient bytes,
        parameter bytes, ready point of the chunk's backward in 0..1), the bytes the whole TP
        group's (`virtual_stage_params`) in the cut's shares; `sharded`: distributed optimizer;
        `numel`: elements per bucket (`Plan.bucket_numel`; None: one bucket per buffer)."""
        def of(run: BucketRun | None, grad: float, param: float) -> tuple[Bucketed, ...]:
            if run is None:
                return ()
            return _BUCKET_BYTES.get((run,), (grad, param), lambda: tuple(
                (grad * share, param * share, point)
                for share, point in zip(run.shares, run.ready, strict=True)))
        return tuple(of(*buffer) for buffer in self.bucket_runs(layers_per_stage, j, sharded,
                                                                numel))

    def bucket_runs(self, layers_per_stage: tuple[int, ...], j: int, sharded: bool,
                    numel: int | None) -> tuple[tuple[BucketRun | None, float, float], ...]:
        """`gradient_buckets` before its bytes: (dense, routed experts') buffers, each as the
        cut's run (None: no buckets) and the buffer's gradient and parameter bytes (whole TP
        group)."""
        w = self.workload
        params = self.virtual_stage_params(layers_per_stage, j)
        expert = self.virtual_stage_expert_params(layers_per_stage, j)
        dense_run, expert_run = chunk_bucket_runs(
            w, self.tp, sum(layers_per_stage[:j]), layers_per_stage[j], j == 0,
            j == len(layers_per_stage) - 1, sharded, numel)
        if expert_run is None:  # no routed experts of their own in this chunk's layers
            expert = 0
        return tuple((None, 0.0, 0.0) if run is None or n == 0 else
                     (run, w.grad_bytes_of(n), n * w.dtype_bytes)
                     for run, n in ((dense_run, params - expert), (expert_run, expert)))

    def held_sm_loss_s(self, node: Node, transports: tuple[Transport, ...], layers: int,
                       last: bool) -> float:
        """Seconds a chunk's backward on `node` (`layers` layers, the output layer's on the last
        virtual stage) loses with its GEMMs beside the data-parallel collectives it releases
        over groups of `transports`, whose NCCL kernels hold `node_comm_sms(node, transports)`
        SMs (`ComputeModel.held_sm_loss_s`), at the node's speed."""
        return self.held_loss_s(node, node_comm_sms(node, transports), layers, last)

    def held_loss_s(self, node: Node, held: int, layers: int, last: bool) -> float:
        """`held_sm_loss_s` with `held` (`node_comm_sms`) given."""
        key = (id(node.gpu), held)  # the cluster holds its GPU models
        got = self._released.get(key)
        if got is None:
            got = self._released[key] = self.compute.held_sm_loss_s(node.gpu, self.workload,
                                                                     self.tp, held)
        layer, head = got
        return (layers * layer + (head if last else 0.0)) / node.speed

    def first_release_fraction(self, layers_per_stage: tuple[int, ...], j: int,
                               reduce_experts: bool, sharded: bool, numel: int | None) -> float:
        """The share of virtual stage j's releasing backward before its first gradient bucket
        is ready (1 with one bucket): the dense and, with `reduce_experts`, the routed experts'
        buckets of `gradient_buckets` (`bucket_runs`' ready points) by ready point, the last one
        ending the chunk, as the engine releases them (`sim.gradient_buckets.chunk_buckets`)."""
        return first_release_point(self.bucket_runs(layers_per_stage, j, sharded, numel),
                                   reduce_experts)

    def optimizer_s(self, node: Node, params_per_gpu: float) -> float:
        """The optimizer step of `params_per_gpu` parameters on one GPU of `node` (s)."""
        return self.compute.optimizer_s(node.gpu, params_per_gpu) / node.speed

    def gradient_buffer_s(self, node: Node, params_per_gpu: float) -> float:
        """The per-step passes over the gradient buffer of `params_per_gpu` parameters on one GPU
        of `node` (zeroing, NaN check, 1/DP scaling), s."""
        return self.compute.gradient_buffer_s(node.gpu, self.workload, params_per_gpu) / node.speed


def first_release_point(runs: tuple[tuple[BucketRun | None, float, float], ...],
                        reduce_experts: bool) -> float:
    """`OpCosts.first_release_fraction` of a chunk's `OpCosts.bucket_runs`."""
    firsts, count = [], 0  # a run's points rise: its first is its least
    for run, _, _ in runs if reduce_experts else runs[:1]:
        if run is not None and run.ready:
            firsts.append(run.ready[0])
            count += len(run.ready)
    return 1.0 if count < 2 else min(firsts)


def stage_bucket_layout(runs: tuple, widths: tuple[int, ...], expert: bool
                        ) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """A stage's dense (or routed experts') DP buckets in release order as columns (gradient
    bytes, parameter bytes, ready point 0..1 of the stage's backward window), from its chunks'
    `OpCosts.bucket_runs` `runs` and parameters `widths`: each chunk's bytes in its cut's
    shares, its points placed in its share of the window (chunks in order, each its share of
    the stage's parameters)."""
    total = sum(widths)
    grads: list[float] = []
    params: list[float] = []
    points: list[float] = []
    offset = 0.0
    for width, chunk_runs in zip(widths, runs, strict=True):
        share = width / total
        run, grad, param = chunk_runs[expert]
        if run is not None:
            grads += [grad * part for part in run.shares]
            params += [param * part for part in run.shares]
            points += [offset + share * point for point in run.ready]
        offset += share
    return tuple(grads), tuple(params), tuple(points)


def node_comm_sms(node: Node, transports: tuple[Transport, ...]) -> int:
    """SMs the NCCL kernels of a backward's data-parallel collectives hold on a GPU of `node`
    (`transformer.nccl_comm_sms`), the most over the groups they run on (`transports`: the
    stage's DP group's and, where its experts' buckets are reduced, its expert-data-parallel
    group's): by the node's NICs on the network each group's transport uses (RDMA: its
    fabric; TCP: Ethernet), a group within the node (LOCAL) by its NICs on its first RDMA
    fabric, else its Ethernet NICs; 0 without a group."""
    return max((nccl_comm_sms(len(_comm_nics(node, t))) for t in transports), default=0)


def _comm_nics(node: Node, transport: Transport) -> tuple:
    """The NICs of `node` whose count sets the SMs a collective over `transport` holds."""
    if transport.kind is TransportKind.LOCAL:
        fabrics = node.rdma_fabrics
        return node.nics_on(fabrics[0]) if fabrics else node.nics
    return node.nics_on(transport.fabric or ETHERNET)


def released_share_s(loss_s: float, fraction: float, first: bool) -> float:
    """Seconds a releasing backward's bucket share (`fraction` of the op) adds while gradient
    reductions hold SMs: the op's whole loss `loss_s` (`OpCosts.held_sm_loss_s`) pro rata,
    none in the first share, which runs before anything of the op is in flight. The reductions
    released are taken to stay in flight to the op's end (a bucket's reduction outlasting the
    next bucket's compute)."""
    return 0.0 if first else loss_s * fraction


def released_extra_s(loss_s: float, first_fraction: float) -> float:
    """Seconds a releasing backward adds over its time alone: `released_share_s` over every
    share after the first (`first_fraction` of the op)."""
    return loss_s * (1.0 - first_fraction)


def released_at_s(op_s: float, loss_s: float, first_fraction: float, point: float) -> float:
    """When, after a releasing backward of `op_s` s alone starts, its bucket of ready point
    `point` is released: the op's time to the point plus the loss of the shares after the
    first (`released_share_s`)."""
    return op_s * point + loss_s * max(0.0, point - first_fraction)


def released_chunks(costs: OpCosts, node: Node, held: int, layers: tuple[int, ...], last: bool,
                    runs: tuple, experts: bool) -> tuple[tuple[float, float, float], ...] | None:
    """Per chunk (`layers` its layers, the output layer's in the last one where `last`, `runs`
    its `OpCosts.bucket_runs`, `experts`: with the routed experts' buckets) of a stage on `node`
    (`held`: `node_comm_sms`) whose backwards release gradient buckets: (the op's extra
    seconds `released_extra_s`, its loss `OpCosts.held_sm_loss_s`, the share before its first
    bucket `OpCosts.first_release_fraction`); None where none takes longer. Kept by the op
    costs, the runs (a search's candidates share them) and the GPU model."""
    return _RELEASED_CHUNKS.get((costs, runs, node.gpu), (node.speed, held, layers, last, experts),
                                lambda: _released_chunks(costs, node, held, layers, last, runs,
                                                         experts))


def _released_chunks(costs: OpCosts, node: Node, held: int, layers: tuple[int, ...], last: bool,
                     runs: tuple, experts: bool) -> tuple[tuple[float, float, float], ...] | None:
    """`released_chunks` computed."""
    got, end = [], len(layers) - 1
    for c, (n, chunk_runs) in enumerate(zip(layers, runs, strict=True)):
        loss, first = costs.held_loss_s(node, held, n, last and c == end), \
            first_release_point(chunk_runs, experts)
        got.append((released_extra_s(loss, first), loss, first))
    return tuple(got) if any(e > 0 for e, _, _ in got) else None


def released_points(buckets: tuple[tuple[float, float], ...], widths: tuple[int, ...],
                    chunks: tuple[tuple[float, float, float], ...], window_s: float
                    ) -> tuple[tuple[float, float], ...]:
    """(time s, ready point) buckets of a stage's backward window, chunk c's points in its share
    widths[c] / sum(widths) of it (the estimate's layout), moved into the window of `window_s`
    s whose releasing backwards take their extras (`released_chunks`): a point of chunk c
    later by the extras of the chunks before it and by its own loss after its first bucket
    (`released_at_s`). Kept by the buckets (a search's candidates share them) and the rest."""
    return _RELEASED.get((buckets,), (widths, chunks, window_s),
                         lambda: _released_points(buckets, widths, chunks, window_s))


def _released_points(buckets: tuple[tuple[float, float], ...], widths: tuple[int, ...],
                     chunks: tuple[tuple[float, float, float], ...], window_s: float
                     ) -> tuple[tuple[float, float], ...]:
    """`released_points` computed (a buffer's points rise, so its chunks are met in order): per
    chunk its end, offset, share, the time before it and its time alone."""
    total, plain = sum(widths), window_s - sum(e for e, _, _ in chunks)
    parts, offset, before = [], 0.0, 0.0
    for width, (extra, loss, first) in zip(widths, chunks, strict=True):
        share = width / total
        parts.append((offset + share, offset, share, plain * offset + before, plain * share,
                      loss, first))
        offset, before = offset + share, before + extra
    out, c, last = [], 0, len(parts) - 1
    end, o, share, base, op, loss, first = parts[0]
    for r, point in buckets:
        while c < last and point > end:
            c += 1
            end, o, share, base, op, loss, first = parts[c]
        out.append((r, (base + released_at_s(op, loss, first, (point - o) / share)) / window_s))
    return tuple(out)


class ChunkTimes:
    """`chunk_compute_s + tp_comm_s` of one micro-batch's chunk (s), remembered by the node's GPU
    model, intra-node link and speed (equal hardware, equal time); get one with `chunk_times`."""

    def __init__(self, costs: OpCosts):
        self.costs = costs
        self._seconds: dict[tuple, float] = {}
        self._parts: dict[tuple, tuple[ChunkParts, float]] = {}

    def op_s(self, node: Node, layers: int, first: bool, last: bool, backward: bool) -> float:
        key = (id(node.gpu), id(node.intra_link), node.speed, layers, first, last, backward)
        got = self._seconds.get(key)
        if got is None:
            # What does not depend on the layer count, once per hardware and direction.
            hardware = key[:3] + key[6:]
            parts = self._parts.get(hardware)
            if parts is None:
                costs = self.costs
                parts = self._parts[hardware] = (costs.chunk_parts(node, backward),
                                                 costs.tp_comm_layer_s(node, backward))
            got = self._seconds[key] = parts[0].compute_s(layers, first, last) + layers * parts[1]
        return got


_CHUNK_TIMES: IdentityMemo[ChunkTimes] = IdentityMemo(64)
_BUCKET_BYTES: IdentityMemo[tuple[tuple[float, float, float], ...]] = IdentityMemo(4096)
"""A cut's buckets in bytes (`OpCosts.gradient_buckets`), by the cut and its buffer's bytes."""
"""Shared by every OpCosts of one cluster (held, so its hardware objects' ids stay valid),
compute model, workload (by identity: hashing one reads all its fields; the planner builds one
per distinct setting, `search.planner._workload_for`) and TP degree: the candidates of a search
that differ only in placement, schedule or optimizer, and the partition search and estimate of
one candidate."""


def op_costs(cluster: Cluster, workload: Workload, compute: ComputeModel, tp: int) -> OpCosts:
    """`OpCosts(cluster, workload, compute, tp)`, one per these objects and TP degree: the
    planner's partition search, memory check and estimates of a candidate ask for the same."""
    return _OP_COSTS.get((cluster, workload, compute), (tp,),
                         lambda: OpCosts(cluster, workload, compute, tp))


_OP_COSTS: IdentityMemo[OpCosts] = IdentityMemo(256)
_RELEASED: IdentityMemo = IdentityMemo(4096)
"""`released_points` by buckets."""
_RELEASED_CHUNKS: IdentityMemo = IdentityMemo(1024)
"""`released_chunks` by op costs, bucket runs and GPU model."""


def stage_param_counts(costs: OpCosts, layers_per_stage: tuple[int, ...], pp: int
                       ) -> tuple[tuple[int, int, int], ...]:
    """Each pipeline rank's parameters and routed experts' parameters (`OpCosts.stage_params`,
    `stage_expert_params`) and its largest chunk's layers, kept by the op costs (their
    workload), layers and pipeline degree: the planner's memory checks of one split (a
    Megatron plan's optimizers) share them."""
    return _STAGE_PARAMS.get((costs,), (layers_per_stage, pp),
                             lambda: _stage_param_counts(costs, layers_per_stage, pp))


def _stage_param_counts(costs: OpCosts, layers_per_stage: tuple[int, ...], pp: int
                        ) -> tuple[tuple[int, int, int], ...]:
    """`stage_param_counts` computed; a stage's counts depend on its chunks' layers and on
    holding the first or the last virtual stage: most stages of a pipeline share them."""
    params_of: dict[tuple, tuple[int, int]] = {}
    out = []
    for s in range(pp):
        layers = tuple(layers_per_stage[s::pp])  # `Plan.stage_layers`
        key = (layers, s == 0, s == pp - 1)
        got = params_of.get(key)
        if got is None:
            got = params_of[key] = (costs.stage_params(layers_per_stage, pp, s),
                                    costs.stage_expert_params(layers_per_stage, pp, s))
        out.append((*got, max(layers)))
    return tuple(out)


_STAGE_PARAMS: IdentityMemo[tuple[tuple[int, int, int], ...]] = IdentityMemo(256)


def chunk_times(costs: OpCosts) -> ChunkTimes:
    """The shared `ChunkTimes` of `costs`."""
    return _CHUNK_TIMES.get((costs.cluster, costs.compute, costs.workload), (costs.tp,),
                            lambda: ChunkTimes(costs))
