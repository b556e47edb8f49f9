"""Pipeline schedules: the per-stage order of forward and backward ops.

Pure and shared: the SimPy engine, the analytic estimate and the real torch backend all execute
the very same `Schedule`, so a validation compares like with like.

Conventions (Megatron-LM, `megatron/core/pipeline_parallel/schedules.py`):
- `p` pipeline stages (ranks), `m` micro-batches, `v` model chunks per stage (v > 1 only for the
  interleaved schedule). Model chunk `c` of stage `s` is virtual stage `c * p + s`; activations
  flow from virtual stage `j` to `j + 1`.
- GPipe (Huang et al. 2019): all forwards, then all backwards.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021): `p - s - 1` warm-up forwards, then alternate
  one forward and one backward, then the cool-down backwards.
- Interleaved 1F1B (Narayanan et al. SC'21, section 2.2): as Megatron orders it; needs `m % p == 0`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

from holmes_sim.errors import ScenarioError


class ScheduleKind(StrEnum):
    """The pipeline schedules holmes-sim knows."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"


@dataclass(frozen=True, slots=True)
class Op:
    """One compute op of one stage: a forward ('F') or backward ('B') of a micro-batch's chunk."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True, slots=True)
class Schedule:
    """The op order of every pipeline stage.

    Attributes:
        kind: which schedule.
        num_stages: pipeline degree p.
        num_microbatches: micro-batches per iteration m.
        num_chunks: model chunks per stage v (1 unless interleaved).
        stage_ops: `stage_ops[s]` is stage s's ops in execution order.
    """

    kind: ScheduleKind
    num_stages: int
    num_microbatches: int
    num_chunks: int
    stage_ops: tuple[tuple[Op, ...], ...]

    def virtual_stage(self, stage: int, chunk: int) -> int:
        """Index of (stage, chunk) along the model's layer order."""
        return chunk * self.num_stages + stage

    def stage_of_virtual(self, virtual: int) -> tuple[int, int]:
        """(stage, chunk) that runs virtual stage `virtual`."""
        return virtual % self.num_stages, virtual // self.num_stages

    @property
    def num_virtual_stages(self) -> int:
        return self.num_stages * self.num_chunks

    def peak_in_flight(self, stage: int) -> int:
        """Most (micro-batch, chunk) forwards whose activations stage `stage` holds at once
        (cached per schedule shape: the planner asks for it once per candidate)."""
        return peak_in_flight(self.kind, self.num_stages, self.num_microbatches, self.num_chunks,
                              stage)


def build_schedule(kind: str | ScheduleKind, num_stages: int, num_microbatches: int,
                   num_chunks: int = 1) -> Schedule:
    """Build the per-stage op order (cached: a Schedule is immutable).

    Raises:
        ScenarioError: when the numbers do not allow the schedule (e.g. interleaved with m % p != 0).
    """
    return _build_schedule(ScheduleKind(kind), num_stages, num_microbatches, num_chunks)


def check_schedule(kind: str | ScheduleKind, p: int, m: int, v: int = 1) -> None:
    """Raise what `build_schedule` raises for these numbers, without building the ops (the
    planner checks every layout)."""
    kind = ScheduleKind(kind)
    if p < 1 or m < 1 or v < 1:
        raise ScenarioError("schedule needs positive stages, micro-batches and chunks; "
                            f"got p={p}, m={m}, v={v}")
    if kind != ScheduleKind.INTERLEAVED and v != 1:
        raise ScenarioError(f"parallel.virtual_stages={v} needs schedule 'interleaved' (got '{kind}'); "
                            "set virtual_stages: 1 or schedule: interleaved")
    if kind == ScheduleKind.INTERLEAVED and p > 1 and m % p != 0:
        raise ScenarioError(
            f"interleaved schedule needs the number of micro-batches ({m}) to be a multiple of "
            f"the pipeline degree ({p}); change training.global_batch_size or parallel.pipeline")


def check_pipelined(kind: str | ScheduleKind, p: int) -> None:
    """Raise ScenarioError for the interleaved schedule without pipeline parallelism (p = 1),
    which Megatron-LM refuses (`validate_args`: "When interleaved schedule is used,
    pipeline-model-parallel size should be greater than 1"); `check_schedule` still builds it,
    as one stage's op order."""
    if ScheduleKind(kind) == ScheduleKind.INTERLEAVED and p == 1:
        raise ScenarioError("the interleaved schedule needs parallel.pipeline > 1 (Megatron-LM "
                            "refuses virtual pipeline stages at pipeline 1); use schedule: 1f1b, "
                            "or raise parallel.pipeline")


def check_megatron_interleaving(kind: str | ScheduleKind, p: int, overlap_p2p_comm: bool) -> None:
    """Raise ScenarioError for the interleaved schedule at pipeline 2 with blocking p2p, which
    Megatron-LM refuses to start (`validate_args`, megatron/training/arguments.py: each batch of
    p2p ops would send and receive twice between the same two ranks). Megatron-LM has required
    pipeline > 2 for interleaving since 182841f (2021-03) and allows 2 with
    `overlap_p2p_comm` since 3ee489d (2024-05); the simulator and the testbed backend run it."""
    if ScheduleKind(kind) == ScheduleKind.INTERLEAVED and p == 2 and not overlap_p2p_comm:
        raise ScenarioError("Megatron-LM refuses the interleaved schedule at pipeline 2 with "
                            "blocking p2p (each batch would send and receive twice between the "
                            "same two ranks); set training.overlap_p2p_comm: true, use pipeline "
                            ">= 3, or schedule: 1f1b")


@lru_cache(maxsize=512)
def _build_schedule(kind: ScheduleKind, num_stages: int, num_microbatches: int,
                    num_chunks: int) -> Schedule:
    p, m, v = num_stages, num_microbatches, num_chunks
    check_schedule(kind, p, m, v)
    if kind == ScheduleKind.GPIPE:
        ops = [_gpipe(m)] * p
    elif kind == ScheduleKind.ONE_F_ONE_B:  # every stage runs the same units in its own order
        units = [Op("F", i) for i in range(m)], [Op("B", i) for i in range(m)]
        ops = [_one_f_one_b(p, s, m, *units) for s in range(p)]
    else:
        units = _interleaved_units(p, v, m * v, "F"), _interleaved_units(p, v, m * v, "B")
        ops = [_interleaved(p, s, m, v, *units) for s in range(p)]
    return Schedule(kind, p, m, v, tuple(tuple(o) for o in ops))


def _gpipe(m: int) -> list[Op]:
    return [Op("F", i) for i in range(m)] + [Op("B", i) for i in range(m)]


def _one_f_one_b(p: int, s: int, m: int, forwards: list[Op], backwards: list[Op]) -> list[Op]:
    """p - s - 1 warm-up forwards, then one forward and one backward, then the backwards left
    (`forwards`, `backwards`: the m micro-batches' units)."""
    warmup = min(p - s - 1, m)
    ops = forwards[:warmup]
    for f in range(warmup, m):
        ops.append(forwards[f])
        ops.append(backwards[f - warmup])
    ops.extend(backwards[m - warmup:])
    return ops


def _interleaved_units(p: int, v: int, total: int, kind: str) -> list[Op]:
    """The first `total` forward ('F') or backward ('B') units in Megatron's ordering: unit k
    is micro-batch (k // pv) p + k % p of chunk (k % pv) // p (backward: the chunks from the
    last)."""
    pv, last = p * v, v - 1
    if kind == "F":
        return [Op("F", (k // pv) * p + k % p, (k % pv) // p) for k in range(total)]
    return [Op("B", (k // pv) * p + k % p, last - (k % pv) // p) for k in range(total)]


def _interleaved(p: int, s: int, m: int, v: int, forwards: list[Op],
                 backwards: list[Op]) -> list[Op]:
    total = m * v
    warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
    ops = forwards[:warmup]
    for f in range(warmup, total):  # one forward, one backward
        ops.append(forwards[f])
        ops.append(backwards[f - warmup])
    ops.extend(backwards[total - warmup:])
    return ops


def peak_in_flight(kind: str | ScheduleKind, p: int, m: int, v: int, stage: int) -> int:
    """`Schedule.peak_in_flight` of schedule (kind, p, m, v) without building it for many
    micro-batches: GPipe holds all m; in 1F1B and interleaved the count rises through the
    warm-up forwards and then alternates (one forward, one backward), so it peaks at the first
    steady forward and is the same for every m with one (1F1B: m >= p; interleaved: m v past
    the longest warm-up)."""
    kind = ScheduleKind(kind)
    if kind is ScheduleKind.GPIPE:
        return m
    if kind is ScheduleKind.ONE_F_ONE_B:
        m = min(m, p)
    elif p > 1:
        enough = p * (-(-((p - 1) * 2 + (v - 1) * p + 1) // (p * v)))  # a multiple of p
        m = min(m, enough)
    return _peak_in_flight(kind, p, m, v, stage)


@lru_cache(maxsize=1024)
def peaks_in_flight(kind: str | ScheduleKind, p: int, m: int, v: int) -> tuple[int, ...]:
    """`peak_in_flight` of every stage (cached: the planner's memory check asks for all of them
    once per candidate)."""
    return tuple(peak_in_flight(kind, p, m, v, s) for s in range(p))


@lru_cache(maxsize=4096)
def _peak_in_flight(kind: ScheduleKind, p: int, m: int, v: int, stage: int) -> int:
    held = peak = 0
    for op in _build_schedule(kind, p, m, v).stage_ops[stage]:
        held += 1 if op.kind == "F" else -1
        peak = max(peak, held)
    return peak


def steady_phase(kind: str, p: int, m: int, v: int) -> tuple[tuple[int, ...], int, int] | None:
    """Where the steady phase starts per stage, ops per round, and micro-batches per round
    (the schedules' definitions above; the walk's `_steady_run` checks them)."""
    kind = ScheduleKind(kind)
    if kind is ScheduleKind.GPIPE:
        # Its phases feed one way (no backward between forwards), so stages of different speeds
        # drift apart at their own rates and the state never repeats up to one constant.
        return None
    if kind is ScheduleKind.ONE_F_ONE_B:
        return tuple(min(p - s - 1, m) for s in range(p)), 2, 1
    return tuple(min((p - s - 1) * 2 + (v - 1) * p, m * v) for s in range(p)), 2 * p * v, p
