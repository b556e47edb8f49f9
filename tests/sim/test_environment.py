"""The engine's calendar event loop processes events in SimPy's own order."""

import random

import simpy

from holmes_sim.sim.environment import CountingEnvironment


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
