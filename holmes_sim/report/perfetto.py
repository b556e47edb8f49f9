"""A Trace as a Chrome Trace Event document, which Perfetto (ui.perfetto.dev) and chrome://tracing
open: one process per node, one thread per (entity, stream), one complete event per op.

Format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

import json
from pathlib import Path

from holmes_sim.report.files import write_atomic
from holmes_sim.trace import OpRecord, Trace

US_PER_S = 1e6
_STREAM_ORDER = ("compute", "pp", "dp")


def chrome_trace(trace: Trace) -> dict:
    """The trace as `{"traceEvents": [...], "displayTimeUnit": "ms"}`.

    Every record becomes exactly one complete event (`ph: "X"`, `ts` and `dur` in microseconds);
    `pid` numbers nodes and `tid` numbers (entity, stream) pairs, both in first-seen order, and
    each is named by a metadata event (`ph: "M"`). Times are rounded to the nanosecond."""
    node_of = {e.name: e.node for e in trace.entities}
    entity_index = {e.name: i for i, e in enumerate(trace.entities)}
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str], int] = {}
    meta: list[dict] = []
    events: list[dict] = []
    for e in trace.entities:
        _pid(e.node, pids, meta)
    for r in trace.records:
        pid = _pid(node_of.get(r.entity, r.entity), pids, meta)
        key = (r.entity, r.stream)
        if key not in tids:
            tids[key] = len(tids) + 1
            meta.extend(_thread_meta(pid, tids[key], r, entity_index))
        events.append(_complete_event(r, pid, tids[key]))
    return {"traceEvents": meta + events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, trace: Trace) -> None:
    """Write `chrome_trace(trace)` as compact, deterministic JSON (atomically)."""
    text = json.dumps(chrome_trace(trace), separators=(",", ":"), sort_keys=True)
    write_atomic(path, text + "\n")


def event_name(r: OpRecord) -> str:
    """The op kind, with its micro-batch when it has one: 'forward mb3'."""
    return f"{r.kind.value} mb{r.microbatch}" if r.microbatch >= 0 else r.kind.value


def _pid(node: str, pids: dict[str, int], meta: list[dict]) -> int:
    if node not in pids:
        pids[node] = len(pids) + 1
        meta.append({"ph": "M", "name": "process_name", "pid": pids[node], "tid": 0,
                     "args": {"name": node}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": pids[node], "tid": 0,
                     "args": {"sort_index": pids[node]}})
    return pids[node]


def _thread_meta(pid: int, tid: int, r: OpRecord, entity_index: dict[str, int]) -> list[dict]:
    stream_rank = _STREAM_ORDER.index(r.stream) if r.stream in _STREAM_ORDER else len(_STREAM_ORDER)
    order = entity_index.get(r.entity, len(entity_index)) * (len(_STREAM_ORDER) + 1) + stream_rank
    return [
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
         "args": {"name": f"{r.entity} {r.stream}"}},
        {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
         "args": {"sort_index": order}},
    ]


def _complete_event(r: OpRecord, pid: int, tid: int) -> dict:
    return {"ph": "X", "name": event_name(r), "cat": r.stream, "pid": pid, "tid": tid,
            "ts": round(r.start_s * US_PER_S, 3), "dur": round(r.duration_s * US_PER_S, 3),
            "args": {"bytes": r.bytes, "microbatch": r.microbatch, "chunk": r.chunk}}
