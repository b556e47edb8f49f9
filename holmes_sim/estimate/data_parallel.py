"""The analytic estimate's data-parallel and optimizer part of a stage: its parameters, its DP
buckets in release order timed on its rings (the algorithm and protocol NCCL picks), when each
chunk's first forward may start, waiting for parameter all-gathers, the extra seconds of the
backwards that
release gradient buckets, and its work after its last op (gradient sync, embedding all-reduce,
optimizer step, parameter all-gathers). A buffer's data-parallel collectives run one after
another on one stream; with routed experts the expert buffer's run on a stream of their own, the
two sharing the link both rings leave each member by (`bucket_streams.merged_delay_s`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from holmes_sim.cost.collectives import ring_collective_time_s
from holmes_sim.cost.nccl_algorithms import collective_time_s, gradient_op, with_nvls
from holmes_sim.cost.ops import released_chunks, released_points, stage_bucket_layout
from holmes_sim.cost.ops import released_at_s
from holmes_sim.estimate.bucket_streams import (gather_floors, merged_delay_s, merged_gather_floors,
                                                reduction_tail_s, released_reduction_tail_s, total_s)
from holmes_sim.memo import IdentityMemo
from holmes_sim.model.bucket_layout import shape_token as bucket_shape_token
from holmes_sim.schedule import ScheduleKind

T = TypeVar("T")
Layout = tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]
"""A stage's DP buckets in release order as columns: gradient bytes, parameter bytes, ready
point 0..1 of the stage's backward window (`DataParallelPricing._layout`)."""
_BUCKETS: IdentityMemo[tuple] = IdentityMemo(4096)
"""`DataParallelPricing._layout` by what the cut depends on (the workload's shape, not its
micro-batch), `DataParallelPricing._buckets` by the layout (held) and what its timing depends
on, and each ring's and collective's times by bucket size: candidates of a search with equal
stages (and rings) share them."""


class DataParallelPricing:
    """The estimator's data-parallel and optimizer methods (`analytic._Estimator` derives from
    this class): they read its plan, workload (`w`), op costs, view (`net`), virtual stages
    (`nv`), schedule shape, caches and `_siblings` (`analytic.Siblings` or None), all set in its
    `__init__`, and call its `_alike`, `_op_s` and `_virtual`."""

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

    def _buckets(self, s: int, kind: str, what: str, d: int | None = None,
                 chunk: int | None = None) -> tuple[tuple[float, float], ...]:
        """Stage s's DP buckets in release order as (ring time s, ready point 0..1 of the
        stage's backward window): `_layout`'s buckets timed on the ring (the algorithm and
        protocol NCCL picks, `cost.nccl_algorithms`); `what` is "grad" (gradient bytes, reduced
        with the workload's op, `gradient_op`) or "param" (parameter bytes). With `d` the routed experts' buckets on replica d's
        expert-data-parallel ring, else the dense ones on the DP ring (`sim.gradient_buckets`).
        With `chunk` that chunk's alone, its points in its own backward. Empty without the
        ring (without expert parallelism there are no expert-data-parallel groups,
        `policies.groups`)."""
        if d is not None and self.w.ep == 1:
            return ()
        ring = self.net.dp_ring(s) if d is None else self.net.edp_ring(s, d)
        if ring is None:
            return ()
        topology = self.net.dp_topology(s) if d is None else self.net.edp_topology(s, d)
        # The view holds its topologies while this estimator lives: their ids are theirs.
        key = (id(topology), s, kind, what, d is None, chunk)
        got = self._bucket_cache.get(key)
        if got is None:
            topology = with_nvls(topology, self.w.nvls_enable)
            layout = self._layout(s, d is not None, chunk)
            op = gradient_op(self.w.average_in_collective) if what == "grad" else "sum"
            got = self._bucket_cache[key] = _BUCKETS.get(
                (layout,), (topology, kind, what, op),
                lambda: _timed_buckets(layout, _BUCKETS.get((), (topology, kind, op), dict),
                                       topology, kind, what == "grad", op))
        return got

    def _layout(self, s: int, expert: bool, chunk: int | None = None) -> Layout:
        """Stage s's dense (or routed experts') DP buckets in release order as columns (gradient
        bytes, parameter bytes, ready point 0..1 of the stage's backward window) of its cut
        (`_cut`, which keeps it): `cost.ops.stage_bucket_layout`; with `chunk` of that chunk
        alone (points in its own backward)."""
        got = self._layout_cache.get((s, expert, chunk))
        if got is None:
            runs, layouts = self._cut(s)
            got = layouts.get((expert, chunk))
            if got is None:
                part = slice(None) if chunk is None else slice(chunk, chunk + 1)
                got = layouts[(expert, chunk)] = stage_bucket_layout(
                    runs[part], self._params(s)[part], expert)
            self._layout_cache[(s, expert, chunk)] = got
        return got

    def _cut(self, s: int) -> tuple[tuple, dict[bool, Layout]]:
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

    def _gather_floors(self, s: int, d: int) -> tuple[float, ...] | None:
        """Overlapped optimizer: when (s) each chunk's first forward may start. It consumes its
        chunk's parameter buckets in forward order as their all-gathers complete (one stream,
        back to back, every chunk's at once, chunk 0's first); a bucket's share of that forward
        can start only after its own all-gather (`bucket_streams.gather_floors`). None without
        gathers before the forward."""
        if not self.plan.optimizer.gathers_before_forward:
            return None
        chunks = range(self.plan.num_chunks)
        dense = [self._buckets(s, "all-gather", "param", None, c) for c in chunks]
        expert = [self._buckets(s, "all-gather", "param", d, c) for c in chunks]
        if not any(dense) and not any(expert):
            return None
        forwards = [self._op_s(s, d, self._virtual(s, c), False) for c in chunks]
        if any(expert):  # both buffers' gathers, consumed in forward order
            return tuple(merged_gather_floors(dense, expert, forwards))
        return tuple(gather_floors(dense, forwards))

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
        is `cost.ops.node_comm_sms`)."""
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
                   first_release + m * total_s(reduce) - window)

    def _tail(self, s: int, d: int, gaps: tuple[float | None, ...] | None = None) -> float:
        """Seconds of stage s's gradient sync, embedding all-reduce, optimizer step and
        all-gather after its last op, on replica d; priced once per alike stages (`_alike`)
        with equal embedding rings. `gaps`: where the stage's chunks release gradients in
        their last backwards, seconds from each one's end to the stage's last op's end (None
        for a chunk: its reductions left out, as for a lower bound), the reductions then
        priced from them (`_gapped_reduction_s`)."""
        emb = self.net.embedding_ring(d) if self.w.tie_embeddings and self.plan.pp > 1 and \
            s in (0, self.plan.pp - 1) else None
        key = (self._alike(s, d), emb)  # alike stages with the same embedding ring (or none)
        got = self._tail_cache.get(key)
        if got is None:
            got = self._tail_cache[key] = self._sibling("tail", s, d, emb,
                                                        lambda: self._tail_s(s, d, emb))
        if gaps is None:
            return got[0]
        _, reduces, deferred, after = got
        t = max(self._gapped_reduction_s(s, d, gaps) if reduces else 0.0, deferred)
        for seconds in after:
            t += seconds
        return t

    def _gapped_reduction_s(self, s: int, d: int, gaps: tuple[float | None, ...]) -> float:
        """Seconds the gradient reductions end after stage s's last op where each chunk's last
        backward releases its buckets (the engine's `_releasing_compute`): chunk c's ends
        `gaps[c]` s before the stage's last op's end, releasing its buckets as `_chunk_jobs`
        times them; each buffer's reductions run in release order on one stream
        (`bucket_streams.reduction_tail_s`). A stage runs its ops one after another, so its
        chunks' releases follow the order of their ends."""
        templates = self._chunk_jobs(s, d)
        key = (id(templates), gaps)  # the estimate (and `siblings`) hold the templates
        got = self._gapped_cache.get(key)
        if got is None:
            shared = None if self._siblings is None else self._siblings.gapped
            got = None if shared is None else shared.get(key)
            if got is None:
                got = _gapped_reduction_s(templates, gaps)
                if shared is not None:
                    shared[key] = got
            self._gapped_cache[key] = got
        return got

    def _chunk_jobs(self, s: int, d: int) -> tuple:
        """Per chunk of stage s on replica d: its releasing backward's seconds (its time alone
        plus its extra, `_released_row`) and its dense and expert gradient buckets as (release
        s after the op's start, `cost.ops.released_at_s` of its point in the chunk, reduction
        s); priced once per alike stages."""
        key = self._alike(s, d)
        got = self._jobs_cache.get(key)
        if got is None:
            got = self._jobs_cache[key] = self._sibling("jobs", s, d, None,
                                                        lambda: self._new_chunk_jobs(s, d))
        return got

    def _new_chunk_jobs(self, s: int, d: int) -> tuple:
        """`_chunk_jobs` computed."""
        kind, extras = self.plan.optimizer.gradient_collective, self._released_row(d)[s]
        got = []
        for c in range(self.plan.num_chunks):
            op = self._op_s(s, d, self._virtual(s, c), True)
            extra, loss, first = extras[c] if extras is not None else (0.0, 0.0, 0.0)
            got.append((op + extra, tuple(
                tuple((released_at_s(op, loss, first, point), r)
                      for r, point in self._buckets(s, kind, "grad", e, c)) for e in (None, d))))
        return tuple(got)

    def _sibling(self, which: str, s: int, d: int, extra, make: Callable[[], T]) -> T:
        """`make()`, what stage s prices on replica d (the caller keeps it by `_alike`), or
        with `_siblings` (`analytic.Siblings`) what an estimate of another placement of the
        same plan priced for the same stage, `_alike`, DP topology and `extra`."""
        siblings = self._siblings
        if siblings is None:
            return make()
        shared = getattr(siblings, which)
        key = (s, self._alike(s, d), self.net.dp_topology(s), extra)
        got = shared.get(key)
        if got is None:
            got = shared[key] = make()
        return got

    def _tail_s(self, s: int, d: int, emb) -> tuple[float, bool, float, tuple[float, ...]]:
        """The work after the stage's last op (see `_tail`): its seconds with the reductions
        priced in one backward window, whether it reduces gradients, the deferred output-layer
        weight gradients' seconds and the seconds of each step after the gradient sync."""
        p, mode = self.plan, self.plan.optimizer
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
            t += merged_delay_s(dense, expert, self._backward_window(s, d))
        elif p.releases_gradients_in_backward:
            t += released_reduction_tail_s(reduce, self._backward_window(s, d)) if reduce else 0.0
        else:
            t += total_s(reduce)
        t = max(t, deferred) if p.releases_gradients_in_backward else t + deferred
        after = self._after_sync_s(s, d, emb)
        for seconds in after:
            t += seconds
        return t, bool(reduce), deferred, after

    def _after_sync_s(self, s: int, d: int, emb) -> tuple[float, ...]:
        """Seconds of each step of stage s after its gradient sync, in order: the embedding
        all-reduce (on ring `emb`, if any), the gradient buffer's pass, the optimizer step and
        (outside the forward) the parameter all-gathers."""
        p, mode, w = self.plan, self.plan.optimizer, self.w
        out = []
        if emb is not None:
            out.append(ring_collective_time_s("all-reduce", emb[0], w.grad_bytes_of(w.vocab * w.hidden),
                                              emb[1], emb[2]))
        node = self.net.node(s, d)
        params, expert = sum(self._params(s)), sum(self._split_params(s, expert=True))
        out.append(self.costs.gradient_buffer_s(node, params / p.tp))
        if expert == 0:  # `OpCosts.stage_params`
            out.append(self.costs.optimizer_s(node, params / p.tp / (p.dp if mode.sharded else 1)))
        else:  # the experts' state sharded over their expert-data-parallel group
            edp = p.dp // self.w.ep_replicas if mode.sharded else 1
            out.append(self.costs.optimizer_s(
                node, (params - expert) / p.tp / (p.dp if mode.sharded else 1) + expert / p.tp / edp))
        if mode.gathers_after_step:
            out.append(total_s(self._stage_buckets(s, d, "all-gather", "param")))
        return tuple(out)

    def _stage_buckets(self, s: int, d: int, kind: str, what: str
                       ) -> tuple[tuple[float, float], ...]:
        """`_buckets` of the dense parameters, then of replica d's routed experts: the engine
        runs the two on their own streams at once, but both rings leave every member by the
        same link (its NIC, or its NVLink port inside a node), so their times add up as on one
        stream (`merged_delay_s` where their order matters)."""
        return self._buckets(s, kind, what) + self._buckets(s, kind, what, d)


def _gapped_reduction_s(templates: tuple, gaps: tuple[float | None, ...]) -> float:
    """`DataParallelPricing._gapped_reduction_s` of the chunks' jobs `templates`
    (`DataParallelPricing._chunk_jobs`) and `gaps`."""
    jobs: tuple[list, list] = ([], [])
    for c in sorted((c for c, g in enumerate(gaps) if g is not None), key=lambda c: -gaps[c]):
        length, chunk_jobs = templates[c]
        begin = -gaps[c] - length
        for stream, offsets in zip(jobs, chunk_jobs):
            stream.extend((begin + offset, r) for offset, r in offsets)
    return reduction_tail_s(*jobs)


def _timed_buckets(layout: Layout, times: dict[float, float], topology, kind: str,
                   grad: bool, op: str) -> tuple[tuple[float, float], ...]:
    """(ring time s, ready point) of each bucket of `layout` (`DataParallelPricing._layout`'s
    columns): its gradient (`grad`) or parameter bytes' `kind` collective with reduction `op`
    on `topology`, the algorithm and protocol NCCL picks (`cost.nccl_algorithms`), kept in
    `times` by size."""
    sizes = layout[0] if grad else layout[1]
    for size in dict.fromkeys(sizes):  # each distinct size once (most buckets are full)
        if size not in times:
            times[size] = collective_time_s(topology, kind, size, op)
    return tuple(zip(map(times.__getitem__, sizes), layout[2]))
