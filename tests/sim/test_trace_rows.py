"""The trace's row packing (`trace.append_row`, `trace.append_rows`): in C where the extension
was built, with `struct` otherwise; the same bytes either way, and the same simulated trace."""

from __future__ import annotations

import random
import struct

import pytest

from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from holmes_sim.sim import engine, entity_steps, pipeline_messages, sync, trace
from holmes_sim.sim.engine import EngineOptions, simulate
from tests.conftest import SCENARIOS

PACKERS = [pytest.param(trace._append_rows_struct, id="struct"),
           pytest.param(trace.append_rows, id="built")]
ONE_ROW = [pytest.param(trace._append_row_struct, id="struct"),
           pytest.param(trace.append_row, id="built")]


def _random_row(rng: random.Random) -> tuple:
    return (rng.uniform(-1e3, 1e3), rng.random(), rng.choice([0.0, -0.0, 1e300, float("inf"), 7]),
            rng.randint(-2**31, 2**31 - 1), rng.randint(-1, 500), rng.randint(-2**15, 2**15 - 1),
            rng.randint(-128, 127), rng.randint(0, 13))


@pytest.mark.parametrize("append", PACKERS)
def test_rows_are_the_bytes_struct_packs(append):
    rng = random.Random(25)
    rows, expected = bytearray(), bytearray()
    for _ in range(500):
        one, two = _random_row(rng), _random_row(rng)
        append(rows, *one)
        append(rows, *one, *two)
        expected += trace.ROW.pack(*one) + trace.ROW.pack(*one) + trace.ROW.pack(*two)
    assert rows == expected


@pytest.mark.parametrize("append", ONE_ROW)
def test_one_row_is_the_bytes_struct_packs(append):
    rng = random.Random(26)
    rows, expected = bytearray(), bytearray()
    for _ in range(500):
        row = _random_row(rng)
        append(rows, *row)
        expected += trace.ROW.pack(*row)
    assert rows == expected


@pytest.mark.parametrize("append", PACKERS)
@pytest.mark.parametrize("fields", [
    (1.0, 2.0, 0.0, 2**31, 0, 0, 0, 0),  # entity index past int32
    (1.0, 2.0, 0.0, 0, 0, 2**15, 0, 0),  # chunk past int16
    (1.0, 2.0, 0.0, 0, 0, 0, 0, 128),  # kind code past int8
    (1.0, "2", 0.0, 0, 0, 0, 0, 0),  # not a number
    (1.0, 2.0, 0.0, 0.5, 0, 0, 0, 0),  # not an integer
    (1.0, 2.0, 0.0, 0, 0, 0, 0),  # a field short
])
def test_bad_rows_raise_and_append_nothing(append, fields):
    rows = bytearray(b"kept")
    with pytest.raises((TypeError, OverflowError, struct.error)):
        append(rows, *fields, *fields[:8])
    assert rows == b"kept"


def test_a_simulation_records_the_same_rows_with_struct(monkeypatch):
    prepared = prepare(SCENARIOS / "two_clusters_39b.yaml")
    plan, cluster = plan_policy(prepared, "holmes")
    options = EngineOptions(full_simulation=True)
    built = simulate(plan, cluster, prepared.workload, prepared.compute, options)
    monkeypatch.setattr(pipeline_messages, "Core", None)  # its rows packed in C
    monkeypatch.setattr(entity_steps, "Steps", None)
    for module in (engine, pipeline_messages, sync, trace):
        monkeypatch.setattr(module, "append_row", trace._append_row_struct)
    for module in (engine, trace):
        monkeypatch.setattr(module, "append_rows", trace._append_rows_struct)
    packed = simulate(plan, cluster, prepared.workload, prepared.compute, options)
    assert len(built) > 1000 and built.rows == packed.rows
    assert (built.iteration_s, built.events, built.flows) == \
        (packed.iteration_s, packed.events, packed.flows)
