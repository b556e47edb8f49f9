"""Plan: what a policy decides, and what the simulator, the analytic model and the real backend run.

A Plan is immutable and serialises to JSON, so a real run can be replayed from it.

Rank layout follows Megatron-LM's default order (tensor fastest, then data, then pipeline):
    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank
With context parallelism (CP degree cp) a plan's `dp` counts replicas, Megatron's
data-parallel-with-context group of DP x CP ranks, and replica r is (data rank r // cp, CP rank
r % cp): Megatron-Core's `RankGenerator` order "tp-cp-ep-dp-pp" (TP fastest, then CP, then DP,
then PP; megatron/core/parallel_state.py), and gradients are reduced over all DP x CP replicas as
Megatron reduces them.
A policy chooses which GPU each rank runs on; the layout of ranks into groups never changes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Protocol

from holmes_sim.memo import IdentityMemo
from holmes_sim.schedule import Schedule, ScheduleKind, build_schedule

DEFAULT_BUCKET_NUMEL = 40_000_000
"""Gradient elements per bucket unless the scenario sets `bucket_size_mb`: Megatron-Core
`DistributedDataParallel`'s floor (raised with dp, `Plan.bucket_numel`), kept for the others."""


class TransportKind(StrEnum):
    """How a communication group moves bytes."""

    LOCAL = "local"  # every member on one node: NVLink / PCIe
    RDMA = "rdma"  # every member on one InfiniBand or RoCE fabric
    TCP = "tcp"  # TCP over the Ethernet fabric


class GroupKind(StrEnum):
    """The parallelism a communication group serves."""

    TENSOR = "tp"
    DATA = "dp"
    PIPELINE = "pp"
    EMBEDDING = "embedding"
    CONTEXT = "cp"
    EXPERT = "ep"
    EXPERT_DATA = "edp"
    """Replicas holding the same experts (Megatron-Core's expert-data-parallel group)."""


class OptimizerMode(StrEnum):
    """How gradients are synchronised and the optimizer state is held.

    - replicated: all-reduce of gradients after the backward, full Adam state on every DP rank.
    - distributed: reduce-scatter after the backward, sharded state, all-gather of parameters
      after the step (Megatron-LM `--use-distributed-optimizer`, no overlap).
    - distributed-overlapped: the same, with bucketed reduce-scatter during the last backward and
      the all-gather overlapped with the next forward (Holmes section 3.4; Megatron-LM
      `--overlap-grad-reduce --overlap-param-gather`).
    - per-microbatch-overlapped: Megatron-LLaMA's OverlappedDistributedOptimizer as its schedules
      call it since alibaba/Megatron-LLaMA e48bbb3 and 25306de (2023-10; megatron/optimizer/
      overlapped_dist_optimizer.py, megatron/core/pipeline_parallel/schedules.py): a gradient
      hook copies each gradient into its bucket and drops it; a full bucket is reduce-scattered
      on a side stream in *every* micro-batch's backward (`backward_epilogue()` after each
      backward resets the buckets and accumulates the reduced shard); the parameter all-gather
      is issued before the next forward and each module's first forward waits for its bucket.
    - per-microbatch-gather-in-step: the same reduce-scatter in every micro-batch, with the
      all-gather inside `step()`: the optimizer as first released (d2e05b8, 2023-08) under its
      no-pipeline schedule, the one schedule there that calls `backward_epilogue()`.
    - reduce-scatter-once: that release under PP > 1 (its 1F1B and interleaved schedules never
      call `backward_epilogue()`; the file ships byte-identical in CodexDive/Holmes d8d2ac5): a
      bucket's `_collected_grad` is never reset, so `is_all_grad_collected()` holds only in the
      run's first micro-batch and each bucket is reduce-scattered then and never again. A
      steady-state iteration moves no gradient bytes; its one DP collective is the parameter
      all-gather inside `step()`.
    - zero-1: DeepSpeed ZeRO stage 1 as Megatron-DeepSpeed runs it with pipeline parallelism:
      gradients all-reduced after the pipeline flush, each rank steps its shard of the optimizer
      state, then the updated parameters are all-gathered (Rajbhandari et al. SC'20, P_os;
      DeepSpeed `stage_1_and_2.py` with partition_gradients off).
    """

    REPLICATED = "replicated"
    DISTRIBUTED = "distributed"
    DISTRIBUTED_OVERLAPPED = "distributed-overlapped"
    PER_MICROBATCH_OVERLAPPED = "per-microbatch-overlapped"
    PER_MICROBATCH_GATHER_IN_STEP = "per-microbatch-gather-in-step"
    REDUCE_SCATTER_ONCE = "reduce-scatter-once"
    ZERO1 = "zero-1"

    @property
    def sharded(self) -> bool:
        return self is not OptimizerMode.REPLICATED

    @property
    def overlapped(self) -> bool:
        return self is OptimizerMode.DISTRIBUTED_OVERLAPPED

    @property
    def gradient_collective(self) -> str:
        """The collective that reduces gradients: all-reduce or reduce-scatter."""
        return "all-reduce" if self in (OptimizerMode.REPLICATED, OptimizerMode.ZERO1) \
            else "reduce-scatter"

    @property
    def gathers_after_step(self) -> bool:
        """Parameters are all-gathered after the step, outside the next forward."""
        return self in (OptimizerMode.DISTRIBUTED, OptimizerMode.ZERO1,
                        OptimizerMode.PER_MICROBATCH_GATHER_IN_STEP,
                        OptimizerMode.REDUCE_SCATTER_ONCE)

    @property
    def gathers_before_forward(self) -> bool:
        """The previous step's parameter all-gathers run ahead of, and gate, the first forward."""
        return self in (OptimizerMode.DISTRIBUTED_OVERLAPPED,
                        OptimizerMode.PER_MICROBATCH_OVERLAPPED)

    @property
    def reduces_gradients(self) -> bool:
        """A steady-state iteration synchronises gradients over DP."""
        return self is not OptimizerMode.REDUCE_SCATTER_ONCE

    @property
    def reduces_every_microbatch(self) -> bool:
        """Gradients are reduced in every micro-batch's backward, not only the last."""
        return self in (OptimizerMode.PER_MICROBATCH_OVERLAPPED,
                        OptimizerMode.PER_MICROBATCH_GATHER_IN_STEP)

    @property
    def is_megatron_llama(self) -> bool:
        """Megatron-LLaMA's OverlappedDistributedOptimizer (`--overlapped-distributed-optimizer`)."""
        return self in (OptimizerMode.PER_MICROBATCH_OVERLAPPED,
                        OptimizerMode.PER_MICROBATCH_GATHER_IN_STEP,
                        OptimizerMode.REDUCE_SCATTER_ONCE)


_RELEASING_MODES = (OptimizerMode.DISTRIBUTED_OVERLAPPED, OptimizerMode.PER_MICROBATCH_OVERLAPPED,
                    OptimizerMode.PER_MICROBATCH_GATHER_IN_STEP)
"""Optimizer modes that reduce gradient buckets during the backward whatever
`Plan.overlap_grad_reduce` says: `overlapped` or `reduces_every_microbatch` (a tuple: membership
tests identity first, where a set would hash the enum in Python)."""


@dataclass(frozen=True, slots=True)
class Transport:
    """The transport of one group: its kind and the fabric it uses (None for LOCAL)."""

    kind: TransportKind
    fabric: str | None = None

    def __str__(self) -> str:
        return self.kind.value if self.fabric is None else f"{self.kind.value}:{self.fabric}"


@dataclass(frozen=True, slots=True)
class GpuRef:
    """One physical GPU: node name and local index on the node."""

    node: str
    local_index: int

    def __str__(self) -> str:
        return f"{self.node}/gpu{self.local_index}"


@dataclass(frozen=True, slots=True)
class Group:
    """A communication group: its ranks, the transport, and each member's NIC on the node.

    `nics[i]` is the node-local NIC name (e.g. "ib0", "eth1") rank `ranks[i]` uses, or "" for LOCAL.
    """

    kind: GroupKind
    ranks: tuple[int, ...]
    transport: Transport
    nics: tuple[str, ...]


class GroupLookup(Protocol):
    """What the estimate needs of single groups of a plan: the transport of the pipeline pair
    of (sender, receiver) ranks, and the ranks and transport of the first group of a kind (in
    the plan's order) whose first rank is given; None when there is none."""

    def pair_transport(self, ranks: tuple[int, ...]) -> Transport | None: ...

    def first(self, kind: GroupKind, rank: int) -> tuple[tuple[int, ...], Transport] | None: ...


class Groups(Sequence[Group]):
    """A plan's groups, built when first read: `build()` gives the tuple, and `lookup` (when
    given) answers for single groups without building them all (the estimate of a 1,024-GPU
    plan needs a transport per stage pair and a ring per stage, not 1,344 groups). Equal to,
    hashed as, pickled and serialised as the tuple."""

    __slots__ = ("_build", "_groups", "lookup")

    def __init__(self, build: Callable[[], tuple[Group, ...]], lookup: GroupLookup | None = None):
        self._build: Callable[[], tuple[Group, ...]] | None = build
        self._groups: tuple[Group, ...] | None = None
        self.lookup = lookup

    def built(self) -> tuple[Group, ...]:
        if self._groups is None:
            assert self._build is not None
            self._groups, self._build = self._build(), None
        return self._groups

    def __len__(self) -> int:
        return len(self.built())

    def __getitem__(self, index):
        return self.built()[index]

    def __iter__(self) -> Iterator[Group]:
        return iter(self.built())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Groups):
            other = other.built()
        return self.built() == other if isinstance(other, tuple) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.built())

    def __repr__(self) -> str:
        return repr(self.built())

    def __reduce__(self):
        return tuple, (self.built(),)


def group_lookup(groups: Sequence[Group]) -> GroupLookup:
    """The groups' own lookup (`Groups`), else an index over them."""
    lookup = getattr(groups, "lookup", None)
    return _Index(groups) if lookup is None else lookup


class _Index:
    """`GroupLookup` over built groups: one pass, pipeline pairs by ranks, all by first rank."""

    def __init__(self, groups: Sequence[Group]):
        self._pairs: dict[tuple[int, ...], Transport] = {}
        self._first: dict[tuple[GroupKind, int], tuple[tuple[int, ...], Transport]] = {}
        pipeline, pairs, first = GroupKind.PIPELINE, self._pairs, self._first
        for g in groups:
            if g.kind is pipeline:
                pairs[g.ranks] = g.transport
            if (g.kind, g.ranks[0]) not in first:
                first[(g.kind, g.ranks[0])] = (g.ranks, g.transport)

    def pair_transport(self, ranks: tuple[int, ...]) -> Transport | None:
        return self._pairs.get(ranks)

    def first(self, kind: GroupKind, rank: int) -> tuple[tuple[int, ...], Transport] | None:
        return self._first.get((kind, rank))


_PLACES: IdentityMemo[tuple] = IdentityMemo()


def tp_group_places(rank_to_gpu: Sequence[GpuRef], tp: int
                    ) -> tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]:
    """Per TP group of a rank order (ranks k tp .. k tp + tp - 1): its GPUs' nodes in order of
    first appearance and their local indices; found once per rank order (by identity) for the
    TP check, the group builder and `NetView`."""
    return _PLACES.get((rank_to_gpu,), (tp,), lambda: tuple(
        (tuple(dict.fromkeys(g.node for g in part)), tuple(g.local_index for g in part))
        for part in (rank_to_gpu[k:k + tp] for k in range(0, len(rank_to_gpu), tp))))


def megatron_cp_rank(pp_rank: int, dp_rank: int, cp_rank: int, tp_rank: int, dp: int, cp: int,
                     tp: int) -> int:
    """Global rank of (pipeline, data, context, tensor) coordinates in Megatron-Core's
    "tp-cp-ep-dp-pp" order (expert degree 1): TP fastest, then CP, then DP, then PP
    (`RankGenerator`, megatron/core/parallel_state.py); replica dp_rank * cp + cp_rank."""
    return megatron_rank(pp_rank, dp_rank * cp + cp_rank, tp_rank, dp * cp, tp)


def megatron_rank(pp_rank: int, dp_rank: int, tp_rank: int, dp: int, tp: int) -> int:
    """Global rank of (pipeline, data, tensor) coordinates in Megatron's "tp-dp-pp" order (TP
    fastest, then DP, then PP; Megatron-Core `RankGenerator`)."""
    return pp_rank * dp * tp + dp_rank * tp + tp_rank


@dataclass(frozen=True, slots=True)
class Plan:
    """The output of a policy.

    Attributes:
        policy: the policy's name.
        tp, pp, dp: tensor and pipeline degrees, and the replicas: data-parallel x
            context-parallel degree (module; `data_parallel`, `cp`).
        rank_to_gpu: the GPU of every global rank.
        layers_per_stage: transformer layers of every virtual stage (length pp * num_chunks),
            in model order.
        schedule_kind, num_microbatches, num_chunks: the pipeline schedule.
        optimizer: gradient synchronisation and optimizer state mode.
        overlap_grad_reduce: see the field.
        groups: every communication group (TP, DP, PP pairs, embedding): a tuple, or `Groups`
            built on first use.
        notes: human-readable decisions the policy made (shown in reports).
    """

    policy: str
    tp: int
    pp: int
    dp: int
    rank_to_gpu: tuple[GpuRef, ...]
    layers_per_stage: tuple[int, ...]
    schedule_kind: ScheduleKind
    num_microbatches: int
    num_chunks: int
    optimizer: OptimizerMode
    groups: tuple[Group, ...] | Groups
    notes: tuple[str, ...] = ()
    overlap_grad_reduce: bool = False
    """Gradient buckets are reduced during the last backward (PyTorch DDP, Megatron
    `--overlap-grad-reduce`); always so with the distributed-overlapped optimizer."""
    cp: int = 1
    """Context-parallel degree: replicas d // cp * cp .. + cp - 1 form a CP group (module)."""

    @property
    def data_parallel(self) -> int:
        """Megatron's data-parallel degree: replicas / cp."""
        return self.dp // self.cp

    def cp_peers(self, d: int) -> tuple[int, ...]:
        """The replicas of replica d's CP group, in ring order (CP rank order)."""
        first = d - d % self.cp
        return tuple(range(first, first + self.cp))

    @property
    def releases_gradients_in_backward(self) -> bool:
        """Gradient buckets are reduced during a backward (`overlap_grad_reduce`, the overlapped
        distributed optimizer, Megatron-LLaMA's per-micro-batch reduction)."""
        return self.overlap_grad_reduce or self.optimizer in _RELEASING_MODES

    def bucket_numel(self, j: int, given: int | None) -> int | None:
        """Gradient elements per bucket of virtual stage j (`given`: the scenario's, None for
        the framework's default); None: one bucket per buffer, reduced once the chunk's backward
        is done. With `overlap_grad_reduce` the buckets are Megatron-Core
        `DistributedDataParallel`'s (megatron/core/distributed/distributed_data_parallel.py,
        `__init__`): its default `bucket_size` is max(40,000,000, 1,000,000 x dp) elements, dp
        the data-parallel group's size without context parallelism (`dp_group`), and it sets
        `bucket_size` to None on pipeline ranks > 0 and where `disable_bucketing`, which
        megatron/training/training.py `get_model` passes for every model chunk after the first:
        only virtual stage 0 (pipeline rank 0, chunk 0) is cut. Holmes' overlapped optimizer and
        Megatron-LLaMA's (megatron/optimizer/overlapped_dist_optimizer.py) cut every chunk,
        by default into 40,000,000-element buckets; without reduction during the backward
        (Megatron-Core without `overlap_grad_reduce`, ZeRO-1) there is one bucket."""
        if not self.releases_gradients_in_backward:
            return None
        if not self.overlap_grad_reduce:
            return DEFAULT_BUCKET_NUMEL if given is None else given
        if j > 0:
            return None
        return max(DEFAULT_BUCKET_NUMEL, 1_000_000 * self.data_parallel) if given is None \
            else given

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        """Global rank of (pipeline, data, tensor) coordinates."""
        return megatron_rank(pp_rank, dp_rank, tp_rank, self.dp, self.tp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        pp_rank, rest = divmod(rank, self.dp * self.tp)
        dp_rank, tp_rank = divmod(rest, self.tp)
        return pp_rank, dp_rank, tp_rank

    def schedule(self) -> Schedule:
        """The op order every stage executes (the same object the backend runs)."""
        return build_schedule(self.schedule_kind, self.pp, self.num_microbatches, self.num_chunks)

    def groups_of(self, kind: GroupKind) -> tuple[Group, ...]:
        return tuple(g for g in self.groups if g.kind is kind)

    def group_containing(self, kind: GroupKind, rank: int) -> Group | None:
        """The group of `kind` that holds `rank` (PP: the pair where `rank` sends, if any)."""
        for g in self.groups:
            if g.kind is kind and rank in g.ranks and (kind is not GroupKind.PIPELINE or g.ranks[0] == rank):
                return g
        return None

    def entity_gpus(self, pp_rank: int, dp_rank: int) -> tuple[GpuRef, ...]:
        """The GPUs of the TP group at (pp_rank, dp_rank), in TP-rank order (consecutive ranks)."""
        first = self.rank(pp_rank, dp_rank, 0)
        return tuple(self.rank_to_gpu[first:first + self.tp])

    def transport_of(self, kind: GroupKind, rank: int) -> Transport | None:
        """Transport of the group of `kind` holding `rank` (None if there is none)."""
        g = self.group_containing(kind, rank)
        return None if g is None else g.transport

    def stage_layers(self, pp_rank: int) -> tuple[int, ...]:
        """Layers of each model chunk held by pipeline rank `pp_rank` (chunk order)."""
        return tuple(self.layers_per_stage[c * self.pp + pp_rank] for c in range(self.num_chunks))

    def to_json(self) -> str:
        """Deterministic JSON (sorted keys) of the whole plan."""
        plan = self if isinstance(self.groups, tuple) else replace(self, groups=tuple(self.groups))
        return json.dumps(asdict(plan), sort_keys=True, default=str)

    @staticmethod
    def from_json(text: str) -> Plan:
        """Inverse of `to_json`."""
        d = json.loads(text)
        return Plan(
            policy=d["policy"], tp=d["tp"], pp=d["pp"], dp=d["dp"],
            rank_to_gpu=tuple(GpuRef(**g) for g in d["rank_to_gpu"]),
            layers_per_stage=tuple(d["layers_per_stage"]),
            schedule_kind=ScheduleKind(d["schedule_kind"]),
            num_microbatches=d["num_microbatches"], num_chunks=d["num_chunks"],
            optimizer=OptimizerMode(d["optimizer"]),
            groups=tuple(
                Group(GroupKind(g["kind"]), tuple(g["ranks"]),
                      Transport(TransportKind(g["transport"]["kind"]), g["transport"]["fabric"]),
                      tuple(g["nics"]))
                for g in d["groups"]),
            notes=tuple(d.get("notes", ())),
            overlap_grad_reduce=bool(d.get("overlap_grad_reduce", False)),
            cp=int(d.get("cp", 1)),
        )
