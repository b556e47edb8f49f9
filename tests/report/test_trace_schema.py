"""Every trace holmes-sim writes passes a checker written from the Chrome trace-event spec: integer
non-negative times, no overlapping slices on a track, integer bytes, matched flow events."""

from __future__ import annotations

import json

import pytest

from holmes_sim.prepare import prepare
from holmes_sim.report.perfetto import chrome_trace
from holmes_sim.runner import run_scenario
from holmes_sim.sim.trace import Entity, OpKind, OpRecord, Trace
from tests.conftest import SCENARIOS
from tests.report.trace_schema import problems


@pytest.fixture(scope="module")
def roce_outcomes():
    return run_scenario(prepare(SCENARIOS / "mixed_ib_roce.yaml"))


def test_every_policy_trace_of_mixed_ib_roce_passes_the_schema(roce_outcomes):
    for o in roce_outcomes:
        doc = chrome_trace(o.trace)
        assert problems(doc) == [], o.plan.policy
        sends = sum(r.kind is OpKind.PP_SEND for r in o.trace.records)
        flows = sum(e["ph"] == "s" for e in doc["traceEvents"])
        assert flows == sends, f"{o.plan.policy}: every pipeline send has a flow arrow"


def test_float_noise_never_makes_slices_overlap_or_times_negative():
    ents = [Entity("s0.d0", 0, 0, "n0", "c", ()), Entity("s1.d0", 1, 0, "n1", "c", ())]
    t1, t2 = 0.1 + 0.2, 0.30000000049  # 0.30000000000000004 and a time 0.5 ns later
    records = [
        OpRecord(-1e-12, 0.0000005, "s0.d0", "compute", OpKind.FORWARD, 0, 0),
        OpRecord(0.0000005, t1, "s0.d0", "compute", OpKind.BACKWARD, 0, 0),
        OpRecord(0.3 - 4e-7, t2, "s0.d0", "compute", OpKind.FORWARD, 0, 1),
        OpRecord(t1, t2, "s0.d0", "pp", OpKind.PP_SEND, 1.5e6 / 7, 0),
        OpRecord(t2, 0.5, "s1.d0", "compute", OpKind.BACKWARD, 0, 0),
    ]
    doc = chrome_trace(Trace(ents, records, iteration_s=0.5))
    assert problems(doc) == []
    assert all(isinstance(e["args"]["bytes"], int) for e in doc["traceEvents"] if e["ph"] == "X")


def test_the_checker_catches_what_it_should():
    x = {"ph": "X", "name": "a", "cat": "c", "ts": 0, "dur": 10, "pid": 1, "tid": 1}
    overlap = {**x, "ts": 9}
    assert any("overlaps" in p for p in problems({"traceEvents": [x, overlap]}))
    assert any("must be int" in p for p in problems({"traceEvents": [{**x, "ts": 1.5}]}))
    assert any("negative" in p for p in problems({"traceEvents": [{**x, "ts": -1}]}))
    lonely = {"ph": "s", "name": "p", "cat": "pp", "id": 1, "ts": 0, "pid": 1, "tid": 1}
    assert any("exactly one" in p for p in problems({"traceEvents": [x, lonely]}))


def test_a_1024_gpu_trace_is_sampled_and_says_so():
    ents = [Entity(f"s{s}.d{d}", s, d, f"n{s}", "c", ()) for s in range(16) for d in range(8)]
    records = [OpRecord(0.0, 1.0, e.name, "compute", OpKind.FORWARD, 0, 0) for e in ents]
    doc = chrome_trace(Trace(ents, records, iteration_s=1.0))
    other = doc["otherData"]
    assert other["entities_total"] == 128 and other["entities_shown"] < 128
    assert other["entities"].startswith(f"{other['entities_shown']} of 128")
    assert sum(e["ph"] == "X" for e in doc["traceEvents"]) == other["entities_shown"]
    assert problems(doc) == []


def test_the_1024_gpu_trace_stays_small_and_valid():
    from holmes_sim.runner import run_policy

    outcome = run_policy(prepare(SCENARIOS / "large_175b_1024.yaml"), "holmes")
    doc = chrome_trace(outcome.trace)
    size = len(json.dumps(doc, separators=(",", ":")))
    assert size < 20e6, f"{size / 1e6:.1f} MB"
    assert doc["otherData"]["entities_total"] == 128 and doc["otherData"]["entities_shown"] <= 64
    assert problems(doc) == []
    assert sum(e["ph"] == "s" for e in doc["traceEvents"]) > 0
