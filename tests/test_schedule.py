"""Pipeline schedules: every op exactly once, dependencies respected, Megatron's warm-up counts."""

from __future__ import annotations

import pytest

from holmes_sim.errors import ScenarioError
from holmes_sim.schedule import _peak_in_flight, build_schedule, peak_in_flight


@pytest.mark.parametrize("kind,p,m,v", [("gpipe", 4, 6, 1), ("1f1b", 4, 6, 1), ("1f1b", 3, 2, 1),
                                        ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 3)])
def test_every_forward_and_backward_once_and_forward_first(kind, p, m, v):
    sched = build_schedule(kind, p, m, v)
    for ops in sched.stage_ops:
        expected = {(k, mb, c) for k in "FB" for mb in range(m) for c in range(v)}
        seen = [(o.kind, o.microbatch, o.chunk) for o in ops]
        assert sorted(seen) == sorted(expected)
        for mb in range(m):
            for c in range(v):
                assert seen.index(("F", mb, c)) < seen.index(("B", mb, c))


def test_1f1b_warmup_and_memory():
    sched = build_schedule("1f1b", 4, 8)
    # Stage s runs p - s - 1 warm-up forwards then alternates: peak in flight = p - s.
    assert [sched.peak_in_flight(s) for s in range(4)] == [4, 3, 2, 1]
    assert "".join(o.kind for o in sched.stage_ops[3]) == "FB" * 8
    assert "".join(o.kind for o in sched.stage_ops[0])[:5] == "FFFFB"


def test_gpipe_holds_every_microbatch():
    sched = build_schedule("gpipe", 3, 5)
    assert all(sched.peak_in_flight(s) == 5 for s in range(3))


def test_interleaved_warmup_matches_megatron():
    # Megatron: warm-up = (p - s - 1) * 2 + (v - 1) * p forwards.
    p, m, v = 4, 8, 2
    sched = build_schedule("interleaved", p, m, v)
    for s in range(p):
        kinds = "".join(o.kind for o in sched.stage_ops[s])
        warmup = (p - s - 1) * 2 + (v - 1) * p
        assert kinds[:warmup] == "F" * warmup and kinds[warmup:warmup + 2] == "FB"
    first = sched.stage_ops[0][:6]
    assert [(o.microbatch, o.chunk) for o in first] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1)]


def test_interleaved_rejects_bad_microbatches():
    with pytest.raises(ScenarioError, match="multiple of the pipeline degree"):
        build_schedule("interleaved", 4, 6, 2)


def test_virtual_stages_need_interleaved():
    with pytest.raises(ScenarioError, match="virtual_stages=2"):
        build_schedule("1f1b", 2, 4, 2)


def test_peak_in_flight_without_building_long_schedules_equals_counting_every_op():
    for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)):
        for p in (1, 2, 3, 4, 8) if kind != "interleaved" else (2, 3, 4, 8):
            for m in sorted({1, 2, 3, p - 1, p, p + 1, 2 * p, 5 * p, 12 * p} - {0}):
                if kind == "interleaved" and m % p:
                    continue
                for s in range(p):
                    assert peak_in_flight(kind, p, m, v, s) == _peak_in_flight.__wrapped__(
                        kind, p, m, v, s), (kind, p, m, v, s)
