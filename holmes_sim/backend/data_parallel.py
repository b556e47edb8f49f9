"""A rank's data parallelism: gradient buckets, their reduction over the DATA group, the
optimizer step of this rank's part, and the parameter all-gather of the sharded modes.

Under expert parallelism the routed experts' parameters have buckets of their own, reduced over
the EXPERT_DATA group (the replicas holding the same experts) instead of the DATA group, with
their optimizer state sharded over that group in the sharded modes: Megatron-Core's
`expert_parallel_buffers` next to its dense `buffers`
(megatron/core/distributed/distributed_data_parallel.py), each reduced over its own group and
scaled by 1 / dp (its `expert_gradient_scaling_factor` is `1 / data_parallel_world_size` too: an
expert's local gradient already sums the tokens of its EP group's replicas, so the sum over the
expert-data-parallel group covers all dp replicas' tokens once). `GradientSync` holds the two
`DataParallel` parts; each part reduces and gathers in threads of its own, as the simulator runs
the expert-data-parallel collectives on a stream beside the data-parallel one
(`sim/gradient_buckets.py`).

SYNC-4 (gradient reduction) and SYNC-5 (parameter all-gather) of `rank.py` happen here; in the
overlapped mode each runs in a background thread, bucket by bucket, while the backward (SYNC-4)
or the next forward (SYNC-5) computes.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from holmes_sim.backend.collectives import all_gather, ring_reduce_scatter
from holmes_sim.backend.emulation import PreciseWait
from holmes_sim.backend.groups import BuiltGroup
from holmes_sim.backend.model import Stage
from holmes_sim.backend.moe import MoeMLP
from holmes_sim.backend.optimizer import FlatOptimizer
from holmes_sim.backend.recorder import Recorder
from holmes_sim.backend.run_config import RunConfig
from holmes_sim.errors import TestbedError
from holmes_sim.plan import Plan


@dataclass(slots=True)
class Bucket:
    """Parameters whose gradients are reduced together; flat length padded to a multiple of dp."""

    params: list[torch.nn.Parameter]
    chunk: int
    numel: int
    padded: int
    ready: int = 0

    def flat_grad(self) -> torch.Tensor:
        return _flat([p.grad for p in self.params], self.padded)

    def flat_param(self) -> torch.Tensor:
        return _flat([p.detach() for p in self.params], self.padded)

    @torch.no_grad()
    def write_params(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def _flat(tensors: list[torch.Tensor], padded: int) -> torch.Tensor:
    flat = torch.zeros(padded, device=tensors[0].device)
    torch.cat([t.reshape(-1) for t in tensors], out=flat[:sum(t.numel() for t in tensors)])
    return flat


def bucket_sizes(plan: Plan, pp_rank: int, bucket_numel: int | None) -> list[int | None]:
    """Elements per bucket of each of the rank's chunks (`bucket_numel`: the scenario's, None
    for the framework's default), None for one bucket per chunk and buffer: the simulator's
    `Plan.bucket_numel` of the chunk's virtual stage (Megatron-Core cuts only pipeline rank 0's
    first chunk, and none without `overlap_grad_reduce`)."""
    schedule = plan.schedule()
    return [plan.bucket_numel(schedule.virtual_stage(pp_rank, c), bucket_numel)
            for c in range(plan.num_chunks)]


def make_buckets(stages: list[Stage], chunk_order: list[int], dp: int,
                 bucket_numel: list[int | None],
                 keep: Callable[[torch.nn.Parameter], bool] | None = None) -> list[Bucket]:
    """Buckets in the order their gradients become final: chunks by their last backward, within
    a chunk parameters in reverse registration order (backward reaches the last layers first),
    a bucket of chunk c closed at the first parameter that brings it to `bucket_numel[c]`
    elements (None: one per chunk; Megatron-Core's `_ParamAndGradBuffer`); `keep`: only the
    parameters it accepts (None: all), padded for a group of `dp`."""
    buckets: list[Bucket] = []
    for c in chunk_order:
        current: list[torch.nn.Parameter] = []
        limit = bucket_numel[c]
        for p in reversed(list(stages[c].parameters())):
            if keep is not None and not keep(p):
                continue
            current.append(p)
            if limit is not None and sum(q.numel() for q in current) >= limit:
                buckets.append(make_bucket(current, c, dp))
                current = []
        if current:
            buckets.append(make_bucket(current, c, dp))
    return buckets


def make_bucket(params: list[torch.nn.Parameter], chunk: int, dp: int) -> Bucket:
    """One bucket of `params` (of chunk `chunk`), padded for a group of `dp`."""
    n = sum(p.numel() for p in params)
    return Bucket(params, chunk, n, -(-n // dp) * dp)


def routed_expert_ids(stages: list[Stage]) -> set[int]:
    """ids of the parameters of the routed experts split over an EP group (`MoeMLP.keep_local`
    with ep > 1): the parameters whose gradients go to the expert buckets. Without expert
    parallelism every rank holds every expert and they are reduced with the dense ones."""
    return {id(p) for stage in stages for block in stage.blocks
            if isinstance(block.mlp, MoeMLP) and block.mlp.ep_size > 1
            for p in block.mlp.experts.parameters()}


class DataParallel:
    """A rank's DP side: its buckets, their reduction over `group` (None: dp = 1), the optimizer
    step of its part and the parameter all-gather (sharded modes).

    `optimizer_s_per_param` (emulated compute): the step is a wait of that many seconds per
    parameter on `clock`; None: the real optimizer steps. `label` starts the details of what it
    records ("expert " for the routed experts' part)."""

    def __init__(self, plan: Plan, cfg: RunConfig, group: BuiltGroup | None,
                 buckets: list[Bucket], rec: Recorder, clock: PreciseWait,
                 optimizer_s_per_param: float | None, label: str = "") -> None:
        self.plan, self.cfg, self.group, self.buckets, self.rec = plan, cfg, group, buckets, rec
        self.label = label
        self.clock, self.optimizer_s_per_param = clock, optimizer_s_per_param
        self.optimizer = FlatOptimizer(cfg.optimizer, cfg.lr)
        self.overlapped = plan.optimizer.overlapped and group is not None
        self.sharded = plan.optimizer.sharded and group is not None
        self.owner = {id(p): b for b, bucket in enumerate(buckets) for p in bucket.params}
        self.armed: set[int] = set()  # chunks whose last backward runs: their gradients finalise
        self._ready: queue.Queue[int] = queue.Queue()
        self._shards: dict[int, torch.Tensor] = {}
        self._comm_error: BaseException | None = None
        # Overlapped mode: the previous step's parameter all-gather, per chunk, still in flight.
        self._gather: threading.Thread | None = None
        self._gather_error: BaseException | None = None
        self._gather_flats: dict[int, torch.Tensor] = {}
        self.gathered: dict[int, threading.Event] = {}  # bucket -> all-gather done
        self.gather_wait_s = 0.0  # total time forwards waited for parameter buckets

    # -- gradient reduction (SYNC-4)

    def install_hooks(self, stages: list[Stage]) -> None:
        """Overlapped mode: a parameter's accumulated gradient counts towards its bucket."""
        for c, stage in enumerate(stages):
            for p in stage.parameters():
                if id(p) in self.owner:
                    p.register_post_accumulate_grad_hook(lambda q, c=c: self.grad_ready(q, c))

    def grad_ready(self, p: torch.nn.Parameter, chunk: int) -> None:
        """p's gradient was accumulated; queue its bucket once every member's is final."""
        if not self.overlapped or chunk not in self.armed:
            return  # reduced after the backward, or not this chunk's last backward yet
        b = self.owner[id(p)]
        self.buckets[b].ready += 1
        if self.buckets[b].ready == len(self.buckets[b].params):
            self._ready.put(b)

    def start_comm_thread(self) -> threading.Thread | None:
        """Overlapped mode: a thread reduce-scatters buckets in bucket order as they turn ready."""
        if not self.overlapped:
            return None
        for b in self.buckets:
            b.ready = 0
        self._shards = {}
        self._comm_error = None
        arrived: set[int] = set()

        def run() -> None:
            try:
                for b in range(len(self.buckets)):
                    while b not in arrived:
                        arrived.add(self._ready.get(timeout=self.cfg.timeout_s))
                    t = time.perf_counter()
                    self._shards[b] = self._reduce(b)  # SYNC-4 (overlapped with backward)
                    self.rec.record("dp-sync", t, time.perf_counter(), -1, self.buckets[b].chunk,
                                    f"{self.label}reduce-scatter bucket {b} (async)")
            except BaseException as e:  # re-raised in the main thread
                self._comm_error = e

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def _tag(self, b: int, phase: int) -> int:
        """Tag of bucket b's ring steps this iteration: phase 0 reduce-scatter, 1 all-gather
        (p - 1 steps each, so the tags of every bucket, phase and iteration differ)."""
        p = self.group.size
        return ((self.rec.iteration * len(self.buckets) + b) * 2 + phase) * p

    def _reduce(self, b: int) -> torch.Tensor:
        flat = self.buckets[b].flat_grad()
        shard = ring_reduce_scatter(self.group, flat, self._tag(b, 0))
        return shard if self.cfg.mutation == "reduce-scatter-no-dp" else shard.div_(self.plan.dp)

    def _reduced_grads(self, comm: threading.Thread | None) -> dict[int, torch.Tensor]:
        """Each bucket's gradient (or this rank's shard of it) summed over the group / dp."""
        group = self.group
        t = time.perf_counter()
        if group is None:  # dp = 1, or experts whose replicas are all in their EP group
            grads = {b: bucket.flat_grad().div_(self.plan.dp)
                     for b, bucket in enumerate(self.buckets)}
        elif comm is not None:
            comm.join()  # SYNC-4: the asynchronous reduce-scatters are done
            if self._comm_error is not None:
                raise TestbedError(f"overlapped gradient reduction failed: {self._comm_error}")
            grads = self._shards
        elif self.sharded:
            grads = {b: self._reduce(b) for b in range(len(self.buckets))}  # SYNC-4
        else:
            grads = {}
            for b, bucket in enumerate(self.buckets):
                flat = bucket.flat_grad()
                group.pg.allreduce([flat]).wait()  # SYNC-4
                grads[b] = flat if self.cfg.mutation == "all-reduce-no-dp" \
                    else flat.div_(self.plan.dp)
        self.rec.record("dp-sync", t, time.perf_counter(),
                        detail=f"{self.label}wait gradient reduction")
        return grads

    # -- the step and the parameter all-gather (SYNC-5)

    def sync_and_step(self, comm: threading.Thread | None) -> None:
        """Reduce the gradients (waiting for `comm`, the overlapped reduction), step, and bring
        every parameter up to date (overlapped sharded mode: start gathering them)."""
        grads = self._reduced_grads(comm)
        if self.cfg.mutation == "grad-x7":
            grads = {b: g * 7 for b, g in grads.items()}
        flats = self._step(grads)
        if self.sharded and self.plan.optimizer.overlapped:
            self._start_gather(flats)
            return
        t = time.perf_counter()
        for b, bucket in enumerate(self.buckets):
            if self.sharded:
                all_gather(self.group, flats[b], self._tag(b, 1))  # SYNC-5
            bucket.write_params(flats[b])
        if self.sharded:
            self.rec.record("dp-sync", t, time.perf_counter(),
                            detail=f"{self.label}all-gather parameters")

    def _step(self, grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Step this rank's part of every bucket (sharded: its shard); the flat parameters."""
        t = time.perf_counter()
        flats = {}
        self.clock.start()
        for b, bucket in enumerate(self.buckets):
            flat = bucket.flat_param()
            local = flat.view(self.group.size, -1)[self.group.group_rank] if self.sharded \
                else flat
            if self.optimizer_s_per_param is not None:  # the step of this shard, as a wait
                self.clock.wait(self.optimizer_s_per_param * local.numel())
            else:
                self.optimizer.step(b, local, grads[b])
            flats[b] = flat
        self.rec.record("optimizer", t, time.perf_counter(), detail=self.label.strip())
        return flats

    def _start_gather(self, flats: dict[int, torch.Tensor]) -> None:
        """Overlapped mode: all-gather the updated parameters in the background, bucket by bucket
        in forward order; the next iteration's forward waits for each bucket only just before the
        first module that uses it (Megatron's --overlap-param-gather, Holmes section 3.4; the
        simulator releases compute bucket by bucket too)."""
        # Buckets were cut from each chunk's last parameter backwards: forward order is chunk
        # order, then descending bucket index.
        order = sorted(range(len(self.buckets)), key=lambda b: (self.buckets[b].chunk, -b))
        events = {b: threading.Event() for b in order}
        tags = {b: self._tag(b, 1) for b in order}  # this iteration's, before it moves on
        self.gathered = dict(events)  # the forwards pop theirs; the thread keeps `events`
        self._gather_error = None

        def run() -> None:
            try:
                for b in order:
                    t = time.perf_counter()
                    all_gather(self.group, flats[b], tags[b])  # SYNC-5 (overlapped with forward)
                    self.rec.record("dp-sync", t, time.perf_counter(), -1, self.buckets[b].chunk,
                                    f"{self.label}all-gather bucket {b} (async)")
                    events[b].set()
            except BaseException as e:  # re-raised by the waiting forward
                self._gather_error = e
                for ev in events.values():
                    ev.set()

        self._gather_flats = flats
        self._gather = threading.Thread(target=run, daemon=True)
        self._gather.start()

    def install_gather_waits(self, stages: list[Stage]) -> None:
        """Forward pre-hooks: a module waits for the buckets holding its own parameters."""
        for stage in stages:
            for module in stage.modules():
                mine = sorted({self.owner[id(p)] for p in module.parameters(recurse=False)
                               if id(p) in self.owner}, reverse=True)  # forward order
                if mine:
                    module.register_forward_pre_hook(self._gather_wait_hook(mine))

    def _gather_wait_hook(self, buckets: list[int]):
        def hook(_module, _args) -> None:
            for b in buckets:
                self.wait_bucket(b)
        return hook

    def wait_bucket(self, b: int) -> None:
        """Before the first use of bucket b's parameters: its background all-gather."""
        ev = self.gathered.pop(b, None)
        if ev is None:
            return
        t = time.perf_counter()
        ev.wait(timeout=self.cfg.timeout_s)
        if self._gather_error is not None or not ev.is_set():
            raise TestbedError(f"overlapped parameter all-gather failed: {self._gather_error}")
        self.buckets[b].write_params(self._gather_flats[b])
        end = time.perf_counter()
        self.gather_wait_s += end - t
        self.rec.record("dp-sync", t, end, -1, self.buckets[b].chunk,
                        f"{self.label}wait parameter all-gather bucket {b}")

    def finish(self) -> None:
        """Complete a background all-gather so the final parameters are in place."""
        for b in sorted(self.gathered):
            self.wait_bucket(b)
        if self._gather is not None:
            self._gather.join()


class GradientSync:
    """A rank's whole data-parallel side: its `DataParallel` parts (the dense parameters' over
    the DATA group, under expert parallelism the routed experts' over the EXPERT_DATA group; module
    docstring), driven together. Bucket keys are (part, bucket) pairs."""

    def __init__(self, parts: list[DataParallel]) -> None:
        self.parts = parts
        self.owner = {pid: (k, b) for k, part in enumerate(parts)
                      for pid, b in part.owner.items()}

    @property
    def overlapped(self) -> bool:
        return any(part.overlapped for part in self.parts)

    @property
    def gather_wait_s(self) -> float:
        """Seconds forwards waited for parameter buckets, all parts."""
        return sum(part.gather_wait_s for part in self.parts)

    @property
    def gathered(self) -> set[tuple[int, int]]:
        """Buckets whose background all-gather a forward has not waited for yet."""
        return {(k, b) for k, part in enumerate(self.parts) for b in part.gathered}

    def wait_bucket(self, key: tuple[int, int]) -> None:
        k, b = key
        self.parts[k].wait_bucket(b)

    def grad_ready(self, p: torch.nn.Parameter, chunk: int) -> None:
        self.parts[self.owner[id(p)][0]].grad_ready(p, chunk)

    def arm(self, chunk: int) -> None:
        """Chunk `chunk`'s last backward runs: its gradients become final."""
        for part in self.parts:
            part.armed.add(chunk)

    def disarm(self) -> None:
        for part in self.parts:
            part.armed.clear()

    def install_hooks(self, stages: list[Stage]) -> None:
        for part in self.parts:
            if part.overlapped:
                part.install_hooks(stages)

    def install_gather_waits(self, stages: list[Stage]) -> None:
        for part in self.parts:
            if part.overlapped and part.sharded:
                part.install_gather_waits(stages)

    def start_comm_threads(self) -> list[threading.Thread | None]:
        return [part.start_comm_thread() for part in self.parts]

    def sync_and_step(self, comms: list[threading.Thread | None]) -> None:
        """Each part's reduction, step and parameter all-gather, in part order."""
        for part, comm in zip(self.parts, comms, strict=True):
            part.sync_and_step(comm)

    def finish(self) -> None:
        for part in self.parts:
            part.finish()
