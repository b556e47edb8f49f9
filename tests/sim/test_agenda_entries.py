"""The flow network's agenda entries (`agenda_entries.apply`): in C where the extension was
built, in Python otherwise; the same simulation either way (`test_network.py` runs every
network test both ways)."""

from __future__ import annotations

import pytest

from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from holmes_sim.sim import agenda_entries, network
from holmes_sim.sim.engine import EngineOptions, simulate
from tests.conftest import SCENARIOS


@pytest.mark.parametrize("scenario", ["two_clusters_39b.yaml", "mixed_ib_roce.yaml"])
def test_a_simulation_is_the_same_with_the_python_entries(monkeypatch, scenario):
    if network.apply is agenda_entries._apply:
        pytest.skip("the C agenda entries were not built")
    prepared = prepare(SCENARIOS / scenario)
    plan, cluster = plan_policy(prepared, "holmes")
    options = EngineOptions(full_simulation=True)
    built = simulate(plan, cluster, prepared.workload, prepared.compute, options)
    monkeypatch.setattr(network, "apply", agenda_entries._apply)
    monkeypatch.setattr(network, "post", None)
    python = simulate(plan, cluster, prepared.workload, prepared.compute, options)
    assert built.flows > 100 and built.rows == python.rows
    assert (built.iteration_s, built.events, built.flows) == \
        (python.iteration_s, python.events, python.flows)


@pytest.mark.parametrize("apply", [pytest.param(agenda_entries._apply, id="python"),
                                   pytest.param(agenda_entries.apply, id="built")])
def test_bad_entries_raise(apply):
    context = ({}, None, None, None, [], [])
    with pytest.raises(TypeError):
        apply([object()], 0.0, None, context)
    with pytest.raises((TypeError, ValueError)):
        apply([], 0.0, None, context[:5])
    assert apply([], 0.0, None, context) == (-1, 0, 0)


def test_a_bad_post_context_raises():
    if agenda_entries.post is None:
        pytest.skip("the C agenda entries were not built")
    with pytest.raises(TypeError):
        agenda_entries.post((), None, 1.0, 0.0, [], None)
