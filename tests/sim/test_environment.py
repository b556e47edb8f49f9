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
