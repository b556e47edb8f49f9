"""One rank of a real run: `python -m holmes_sim.backend.worker --config RUN.json --rank R`.

The rank executes exactly `plan.schedule().stage_ops[pp_rank]`, moving activations and
gradients over the plan's PIPELINE groups, then synchronises gradients over its DATA group as the
plan's optimizer mode says, and steps a deterministic SGD or Adam. It writes one JSON result
file (timestamps from time.perf_counter(), seconds; CLOCK_MONOTONIC is system-wide on Linux so
ranks on one host share a time base).

Synchronisation points (named SYNC-n in the code):
  SYNC-1 barrier before each iteration (all ranks start together): the gloo world group on
          the testbed, a separate gloo group under NCCL (BARRIER_GROUP).
  SYNC-2 blocking receive of an activation (forward) or gradient (backward).
  SYNC-3 wait for this iteration's outstanding non-blocking sends.
  SYNC-4 gradient reduction on the DATA group (all-reduce or reduce-scatter).
  SYNC-5 parameter all-gather on the DATA group (sharded optimizer modes; overlapped mode: a
          forward pre-hook waits for each bucket just before the first module using it).
  SYNC-6 the same barrier after the last iteration, before exit.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from holmes_sim.backend.groups import (
    BuiltGroup,
    build_groups,
    data_group,
    default_interface_of,
    init_world,
    pipeline_group,
    tensor_group,
)
from holmes_sim.backend.model import (
    GPTConfig,
    Stage,
    TensorParallel,
    build_full_model,
    build_stage,
    shard_placements,
    synthetic_batch,
)
from holmes_sim.errors import TestbedError
from holmes_sim.plan import Plan


@dataclass(slots=True)
class RunConfig:
    """Everything a rank needs besides the plan.

    Attributes:
        model: the GPT shape.
        micro_batch_size: sequences per micro-batch.
        iterations: total iterations run, warm-up included.
        warmup: leading iterations left out of the timing summary.
        lr: learning rate.
        optimizer: "adam" or "sgd".
        store: rendezvous: {"kind": "file", "path": P} or {"kind": "tcp", "host": H, "port": N};
            empty: launch fills in a FileStore in its temp dir.
        interface_map: plan NIC name -> interface name; key "*" maps every NIC (local tests: "lo").
            NICs not mapped keep their name (the testbed names interfaces like NICs).
        world_interfaces: per-rank interface of the world (barrier) group, or empty: gloo default.
        output_dir: where rank_R.json / rank_R.log go; empty: launch fills it in.
        timeout_s: gloo operation and rendezvous timeout, seconds.
        bucket_numel: gradient elements per DP bucket (the overlapped mode's unit of launch).
        torch_threads: intra-op threads per rank (1: ranks share few cores honestly).
        dry_run: build groups and stages, then exit without training.
    """

    model: GPTConfig = field(default_factory=GPTConfig)
    micro_batch_size: int = 2
    iterations: int = 3
    warmup: int = 1
    lr: float = 1e-3
    optimizer: str = "adam"
    store: dict = field(default_factory=dict)
    interface_map: dict = field(default_factory=dict)
    world_interfaces: list = field(default_factory=list)
    output_dir: str = ""
    timeout_s: float = 60.0
    bucket_numel: int = 1 << 16
    torch_threads: int = 1
    dry_run: bool = False
    backend: str = "gloo"
    """"gloo" (CPU, emulated testbed) or "nccl" (GPUs, under torchrun; see backend/nccl.py)."""
    nic_devices: dict = field(default_factory=dict)
    """NCCL only: plan NIC name -> the site's HCA or interface name (e.g. "ib0": "mlx5_0")."""
    roce_fabrics: list = field(default_factory=list)
    """NCCL only: fabrics that are RoCE (get NCCL_IB_GID_INDEX); empty: fabrics named *roce*."""
    roce_gid_index: int = 3
    """NCCL only: the GID index of RoCE v2 on the site's HCAs (`show_gids`)."""
    bootstrap_ifname: str = ""
    """NCCL only: the Ethernet interface for NCCL's bootstrap on RDMA groups and for the gloo
    barrier group; empty: NCCL's and gloo's own choice."""
    node_hosts: dict = field(default_factory=dict)
    """NCCL only: plan node name -> host name, for the placement check (unmapped: equal)."""
    dump_params: bool = False
    """Put every final parameter (canonical full-model name -> values) in the rank's result;
    for the gradient-equality tests on tiny models."""
    mutation: str = ""
    """Test only: inject a known bug (one of MUTATIONS) so the equality tests can prove they
    catch it. Empty in every real run."""
    emulated_compute: list = field(default_factory=list)
    """Per rank, the compute durations to emulate (seconds; keys of EMULATED_KEYS), or empty:
    real compute. Emulated, every compute op (embedding, each layer, head, forward and
    backward, the optimizer step) becomes a precise wait of its duration while every byte still
    moves: activations and gradients of the real shapes over the pipeline groups, gradient
    buckets over the DP group, the overlap threads as in a real run. Waiting ranks leave the
    host's cores to the communication, so a busy host does not change what is measured; the
    simulator predicts with the same durations. Losses are not computed (the result has none)."""
    realtime_priority: int = 0
    """> 0: the rank (and every thread it starts) runs under SCHED_FIFO at this priority, so a
    waiting rank wakes on time and its messages move when due although other processes keep
    the host's cores busy (the kernel's RT throttling still leaves them 5%). For emulated
    compute, whose ranks mostly wait; 0: the default scheduler. Without the permission the
    rank runs on, and its result says so."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> RunConfig:
        d = json.loads(text)
        d["model"] = GPTConfig(**d["model"])
        return RunConfig(**d)

    def interface_of(self, nic: str) -> str:
        """Interface a plan NIC maps to (see `interface_map`)."""
        if "*" in self.interface_map:
            return self.interface_map["*"]
        return self.interface_map.get(nic, default_interface_of(nic))


# Known bugs the gradient-equality tests must catch (RunConfig.mutation).
MUTATIONS = ("reduce-scatter-no-dp", "all-reduce-no-dp", "no-microbatch-scaling", "grad-x7",
             "tp-no-input-grad-reduce")
# The durations an emulated rank waits (RunConfig.emulated_compute), as in a compute profile.
EMULATED_KEYS = ("layer_forward_s", "layer_backward_s", "embedding_forward_s",
                 "embedding_backward_s", "head_forward_s", "head_backward_s",
                 "optimizer_s_per_param")


class PreciseWait:
    """Waits to deadlines: sleep until `spin_s` before one, then spin (time.sleep alone
    overshoots by 50-100 us and more on a busy core). Consecutive waits of one op run to a
    running deadline, so one wait's overshoot shortens the next instead of adding up."""

    def __init__(self, spin_s: float = 2e-4) -> None:
        self.spin_s = spin_s
        self.deadline = 0.0
        self.waited_s = 0.0  # total requested wait (what the simulator charges)

    def start(self) -> None:
        """A new op begins now: its waits count from here."""
        self.deadline = time.perf_counter()

    def wait(self, duration_s: float) -> None:
        self.waited_s += duration_s
        self.deadline += duration_s
        remaining = self.deadline - time.perf_counter()
        if remaining > self.spin_s:
            time.sleep(remaining - self.spin_s)
        while time.perf_counter() < self.deadline:
            pass


# ----------------------------------------------------------------------------- optimizer


class FlatOptimizer:
    """SGD or Adam (no weight decay) on flat fp32 tensors; state keyed by a caller's id.

    Elementwise, so a shard of a flat parameter gets exactly the update the full tensor would.
    """

    def __init__(self, kind: str, lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8) -> None:
        if kind not in ("adam", "sgd"):
            raise TestbedError(f"optimizer must be 'adam' or 'sgd', got {kind!r}")
        self.kind, self.lr, self.betas, self.eps = kind, lr, betas, eps
        self.state: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    @torch.no_grad()
    def step(self, key: int, param: torch.Tensor, grad: torch.Tensor) -> None:
        if self.kind == "sgd":
            param.add_(grad, alpha=-self.lr)
            return
        m, v, t = self.state.get(key) or (torch.zeros_like(param), torch.zeros_like(param), 0)
        b1, b2 = self.betas
        t += 1
        m.mul_(b1).add_(grad, alpha=1 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        denom = (v / (1 - b2**t)).sqrt_().add_(self.eps)
        param.addcdiv_(m, denom, value=-self.lr / (1 - b1**t))
        self.state[key] = (m, v, t)


# ----------------------------------------------------------------------------- DP buckets


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


def make_buckets(stages: list[Stage], chunk_order: list[int], dp: int,
                 bucket_numel: int) -> list[Bucket]:
    """Buckets in the order their gradients become final: chunks by their last backward, within
    a chunk parameters in reverse registration order (backward reaches the last layers first)."""
    buckets: list[Bucket] = []
    for c in chunk_order:
        current: list[torch.nn.Parameter] = []
        for p in reversed(list(stages[c].parameters())):
            current.append(p)
            if sum(q.numel() for q in current) >= bucket_numel:
                buckets.append(_bucket(current, c, dp))
                current = []
        if current:
            buckets.append(_bucket(current, c, dp))
    return buckets


def _bucket(params: list[torch.nn.Parameter], chunk: int, dp: int) -> Bucket:
    n = sum(p.numel() for p in params)
    return Bucket(params, chunk, n, -(-n // dp) * dp)


def ring_reduce_scatter(group: BuiltGroup, flat: torch.Tensor, tag: int) -> torch.Tensor:
    """Sum `flat` over the group; returns this member's reduced shard (a view of `flat`).

    A ring: p - 1 steps, each sending one 1/p shard, so every member sends (p-1)/p * N elements,
    the volume the analytic model assumes. (gloo's own reduce_scatter in torch 2.13 moves an
    all-reduce's volume, 2 (p-1)/p * N, measured on loopback.) Member i ends with shard i.
    """
    p, i = group.size, group.group_rank
    shards = flat.view(p, -1)
    right, left = (i + 1) % p, (i - 1) % p
    incoming = torch.empty_like(shards[0])
    for step in range(p - 1):
        send = group.send(shards[(i - step - 1) % p], right, tag + step)
        group.recv(incoming, left, tag + step).wait()
        shards[(i - step - 2) % p].add_(incoming)
        send.wait()  # the next step reads the shard this step just summed into, not this one
    return shards[i]


def all_gather(group: BuiltGroup, flat: torch.Tensor, tag: int) -> None:
    """Fill every shard of `flat` from its owner: a ring of p - 1 steps, each passing one shard
    on, so every member sends (p-1)/p * N elements (NCCL's ring all-gather; the volume the
    analytic model assumes). Point-to-point like `ring_reduce_scatter`: gloo's own allgather
    ran 1.4x slower than its bytes at the NIC's rate on the testbed (0.5 MB buckets, p = 2,
    100 Mbit/s, rate-sized shaper buckets: 122 ms where send/recv took 87 ms)."""
    p, i = group.size, group.group_rank
    shards = flat.view(p, -1)
    right, left = (i + 1) % p, (i - 1) % p
    for step in range(p - 1):
        send = group.send(shards[(i - step) % p], right, tag + step)
        group.recv(shards[(i - step - 1) % p], left, tag + step).wait()
        send.wait()


# ----------------------------------------------------------------------------- the rank


class Recorder:
    """Per-op timing records (seconds, perf_counter)."""

    def __init__(self) -> None:
        self.ops: list[dict] = []
        self.iteration = 0

    def record(self, kind: str, start: float, end: float, microbatch: int = -1, chunk: int = -1,
               detail: str = "") -> None:
        self.ops.append({"iteration": self.iteration, "kind": kind, "microbatch": microbatch,
                         "chunk": chunk, "start": start, "end": end, "detail": detail})


class Rank:
    """State and behaviour of one rank during a run."""

    def __init__(self, plan: Plan, cfg: RunConfig, rank: int, groups: list[BuiltGroup]) -> None:
        self.plan, self.cfg, self.rank, self.groups = plan, cfg, rank, groups
        self.sched = plan.schedule()
        self.pp_rank, self.dp_rank, self.tp_rank = plan.coords(rank)
        self.num_virtual = plan.pp * plan.num_chunks
        self.device = DEVICE
        self.tp_group = tensor_group(groups) if plan.tp > 1 else None
        self._tp_calls = 0  # TP collectives so far: both ranks of a group run them in one order
        self.tp_collectives = 0  # of the iterations (not the parameter dump)
        self._tp_comm_s = 0.0  # seconds spent in them (not emulated compute)
        self.tp = None if self.tp_group is None else \
            TensorParallel(plan.tp, self.tp_rank, self._tp_all_reduce, self._tp_all_gather,
                           reduce_input_grads=cfg.mutation != "tp-no-input-grad-reduce")
        self.stages = [s.to(self.device) for s in
                       build_stages(plan, cfg.model, self.pp_rank, self.tp)]
        self.dp_group = data_group(groups) if plan.dp > 1 else None
        self.optimizer = FlatOptimizer(cfg.optimizer, cfg.lr)
        ops = self.sched.stage_ops[self.pp_rank]
        # Index of each chunk's last backward: its gradients are final after that op.
        self.last_backward = {op.chunk: k for k, op in enumerate(ops) if op.kind == "B"}
        chunk_order = sorted(self.last_backward, key=self.last_backward.get)
        self.buckets = make_buckets(self.stages, chunk_order, plan.dp, cfg.bucket_numel)
        self.rec = Recorder()
        self.losses: list[list[float]] = []
        self._armed: set[int] = set()
        self._ready: queue.Queue[int] = queue.Queue()
        # Overlapped mode: the previous step's parameter all-gather, per chunk, still in flight.
        self._gather: threading.Thread | None = None
        self._gather_error: BaseException | None = None
        self._gathered: dict[int, threading.Event] = {}  # bucket -> all-gather done
        self._gather_wait_s = 0.0  # total time forwards waited for parameter buckets
        self.emulated = _emulated_durations(cfg, rank)
        self.clock = PreciseWait()
        # Emulated compute of the measured iterations: requested and actual seconds (the
        # difference is the host's wake-up lag, which no prediction contains).
        self.emulation = {"requested_s": 0.0, "actual_s": 0.0}
        self._training = True  # False once the iterations are done
        self._overlapped = plan.optimizer.overlapped and self.dp_group is not None
        if self.emulated is not None:
            # No autograd runs: gradients are zeros of the parameters' shapes, moved as real
            # ones are; the emulated backward marks them final piece by piece.
            self._pieces = [_pieces(stage, self.emulated, plan.tp) for stage in self.stages]
            self._owner = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket.params}
            for p in self._params():
                p.grad = torch.zeros_like(p)
        elif self._overlapped:
            self._install_hooks()
            if plan.optimizer.sharded:
                self._install_gather_waits()

    # -- pipeline neighbours

    def _peer(self, virtual: int) -> int:
        stage, _ = self.sched.stage_of_virtual(virtual)
        return self.plan.rank(stage, self.dp_rank, self.tp_rank)

    # -- tensor parallelism

    def _tp_tag(self) -> int:
        """The next TP collective's tags (p - 1 ring steps in each of two phases)."""
        self._tp_calls += 1
        self.tp_collectives += self._training
        return (self._tp_calls % (1 << 24)) * 2 * self.plan.tp

    def _tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The TP group's sum of `x`, a new tensor: the ring reduce-scatter and all-gather the
        simulator prices on the intra-node link [N21, section 3.2]."""
        t = time.perf_counter()
        p = self.plan.tp
        flat = torch.zeros(-(-x.numel() // p) * p, dtype=x.dtype, device=x.device)
        flat[:x.numel()] = x.detach().reshape(-1)
        tag = self._tp_tag()
        ring_reduce_scatter(self.tp_group, flat, tag)
        all_gather(self.tp_group, flat, tag + p)
        self._tp_comm_s += time.perf_counter() - t
        return flat[:x.numel()].view_as(x)

    def _tp_all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every TP member's `x`, stacked in group-rank order: shape (tp, *x.shape)."""
        t = time.perf_counter()
        p = self.plan.tp
        flat = torch.empty(x.numel() * p, dtype=x.dtype, device=x.device)
        flat.view(p, -1)[self.tp_rank].copy_(x.detach().reshape(-1))
        all_gather(self.tp_group, flat, self._tp_tag())
        self._tp_comm_s += time.perf_counter() - t
        return flat.view(p, *x.shape)

    def _tp_slice(self, tensor: torch.Tensor) -> torch.Tensor:
        """This TP rank's slice of a pipeline message (each rank sends 1/tp of it)."""
        return tensor.reshape(self.plan.tp, -1)[self.tp_rank]

    def _tag(self, direction: int, microbatch: int, virtual_dst: int) -> int:
        it = self.rec.iteration
        m, v = self.plan.num_microbatches, self.num_virtual
        return ((it * 2 + direction) * m + microbatch) * v + virtual_dst

    def run_iteration(self, iteration: int) -> None:
        self.rec.iteration = iteration
        if self.emulated is None:
            for p in self._params():
                p.grad = None
        dist.barrier(group=BARRIER_GROUP)  # SYNC-1
        t0 = time.perf_counter()
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        mailbox: dict[tuple[int, int, int], torch.Tensor] = {}  # same-rank hand-over (p == 1)
        pending: list[tuple[object, torch.Tensor]] = []
        losses: list[float] = []
        comm = self._start_comm_thread()
        for k, op in enumerate(self.sched.stage_ops[self.pp_rank]):
            if op.kind == "F":
                self._forward(op.microbatch, op.chunk, inputs, outputs, mailbox, pending, losses)
            else:
                if op.chunk in self.last_backward and self.last_backward[op.chunk] == k:
                    self._armed.add(op.chunk)
                self._backward(op.microbatch, op.chunk, inputs, outputs, mailbox, pending)
        t = time.perf_counter()
        for work, _ in pending:
            work.wait()  # SYNC-3
        self.rec.record("send-wait", t, time.perf_counter())
        self._armed.clear()
        self._dp_sync_and_step(comm)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # SYNC-7: GPU work is asynchronous
        self.rec.ops.append({"iteration": iteration, "kind": "iteration", "microbatch": -1,
                             "chunk": -1, "start": t0, "end": time.perf_counter(), "detail": ""})
        if losses:
            self.losses.append(losses)

    def _forward(self, mb: int, chunk: int, inputs: dict, outputs: dict, mailbox: dict,
                 pending: list, losses: list) -> None:
        v = self.sched.virtual_stage(self.pp_rank, chunk)
        stage = self.stages[chunk]
        tokens, targets = (t.to(self.device) for t in synthetic_batch(
            self.cfg.model, self.rec.iteration, mb, self.cfg.micro_batch_size, self.dp_rank,
            self.plan.dp))
        # Received activations are leaves that need a gradient: it is sent back in the backward.
        x = tokens if v == 0 else self._receive(0, mb, v, mailbox, chunk).requires_grad_(True)
        t, waited = time.perf_counter(), self._gather_wait_s
        if self.emulated is not None:
            requested, comm = self.clock.waited_s, self._tp_comm_s
            out = self._emulated_forward(chunk, x, v == self.num_virtual - 1)
            t += self._gather_wait_s - waited
            self.rec.record("forward", t, time.perf_counter(), mb, chunk)
            self._count_emulation(self.clock.waited_s - requested,
                                  time.perf_counter() - t - (self._tp_comm_s - comm))
            inputs[(mb, chunk)], outputs[(mb, chunk)] = x, out
            if v < self.num_virtual - 1:
                self._send(0, mb, v + 1, out, mailbox, pending)
            return
        out = stage(x, targets if v == self.num_virtual - 1 else None)  # may wait at SYNC-5
        t += self._gather_wait_s - waited  # the waits are recorded as dp-sync, not as forward
        if v == self.num_virtual - 1:
            losses.append(out.item())
            if self.cfg.mutation != "no-microbatch-scaling":
                out = out / self.plan.num_microbatches
        self.rec.record("forward", t, time.perf_counter(), mb, chunk)
        inputs[(mb, chunk)], outputs[(mb, chunk)] = x, out
        if v < self.num_virtual - 1:
            self._send(0, mb, v + 1, out.detach(), mailbox, pending)

    def _backward(self, mb: int, chunk: int, inputs: dict, outputs: dict, mailbox: dict,
                  pending: list) -> None:
        v = self.sched.virtual_stage(self.pp_rank, chunk)
        out, x = outputs.pop((mb, chunk)), inputs.pop((mb, chunk))
        grad = None if v == self.num_virtual - 1 else self._receive(1, mb, v, mailbox, chunk)
        t = time.perf_counter()
        if self.emulated is not None:
            requested, comm = self.clock.waited_s, self._tp_comm_s
            self._emulated_backward(chunk)
            self.rec.record("backward", t, time.perf_counter(), mb, chunk)
            self._count_emulation(self.clock.waited_s - requested,
                                  time.perf_counter() - t - (self._tp_comm_s - comm))
            if v > 0:
                self._send(1, mb, v - 1, torch.zeros_like(x), mailbox, pending)
            return
        torch.autograd.backward(out, grad)
        self.rec.record("backward", t, time.perf_counter(), mb, chunk)
        if v > 0:
            self._send(1, mb, v - 1, x.grad, mailbox, pending)

    # -- emulated compute (RunConfig.emulated_compute)

    def _count_emulation(self, requested_s: float, actual_s: float) -> None:
        if self.rec.iteration >= self.cfg.warmup:
            self.emulation["requested_s"] += requested_s
            self.emulation["actual_s"] += actual_s

    def _emulated_forward(self, chunk: int, x: torch.Tensor, last: bool) -> torch.Tensor | None:
        """Wait each piece's forward duration, in order, parameter by parameter (each its share
        of the piece, by size: a linear layer's FLOPs are proportional to its weights); in the
        overlapped sharded mode each share first waits for its parameter's bucket, as the real
        forward's pre-hooks make a module wait, and as the simulator releases a chunk's first
        forward bucket by bucket. Returns an activation of the real shape (None on the last
        virtual stage: the loss)."""
        gate = self._overlapped and self.plan.optimizer.sharded
        self.clock.start()
        for forward_s, _, params, layer in self._pieces[chunk]:
            self._emulated_piece(forward_s, layer, params, gate=gate)
        if last:
            return None
        c = self.cfg.model
        return torch.zeros(self.cfg.micro_batch_size, c.block_size, c.n_embd, device=self.device)

    def _emulated_backward(self, chunk: int) -> None:
        """Wait each piece's backward duration, last piece first, parameter by parameter in
        reverse; after its share each parameter's gradient is final, as autograd's accumulation
        hooks fire one by one (overlapped: buckets launch as they fill, as the simulator
        releases them during the backward)."""
        self.clock.start()
        release = chunk if self._overlapped else None
        for _, backward_s, params, layer in reversed(self._pieces[chunk]):
            self._emulated_piece(backward_s, layer, params[::-1], release=release)

    def _emulated_piece(self, seconds: float, layer: bool, params: list, gate: bool = False,
                        release: int | None = None) -> None:
        """One piece's wait, shared out over `params` (in compute order) by size, one wait per
        run of parameters in one bucket (few waits: each ends in a short spin); `gate`: a run
        first waits for its bucket's all-gather; `release` (a chunk): a run's gradients are
        final after its share. A TP layer runs its two all-reduces of the layer's activations
        (2 per forward and per backward [N21, 3.2]) after each half of its time."""
        total = sum(p.numel() for p in params)
        if not total:
            self.clock.wait(seconds)
            return
        cuts = [total / 2, total] if layer and self.tp is not None else []
        done = 0
        for bucket, run in itertools.groupby(params, key=lambda p: self._owner.get(id(p))):
            run = list(run)
            if gate and bucket in self._gathered:
                self._wait_bucket(bucket)
                self.clock.deadline = max(self.clock.deadline, time.perf_counter())
            end = done + sum(p.numel() for p in run)
            while cuts and cuts[0] <= end:
                cut = cuts.pop(0)
                self.clock.wait(seconds * (cut - done) / total)
                done = cut
                self._emulated_tp_all_reduce()
            self.clock.wait(seconds * (end - done) / total)
            done = end
            if release is not None:
                for p in run:
                    self._grad_ready(p, release)

    def _emulated_tp_all_reduce(self) -> None:
        """A TP all-reduce of one layer's activations (b s h) between emulated compute."""
        c = self.cfg.model
        self._tp_all_reduce(torch.zeros(self.cfg.micro_batch_size, c.block_size, c.n_embd,
                                        device=self.device))
        self.clock.deadline = max(self.clock.deadline, time.perf_counter())

    def _receive(self, direction: int, mb: int, v: int, mailbox: dict, chunk: int) -> torch.Tensor:
        """Activation (direction 0) for virtual stage v from v-1, or gradient (1) from v+1."""
        src_v = v - 1 if direction == 0 else v + 1
        src = self._peer(src_v)
        if src == self.rank:
            return mailbox.pop((direction, mb, v))
        group = pipeline_group(self.groups, src, self.rank) if direction == 0 \
            else pipeline_group(self.groups, self.rank, src)
        c = self.cfg.model
        shape = (self.cfg.micro_batch_size, c.block_size, c.n_embd)
        buf = torch.empty(shape, device=self.device)
        part = buf if self.tp is None else self._tp_slice(buf)
        t = time.perf_counter()
        group.recv(part, group.peer(src), self._tag(direction, mb, v)).wait()  # SYNC-2
        if self.tp is not None:  # Megatron's scatter-gather of pipeline messages [N21, 4.1]
            buf = self._tp_all_gather(part).view(shape)
        self.rec.record("recv", t, time.perf_counter(), mb, chunk,
                        "activation" if direction == 0 else "gradient")
        return buf

    def _send(self, direction: int, mb: int, v_dst: int, tensor: torch.Tensor, mailbox: dict,
              pending: list) -> None:
        dst = self._peer(v_dst)
        if dst == self.rank:
            mailbox[(direction, mb, v_dst)] = tensor.clone()
            return
        group = pipeline_group(self.groups, self.rank, dst) if direction == 0 \
            else pipeline_group(self.groups, dst, self.rank)
        tensor = tensor.contiguous() if self.tp is None else self._tp_slice(tensor).contiguous()
        # Non-blocking: a blocked send could deadlock 1F1B; waited at SYNC-3.
        work = group.send(tensor, group.peer(dst), self._tag(direction, mb, v_dst))
        pending.append((work, tensor))  # the tensor must live until the send completes

    # -- data parallelism

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for s in self.stages for p in s.parameters()]

    def _install_hooks(self) -> None:
        self._owner = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket.params}
        for c, stage in enumerate(self.stages):
            for p in stage.parameters():
                p.register_post_accumulate_grad_hook(lambda q, c=c: self._grad_ready(q, c))

    def _grad_ready(self, p: torch.nn.Parameter, chunk: int) -> None:
        """p's gradient was accumulated; queue its bucket once every member's is final."""
        if chunk not in self._armed:
            return  # not this chunk's last backward: the gradient is not final yet
        b = self._owner[id(p)]
        self.buckets[b].ready += 1
        if self.buckets[b].ready == len(self.buckets[b].params):
            self._ready.put(b)

    def _start_comm_thread(self) -> threading.Thread | None:
        """Overlapped mode: a thread reduce-scatters buckets in bucket order as they turn ready."""
        if not (self.plan.optimizer.overlapped and self.dp_group is not None):
            return None
        for b in self.buckets:
            b.ready = 0
        self._shards: dict[int, torch.Tensor] = {}
        self._comm_error: BaseException | None = None
        arrived: set[int] = set()

        def run() -> None:
            try:
                for b in range(len(self.buckets)):
                    while b not in arrived:
                        arrived.add(self._ready.get(timeout=self.cfg.timeout_s))
                    t = time.perf_counter()
                    self._shards[b] = self._reduce(b)  # SYNC-4 (overlapped with backward)
                    self.rec.record("dp-sync", t, time.perf_counter(), -1, self.buckets[b].chunk,
                                    f"reduce-scatter bucket {b} (async)")
            except BaseException as e:  # re-raised in the main thread
                self._comm_error = e

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def _dp_tag(self, b: int, phase: int) -> int:
        """Tag of bucket b's ring steps this iteration: phase 0 reduce-scatter, 1 all-gather
        (p - 1 steps each, so the tags of every bucket, phase and iteration differ)."""
        p = self.dp_group.size
        return ((self.rec.iteration * len(self.buckets) + b) * 2 + phase) * p

    def _reduce(self, b: int) -> torch.Tensor:
        flat = self.buckets[b].flat_grad()
        shard = ring_reduce_scatter(self.dp_group, flat, self._dp_tag(b, 0))
        return shard if self.cfg.mutation == "reduce-scatter-no-dp" else shard.div_(self.plan.dp)

    def _dp_sync_and_step(self, comm: threading.Thread | None) -> None:
        mode, group = self.plan.optimizer, self.dp_group
        t = time.perf_counter()
        if group is None:
            grads = {b: bucket.flat_grad() for b, bucket in enumerate(self.buckets)}
        elif comm is not None:
            comm.join()  # SYNC-4: the asynchronous reduce-scatters are done
            if self._comm_error is not None:
                raise TestbedError(f"overlapped gradient reduction failed: {self._comm_error}")
            grads = self._shards
        elif mode.sharded:
            grads = {b: self._reduce(b) for b in range(len(self.buckets))}  # SYNC-4
        else:
            grads = {}
            for b, bucket in enumerate(self.buckets):
                flat = bucket.flat_grad()
                group.pg.allreduce([flat]).wait()  # SYNC-4
                grads[b] = flat if self.cfg.mutation == "all-reduce-no-dp" \
                    else flat.div_(self.plan.dp)
        self.rec.record("dp-sync", t, time.perf_counter(), detail="wait gradient reduction")
        if self.cfg.mutation == "grad-x7":
            grads = {b: g * 7 for b, g in grads.items()}
        t = time.perf_counter()
        sharded = group is not None and mode.sharded
        flats = {}
        self.clock.start()
        for b, bucket in enumerate(self.buckets):
            flat = bucket.flat_param()
            local = flat.view(group.size, -1)[group.group_rank] if sharded else flat
            if self.emulated is not None:  # the step of this shard's parameters, as a wait
                self.clock.wait(self.emulated["optimizer_s_per_param"] * local.numel())
            else:
                self.optimizer.step(b, local, grads[b])
            flats[b] = flat
        self.rec.record("optimizer", t, time.perf_counter())
        if sharded and mode.overlapped:
            self._start_gather(flats)
            return
        t = time.perf_counter()
        for b, bucket in enumerate(self.buckets):
            if sharded:
                all_gather(group, flats[b], self._dp_tag(b, 1))  # SYNC-5
            bucket.write_params(flats[b])
        if sharded:
            self.rec.record("dp-sync", t, time.perf_counter(), detail="all-gather parameters")

    def _start_gather(self, flats: dict[int, torch.Tensor]) -> None:
        """Overlapped mode: all-gather the updated parameters in the background, bucket by bucket
        in forward order; the next iteration's forward waits for each bucket only just before the
        first module that uses it (Megatron's --overlap-param-gather, Holmes section 3.4; the
        simulator releases compute bucket by bucket too)."""
        # Buckets were cut from each chunk's last parameter backwards: forward order is chunk
        # order, then descending bucket index.
        order = sorted(range(len(self.buckets)), key=lambda b: (self.buckets[b].chunk, -b))
        events = {b: threading.Event() for b in order}
        tags = {b: self._dp_tag(b, 1) for b in order}  # this iteration's, before it moves on
        self._gathered = dict(events)  # the forwards pop theirs; the thread keeps `events`
        self._gather_error = None

        def run() -> None:
            try:
                for b in order:
                    t = time.perf_counter()
                    all_gather(self.dp_group, flats[b], tags[b])  # SYNC-5 (overlapped with forward)
                    self.rec.record("dp-sync", t, time.perf_counter(), -1, self.buckets[b].chunk,
                                    f"all-gather bucket {b} (async)")
                    events[b].set()
            except BaseException as e:  # re-raised by the waiting forward
                self._gather_error = e
                for ev in events.values():
                    ev.set()

        self._gather_flats = flats
        self._gather = threading.Thread(target=run, daemon=True)
        self._gather.start()

    def _install_gather_waits(self) -> None:
        """Forward pre-hooks: a module waits for the buckets holding its own parameters."""
        owner = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket.params}
        for stage in self.stages:
            for module in stage.modules():
                mine = sorted({owner[id(p)] for p in module.parameters(recurse=False)},
                              reverse=True)  # forward order
                if mine:
                    module.register_forward_pre_hook(self._gather_wait_hook(mine))

    def _gather_wait_hook(self, buckets: list[int]):
        def hook(_module, _args) -> None:
            for b in buckets:
                self._wait_bucket(b)
        return hook

    def _wait_bucket(self, b: int) -> None:
        """Before the first use of bucket b's parameters: its background all-gather."""
        ev = self._gathered.pop(b, None)
        if ev is None:
            return
        t = time.perf_counter()
        ev.wait(timeout=self.cfg.timeout_s)
        if self._gather_error is not None or not ev.is_set():
            raise TestbedError(f"overlapped parameter all-gather failed: {self._gather_error}")
        self.buckets[b].write_params(self._gather_flats[b])
        end = time.perf_counter()
        self._gather_wait_s += end - t
        self.rec.record("dp-sync", t, end, -1, self.buckets[b].chunk,
                        f"wait parameter all-gather bucket {b}")

    def full_params(self, stage: Stage) -> dict[str, torch.Tensor]:
        """`stage`'s parameters at full-model shape and name: a TP shard summed with its
        group's (`model.shard_placements`); every TP member runs this in the same order."""
        self._training = False
        placed = shard_placements(stage, self.cfg.model)
        values = {name: p.detach() if placed[name] is None else self._tp_all_reduce(placed[name])
                  for name, p in stage.named_parameters()}
        return canonical_params(stage, values)

    def finish(self) -> None:
        """Complete a background all-gather so the final parameters are in place."""
        for b in sorted(self._gathered):
            self._wait_bucket(b)
        if self._gather is not None:
            self._gather.join()


def set_realtime(priority: int) -> str:
    """SCHED_FIFO at `priority` for this process and the threads it starts later (0: leave the
    scheduler alone); what it runs under, for the result."""
    if priority <= 0:
        return "other"
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except (OSError, AttributeError) as e:
        return f"other (SCHED_FIFO refused: {e})"
    return f"fifo:{priority}"


def _emulated_durations(cfg: RunConfig, rank: int) -> dict | None:
    """This rank's emulated durations (RunConfig.emulated_compute), or None: real compute."""
    if not cfg.emulated_compute:
        return None
    if len(cfg.emulated_compute) <= rank:
        raise TestbedError(f"emulated_compute has {len(cfg.emulated_compute)} entries; rank "
                           f"{rank} has none")
    d = cfg.emulated_compute[rank]
    missing = [k for k in EMULATED_KEYS if k not in d]
    bad = [k for k in EMULATED_KEYS if k in d and not 0 <= float(d[k]) < 60]
    if missing or bad:
        raise TestbedError(f"rank {rank} emulated_compute: missing {missing}, out of range {bad}")
    return {k: float(d[k]) for k in EMULATED_KEYS}


def _pieces(stage: Stage, d: dict, tp: int) -> list[tuple[float, float, list, bool]]:
    """A stage's compute pieces in forward order: (forward s, backward s, parameters, whether
    it is a layer). Each of `tp` ranks computes 1/tp of a piece (the simulator's measured
    profile divides so too, `cost.compute.ProfiledCompute`)."""
    out = []
    if stage.embedding is not None:
        out.append((d["embedding_forward_s"] / tp, d["embedding_backward_s"] / tp,
                    list(stage.embedding.parameters()), False))
    for block in stage.blocks:
        out.append((d["layer_forward_s"] / tp, d["layer_backward_s"] / tp,
                    list(block.parameters()), True))
    if stage.head is not None:
        out.append((d["head_forward_s"] / tp, d["head_backward_s"] / tp,
                    list(stage.head.parameters()), False))
    return out


def canonical_params(stage: Stage, values: dict[str, torch.Tensor] | None = None
                     ) -> dict[str, torch.Tensor]:
    """A stage's parameters (or `values` by stage-local name) under the names the full model
    (`build_full_model`) gives them."""
    out = {}
    for name, p in stage.named_parameters():
        if values is not None:
            p = values[name]
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            name = f"blocks.{stage.first_layer + int(i)}.{rest}"
        out[name] = p.detach().cpu()
    return out


def _no_comm(_tensor: torch.Tensor) -> torch.Tensor:
    raise TestbedError("a dry run builds TP stages without communicating")


def build_stages(plan: Plan, config: GPTConfig, pp_rank: int,
                 tp: TensorParallel | None = None) -> list[Stage]:
    """The stage module of every chunk pipeline rank `pp_rank` holds (chunk order), split over
    `tp`'s group when given."""
    if sum(plan.layers_per_stage) != config.n_layer:
        raise TestbedError(f"plan places {sum(plan.layers_per_stage)} layers, "
                           f"the model has {config.n_layer}")
    last = plan.pp * plan.num_chunks - 1
    stages = []
    for c in range(plan.num_chunks):
        v = c * plan.pp + pp_rank
        first = sum(plan.layers_per_stage[:v])
        stages.append(build_stage(config, first, plan.layers_per_stage[v], v == 0, v == last, tp))
    return stages


def summary(rank: int, plan: Plan, groups: list[BuiltGroup], stages: list[Stage]) -> dict:
    """What a rank built: its groups (ranks, nic, interface) and stages (layers, parameters)."""
    pp_rank, dp_rank, tp_rank = plan.coords(rank)
    return {
        "rank": rank, "pp_rank": pp_rank, "dp_rank": dp_rank, "tp_rank": tp_rank,
        "groups": [{"index": g.index, "kind": g.group.kind.value, "ranks": list(g.group.ranks),
                    "group_rank": g.group_rank, "size": g.pg.size(), "nic": g.options.nic,
                    "interface": g.options.interface} for g in groups],
        "stages": [{"chunk": c, "virtual": c * plan.pp + pp_rank, "first_layer": s.first_layer,
                    "num_layers": s.num_layers, "embedding": s.has_embedding, "head": s.has_head,
                    "parameters": sum(p.numel() for p in s.parameters())}
                   for c, s in enumerate(stages)],
    }


def train_reference(config: GPTConfig, micro_batch_size: int, num_microbatches: int, dp: int,
                    iterations: int, lr: float, optimizer: str) -> list[float]:
    """Single-process training on the same global batch; mean micro-batch loss per iteration."""
    return train_reference_model(config, micro_batch_size, num_microbatches, dp, iterations,
                                 lr, optimizer)[0]


def train_reference_model(config: GPTConfig, micro_batch_size: int, num_microbatches: int,
                          dp: int, iterations: int, lr: float,
                          optimizer: str) -> tuple[list[float], Stage]:
    """`train_reference`'s losses and the trained full model."""
    model = build_full_model(config)
    params = list(model.parameters())
    opt = FlatOptimizer(optimizer, lr)
    losses = []
    for it in range(iterations):
        for p in params:
            p.grad = None
        vals = []
        for d in range(dp):
            for mb in range(num_microbatches):
                tokens, targets = synthetic_batch(config, it, mb, micro_batch_size, d, dp)
                loss = model(tokens, targets)
                vals.append(loss.item())
                (loss / (num_microbatches * dp)).backward()
        bucket = _bucket(params, 0, 1)
        flat = bucket.flat_param()
        opt.step(0, flat, bucket.flat_grad())
        bucket.write_params(flat)
        losses.append(sum(vals) / len(vals))
    return losses, model


def open_store(cfg: RunConfig, rank: int, world_size: int) -> dist.Store:
    spec = cfg.store
    if spec.get("kind") == "file":
        return dist.FileStore(spec["path"], world_size)
    if spec.get("kind") == "tcp":
        from datetime import timedelta
        return dist.TCPStore(spec["host"], int(spec["port"]), world_size, is_master=rank == 0,
                             timeout=timedelta(seconds=cfg.timeout_s))
    raise TestbedError(f"run config store must be kind 'file' or 'tcp', got {spec!r}")


def run_rank(plan: Plan, cfg: RunConfig, rank: int) -> dict:
    """Build everything for `rank`, train (unless dry run) and return the result document."""
    torch.set_num_threads(cfg.torch_threads)
    if cfg.mutation and cfg.mutation not in MUTATIONS:
        raise TestbedError(f"unknown mutation {cfg.mutation!r}; known: {', '.join(MUTATIONS)}")
    _emulated_durations(cfg, rank)  # a bad entry fails here, before any peer waits for it
    scheduler = set_realtime(cfg.realtime_priority)
    if cfg.backend == "nccl":
        groups = _init_nccl(plan, cfg, rank)
    else:
        if cfg.world_interfaces:
            os.environ["GLOO_SOCKET_IFNAME"] = cfg.world_interfaces[rank]
        store = open_store(cfg, rank, plan.world_size)
        init_world(store, rank, plan.world_size, cfg.timeout_s)
        groups = build_groups(plan, rank, store, cfg.interface_of, cfg.timeout_s)
    if cfg.dry_run:
        pp_rank, _, tp_rank = plan.coords(rank)
        tp = None if plan.tp == 1 else TensorParallel(plan.tp, tp_rank, _no_comm, _no_comm)
        result = summary(rank, plan, groups, build_stages(plan, cfg.model, pp_rank, tp))
        dist.barrier(group=BARRIER_GROUP)  # SYNC-6
        return result
    worker = Rank(plan, cfg, rank, groups)
    for it in range(cfg.iterations):
        worker.run_iteration(it)
    worker.finish()
    dist.barrier(group=BARRIER_GROUP)  # SYNC-6: no rank leaves while a peer may still talk to it
    result = summary(rank, plan, groups, worker.stages)
    result.update({
        "iterations": [{"index": o["iteration"], "start": o["start"], "end": o["end"]}
                       for o in worker.rec.ops if o["kind"] == "iteration"],
        "ops": [o for o in worker.rec.ops if o["kind"] != "iteration"],
        "losses": worker.losses,
    })
    if worker.emulated is not None:
        result["emulation"] = dict(worker.emulation)
    result["tp_collectives"] = worker.tp_collectives
    result["scheduler"] = scheduler
    if cfg.dump_params:
        result["params"] = {n: t.reshape(-1).tolist() for s in worker.stages
                            for n, t in worker.full_params(s).items()}
    return result


# The device every tensor of this rank lives on: the CPU, or the rank's GPU under NCCL.
DEVICE = torch.device("cpu")
# The group SYNC-1 / SYNC-6 barriers run on: None (the gloo world) on the testbed, a separate
# gloo group under NCCL (no barrier ever builds a world NCCL communicator).
BARRIER_GROUP = None


def _init_nccl(plan: Plan, cfg: RunConfig, rank: int) -> list:
    """torchrun rendezvous (env://), one GPU per rank, every plan group created eagerly.

    The world group gets no `device_id`: torch then creates no world NCCL communicator (it is
    never used), so each plan group's communicator is built by itself under its own settings
    rather than split from the world's. Barriers use a gloo group (see nccl.py)."""
    global DEVICE, BARRIER_GROUP
    import socket
    from datetime import timedelta

    from holmes_sim.backend.groups import build_nccl_groups
    from holmes_sim.backend.nccl import check_placement

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    check_placement(plan, rank, socket.gethostname(), local_rank, cfg.node_hosts)
    DEVICE = torch.device("cuda", local_rank)
    torch.cuda.set_device(DEVICE)
    if cfg.bootstrap_ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = cfg.bootstrap_ifname
    timeout = timedelta(seconds=cfg.timeout_s)
    dist.init_process_group("nccl", rank=rank, world_size=plan.world_size, timeout=timeout)
    BARRIER_GROUP = dist.new_group(backend="gloo", timeout=timeout)
    return build_nccl_groups(plan, rank, cfg.nic_devices, DEVICE, cfg.timeout_s,
                             roce_fabrics=cfg.roce_fabrics, gid_index=cfg.roce_gid_index,
                             bootstrap_ifname=cfg.bootstrap_ifname)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="run config JSON (with plan_path)")
    parser.add_argument("--rank", type=int, default=None,
                        help="this rank (default: $RANK, as torchrun sets it)")
    args = parser.parse_args(argv)
    if args.rank is None:
        args.rank = int(os.environ["RANK"])
    # The overlapped optimizer's communication runs in a Python thread; with the default 5 ms
    # GIL switch interval every hand-over between it and the compute thread can stall a bucket
    # for milliseconds (GPU code overlaps through CUDA streams instead).
    sys.setswitchinterval(2e-4)
    doc = json.loads(Path(args.config).read_text())
    out_dir = Path(doc["run"]["output_dir"])
    # Everything this rank prints, C++ aborts included, goes to its log for launch to report.
    log = os.open(out_dir / f"rank_{args.rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 2)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    try:
        plan = Plan.from_json(Path(doc["plan_path"]).read_text())
        cfg = RunConfig.from_json(json.dumps(doc["run"]))
        result = run_rank(plan, cfg, args.rank)
        tmp = out_dir / f"rank_{args.rank}.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.rename(out_dir / f"rank_{args.rank}.json")
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's destructors can abort once peers have gone.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
