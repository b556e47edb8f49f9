"""Emulated compute (`RunConfig.emulated_compute`): each compute op of a rank becomes a precise
wait of its duration while every byte still moves as in a real run.

The durations are a compute profile's (`EMULATED_KEYS`); each of a stage's pieces (embedding,
layers, head) waits its share, parameter run by parameter run, so that buckets are gated and
released at the points the real forward and backward reach them (`ComputeEmulator`).
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

import torch

from holmes_sim.backend.collectives import ExpertParallelComm, TensorParallelComm
from holmes_sim.backend.model import Stage
from holmes_sim.backend.moe import MoeMLP, dispatch_shape
from holmes_sim.backend.run_config import RunConfig
from holmes_sim.errors import TestbedError
from holmes_sim.plan import Plan

if TYPE_CHECKING:
    from holmes_sim.backend.data_parallel import GradientSync

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


def emulated_durations(cfg: RunConfig, rank: int) -> dict | None:
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


def compute_pieces(stage: Stage, d: dict, tp: int) -> list[tuple[float, float, list, bool]]:
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


def _expert_span(block) -> tuple[int, int] | None:
    """(parameter elements of `block` before its experts, its experts' elements) in parameter
    order, or None for a dense layer."""
    if not isinstance(block.mlp, MoeMLP):
        return None
    experts = sum(p.numel() for p in block.mlp.experts.parameters())
    return sum(p.numel() for p in block.parameters()) - experts, experts


class ComputeEmulator:
    """A rank's emulated compute: its forwards, backwards and their TP all-reduces and EP
    all-to-alls as waits on `clock`, the DP side's buckets gated and released as the real ops
    would (`dp`); `tp` is the rank's TP group's collectives (None: no TP), `ep` its EP group's
    (None: no EP)."""

    def __init__(self, durations: dict, plan: Plan, cfg: RunConfig, stages: list[Stage],
                 device: torch.device, dp: GradientSync, tp: TensorParallelComm | None,
                 clock: PreciseWait, ep: ExpertParallelComm | None = None) -> None:
        self.cfg, self.device, self.dp, self.tp, self.clock = cfg, device, dp, tp, clock
        self.ep = ep
        # Per chunk, per MoE layer: parameter elements before its experts, and its experts'.
        self.moe = [[_expert_span(block) for block in stage.blocks] for stage in stages]
        self.gate = dp.overlapped and plan.optimizer.sharded
        self.pieces = [compute_pieces(stage, durations, plan.tp) for stage in stages]
        # Emulated compute of the measured iterations: requested and actual seconds (the
        # difference is the host's wake-up lag, which no prediction contains).
        self.emulation = {"requested_s": 0.0, "actual_s": 0.0}
        # No autograd runs: gradients are zeros of the parameters' shapes, moved as real
        # ones are; the emulated backward marks them final piece by piece.
        for p in [p for s in stages for p in s.parameters()]:
            p.grad = torch.zeros_like(p)

    def count(self, iteration: int, requested_s: float, actual_s: float) -> None:
        """Add one op's requested and actual seconds (measured iterations only)."""
        if iteration >= self.cfg.warmup:
            self.emulation["requested_s"] += requested_s
            self.emulation["actual_s"] += actual_s

    def forward(self, chunk: int, last: bool) -> torch.Tensor | None:
        """Wait each piece's forward duration, in order, parameter by parameter (each its share
        of the piece, by size: a linear layer's FLOPs are proportional to its weights); in the
        overlapped sharded mode each share first waits for its parameter's bucket, as the real
        forward's pre-hooks make a module wait, and as the simulator releases a chunk's first
        forward bucket by bucket. Returns an activation of the real shape (None on the last
        virtual stage: the loss)."""
        self.clock.start()
        layers = iter(self.moe[chunk])
        for forward_s, _, params, layer in self.pieces[chunk]:
            span = next(layers) if layer else None
            self._piece(forward_s, layer, params, gate=self.gate,
                        all_to_all=self._ep_cuts(span, backward=False))
        if last:
            return None
        c = self.cfg.model
        return torch.zeros(self.cfg.micro_batch_size, c.block_size, c.n_embd, device=self.device)

    def backward(self, chunk: int) -> None:
        """Wait each piece's backward duration, last piece first, parameter by parameter in
        reverse; after its share each parameter's gradient is final, as autograd's accumulation
        hooks fire one by one (overlapped: buckets launch as they fill, as the simulator
        releases them during the backward)."""
        self.clock.start()
        release = chunk if self.dp.overlapped else None
        layers = reversed(self.moe[chunk])
        for _, backward_s, params, layer in reversed(self.pieces[chunk]):
            span = next(layers) if layer else None
            self._piece(backward_s, layer, params[::-1], release=release,
                        all_to_all=self._ep_cuts(span, backward=True))

    def _piece(self, seconds: float, layer: bool, params: list, gate: bool = False,
               release: int | None = None, all_to_all: tuple[int, ...] = ()) -> None:
        """One piece's wait, shared out over `params` (in compute order) by size, one wait per
        run of parameters in one bucket (few waits: each ends in a short spin); `gate`: a run
        first waits for its bucket's all-gather; `release` (a chunk): a run's gradients are
        final after its share. A TP layer runs its two all-reduces of the layer's activations
        (2 per forward and per backward [N21, 3.2]) after each half of its time; an MoE layer
        its EP all-to-alls once the elements in `all_to_all` are done (`_ep_cuts`)."""
        total = sum(p.numel() for p in params)
        if not total:
            self.clock.wait(seconds)
            return
        cuts = [(total / 2, self._tp_all_reduce), (total, self._tp_all_reduce)] \
            if layer and self.tp is not None else []
        cuts += [(at, self._ep_all_to_all) for at in all_to_all]
        cuts.sort(key=lambda cut: cut[0])
        done = 0
        for bucket, run in itertools.groupby(params, key=lambda p: self.dp.owner.get(id(p))):
            run = list(run)
            if gate and bucket in self.dp.gathered:
                self.dp.wait_bucket(bucket)
                self.clock.deadline = max(self.clock.deadline, time.perf_counter())
            end = done + sum(p.numel() for p in run)
            while cuts and cuts[0][0] <= end:
                cut, collective = cuts.pop(0)
                self.clock.wait(seconds * (cut - done) / total)
                done = cut
                collective()
            self.clock.wait(seconds * (end - done) / total)
            done = end
            if release is not None:
                for p in run:
                    self.dp.grad_ready(p, release)

    def _ep_cuts(self, span: tuple[int, int] | None, backward: bool) -> tuple[int, ...]:
        """Where an MoE layer's two all-to-alls fall among its parameter elements in compute
        order, `span` = (elements before the experts, the experts'): forward, the dispatch
        once attention and router are done and the combine after the experts; backward (the
        reverse order), the combine's gradient first and the dispatch's after the experts."""
        if span is None or self.ep is None:
            return ()
        before, experts = span
        return (0, experts) if backward else (before, before + experts)

    def _ep_all_to_all(self) -> None:
        """One EP all-to-all of the layer's routed token copies (`moe.dispatch_shape`)."""
        c = self.cfg.model
        self.ep.all_to_all(torch.zeros(dispatch_shape(self.cfg.micro_batch_size, c.block_size,
                                                      c.n_embd, c.moe_topk, self.ep.group.size),
                                       device=self.device))
        self.clock.deadline = max(self.clock.deadline, time.perf_counter())

    def _tp_all_reduce(self) -> None:
        """A TP all-reduce of one layer's activations (b s h) between emulated compute."""
        c = self.cfg.model
        self.tp.all_reduce(torch.zeros(self.cfg.micro_batch_size, c.block_size, c.n_embd,
                                       device=self.device))
        self.clock.deadline = max(self.clock.deadline, time.perf_counter())
