"""Which entities a timeline or a trace shows when a run has too many to draw them all."""

from __future__ import annotations

from collections.abc import Sequence

from holmes_sim.sim.trace import Entity


def sample_entities(entities: Sequence[Entity], max_rows: int) -> tuple[list[Entity], str]:
    """The entities to show, in (stage, replica) order, and a note saying exactly which.

    All of them when at most `max_rows`; else every replica of the first and last stage plus
    replica 0 of evenly spaced stages in between, when those replicas fit; else evenly spaced
    replicas of every stage (evenly spaced stages when even one row per stage is too many)."""
    ordered = sorted(entities, key=lambda e: (e.stage, e.replica))
    if len(ordered) <= max_rows:
        return ordered, f"all {len(ordered)} (stage, replica) entities"
    stages = sorted({e.stage for e in ordered})
    full = {stages[0], stages[-1]}
    if sum(1 for e in ordered if e.stage in full) > max_rows:
        return _spread(ordered, stages, max_rows)
    between = stages[1:-1]
    room = max(0, max_rows - sum(1 for e in ordered if e.stage in full))
    if room < len(between):
        between = _evenly(between, room)
    first = {s: min(e.replica for e in ordered if e.stage == s) for s in between}
    rows = [e for e in ordered if e.stage in full or first.get(e.stage) == e.replica]
    note = (f"{len(rows)} of {len(ordered)} entities: every replica of stages {stages[0]} and "
            f"{stages[-1]}, the first replica of {len(between)} stages between")
    return rows, note


def _spread(ordered: list[Entity], stages: list[int], max_rows: int) -> tuple[list[Entity], str]:
    if len(stages) > max_rows:
        kept = set(_evenly(stages, max_rows))
        first = {s: min(e.replica for e in ordered if e.stage == s) for s in kept}
        rows = [e for e in ordered if first.get(e.stage) == e.replica]
        return rows, (f"{len(rows)} of {len(ordered)} entities: the first replica of {len(kept)} "
                      f"evenly spaced stages of {len(stages)}")
    replicas = sorted({e.replica for e in ordered})
    kept = set(_evenly(replicas, max_rows // len(stages)))
    rows = [e for e in ordered if e.replica in kept]
    shown = ", ".join(map(str, sorted(kept)))
    return rows, (f"{len(rows)} of {len(ordered)} entities: replicas {shown} of each of the "
                  f"{len(stages)} stages")


def _evenly(items: Sequence[int], count: int) -> list[int]:
    """`count` items spread evenly over `items`, first and last included."""
    if count >= len(items):
        return list(items)
    if count <= 1:
        return list(items[:count])
    step = (len(items) - 1) / (count - 1)
    return [items[round(i * step)] for i in range(count)]
