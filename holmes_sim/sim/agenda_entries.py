"""The flow network's agenda entries of one due time, applied in the order posted
(`network.FlowNetwork._on_wake`): a pending flow starts (alone on all its links: its rate and
end at once; else `FlowNetwork._start`), an active flow whose entry is live ends (alone on its
links: its route freed; else `FlowNetwork._take_off`) and its event fires. `_agenda_entries.c`
is `apply` in C, where it was built: the same stores, calls and float arithmetic in the same
order; its `post` is `FlowNetwork.send_message` in C (None where it was not built)."""

from __future__ import annotations

from holmes_sim.sim.flow_records import ACTIVE, DONE, PENDING
from holmes_sim.version import extension


def _apply(bucket: list, now: float, fire, context: tuple) -> tuple[int, int, int]:
    """Apply `bucket`'s (flow, token) entries from its start (also those appended meanwhile) at
    `now` seconds; `fire` schedules a finished flow's event; `context` is the network's
    (due buckets by time, its `_bucket`, `_start`, `_take_off`, seeds, ahead). Stops after a
    lone flow's start when `ahead` holds a time. Returns (entries applied, or -1 for the whole
    bucket; flows started alone; flows ended)."""
    due_at, new_bucket, start, take_off, seeds, ahead = context
    lone = ended = 0
    for i, (flow, token) in enumerate(bucket, 1):
        state = flow.state
        if state == PENDING:
            route = flow.route
            for other in route.conflicts:
                if other.active:  # a flow on one of its links
                    start(flow, now)
                    break
            else:  # alone on all its links: its rate at once, out of their member maps
                flow.state, flow.since, flow.token = ACTIVE, now, 1
                route.active, route.lone = 1, flow
                flow.rate = rate = route.solo
                lone += 1
                end = now + flow.size / rate
                later = due_at.get(end)  # `FlowNetwork._post(end, flow, 1)`
                if later is None:
                    later = new_bucket(end)
                later.append((flow, 1))
                if ahead:  # it is due before this bucket: the caller applies it first
                    return i, lone, ended
        elif state == ACTIVE and token == flow.token:
            route = flow.route
            if route.lone is flow:  # nothing reads its rate or bytes any more
                route.active, route.lone = 0, None
                flow.state = DONE
            else:
                take_off(flow, seeds)
                flow.state, flow.remaining, flow.rate = DONE, 0.0, 0.0
            ended += 1
            done, flow.done = flow.done, None  # no flow <-> event cycle to collect
            done._ok, done._value = True, None  # `done.succeed()`
            fire(done)
    return -1, lone, ended


AGENDA_ENTRIES_ABI = 1
"""The interface version of `_agenda_entries.c` (its `ABI`) that `apply` and `post` are."""
_entries = extension("holmes_sim.sim._agenda_entries", AGENDA_ENTRIES_ABI)  # the loop in C
apply, post = (_apply, None) if _entries is None else (_entries.apply, _entries.post)
