"""The pipeline messages' send, post and arrival (`pipeline_messages.PipelineMessages`): in C
where `_pipeline_messages` was built, in Python otherwise; the same simulation either way."""

from __future__ import annotations

import pytest

from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from holmes_sim.sim import pipeline_messages
from holmes_sim.sim.engine import EngineOptions, simulate
from holmes_sim.sim.environment import CountingEnvironment, fired_event
from holmes_sim.sim.network import FlowNetwork
from holmes_sim.sim.pipeline_messages import PipelineMessages
from tests.conftest import SCENARIOS


@pytest.fixture(params=["built", "python"])
def core(request, monkeypatch):
    """The messages' `Core`: the built one, or None (the Python methods)."""
    if request.param == "python":
        monkeypatch.setattr(pipeline_messages, "Core", None)
    elif pipeline_messages.Core is None:
        pytest.skip("the C pipeline messages were not built")
    return pipeline_messages.Core


@pytest.mark.parametrize("scenario", ["two_clusters_39b.yaml", "mixed_ib_roce.yaml",
                                      "straggler.yaml"])
def test_a_simulation_is_the_same_with_the_python_messages(monkeypatch, scenario):
    if pipeline_messages.Core is None:
        pytest.skip("the C pipeline messages were not built")
    prepared = prepare(SCENARIOS / scenario)
    plan, cluster = plan_policy(prepared, "holmes")
    options = EngineOptions(full_simulation=True)
    built = simulate(plan, cluster, prepared.workload, prepared.compute, options)
    monkeypatch.setattr(pipeline_messages, "Core", None)
    python = simulate(plan, cluster, prepared.workload, prepared.compute, options)
    assert built.flows > 100 and built.rows == python.rows
    assert (built.iteration_s, built.events, built.flows) == \
        (python.iteration_s, python.events, python.flows)


def _exchange(size: float, send_first: bool) -> tuple[bytes, float, list]:
    """Two messages over one 100 B/s link (or a link-less route), sent at t=1 and posted at
    t=2 (or the other way round); the receiver waits for each. Returns the rows, the end time
    and the states left."""
    env = CountingEnvironment()
    net = FlowNetwork(env, {"l": 100.0})
    rows = bytearray()
    msgs = PipelineMessages(env, net, rows, size, 1, 2, [0])
    route = (net.resolve((("l", 1.0),)) if size else net.resolve(()), 0.5, (3, 4))
    got = []

    def sender():
        yield env.timeout(1.0 if send_first else 2.0)
        for k in (0, 1):
            msgs.send(k, route, k, 0)

    def receiver():
        yield env.timeout(2.0 if send_first else 1.0)
        for k in (0, 1):
            msgs.post(k)
            msgs.post(k)  # a second post of a started or posted receive changes nothing
        for k in (0, 1):  # a waiter where it has not arrived (`engine._entity`'s way)
            ev = msgs.arrival[k]
            if ev is None:
                ev = msgs.arrival[k] = fired_event()
            ev.callbacks = [lambda _e, k=k: got.append((k, env.now))]
        yield env.timeout(10.0)

    env.run_until(env.all_of([env.process(sender()), env.process(receiver())]))
    return bytes(rows), env.now, [s is pipeline_messages.STARTED for s in msgs.state] + got


@pytest.mark.parametrize("size", [0.0, 50.0])
@pytest.mark.parametrize("send_first", [True, False])
def test_messages_are_sent_on_both_sides_alike(core, monkeypatch, size, send_first):
    mine = _exchange(size, send_first)
    monkeypatch.setattr(pipeline_messages, "Core", None)
    assert mine == _exchange(size, send_first)
    assert len(mine[0]) == 2 * 36 and mine[2][:2] == [True, True]


def test_a_bad_core_raises():
    if pipeline_messages.Core is None:
        pytest.skip("the C pipeline messages were not built")
    env = CountingEnvironment()
    good = [env, [None], [None], [None], bytearray(), 1.0, 1.0, True, print, [], print,
            object(), object(), 5]
    pipeline_messages.Core(*good)
    for i, bad in ((1, ()), (4, b""), (9, ())):
        with pytest.raises(TypeError):
            pipeline_messages.Core(*good[:i], bad, *good[i + 1:])
    with pytest.raises(TypeError):
        pipeline_messages.Core(*good[:-1])
    core = pipeline_messages.Core(*good)
    with pytest.raises(IndexError):
        core.post(1)
    with pytest.raises(TypeError):
        core.send(0, None)
    with pytest.raises(TypeError):  # a message that is not (k, begun, (sender, stream), mb, chunk)
        core.arrive(type("Done", (), {"message": (0, 1.0)})())
