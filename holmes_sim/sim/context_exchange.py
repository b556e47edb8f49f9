"""The context-parallel exchanges of one op in the engine (`cost.context_parallel`): each ring
step's transfer (K/V, dK/dV or both: `cost.context_parallel.ring_bytes`) to the next replica of
the entity's CP ring as a flow over the CP group's links, beside that step's attention compute
(the step ends when both have), then any exchange that nothing overlaps; the compute stream's
wait beyond compute is `cp-comm`.
"""

from __future__ import annotations

from holmes_sim.plan import GroupKind
from holmes_sim.schedule import Op
from holmes_sim.sim.trace import OpKind


def cp_route(engine, s: int, d: int) -> tuple[object, float]:
    """(route, latency s) of replica d's transfer to the next replica of its CP ring on stage s,
    over the CP group's transport, cached on the engine."""
    key = ("cp", s, d)
    got = engine._route_cache.get(key)
    if got is None:
        peers = engine.plan.cp_peers(d)
        nxt = peers[(peers.index(d) + 1) % len(peers)]
        group = engine.group_by_first[(GroupKind.CONTEXT, engine.plan.rank(s, peers[0], 0))]
        path = engine._entity_path(group, (s, d), (s, nxt))
        got = engine._route_cache[key] = (engine.net.resolve(path.links), path.latency_s)
    return got


def cp_exchange(engine, name: str, s: int, d: int, node, op: Op, kind: OpKind, layers: int):
    """The op's CP exchanges for its `layers` layers together (`cost.context_parallel`; per
    layer the same steps, so on an idle network the same time): each ring step's flow to the
    next replica of d's CP ring beside that step's attention compute, then the exposed flow.
    Returns the attention compute run here (s), which leaves the op's."""
    env, net, trace = engine.env, engine.net, engine.trace
    links, latency = cp_route(engine, s, d)
    scale, done = layers * engine.plan.tp, 0.0
    for p in engine.costs.cp_passes(node, kind is OpKind.BACKWARD):
        for step_bytes in p.ring_bytes:
            start, compute = env.now, layers * p.step_s
            flow = net.transfer(links, scale * step_bytes, layers * latency)
            yield env.all_of([flow, engine._work(name, compute)])
            trace.op(start, start + compute, name, "compute", kind, 0, op.microbatch, op.chunk)
            _cp_wait(engine, name, start + compute, op)
            done += compute
        if p.exposed_bytes:
            start = env.now
            yield net.transfer(links, scale * p.exposed_bytes, layers * p.exposed_hops * latency)
            _cp_wait(engine, name, start, op)
    return done


def _cp_wait(engine, name: str, since: float, op: Op) -> None:
    """Record the compute stream's wait for the exchange from `since` to now as `cp-comm`."""
    if engine.env.now > since:
        engine.trace.op(since, engine.env.now, name, "compute", OpKind.CP_COMM, 0, op.microbatch,
                        op.chunk)
