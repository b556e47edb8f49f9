"""The engine's calendar event loop processes events in SimPy's own order (each test with the
loop in C, `_run_loop`, where it was built, and in Python)."""

import random

import pytest
import simpy

from holmes_sim.sim import environment
from holmes_sim.sim.environment import CountingEnvironment


@pytest.fixture(autouse=True, params=["built", "python"])
def run_loop(request, monkeypatch):
    """The bucket loop `CountingEnvironment.run_until` uses: the built one or `_take`."""
    if request.param == "python":
        monkeypatch.setattr(environment, "take", environment._take)
    elif environment.take is environment._take:
        pytest.skip("the C run loop was not built")


def _workload(env: simpy.Environment, log: list, seed: int) -> simpy.Event:
    """Processes that wait on timeouts of few distinct lengths (many events at one instant),
    succeed shared events, and start new processes mid-run (URGENT starts at the instant being
    processed); every resume is logged as (time, name, step)."""
    rng = random.Random(seed)
    shared = [env.event() for _ in range(4)]

    def child(name: str):
        log.append((env.now, name, "start"))
        yield env.timeout(rng.choice((0.0, 0.5, 1.0)))
        log.append((env.now, name, "end"))

    def worker(name: str):
        for step in range(12):
            choice = rng.random()
            if choice < 0.5:
                yield env.timeout(rng.choice((0.0, 0.5, 1.0, 1.5)))
            elif choice < 0.7:
                ev = shared[rng.randrange(len(shared))]
                if not ev.triggered:
                    ev.succeed(name)
                yield env.timeout(0.0)
            elif choice < 0.85:
                yield env.process(child(f"{name}.{step}"))
            else:
                env.process(child(f"{name}.{step}"))
                yield env.timeout(0.5)
            log.append((env.now, name, step))

    return env.all_of([env.process(worker(f"w{i}")) for i in range(8)])


def test_calendar_order_is_simpys():
    for seed in range(20):
        plain_log, calendar_log = [], []
        plain = simpy.Environment()
        plain.run(until=_workload(plain, plain_log, seed))
        calendar = CountingEnvironment()
        calendar.run_until(_workload(calendar, calendar_log, seed))
        assert calendar_log == plain_log, seed
        assert calendar.now == plain.now
        assert calendar.events_processed > len(calendar_log)


def test_step_and_peek_follow_the_calendar():
    plain_log, stepped_log = [], []
    plain = simpy.Environment()
    plain.run(until=_workload(plain, plain_log, 7))
    stepped = CountingEnvironment()
    done = _workload(stepped, stepped_log, 7)
    while not done.processed:
        assert stepped.peek() >= stepped.now
        stepped.step()
    assert stepped_log == plain_log


def _waits(env: simpy.Environment, log: list, direct: bool):
    """A process body (given its process in `me[0]` when `direct`): inline waits of 0, 0.5 and
    1 s, each followed by a SimPy-style sub-process (a timeout, an event processed already, a
    return value); inline waits are resumed by the generator's own callback when `direct`."""
    from holmes_sim.sim.environment import DETACHED, LeanEvent, via_process

    done_early = env.event()
    done_early.succeed("early")

    def sub(step: int):
        yield env.timeout(0.25)
        if step % 2:
            yield done_early
        return 2 * step

    def body(me=None):
        process = me[0] if direct else None
        for step in range(6):
            if direct:
                ev = object.__new__(LeanEvent)
                ev.callbacks, ev._ok, ev._value = [process._send], True, None
                env.schedule(ev, delay=0.5 * (step % 3))
                yield DETACHED
            else:
                yield env.timeout(0.5 * (step % 3))
            log.append((env.now, "inline", step))
            got = (yield from via_process(sub(step), process)) if direct else (yield from sub(step))
            log.append((env.now, "sub", got))
        yield from (via_process(sub(0), process) if direct else sub(0))
        return "done"

    return body


def test_direct_resumption_keeps_simpys_order():
    from holmes_sim.sim.environment import start_direct

    logs, values = [], []
    for direct in (False, True):
        env = CountingEnvironment() if direct else simpy.Environment()
        log: list = []

        def ticker():
            for i in range(20):
                yield env.timeout(0.25)
                log.append((env.now, "tick", i))

        body = _waits(env, log, direct)
        process = start_direct(env, body) if direct else env.process(body())
        other = env.process(ticker())
        if direct:
            env.run_until(env.all_of([process, other]))
        else:
            env.run(until=env.all_of([process, other]))
        logs.append(log)
        values.append(process.value)
    assert logs[0] == logs[1]
    assert values == ["done", "done"]
    assert len(logs[0]) == 6 * 2 + 20


def _failing(env: simpy.Environment, defused: bool) -> simpy.Event:
    """A timeout at 1 s, after an event failing at 0.5 s (defused or not) and two others."""
    env.timeout(0.25)
    failing = env.event()
    env.schedule(failing, delay=0.5)
    failing._ok, failing._value = False, ValueError("boom")
    if defused:
        failing.defused = True
    env.timeout(0.75)
    return env.timeout(1.0)


@pytest.mark.parametrize("defused", [False, True])
def test_a_failed_event_raises_unless_defused_as_in_simpy(defused):
    plain = simpy.Environment()
    calendar = CountingEnvironment()
    runs = ((plain, lambda: plain.run(until=_failing(plain, defused))),
            (calendar, lambda: calendar.run_until(_failing(calendar, defused))))
    for env, run in runs:
        if defused:
            run()
            assert env.now == 1.0
        else:
            with pytest.raises(ValueError, match="boom"):
                run()
            assert env.now == 0.5
    assert calendar.events_processed == (4 if defused else 2)


def test_a_raising_callback_stops_the_loop_and_the_events_taken_are_counted():
    env = CountingEnvironment()
    log = []
    first, second = env.timeout(0.5), env.timeout(0.5)
    first.callbacks.append(lambda ev: log.append("first"))
    second.callbacks.append(lambda ev: 1 / 0)
    second.callbacks.append(lambda ev: log.append("not called"))
    later = env.timeout(1.0)
    with pytest.raises(ZeroDivisionError):
        env.run_until(later)
    assert log == ["first"] and env.events_processed == 2
    assert first.processed and second.processed and not later.processed
    env.run_until(later)  # the bucket lost the events taken: the run goes on from there
    assert env.now == 1.0 and env.events_processed == 3 and log == ["first"]


def test_events_without_callbacks_are_taken_and_counted():
    """An event whose callbacks are an empty tuple or list (a message's arrival nobody waits
    for yet) is taken, counted and left processed; the others' callbacks run in order."""
    from holmes_sim.sim.environment import fired_event

    env = CountingEnvironment()
    log = []
    events = [fired_event() for _ in range(4)]
    events[0].callbacks, events[1].callbacks = (), []
    events[2].callbacks, events[3].callbacks = [lambda ev: log.append(2)], ()
    for ev in events:
        env.schedule(ev, delay=0.5)
    env.run_until(env.timeout(1.0))
    assert log == [2] and env.events_processed == 5
    assert all(ev.callbacks is None for ev in events)


@pytest.mark.parametrize("lean", [False, True])
def test_an_interrupt_inside_a_process_stops_the_run_as_in_simpy(lean):
    """Ctrl-C landing in a process's generator fails it; the condition the run waits for fails
    with it, and the run raises the KeyboardInterrupt (as SimPy's `run(until=...)` does) instead
    of returning with the clock where it struck, which read as a short iteration."""
    from holmes_sim.sim.environment import LeanProcess

    def interrupted(env):
        yield env.timeout(0.5)
        raise KeyboardInterrupt

    def busy(env):
        yield env.timeout(2.0)

    plain, calendar = simpy.Environment(), CountingEnvironment()
    for env, run in ((plain, plain.run), (calendar, calendar.run_until)):
        start = (lambda g: LeanProcess(env, g)) if lean and env is calendar else env.process
        done = env.all_of([start(interrupted(env)), start(busy(env))])
        with pytest.raises(KeyboardInterrupt):
            run(until=done) if env is plain else run(done)
        assert env.now == 0.5
