"""One rank of a real run: it executes exactly `plan.schedule().stage_ops[pp_rank]`, moving
activations and gradients over the plan's PIPELINE groups, then synchronises gradients over its
DATA group (the routed experts' over its EXPERT_DATA group) as the plan's optimizer mode says
(`data_parallel.py`), and steps a deterministic SGD or Adam. Timestamps are
time.perf_counter() seconds (CLOCK_MONOTONIC is system-wide on Linux, so ranks on one host share
a time base).

Synchronisation points (named SYNC-n in the code):
  SYNC-1 barrier before each iteration (all ranks start together): the gloo world group on
          the testbed, a separate gloo group under NCCL (`worker.BARRIER_GROUP`).
  SYNC-2 blocking receive of an activation (forward) or gradient (backward).
  SYNC-3 wait for this iteration's outstanding non-blocking sends.
  SYNC-4 gradient reduction on the DATA group (all-reduce or reduce-scatter); the routed
          experts' on the EXPERT_DATA group (`data_parallel.GradientSync`).
  SYNC-5 parameter all-gather on the same groups (sharded optimizer modes; overlapped mode: a
          forward pre-hook waits for each bucket just before the first module using it).
  SYNC-6 the same barrier after the last iteration, before exit.
  SYNC-7 under NCCL, the end of the iteration's GPU work.
  SYNC-8 each EP all-to-all (an MoE layer's dispatch and combine, forward and backward) waits
          for every peer of the rank's EXPERT group (`collectives.pairwise_all_to_all`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from holmes_sim.backend.collectives import ExpertParallelComm, TensorParallelComm
from holmes_sim.backend.data_parallel import (
    DataParallel,
    GradientSync,
    bucket_sizes,
    make_buckets,
    routed_expert_ids,
)
from holmes_sim.backend.emulation import ComputeEmulator, PreciseWait, emulated_durations
from holmes_sim.backend.groups import (
    BuiltGroup,
    data_group,
    expert_data_group,
    expert_group,
    pipeline_group,
    tensor_group,
)
from holmes_sim.backend.model import (
    GPTConfig,
    Stage,
    TensorParallel,
    build_stage,
    shard_placements,
    synthetic_batch,
)
from holmes_sim.backend.moe import ExpertParallel
from holmes_sim.backend.recorder import Recorder
from holmes_sim.backend.reference import canonical_params
from holmes_sim.backend.run_config import RunConfig
from holmes_sim.errors import TestbedError
from holmes_sim.plan import Plan


class Rank:
    """State and behaviour of one rank during a run: its tensors live on `device`; the SYNC-1
    barrier runs on `barrier_group` (None: the world group)."""

    def __init__(self, plan: Plan, cfg: RunConfig, rank: int, groups: list[BuiltGroup],
                 device: torch.device, barrier_group: Any) -> None:
        self.plan, self.cfg, self.rank, self.groups = plan, cfg, rank, groups
        self.device, self.barrier_group = device, barrier_group
        self.sched = plan.schedule()
        self.pp_rank, self.dp_rank, self.tp_rank = plan.coords(rank)
        self.num_virtual = plan.pp * plan.num_chunks
        self.tp_comm = TensorParallelComm(tensor_group(groups) if plan.tp > 1 else None,
                                          plan.tp, self.tp_rank)
        self.tp = None if self.tp_comm.group is None else \
            TensorParallel(plan.tp, self.tp_rank, self.tp_comm.all_reduce,
                           self.tp_comm.all_gather,
                           reduce_input_grads=cfg.mutation != "tp-no-input-grad-reduce")
        ep_group = expert_group(groups)
        self.ep_comm = None if ep_group is None else ExpertParallelComm(ep_group)
        self.ep = None if ep_group is None else \
            ExpertParallel(ep_group.size, ep_group.group_rank, self.ep_comm.all_to_all)
        self.stages = [s.to(self.device) for s in
                       build_stages(plan, cfg.model, self.pp_rank, self.tp, self.ep)]
        ops = self.sched.stage_ops[self.pp_rank]
        # Index of each chunk's last backward: its gradients are final after that op.
        self.last_backward = {op.chunk: k for k, op in enumerate(ops) if op.kind == "B"}
        self.rec = Recorder()
        self.losses: list[list[float]] = []
        self.clock = PreciseWait()
        durations = emulated_durations(cfg, rank)
        self.dp = self._gradient_sync(None if durations is None
                                      else durations["optimizer_s_per_param"])
        self.emulator = None if durations is None else ComputeEmulator(
            durations, plan, cfg, self.stages, self.device, self.dp,
            None if self.tp is None else self.tp_comm, self.clock, self.ep_comm)
        if self.emulator is None and self.dp.overlapped:
            self.dp.install_hooks(self.stages)
            if plan.optimizer.sharded:
                self.dp.install_gather_waits(self.stages)

    def _gradient_sync(self, optimizer_s_per_param: float | None) -> GradientSync:
        """The dense parameters' buckets over the DATA group and, under expert parallelism, the
        routed experts' over the EXPERT_DATA group (None where dp = ep: nothing to reduce)."""
        plan, cfg = self.plan, self.cfg
        chunk_order = sorted(self.last_backward, key=self.last_backward.get)
        experts = set() if cfg.mutation == "experts-reduced-over-dp" \
            else routed_expert_ids(self.stages)
        numel = bucket_sizes(plan, self.pp_rank, cfg.bucket_numel)
        dense = make_buckets(self.stages, chunk_order, plan.dp, numel,
                             lambda p: id(p) not in experts)
        parts = [DataParallel(plan, cfg, data_group(self.groups) if plan.dp > 1 else None, dense,
                              self.rec, self.clock, optimizer_s_per_param)]
        if experts:
            edp_group = expert_data_group(self.groups)
            edp = 1 if edp_group is None else edp_group.size
            if edp * self.ep.size != plan.dp:
                raise TestbedError(f"rank {self.rank}: EP group of {self.ep.size} and expert-data-"
                                   f"parallel group of {edp} do not cover dp = {plan.dp}")
            routed = make_buckets(self.stages, chunk_order, edp, numel,
                                  lambda p: id(p) in experts)
            parts.append(DataParallel(plan, cfg, edp_group, routed, self.rec, self.clock,
                                      optimizer_s_per_param, label="expert "))
        return GradientSync(parts)

    # -- pipeline neighbours and messages

    def _peer(self, virtual: int) -> int:
        stage, _ = self.sched.stage_of_virtual(virtual)
        return self.plan.rank(stage, self.dp_rank, self.tp_rank)

    def _tag(self, direction: int, microbatch: int, virtual_dst: int) -> int:
        it = self.rec.iteration
        m, v = self.plan.num_microbatches, self.num_virtual
        return ((it * 2 + direction) * m + microbatch) * v + virtual_dst

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
        split = self.tp is not None and self.cfg.pipeline_split
        part = self.tp_comm.slice(buf) if split else buf
        t = time.perf_counter()
        group.recv(part, group.peer(src), self._tag(direction, mb, v)).wait()  # SYNC-2
        if split:  # Megatron's scatter-gather of pipeline messages [N21, 4.1]
            buf = self.tp_comm.all_gather(part).view(shape)
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
        split = self.tp is not None and self.cfg.pipeline_split
        tensor = self.tp_comm.slice(tensor).contiguous() if split else tensor.contiguous()
        # Non-blocking: a blocked send could deadlock 1F1B; waited at SYNC-3.
        work = group.send(tensor, group.peer(dst), self._tag(direction, mb, v_dst))
        pending.append((work, tensor))  # the tensor must live until the send completes

    # -- the schedule

    def run_iteration(self, iteration: int) -> None:
        self.rec.iteration = iteration
        if self.emulator is None:
            for p in [p for s in self.stages for p in s.parameters()]:
                p.grad = None
        dist.barrier(group=self.barrier_group)  # SYNC-1
        t0 = time.perf_counter()
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        mailbox: dict[tuple[int, int, int], torch.Tensor] = {}  # same-rank hand-over (p == 1)
        pending: list[tuple[object, torch.Tensor]] = []
        losses: list[float] = []
        comm = self.dp.start_comm_threads()
        for k, op in enumerate(self.sched.stage_ops[self.pp_rank]):
            if op.kind == "F":
                self._forward(op.microbatch, op.chunk, inputs, outputs, mailbox, pending, losses)
            else:
                if op.chunk in self.last_backward and self.last_backward[op.chunk] == k:
                    self.dp.arm(op.chunk)
                self._backward(op.microbatch, op.chunk, inputs, outputs, mailbox, pending)
        t = time.perf_counter()
        for work, _ in pending:
            work.wait()  # SYNC-3
        self.rec.record("send-wait", t, time.perf_counter())
        self.dp.disarm()
        self.dp.sync_and_step(comm)
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
        t, waited = time.perf_counter(), self.dp.gather_wait_s
        if self.emulator is not None:
            requested, comm = self.clock.waited_s, self.comm_s
            out = self.emulator.forward(chunk, v == self.num_virtual - 1)
            t += self.dp.gather_wait_s - waited
            self.rec.record("forward", t, time.perf_counter(), mb, chunk)
            self.emulator.count(self.rec.iteration, self.clock.waited_s - requested,
                                time.perf_counter() - t - (self.comm_s - comm))
            inputs[(mb, chunk)], outputs[(mb, chunk)] = x, out
            if v < self.num_virtual - 1:
                self._send(0, mb, v + 1, out, mailbox, pending)
            return
        out = stage(x, targets if v == self.num_virtual - 1 else None)  # may wait at SYNC-5
        t += self.dp.gather_wait_s - waited  # the waits are recorded as dp-sync, not as forward
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
        if self.emulator is not None:
            requested, comm = self.clock.waited_s, self.comm_s
            self.emulator.backward(chunk)
            self.rec.record("backward", t, time.perf_counter(), mb, chunk)
            self.emulator.count(self.rec.iteration, self.clock.waited_s - requested,
                                time.perf_counter() - t - (self.comm_s - comm))
            if v > 0:
                self._send(1, mb, v - 1, torch.zeros_like(x), mailbox, pending)
            return
        torch.autograd.backward(out, grad)
        self.rec.record("backward", t, time.perf_counter(), mb, chunk)
        if v > 0:
            self._send(1, mb, v - 1, x.grad, mailbox, pending)

    @property
    def comm_s(self) -> float:
        """Seconds this rank has spent in TP and EP collectives (not compute)."""
        return self.tp_comm.comm_s + (0.0 if self.ep_comm is None else self.ep_comm.comm_s)

    def full_params(self, stage: Stage) -> dict[str, torch.Tensor]:
        """`stage`'s parameters at full-model shape and name: a TP shard summed with its
        group's (`model.shard_placements`), every TP member running this in the same order;
        under expert parallelism only this rank's experts (`reference.canonical_params`)."""
        self.tp_comm.training = False
        placed = shard_placements(stage, self.cfg.model)
        values = {name: p.detach() if placed[name] is None else self.tp_comm.all_reduce(placed[name])
                  for name, p in stage.named_parameters()}
        return canonical_params(stage, values)

    def finish(self) -> None:
        """Complete a background all-gather so the final parameters are in place."""
        self.dp.finish()


def build_stages(plan: Plan, config: GPTConfig, pp_rank: int,
                 tp: TensorParallel | None = None,
                 ep: ExpertParallel | None = None) -> list[Stage]:
    """The stage module of every chunk pipeline rank `pp_rank` holds (chunk order), split over
    `tp`'s group when given, its experts over `ep`'s."""
    if sum(plan.layers_per_stage) != config.n_layer:
        raise TestbedError(f"plan places {sum(plan.layers_per_stage)} layers, "
                           f"the model has {config.n_layer}")
    last = plan.pp * plan.num_chunks - 1
    stages = []
    for c in range(plan.num_chunks):
        v = c * plan.pp + pp_rank
        first = sum(plan.layers_per_stage[:v])
        stages.append(build_stage(config, first, plan.layers_per_stage[v], v == 0, v == last, tp,
                                  ep))
    return stages
