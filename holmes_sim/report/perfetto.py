"""A Trace as a Chrome Trace Event document, which Perfetto (ui.perfetto.dev) and chrome://tracing
open: one process per node, one thread (track) per (entity, stream), where an entity is one
(pipeline stage, data-parallel replica) rank group; one complete event per op, and a flow arrow
from every pipeline send to the op that consumes it.

Times are integer microseconds (`ts`, `dur`; the format's unit), rounded from the simulated
seconds once per boundary and clamped so no slice starts before the previous one on its track
ends: no overlaps, no negative times. Large runs keep `MAX_TRACE_ENTITIES` entities (the same
choice as the timeline figure) and say which in `otherData`.

Format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from holmes_sim.report.files import write_atomic
from holmes_sim.report.sampling import sample_entities
from holmes_sim.sim.trace import OpKind, OpRecord, Trace

US_PER_S = 1_000_000
MAX_TRACE_ENTITIES = 64
_STREAM_ORDER = ("compute", "pp", "dp")
_COMPUTE = (OpKind.FORWARD, OpKind.BACKWARD)


def chrome_trace(trace: Trace, max_entities: int = MAX_TRACE_ENTITIES) -> dict:
    """The trace as `{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}`.

    `pid` numbers nodes and `tid` numbers (entity, stream) tracks, both in first-seen order, each
    named by a metadata event (`ph: "M"`); ops are complete events (`ph: "X"`) and pipeline sends
    are linked to their consumer by flow events (`ph: "s"` / `"f"`, matching `id`)."""
    shown, note = sample_entities(trace.entities, max_entities)
    keep = {e.name for e in shown}
    node_of = {e.name: e.node for e in trace.entities}
    entity_index = {e.name: i for i, e in enumerate(trace.entities)}
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str], int] = {}
    meta: list[dict] = []
    for e in trace.entities:
        if e.name in keep:
            _pid(e.node, pids, meta)
    records = [r for r in trace.records if r.entity in keep]
    spans = track_spans(records)
    events: list[dict] = []
    for r, span in zip(records, spans, strict=True):
        pid = _pid(node_of.get(r.entity, r.entity), pids, meta)
        key = (r.entity, r.stream)
        if key not in tids:
            tids[key] = len(tids) + 1
            meta.extend(_thread_meta(pid, tids[key], r, entity_index))
        events.append(_complete_event(r, span, pid, tids[key]))
    flows = _flow_events(trace, records, spans, events)
    other = {"time_unit": "integer microseconds", "entities": note,
             "entities_shown": len(shown), "entities_total": len(trace.entities),
             "iteration_s": trace.iteration_s}
    return {"traceEvents": meta + events + flows, "displayTimeUnit": "ms", "otherData": other}


def write_chrome_trace(path: str | Path, trace: Trace) -> None:
    """Write `chrome_trace_text(trace)` (atomically)."""
    write_atomic(path, chrome_trace_text(trace))


def chrome_trace_text(trace: Trace) -> str:
    """`chrome_trace(trace)` as compact, deterministic JSON."""
    return json.dumps(chrome_trace(trace), separators=(",", ":"), sort_keys=True) + "\n"


def event_name(r: OpRecord) -> str:
    """The op kind, with its micro-batch when it has one: 'forward mb3'."""
    return f"{r.kind.value} mb{r.microbatch}" if r.microbatch >= 0 else r.kind.value


def track_spans(records: list[OpRecord]) -> list[tuple[int, int]]:
    """(start, end) of each record in integer microseconds: each boundary rounded once, a start
    clamped to the end of the previous slice on its (entity, stream) track and to 0."""
    spans: list[tuple[int, int]] = [(0, 0)] * len(records)
    tracks: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, r in enumerate(records):
        tracks[(r.entity, r.stream)].append(i)
    for members in tracks.values():
        previous_end = 0
        for i in sorted(members, key=lambda i: (records[i].start_s, records[i].end_s)):
            start = max(_us(records[i].start_s), previous_end)
            end = max(_us(records[i].end_s), start)
            spans[i] = (start, end)
            previous_end = end
    return spans


def _us(seconds: float) -> int:
    return round(seconds * US_PER_S)


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


def _complete_event(r: OpRecord, span: tuple[int, int], pid: int, tid: int) -> dict:
    return {"ph": "X", "name": event_name(r), "cat": r.stream, "pid": pid, "tid": tid,
            "ts": span[0], "dur": span[1] - span[0],
            "args": {"bytes": round(r.bytes), "microbatch": r.microbatch, "chunk": r.chunk}}


def _flow_events(trace: Trace, records: list[OpRecord], spans: list[tuple[int, int]],
                 events: list[dict]) -> list[dict]:
    """A flow (s at the send, f at the consumer's start) per pipeline send whose consumer is shown."""
    by_key = {(e.stage, e.replica): e.name for e in trace.entities}
    stage_of = {e.name: (e.stage, e.replica) for e in trace.entities}
    pp = 1 + max((e.stage for e in trace.entities), default=0)
    compute = {(r.entity, r.kind, r.microbatch, r.chunk): i for i, r in enumerate(records)
               if r.kind in _COMPUTE}
    flows = []
    for i, r in enumerate(records):
        if r.kind is not OpKind.PP_SEND or r.entity not in stage_of:
            continue
        target = _consumer(r, compute, records, stage_of[r.entity], by_key, pp)
        if target is None:
            continue
        flow_id = len(flows) // 2 + 1
        src, dst = events[i], events[target]
        # The send's own start: its slice may begin later, clamped behind an overlapping send
        # of the same stage (rendezvous transfers overlap on a stage's pp track), whose slice
        # then holds this start.
        flows.append({"ph": "s", "id": flow_id, "name": "pp-send", "cat": "pp", "pid": src["pid"],
                      "tid": src["tid"], "ts": max(0, _us(r.start_s))})
        flows.append({"ph": "f", "bp": "e", "id": flow_id, "name": "pp-send", "cat": "pp",
                      "pid": dst["pid"], "tid": dst["tid"], "ts": spans[target][0]})
    return flows


def _consumer(send: OpRecord, compute: dict, records: list[OpRecord], where: tuple[int, int],
              by_key: dict[tuple[int, int], str], pp: int) -> int | None:
    """Index of the compute op that uses what `send` carries: the producer on the sender decides
    the direction (a forward's activation goes downstream, a backward's gradient upstream)."""
    stage, replica = where
    produced = [(records[compute[k]].end_s, k[1]) for k in
                ((send.entity, kind, send.microbatch, send.chunk) for kind in _COMPUTE)
                if k in compute and records[compute[k]].end_s <= send.start_s + 1e-12]
    if not produced:
        return None
    kind = max(produced)[1]
    step = 1 if kind is OpKind.FORWARD else -1
    nxt, chunk = stage + step, send.chunk
    if not 0 <= nxt < pp:  # interleaved schedules wrap to the next (previous) model chunk
        nxt, chunk = nxt % pp, chunk + step
    name = by_key.get((nxt, replica))
    return compute.get((name, kind, send.microbatch, chunk))
