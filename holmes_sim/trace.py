"""The record of a simulated (or measured) iteration: every op with its start, end, entity, stream,
kind and bytes. Metrics, plots and the Chrome/Perfetto export all read this one structure."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class OpKind(StrEnum):
    """What an op does; each maps to one time-breakdown category."""

    FORWARD = "forward"
    BACKWARD = "backward"
    TP_COMM = "tp-comm"
    PP_SEND = "pp-send"
    DP_ALL_REDUCE = "dp-all-reduce"
    DP_REDUCE_SCATTER = "dp-reduce-scatter"
    DP_ALL_GATHER = "dp-all-gather"
    EMBEDDING_ALL_REDUCE = "embedding-all-reduce"
    OPTIMIZER = "optimizer"
    WAIT_PP = "wait-pp"  # compute stream idle while an activation/gradient is on the wire
    WAIT_BUBBLE = "wait-bubble"  # compute stream idle because the producer has not run yet
    WAIT_DP = "wait-dp"  # compute stream idle waiting for DP / embedding collectives


@dataclass(frozen=True, slots=True)
class OpRecord:
    """One op. Times in seconds from the iteration start; `bytes` sent by this entity."""

    start_s: float
    end_s: float
    entity: str
    stream: str
    kind: OpKind
    bytes: float = 0.0
    microbatch: int = -1
    chunk: int = 0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, slots=True)
class Entity:
    """A simulated (pipeline stage, DP replica): one TP group's GPUs in lock-step."""

    name: str
    stage: int
    replica: int
    node: str
    cluster: str
    gpus: tuple[str, ...]


class Trace:
    """All ops of one iteration, plus the entities they ran on.

    A symmetric simulation records only one representative entity per class of identical
    entities: `members` maps a representative's name to every member's name (itself first), and
    `records` expands the representative's records to each member on first access (for reports).
    Metrics read `compact` with `weight` instead, which stays small at any scale."""

    __slots__ = ("entities", "compact", "iteration_s", "flows", "events", "members", "_expanded")

    def __init__(self, entities: list[Entity] | None = None, records: list[OpRecord] | None = None,
                 iteration_s: float = 0.0, flows: int = 0, events: int = 0) -> None:
        self.entities: list[Entity] = [] if entities is None else entities
        self.compact: list[OpRecord] = [] if records is None else records
        self.iteration_s = iteration_s
        self.flows = flows
        self.events = events
        self.members: dict[str, tuple[str, ...]] = {}
        self._expanded: list[OpRecord] | None = None

    def add(self, record: OpRecord) -> None:
        self.compact.append(record)
        self._expanded = None

    def weight(self, name: str) -> int:
        """How many entities `name`'s records stand for (1 unless it represents a class)."""
        members = self.members.get(name)
        return 1 if members is None else len(members)

    @property
    def records(self) -> list[OpRecord]:
        """Every entity's records (the representatives' copied to their members)."""
        if not self.members:
            return self.compact
        if self._expanded is None:
            self._expanded = [r if m == r.entity else replace(r, entity=m)
                              for r in self.compact for m in self.members.get(r.entity, (r.entity,))]
        return self._expanded

    def of_entity(self, name: str) -> list[OpRecord]:
        return [r for r in self.records if r.entity == name]
