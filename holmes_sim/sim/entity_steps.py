"""An entity's process with its common ops in C (`_entity_steps.Steps`, an optional extension):
the same work as `engine._Simulation._entity`'s Python loop, in the same order. `Steps` runs
each common op (input receive and wait, one compute timeout, rows, send) and is itself the
callback of the events it waits for, so the process's generator resumes only for the ops it
leaves to Python (EP, CP, parameter gathers, gradient releases, jitter or a shared host:
`_special_op`) and for the end of the schedule. `Steps` is None where it was not built."""

from __future__ import annotations

from holmes_sim.sim.environment import DETACHED, LeanProcess, fired_event, via_process
from holmes_sim.sim.flow_records import EVENT_TYPE
from holmes_sim.sim.pipeline_messages import POSTED
from holmes_sim.sim.trace import KIND_CODE, OpKind
from holmes_sim.version import extension

_CODES = tuple(KIND_CODE[k] for k in (OpKind.WAIT_BUBBLE, OpKind.WAIT_PP, OpKind.TP_COMM))


def stepped(sim, s: int, d: int, me: list[LeanProcess]):
    """Process of entity (s, d) of `sim` (an `engine._Simulation`), `me[0]`
    (`environment.start_direct`): its steps by `Steps`, its special ops, then its gradient
    sync and step (`_finish`)."""
    name, node, gathers, steps, durations, ids, routes = sim._entity_setup(s, d)
    reductions: list = []
    msgs, process = sim.messages, me[0]
    base = msgs.base(d)
    go = Steps(sim.env, steps, durations, routes, base,
               (msgs.state, msgs.arrival, msgs.sent_at, POSTED, msgs.send, msgs.post),
               sim.trace.rows, ids, (fired_event(EVENT_TYPE), fired_event(EVENT_TYPE)),
               process._send, _CODES).go
    while True:
        i = go()
        if i is None:  # it waits: `Steps` resumes this generator with the next index
            i = yield DETACHED
        if i < 0:
            break
        _, jb, mb, chunk, _, special, out, r, post = steps[i]
        dur, tp = durations[jb]
        reductions += (yield from via_process(
            sim._special_op(name, node, s, d, special, dur, tp, gathers), process))
        if out is not None:
            msgs.send(out + base, routes[r], mb, chunk)
        if post is not None:
            msgs.post(post + base)
    yield from via_process(sim._finish(name, node, s, d, reductions), process)


ENTITY_STEPS_ABI = 1
"""The interface version of `_entity_steps.c` (its `ABI`) whose `Steps` the engine runs."""
# the common ops in C (`_entity_steps.c`, an optional extension); None where it was not built
# or was built with another interface
Steps = getattr(extension("holmes_sim.sim._entity_steps", ENTITY_STEPS_ABI), "Steps", None)
