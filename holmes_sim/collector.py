"""Garbage-collection settings for the phases that build many objects and few cycles: loading a
scenario, planning, the engine's set-up and run, the planner's evaluation."""

from __future__ import annotations

import gc
from contextlib import contextmanager

_frozen_here = False
"""Whether a `quiet_collector` context froze the objects and has not unfrozen them yet."""


def frozen() -> bool:
    """Whether objects are frozen out of collection: by an enclosing `quiet_collector` (known
    at no cost) or by another caller (`gc.get_freeze_count`, which walks every frozen object:
    milliseconds under a chunk of the planner, so asked only when no context froze)."""
    return _frozen_here or gc.get_freeze_count() > 0


@contextmanager
def quiet_collector(threshold: int | None = 200_000, freeze_made: bool = False):
    """Run with the objects alive at the start frozen out of garbage collection (unless a caller
    froze them already: freezing does not nest) and, with `threshold`, a young-generation
    threshold of that many allocations (0: no automatic collection; inside a context that
    turned it off, it stays off): a run makes millions of short-lived objects and few cycles,
    and collections otherwise took a fifth of its CPU time. Restored afterwards. With
    `freeze_made`, the objects made inside (long-lived caches, a set-up) join the frozen ones
    before the thresholds are restored, when a `quiet_collector` froze them (this one or an
    enclosing one, which unfreezes them all into the oldest generation): otherwise the first
    young collection after it traverses them all."""
    global _frozen_here
    old = gc.get_threshold()
    freeze = not frozen()
    if freeze:
        gc.freeze()
        _frozen_here = True
    if threshold is not None and old[0] != 0:
        gc.set_threshold(threshold, old[1], old[2])
    try:
        yield
        if freeze_made and _frozen_here:
            gc.freeze()
    finally:
        gc.set_threshold(*old)
        if freeze:
            gc.unfreeze()
            _frozen_here = False
