"""The record of a simulated (or measured) iteration: every op with its start, end, entity, stream,
kind and bytes. Metrics, plots and the Chrome/Perfetto export all read this one structure."""

from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass(slots=True)
class Trace:
    """All ops of one iteration, plus the entities they ran on."""

    entities: list[Entity] = field(default_factory=list)
    records: list[OpRecord] = field(default_factory=list)
    iteration_s: float = 0.0
    flows: int = 0
    events: int = 0

    def add(self, record: OpRecord) -> None:
        self.records.append(record)

    def of_entity(self, name: str) -> list[OpRecord]:
        return [r for r in self.records if r.entity == name]
