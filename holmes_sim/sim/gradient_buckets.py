"""The engine's gradient buckets of a chunk and the expert-data-parallel streams they go to.

Megatron-Core keeps two gradient buffers (megatron/core/distributed/distributed_data_parallel.py):
`buffers` for the dense parameters, reduced over the data-parallel-with-context group (every
replica of the stage), and `expert_parallel_buffers` for the routed experts' parameters under
expert parallelism, reduced over the expert-data-parallel group: the replicas holding the same
experts, r, r + n, r + 2 n, ... (`GroupKind.EXPERT_DATA`; n = `Workload.ep_replicas`, the
replicas an EP group spans: ep with the experts' TP equal to TP). Each buffer is cut into its own
buckets at parameter boundaries as Megatron-Core cuts them (`model.bucket_layout`), each ready at
the point of the chunk's backward where its last gradient is produced. Where the expert-data-
parallel group has one member (dp cp = n) the expert gradients are not reduced and their
buckets are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from holmes_sim.cost.nccl_algorithms import gradient_op, leaves_node, with_nvls
from holmes_sim.cost.ops import OpCosts
from holmes_sim.cost.paths import ring_paths
from holmes_sim.plan import GroupKind, Plan, Transport
from holmes_sim.sim.sync import RingSpec, Stream


@dataclass(slots=True)
class Bucket:
    grad_bytes: float
    param_bytes: float
    fraction: float  # of the chunk's compute before the bucket is ready
    expert: bool = False
    """Routed experts' gradients, reduced over the expert-data-parallel group."""


def chunk_buckets(costs: OpCosts, layers_per_stage: tuple[int, ...], j: int,
                  reduce_experts: bool, sharded: bool, numel: int | None) -> list[Bucket]:
    """Gradient buckets of virtual stage j in release order, as Megatron-Core cuts them
    (`OpCosts.gradient_buckets`: `sharded` distributed optimizer, `numel` elements per bucket,
    `Plan.bucket_numel`); `reduce_experts`: the expert-data-parallel group has more than one member. Each
    bucket's `fraction` is the share of the chunk's compute between the previous bucket's ready
    point and its own (the last ends the chunk)."""
    dense, expert = costs.gradient_buckets(layers_per_stage, j, sharded, numel)
    marks = sorted([(point, False, g, p) for g, p, point in dense] +
                   ([(point, True, g, p) for g, p, point in expert] if reduce_experts else []),
                   key=lambda m: (m[0], m[1]))
    out, done = [], 0.0
    for k, (point, is_expert, grad, param) in enumerate(marks):
        point = 1.0 if k == len(marks) - 1 else point
        out.append(Bucket(grad, param, point - done, is_expert))
        done = point
    return out


def expert_data_streams(engine) -> dict[tuple[int, int], Stream]:
    """Per (stage, r) with an expert-data-parallel group over replicas r, r + n, ... (n =
    `Workload.ep_replicas`, ep with the experts' TP equal to TP): one comm
    stream on the NCCL ring over its members (the engine runs every replica when ep > 1, so
    the ring is the whole group's), its collectives recorded on the members' "edp" trace
    stream beside the "dp" one."""
    plan: Plan = engine.plan
    w = engine.costs.workload
    ep = w.ep_replicas
    out = {}
    for s in range(plan.pp):
        for r in range(min(ep, plan.dp)):
            g = engine.group_by_first.get((GroupKind.EXPERT_DATA, plan.rank(s, r, 0)))
            if g is None:
                continue
            members = list(range(r, plan.dp, ep))
            ring = ring_paths(engine.cluster, g.transport,
                              [plan.entity_gpus(s, d) for d in members], engine.caps)
            names = tuple(engine.entity[(s, members[k])].name for k in ring.order)
            out[(s, r)] = Stream(RingSpec(names, tuple(engine.net.resolve(h.links) for h in ring.hops),
                                          ring.step_latency_s, len(members),
                                          with_nvls(ring.topology, w.nvls_enable),
                                          tuple(leaves_node(h.links) for h in ring.hops), "edp",
                                          gradient_op(w.average_in_collective)))
    return out


def reduction_transports(engine, s: int, d: int) -> tuple[Transport, ...]:
    """The transports of the groups stage s's releasing backwards on replica d reduce over
    (`cost.ops.node_comm_sms`): its DP group's and, where its experts' buckets are reduced, its
    expert-data-parallel group's."""
    plan: Plan = engine.plan
    firsts = [(GroupKind.DATA, plan.rank(s, 0, 0))]
    if (s, 0) in engine.edp_stream:
        firsts.append((GroupKind.EXPERT_DATA, plan.rank(s, d % engine.costs.workload.ep_replicas, 0)))
    return tuple(g.transport for g in map(engine.group_by_first.get, firsts) if g is not None)
