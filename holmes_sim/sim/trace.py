"""The record of a simulated (or measured) iteration: every op with its start, end, entity, stream,
kind and bytes. Metrics, plots and the Chrome/Perfetto export all read this one structure."""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import NamedTuple

import numpy as np

from holmes_sim.version import extension


class OpKind(StrEnum):
    """What an op does; each maps to one time-breakdown category."""

    FORWARD = "forward"
    BACKWARD = "backward"
    TP_COMM = "tp-comm"
    CP_COMM = "cp-comm"  # compute stream waiting for a context-parallel exchange
    EP_COMM = "ep-comm"  # compute stream waiting for an expert-parallel all-to-all
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


_KINDS = tuple(OpKind)
KIND_CODE = {k: i for i, k in enumerate(_KINDS)}
"""Each kind's code in a trace row (its index in `OpKind` order)."""
ROW = struct.Struct("<dddiihbb")
"""A trace row as bytes: start s, end s, bytes, entity index, micro-batch, chunk, stream index,
kind code (`KIND_CODE`)."""


def _append_row_struct(rows: bytearray, start: float, end: float, nbytes: float, entity: int,
                       microbatch: int, chunk: int, stream: int, kind: int) -> None:
    """`append_row` with `struct` (where the C extension was not built)."""
    rows += ROW.pack(start, end, nbytes, entity, microbatch, chunk, stream, kind)


def _append_rows_struct(rows: bytearray, *fields) -> None:
    """`append_rows` with `struct` (where the C extension was not built)."""
    rows += _row_struct(len(fields)).pack(*fields)


@functools.cache
def _row_struct(n_fields: int) -> struct.Struct:
    """A `struct.Struct` of `n_fields // 8` rows (`ROW` repeated)."""
    if n_fields < 8 or n_fields % 8:
        raise TypeError(f"8 fields a row expected, got {n_fields}")
    return struct.Struct("<" + ROW.format[1:] * (n_fields // 8))


TRACE_ROWS_ABI = 1
"""The interface version of `_trace_rows.c` (its `ABI`) that `append_row` and `append_rows` are."""
_packed = extension("holmes_sim.sim._trace_rows", TRACE_ROWS_ABI)  # the same bytes in C
append_row, append_rows = (_append_row_struct, _append_rows_struct) if _packed is None else \
    (_packed.append, _packed.append)
"""`append_rows(rows, *fields)`: append to bytearray `rows` one `ROW` per 8 `fields` (in `ROW`'s
order), the bytes `ROW.pack` makes of them; `append_row(rows, ...)` appends exactly one. In C
when the optional extension `_trace_rows` was built (no bytes object per row), else with
`struct` (`append_row` then with a fixed signature, which CPython calls with less work than
one taking `*fields`)."""
_ROW_DTYPE = np.dtype({"names": ["start", "end", "bytes", "entity", "mb", "chunk", "stream", "kind"],
                       "formats": ["<f8", "<f8", "<f8", "<i4", "<i4", "<i2", "i1", "i1"],
                       "offsets": [0, 8, 16, 24, 28, 32, 34, 35], "itemsize": ROW.size})


class TraceColumns(NamedTuple):
    """A trace's ops as columns (`Trace.columns`, numpy arrays): start and end s, entity, stream
    and kind indices (kinds in `OpKind` order), and the entity and stream names the indices
    point to."""

    start: np.ndarray
    end: np.ndarray
    entity: np.ndarray
    stream: np.ndarray
    kind: np.ndarray
    names: tuple[str, ...]
    streams: tuple[str, ...]


class Trace:
    """All ops of one iteration, plus the entities they ran on.

    Ops are kept as packed rows (`ROW`, 36 bytes an op instead of about 200 for an `OpRecord`);
    `columns` unpacks them, `compact` and `records` build `OpRecord`s on demand (reports), `ops`
    iterates them. The engine appends rows itself (`rows`, `ids`, `ROW`, `KIND_CODE`); `op` does
    the same for one op by names.
    A symmetric simulation records only one representative entity per class of identical
    entities: `members` maps a representative's name to every member's name (itself first);
    `records` copies the representative's ops to each member, metrics weight them instead."""

    __slots__ = ("entities", "iteration_s", "flows", "events", "members", "rows", "_names",
                 "_name_id", "_streams", "_stream_id", "_cache")

    def __init__(self, entities: list[Entity] | None = None, records: list[OpRecord] | None = None,
                 iteration_s: float = 0.0, flows: int = 0, events: int = 0) -> None:
        self.entities: list[Entity] = [] if entities is None else entities
        self.iteration_s = iteration_s
        self.flows = flows
        self.events = events
        self.members: dict[str, tuple[str, ...]] = {}
        self.rows = bytearray()
        self._names: list[str] = []
        self._name_id: dict[str, int] = {}
        self._streams: list[str] = []
        self._stream_id: dict[str, int] = {}
        self._cache: dict[str, tuple[int, object]] = {}  # by name: (rows' length, value)
        for r in records or ():
            self.add(r)

    def ids(self, entity: str, stream: str) -> tuple[int, int]:
        """(entity index, stream index) of a row of `entity` on `stream`, registering new names."""
        e = self._name_id.get(entity)
        if e is None:
            e = self._name_id[entity] = len(self._names)
            self._names.append(entity)
        st = self._stream_id.get(stream)
        if st is None:
            st = self._stream_id[stream] = len(self._streams)
            self._streams.append(stream)
        return e, st

    def op(self, start_s: float, end_s: float, entity: str, stream: str, kind: OpKind,
           bytes_: float = 0.0, microbatch: int = -1, chunk: int = 0) -> None:
        """Record one op (seconds from the iteration start; bytes sent by `entity`)."""
        e, st = self.ids(entity, stream)
        append_row(self.rows, start_s, end_s, bytes_, e, microbatch, chunk, st, KIND_CODE[kind])

    def add(self, record: OpRecord) -> None:
        self.op(record.start_s, record.end_s, record.entity, record.stream, record.kind,
                record.bytes, record.microbatch, record.chunk)

    def __len__(self) -> int:
        """Ops recorded (representatives only)."""
        return len(self.rows) // ROW.size

    def _cached(self, key: str, build):
        """`build()`, kept until a row is added."""
        got = self._cache.get(key)
        if got is None or got[0] != len(self.rows):
            got = self._cache[key] = (len(self.rows), build())
        return got[1]

    def _column(self, name: str) -> np.ndarray:
        """One field of every row (`_ROW_DTYPE`'s names) as a numpy array (a copy)."""
        view = np.frombuffer(self.rows, dtype=_ROW_DTYPE)
        try:
            return view[name].copy()
        finally:
            del view  # the rows can grow again once no view of them is left

    def ops(self):
        """(start s, end s, entity, stream, kind) of every recorded op, in recording order."""
        names, streams = self._names, self._streams
        return ((a, b, names[e], streams[st], _KINDS[k])
                for a, b, _, e, _, _, st, k in ROW.iter_unpack(self.rows))

    def columns(self) -> TraceColumns:
        """The recorded ops as columns (representatives only, in recording order): entities,
        streams and kinds as indices into `names`, `streams` and `OpKind` order."""
        col = self._column
        return TraceColumns(col("start"), col("end"), col("entity"), col("stream"), col("kind"),
                            tuple(self._names), tuple(self._streams))

    def weight(self, name: str) -> int:
        """How many entities `name`'s records stand for (1 unless it represents a class)."""
        members = self.members.get(name)
        return 1 if members is None else len(members)

    @property
    def compact(self) -> list[OpRecord]:
        """The recorded ops as `OpRecord`s (representatives only)."""
        names, streams = self._names, self._streams
        return self._cached("compact", lambda: [
            OpRecord(a, b, names[e], streams[st], _KINDS[k], n, mb, c)
            for a, b, n, e, mb, c, st, k in ROW.iter_unpack(self.rows)])

    @property
    def records(self) -> list[OpRecord]:
        """Every entity's records (the representatives' copied to their members)."""
        if not self.members:
            return self.compact
        return self._cached("records", lambda: [
            r if m == r.entity else replace(r, entity=m)
            for r in self.compact for m in self.members.get(r.entity, (r.entity,))])

    def of_entity(self, name: str) -> list[OpRecord]:
        return [r for r in self.records if r.entity == name]
