"""The records of the flow network (`network.FlowNetwork`): a resolved route and a flow, with
the states a flow goes through. A flow of `send_message` is also its own SimPy event."""

from __future__ import annotations

PENDING, ACTIVE, DONE = 0, 1, 2
"""A flow's `state`: waiting out its latency, moving bytes, finished."""


class Route:
    """A resolved path: ((link index, weight), ...), for a flow alone on all its links its
    rate in bytes/s (`solo`) and narrowest link index (`solo_bneck`), and its links' member
    maps and weights in the same order (a flow goes on and off its links without indexing the
    network's lists). Which links carry flows is kept per route: `active` flows on it, `lone`
    its flow that is alone on all its links (kept out of their member maps) or None, and
    `conflicts` every route that shares a link with it, itself included
    (`network.FlowNetwork._register`): a flow's links are all free iff no route in its route's
    `conflicts` has an active flow."""

    __slots__ = ("links", "solo", "solo_bneck", "members", "weights", "ids", "conflicts",
                 "active", "lone")

    def __init__(self, links: tuple[tuple[int, float], ...], solo: tuple[float, int],
                 members: tuple[dict, ...]) -> None:
        self.links, self.members = links, members
        self.solo, self.solo_bneck = solo
        self.weights = tuple(w for _, w in links)
        self.ids = tuple(link for link, _ in links)
        self.conflicts, self.active, self.lone = [self], 0, None


class Flow:
    """One flow (`network.FlowNetwork.transfer`, `send_message`); `token` names its live agenda
    entry. It sets only what its start and end read; `links` ((link index, weight) pairs),
    `mark`, `new_rate`, `remaining` (bytes left at time `since`) and, for a flow that started
    alone on its links, `bneck` are set when it joins its links' member maps
    (`FlowNetwork._list`); a flow alone on its links is its route's `lone`. The flow of `send_message` is its own event
    (`callbacks`, `_ok`, `_value`, as `environment.LeanEvent`, and the sender's `message`):
    nothing may wait for it or combine it with other events. The network's wake-ups (`FlowNetwork._arm`)
    are events of this type too, with only those three fields."""

    __slots__ = (
        "fid", "links", "size", "remaining", "rate", "since", "done", "state", "token",
        "mark", "new_rate", "bneck", "route", "callbacks", "_ok", "_value", "message",
    )


EVENT_TYPE = Flow
"""The type of a `send_message` flow, which is an event of `environment.LeanEvent`'s fields: an
engine that makes its own lean events of it (`environment.fired_event`) gives the run loop one
type to read for most events."""
