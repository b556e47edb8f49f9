"""Chrome trace export: one complete event per record, integer microsecond times, named pids and
tids (the format rules themselves: test_trace_schema.py)."""

from __future__ import annotations

import json

import pytest

from holmes_sim.report.perfetto import chrome_trace, event_name, write_chrome_trace
from holmes_sim.sim.trace import Entity, OpKind, OpRecord, Trace
from tests.report.test_document import default_run


@pytest.fixture(scope="module")
def holmes_trace():
    _, outcomes = default_run()
    return next(o.trace for o in outcomes if o.plan.policy == "holmes")


def test_one_complete_event_per_record_with_required_fields(holmes_trace):
    doc = chrome_trace(holmes_trace)
    assert doc["displayTimeUnit"] == "ms"
    events = doc["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(holmes_trace.records)
    for e in complete:
        for key in ("name", "ph", "ts", "dur", "pid", "tid", "args"):
            assert key in e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
    for e, r in zip(complete, holmes_trace.records, strict=True):
        assert e["ts"] == round(r.start_s * 1e6) or e["ts"] == pytest.approx(r.start_s * 1e6, abs=1)
        assert e["ts"] + e["dur"] == round(r.end_s * 1e6)
        assert e["name"] == event_name(r)
        assert e["args"] == {"bytes": round(r.bytes), "microbatch": r.microbatch, "chunk": r.chunk}


def test_processes_are_nodes_and_threads_are_entity_streams(holmes_trace):
    events = chrome_trace(holmes_trace)["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(procs.values()) == sorted({e.node for e in holmes_trace.entities})
    expected = {f"{r.entity} {r.stream}" for r in holmes_trace.records}
    assert set(threads.values()) == expected and len(threads) == len(expected)
    node_of = {e.name: e.node for e in holmes_trace.entities}
    for (pid, _), name in threads.items():
        assert procs[pid] == node_of[name.split()[0]]
    used = {(e["pid"], e["tid"]) for e in events if e["ph"] == "X"}
    assert used == set(threads)


def test_ids_follow_first_seen_order_and_output_is_deterministic(tmp_path):
    ents = [Entity("s0.d0", 0, 0, "n1", "c", ()), Entity("s1.d0", 1, 0, "n0", "c", ())]
    trace = Trace(ents, [
        OpRecord(0.0, 0.5, "s1.d0", "pp", OpKind.PP_SEND, 1e6, 3),
        OpRecord(0.0, 1.0, "s0.d0", "compute", OpKind.FORWARD, 0, 3, 1),
        OpRecord(1.0, 2.0, "s0.d0", "dp", OpKind.DP_ALL_REDUCE, 2e6),
    ], iteration_s=2.0)
    doc = chrome_trace(trace)
    procs = {e["args"]["name"]: e["pid"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert procs == {"n1": 1, "n0": 2}
    names = [(e["name"], e["tid"], e["dur"]) for e in doc["traceEvents"] if e["ph"] == "X"]
    assert names == [("pp-send mb3", 1, 500000), ("forward mb3", 2, 1000000),
                     ("dp-all-reduce", 3, 1000000)]
    write_chrome_trace(tmp_path / "a.json", trace)
    write_chrome_trace(tmp_path / "b.json", trace)
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert json.loads((tmp_path / "a.json").read_text()) == json.loads(json.dumps(doc))
