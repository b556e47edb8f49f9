"""The engine's SimPy environment and its run-time settings: an event loop that counts the
events it processes, garbage collection tuned for a run's many short-lived objects, and the
seeded per-entity compute jitter."""

from __future__ import annotations

import gc
import heapq
import math
from contextlib import contextmanager

import numpy as np
import simpy


@contextmanager
def quiet_collector(threshold: int = 200_000):
    """Run with the set-up's objects frozen out of garbage collection and a young-generation
    threshold of `threshold` allocations: the run makes millions of short-lived objects and
    few cycles, and collections otherwise took a fifth of its CPU time. Restored afterwards."""
    old = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(threshold, old[1], old[2])
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


class _Stop(Exception):
    """Raised by the callback that ends `CountingEnvironment.run_until`."""


def _stop(_event: simpy.Event) -> None:
    raise _Stop


class CountingEnvironment(simpy.Environment):
    """A SimPy environment that counts processed events (reported by benchmarks)."""

    def __init__(self) -> None:
        super().__init__()
        self.events_processed = 0

    def run_until(self, until: simpy.Event) -> None:
        """`run(until)` as one loop: SimPy's `step` inlined (the same events in the same order,
        failures raised the same way), without a Python call per event."""
        until.callbacks.append(_stop)
        queue, pop, n = self._queue, heapq.heappop, 0
        try:
            while queue:
                self._now, _, _, event = pop(queue)
                n += 1
                callbacks, event.callbacks = event.callbacks, None
                for callback in callbacks:
                    callback(event)
                if not event._ok and not hasattr(event, "_defused"):
                    exc = type(event._value)(*event._value.args)
                    exc.__cause__ = event._value
                    raise exc
        except _Stop:
            return
        finally:
            self.events_processed += n
        raise RuntimeError(f'No scheduled events left but "until" event was not triggered: {until}')


class Jitter:
    """Per-entity random streams of compute-time factors (log-normal, mean 1).

    Streams are derived from the seed and the entity's (stage, replica) with numpy's SeedSequence,
    so the same seed gives the same factors whatever order entities draw in."""

    def __init__(self, cv: float, seed: int, pp: int, dp: int):
        self.sigma = math.sqrt(math.log1p(cv * cv)) if cv > 0 else 0.0
        self.mu = -self.sigma**2 / 2
        self.rng = {} if cv <= 0 else {
            f"s{s}.d{d}": np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(s, d)))
            for s in range(pp) for d in range(dp)}

    def factor(self, entity: str) -> float:
        if not self.rng:
            return 1.0
        return float(self.rng[entity].lognormal(self.mu, self.sigma))
