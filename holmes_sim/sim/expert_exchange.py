"""The expert-parallel all-to-alls of one op in the engine (`cost.expert_parallel`): the entity
sends its share of every MoE layer's dispatch and combine to each of its EP peers, as one flow
per peer over the EP group's links, all at once (NCCL runs the all-to-all as one group of sends,
`cost.expert_parallel`), contending with the other EP groups' and the DP and PP flows; nothing
overlaps them, so the compute stream waits for the last flow, recorded as `ep-comm`.
"""

from __future__ import annotations

from holmes_sim.cost.expert_parallel import pass_latency_s, peer_bytes
from holmes_sim.plan import GroupKind
from holmes_sim.schedule import Op
from holmes_sim.sim.trace import OpKind


def ep_peers(d: int, ep: int) -> tuple[int, ...]:
    """The replicas of replica d's EP group: the run of `ep` consecutive replicas holding d."""
    first = d - d % ep
    return tuple(range(first, first + ep))


def ep_routes(engine, s: int, d: int) -> tuple[tuple[object, float], ...]:
    """(route, latency s) of replica d's transfer to each other replica of its EP group on stage
    s, over the EP group's transport, cached on the engine."""
    key = ("ep", s, d)
    got = engine._route_cache.get(key)
    if got is None:
        peers = ep_peers(d, engine.costs.workload.ep)
        group = engine.group_by_first[(GroupKind.EXPERT, engine.plan.rank(s, peers[0], 0))]
        paths = [engine._entity_path(group, (s, d), (s, e)) for e in peers if e != d]
        got = engine._route_cache[key] = tuple((engine.net.resolve(p.links), p.latency_s)
                                               for p in paths)
    return got


def ep_exchange(engine, name: str, s: int, d: int, op: Op, layers: int):
    """Run the all-to-alls of the op's `layers` layers (one forward or backward) as flows to
    each EP peer: the TP group's t GPUs' bytes together, (ep - 1) steps of the path's latency."""
    w, tp = engine.costs.workload, engine.plan.tp
    size = tp * peer_bytes(w, tp, w.ep, layers)
    start = engine.env.now
    yield engine.env.all_of([engine.net.transfer(route, size, pass_latency_s(w, w.ep, layers,
                                                                              latency))
                             for route, latency in ep_routes(engine, s, d)])
    if engine.env.now > start:
        engine.trace.op(start, engine.env.now, name, "compute", OpKind.EP_COMM, 0, op.microbatch,
                        op.chunk)
