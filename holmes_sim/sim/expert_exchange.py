"""The expert-parallel all-to-alls of one op in the engine (`cost.expert_parallel`): the entity
sends its share of every MoE layer's dispatch and combine (or their gradients; a backward under
full recomputation first the recomputed forward's, `exchanges_per_op`) to each other TP group of
its EP group, as one flow per peer over the EP group's links, all at once, beside its GPUs' sends
to the EP peers inside its own TP group (expert TP below TP) on the node's intra-node link,
priced in closed form (`OpCosts.ep_local_s`) (NCCL runs the all-to-all as one group of sends,
`cost.expert_parallel`), contending with the other EP groups' and the DP and PP flows; nothing
overlaps them, so the compute stream waits for the last flow, recorded as `ep-comm`.
"""

from __future__ import annotations

from holmes_sim.cost.expert_parallel import exchanges_per_op, group_peer_bytes, pass_latency_s
from holmes_sim.plan import GroupKind
from holmes_sim.schedule import Op
from holmes_sim.sim.trace import OpKind


def ep_peers(d: int, ep: int) -> tuple[int, ...]:
    """The replicas of replica d's EP group: the run of `ep` consecutive replicas holding d
    (`ep`: `Workload.ep_replicas`)."""
    first = d - d % ep
    return tuple(range(first, first + ep))


def ep_routes(engine, s: int, d: int) -> tuple[tuple[object, float], ...]:
    """(route, latency s) of replica d's transfer to each other replica of its EP group on stage
    s, over the EP group's transport, cached on the engine."""
    key = ("ep", s, d)
    got = engine._route_cache.get(key)
    if got is None:
        peers = ep_peers(d, engine.costs.workload.ep_replicas)
        group = engine.group_by_first[(GroupKind.EXPERT, engine.plan.rank(s, peers[0], 0))]
        paths = [engine._entity_path(group, (s, d), (s, e)) for e in peers if e != d]
        got = engine._route_cache[key] = tuple((engine.net.resolve(p.links), p.latency_s)
                                               for p in paths)
    return got


def ep_exchange(engine, name: str, s: int, d: int, node, op: Op, layers: int):
    """Run the op's exchanges of its `layers` layers (`exchanges_per_op`) one after the other,
    each as flows to each other TP group of the EP group: the TP group's t GPUs' bytes together
    (`group_peer_bytes`), (ep - 1) steps of the path's latency; and the sends inside the TP group
    as a wait of `OpCosts.ep_local_s` on `node`."""
    w, tp = engine.costs.workload, engine.plan.tp
    size = group_peer_bytes(w, tp, layers)
    start = engine.env.now
    local_s = engine.costs.ep_local_s(node, layers)
    for _ in range(exchanges_per_op(w, op.kind == "B")):
        events = [engine.net.transfer(route, size, pass_latency_s(w, w.ep, layers, latency))
                  for route, latency in ep_routes(engine, s, d)]
        if local_s > 0:
            events.append(engine.env.timeout(local_s))
        yield engine.env.all_of(events)
    if engine.env.now > start:
        engine.trace.op(start, engine.env.now, name, "compute", OpKind.EP_COMM, 0, op.microbatch,
                        op.chunk)
