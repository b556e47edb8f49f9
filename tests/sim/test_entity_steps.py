"""An entity's common ops in C (`entity_steps.stepped`, `_entity_steps.Steps`) against the
engine's Python loop (`engine._Simulation._entity`): the same trace rows, events, flows and
iteration time, with the special ops (EP, CP, parameter gathers, gradient releases, jitter, a
shared host) between them, and with the Python pipeline messages too."""

from __future__ import annotations

from dataclasses import replace

import pytest

from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from holmes_sim.sim import entity_steps, pipeline_messages
from holmes_sim.sim.engine import EngineOptions, simulate
from holmes_sim.sim.environment import CountingEnvironment, fired_event
from tests.conftest import SCENARIOS
from tests.sim.test_context_parallel import cp_scenario

FULL = EngineOptions(full_simulation=True)
built = pytest.mark.skipif(entity_steps.Steps is None, reason="the C entity steps were not built")


def _same_with_the_python_loop(monkeypatch, prepared, options: EngineOptions, policy="holmes"):
    plan, cluster = plan_policy(prepared, policy)
    stepped = simulate(plan, cluster, prepared.workload, prepared.compute, options)
    monkeypatch.setattr(entity_steps, "Steps", None)
    python = simulate(plan, cluster, prepared.workload, prepared.compute, options)
    assert len(stepped) > 100 and stepped.rows == python.rows
    assert (stepped.iteration_s, stepped.events, stepped.flows) == \
        (python.iteration_s, python.events, python.flows)


@built
@pytest.mark.parametrize("scenario, options", [
    ("two_clusters_39b.yaml", FULL),
    ("mixed_ib_roce.yaml", EngineOptions()),
    ("straggler.yaml", FULL),
    ("llama3_70b_h100.yaml", FULL),  # interleaved, parameter gathers and gradient releases
    ("moe_mixed_nics.yaml", FULL),  # EP all-to-alls
    ("two_clusters_39b.yaml", replace(FULL, compute_cv=0.05, seed=3)),  # jitter
    ("pure_ib.yaml", EngineOptions(shared_cpu_cores=2.0)),  # a shared host
])
def test_the_c_steps_simulate_what_the_python_loop_does(monkeypatch, scenario, options):
    _same_with_the_python_loop(monkeypatch, prepare(SCENARIOS / scenario), options)


@built
def test_the_c_steps_with_python_messages_and_cp(monkeypatch, write_scenario):
    monkeypatch.setattr(pipeline_messages, "Core", None)
    prepared = prepare(write_scenario(cp_scenario(nodes=4, tp=4, pp=2, cp=2, global_batch=8)))
    _same_with_the_python_loop(monkeypatch, prepared, FULL, policy="megatron")


@built
def test_bad_steps_raise():
    env = CountingEnvironment()
    events = (fired_event(), fired_event())
    messages = ([None], [None], [None], object(), print, print)
    good = [env, [], [], [], 0, messages, bytearray(), (0, 1), events, print, (10, 11, 2)]
    assert entity_steps.Steps(*good).go() == -1  # no steps: at the end at once
    for i, bad in ((1, ()), (6, b""), (5, messages[:5]), (8, events[:1]), (10, (1, 2))):
        with pytest.raises(TypeError):
            entity_steps.Steps(*good[:i], bad, *good[i + 1:])
    with pytest.raises(TypeError):
        entity_steps.Steps(*good[:-1])
    step = (0, 0, 0, 0, 1, None, None, None, None)
    with pytest.raises(TypeError):  # durations that are not pairs
        entity_steps.Steps(env, [step], [1.0], *good[3:]).go()
    with pytest.raises(IndexError):  # a message past the lists
        entity_steps.Steps(env, [step], [(1.0, 0.0)], [], 5, *good[5:]).go()
