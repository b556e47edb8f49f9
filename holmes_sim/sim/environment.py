"""The engine's SimPy environment and its run-time settings: an event loop that counts the
events it processes and the seeded per-entity compute jitter."""

from __future__ import annotations

import heapq
import math

import numpy as np
import simpy
from simpy.core import EmptySchedule
from simpy.events import NORMAL, Event, Process, Timeout

from holmes_sim.version import extension


_make = object.__new__


class _Stop(Exception):
    """Raised by the callback that ends `CountingEnvironment.run_until`."""


def _stop(event: simpy.Event) -> None:
    """End `CountingEnvironment.run_until` at its event: `_Stop`, or the event's exception where
    it failed (a process raised, Ctrl-C's KeyboardInterrupt inside one included), as SimPy's
    `run(until=...)` raises it rather than returning with the clock where the failure struck."""
    if not event._ok:
        raise event._value
    raise _Stop


class LeanEvent:
    """An event of the engine's own (a message's arrival, an op's compute), made with
    `object.__new__` and its three fields set by the maker: what `CountingEnvironment.run_until`
    and `LeanProcess` read of a SimPy event (`callbacks`: None once processed; `_ok`; `_value`),
    in slots, so it is made and freed with less work than a `simpy.Event`. Only a
    `LeanProcess` may wait for it, and it never fails."""

    __slots__ = ("callbacks", "_ok", "_value")


def fired_event(kind: type = LeanEvent) -> LeanEvent:
    """A `LeanEvent` that succeeded (`_ok` True, `_value` None): given callbacks and appended to
    a calendar bucket, it resumes them when the loop takes it; it may fire again once taken.
    `kind` may be another slotted type with the same three fields (a type the loop takes
    most, so that its reads of those fields stay specialised to one type)."""
    event = _make(kind)
    event._ok, event._value = True, None
    return event


class _Detached:
    """The type of `DETACHED`."""

    __slots__ = ()


DETACHED = _Detached()
"""What a `LeanProcess`'s generator yields when it has put a callback of its own on the event
it waits for (`start_direct`): the process leaves its resumption to that callback."""


class LeanProcess(Process):
    """A SimPy process resumed with less work per event: the generator's `send` and the resume
    callback are bound once (SimPy binds a new method at every yield), and the active-process
    bookkeeping that only interrupts and `active_process` read is skipped (the engine uses
    neither). Values, failures and scheduling are SimPy's: the same events in the same order.
    A yielded `DETACHED` leaves the resumption to the generator (`start_direct`)."""

    def __init__(self, env: simpy.Environment, generator) -> None:
        super().__init__(env, generator)
        self._send = generator.send
        self._callback = self._target.callbacks[0]  # the bound `_resume` Initialize holds

    def _resume(self, event: simpy.Event) -> None:
        while True:
            if not event._ok:  # a failed event: SimPy's own handling throws it in
                return Process._resume(self, event)
            try:
                event = self._send(event._value)
            except StopIteration as stop:
                self._ok = True
                self._value = stop.value
                self.env.schedule(self)
                self._target = None
                return
            except BaseException as failure:  # the process failed: SimPy's failed process
                failure.__traceback__ = failure.__traceback__.tb_next
                self._ok = False
                self._value = failure
                self.env.schedule(self)
                self._target = None
                return
            if event is DETACHED:  # the generator is resumed by its own callback
                self._target = None
                return
            callbacks = event.callbacks
            if callbacks is not None:  # not processed yet: resume when it is
                callbacks.append(self._callback)
                self._target = event
                return


def start_direct(env: simpy.Environment, body) -> LeanProcess:
    """Start the process of generator function `body(process)`, given its own `LeanProcess`.
    Its generator may wait for a `LeanEvent` by setting the event's callbacks to
    `[process._send]` (or a list that holds only that, reused) and yielding `DETACHED`: the
    loop then resumes the generator itself, without `_resume`'s call, and ignores what it
    yields next. Waits for other events go through `via_process`; so must the process's last
    wait (a generator that ends while resumed directly would raise in the loop)."""
    holder: list[LeanProcess] = []
    process = env.process(body(holder))
    holder.append(process)
    return process


def via_process(sub, process: LeanProcess):
    """Run `sub`, a SimPy process body (it yields events; it may use no values they send),
    inside a `start_direct` generator: its first wait resumes `process` (`_resume`), which
    then drives it as SimPy does. Returns what `sub` returns."""
    try:
        event = sub.send(None)
        while event.callbacks is None:  # processed already: SimPy's process goes on at once
            event = sub.send(event._value) if event._ok else sub.throw(event._value)
    except StopIteration as stop:
        return stop.value
    event.callbacks.append(process._callback)
    yield DETACHED
    return (yield from sub)


class CountingEnvironment(simpy.Environment):
    """A SimPy environment that counts processed events (reported by benchmarks), runs its
    processes as `LeanProcess`es and keeps its events in a calendar instead of one heap.

    SimPy processes events in (time, priority, schedule order); here every (time, priority) has
    a bucket of its events in schedule order, and a heap holds the buckets' distinct keys. A
    full simulation's replicas are alike, so events come in bunches at one instant (1.45M
    events at 17k distinct (time, priority) keys in the 9,216-GPU benchmark), and a bucket's
    events are taken out without heap operations. The order is SimPy's: an event scheduled at
    the instant being processed goes to the end of its bucket, and one of a higher priority
    (URGENT, a process's start) makes the loop take its bucket first (`_ahead`).

    The clock (`_now`, which SimPy's code sets and reads) and the bucket being processed are
    slots, which the engine's C code reads at their offsets (`_slots.h`)."""

    __slots__ = ("_now", "now_bucket")

    def __init__(self) -> None:
        super().__init__()
        self.events_processed = 0
        self._keys: list[tuple[float, int]] = []  # heap of the buckets' (time, priority)
        self.normal: dict[float, list] = {}  # NORMAL-priority buckets by time
        self._urgent: dict[float, list] = {}  # URGENT-priority buckets by time
        self._current: tuple[float, int] = (-math.inf, 0)  # the key being processed
        self._ahead: list[tuple[float, int]] = []  # keys made before `_current` while in it
        self.now_bucket: list | None = None  # NORMAL bucket of `now` while `run_until` is in it

    def process(self, generator) -> LeanProcess:  # type: ignore[override]
        return LeanProcess(self, generator)

    def timeout(self, delay: float = 0, value=None) -> Timeout:  # type: ignore[override]
        """SimPy's `Timeout(env, delay, value)`, built without its Python `__init__` call."""
        if delay < 0:
            raise ValueError(f"Negative delay {delay}")
        timeout = _make(Timeout)
        timeout.env, timeout.callbacks, timeout._value, timeout._delay, timeout._ok = \
            self, [], value, delay, True
        self.schedule(timeout, NORMAL, delay)
        return timeout

    def event(self) -> Event:  # type: ignore[override]
        """SimPy's `Event(env)`, built without its Python `__init__` call."""
        event = _make(Event)
        event.env, event.callbacks = self, []
        return event

    def schedule(self, event: simpy.Event, priority: int = NORMAL, delay: float = 0) -> None:
        """Add `event` at `now + delay` (SimPy's `schedule`, on the calendar)."""
        if not delay and priority == NORMAL and self.now_bucket is not None:
            self.now_bucket.append(event)
            return
        at = self._now + delay
        buckets = self.normal if priority == NORMAL else self._urgent
        bucket = buckets.get(at)
        if bucket is None:
            self.new_bucket(at, priority).append(event)
        else:
            bucket.append(event)

    def new_bucket(self, at: float, priority: int = NORMAL) -> list:
        """The (empty) bucket of a key with none yet."""
        bucket: list = []
        (self.normal if priority == NORMAL else self._urgent)[at] = bucket
        key = (at, priority)
        heapq.heappush(self._keys, key)
        if key < self._current:
            self._ahead.append(key)
        return bucket

    def _bucket(self) -> tuple[tuple[float, int], list] | None:
        """The first key with events and its bucket (empty ones dropped), or None."""
        keys = self._keys
        while keys:
            key = keys[0]
            buckets = self.normal if key[1] == NORMAL else self._urgent
            bucket = buckets[key[0]]
            if bucket:
                return key, bucket
            heapq.heappop(keys)
            del buckets[key[0]]
        return None

    def peek(self) -> float:
        got = self._bucket()
        return math.inf if got is None else got[0][0]

    def step(self) -> None:
        """Process the next event (SimPy's `step`): the first of its bucket, taken off the list
        in time linear in the bucket's length (`run_until` takes a bucket in one pass)."""
        got = self._bucket()
        if got is None:
            raise EmptySchedule
        self._now = got[0][0]
        event = got[1].pop(0)
        self.events_processed += 1
        callbacks, event.callbacks = event.callbacks, None
        for callback in callbacks:
            callback(event)
        if not event._ok and not hasattr(event, "_defused"):
            _raise_failure(event)

    def run_until(self, until: simpy.Event) -> None:
        """`run(until)` as one loop: `step` inlined (the same events in the same order,
        failures raised the same way), a bucket's events taken one after another by `take`,
        which also takes the events appended to the bucket meanwhile; the events taken leave
        the bucket when the loop leaves it."""
        until.callbacks.append(_stop)
        ahead, counter = self._ahead, [0]
        try:
            while (got := self._bucket()) is not None:
                self._current, bucket = got
                self._now = got[0][0]
                self.now_bucket = bucket if got[0][1] == NORMAL else None
                failure = take(bucket, ahead, counter)
                if failure is not None:
                    _raise_failure(failure)
        except _Stop:
            return
        finally:
            self.events_processed += counter[0]
            self._current = (-math.inf, 0)
            self.now_bucket = None
        raise RuntimeError(f'No scheduled events left but "until" event was not triggered: {until}')


def _take(bucket: list, ahead: list, counter: list[int]):
    """Take `bucket`'s events from its start (also those appended meanwhile): each event's
    callbacks are called with it, most events' one without an iterator; stop after an event
    when `ahead` holds a key (clearing it) or when the event failed and nothing defused it
    (returned, for the caller to raise). The events taken leave the bucket and are counted in
    `counter[0]`. `_run_loop.take` is this loop in C."""
    n = 0
    try:
        for event in bucket:
            n += 1
            callbacks = event.callbacks
            event.callbacks = None
            try:  # most events have one callback: called without an iterator
                callback, = callbacks
            except ValueError:
                for callback in callbacks:
                    callback(event)
            else:
                callback(event)
            if not event._ok and not hasattr(event, "_defused"):
                return event
            if ahead:  # a key before this one appeared: take it first
                ahead.clear()
                break
        return None
    finally:
        del bucket[:n]
        counter[0] += n


RUN_LOOP_ABI = 1
"""The interface version of `_run_loop.c` (its `ABI`) that `take` is."""
# the loop in C (`_run_loop.c`, an optional extension): the same calls in the same order
take = getattr(extension("holmes_sim.sim._run_loop", RUN_LOOP_ABI), "take", _take)


def _raise_failure(event: simpy.Event) -> None:
    """Raise a copy of a failed event's exception that nothing defused (as SimPy's `step`)."""
    exc = type(event._value)(*event._value.args)
    exc.__cause__ = event._value
    raise exc


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
