"""The engine's gradient buckets of a chunk and the expert-data-parallel streams they go to.

Megatron-Core keeps two gradient buffers (megatron/core/distributed/distributed_data_parallel.py):
`buffers` for the dense parameters, reduced over the data-parallel-with-context group (every
replica of the stage), and `expert_parallel_buffers` for the routed experts' parameters under
expert parallelism, reduced over the expert-data-parallel group: the replicas holding the same
experts, r, r + n, r + 2 n, ... (`GroupKind.EXPERT_DATA`; n = `Workload.ep_replicas`, the
replicas an EP group spans: ep with the experts' TP equal to TP). Each buffer is cut into its own
buckets of `bucket_size_mb`; a buffer's bucket k of n is ready when (k + 1)/n of the chunk's
backward has run (buckets fill in reverse layer order and both kinds of parameter run through
every MoE layer). Where the expert-data-parallel group has one member (dp cp = n) the expert
gradients are not reduced and their buckets are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from holmes_sim.cost.nccl_algorithms import leaves_node
from holmes_sim.cost.ops import OpCosts
from holmes_sim.cost.paths import ring_paths
from holmes_sim.plan import GroupKind, Plan
from holmes_sim.sim.sync import RingSpec, Stream


@dataclass(slots=True)
class Bucket:
    grad_bytes: float
    param_bytes: float
    fraction: float  # of the chunk's compute before the bucket is ready
    expert: bool = False
    """Routed experts' gradients, reduced over the expert-data-parallel group."""


def chunk_buckets(costs: OpCosts, layers_per_stage: tuple[int, ...], j: int,
                  reduce_experts: bool) -> list[Bucket]:
    """Gradient buckets of virtual stage j in release order, per-GPU bucket size as Megatron
    sizes them; `reduce_experts`: the expert-data-parallel group has more than one member."""
    params = costs.virtual_stage_params(layers_per_stage, j)
    expert = costs.virtual_stage_expert_params(layers_per_stage, j)
    if expert == 0:
        return _run(costs, params, False)
    dense = _run(costs, params - expert, False)
    if not reduce_experts:
        return dense
    marks = [((k + 1) / len(run), run is not dense, b)
             for run in (dense, _run(costs, expert, True)) for k, b in enumerate(run)]
    marks.sort(key=lambda m: (m[0], m[1]))
    done = 0.0
    for point, _, b in marks:
        b.fraction, done = point - done, point
    return [b for _, _, b in marks]


def _run(costs: OpCosts, params: int, expert: bool) -> list[Bucket]:
    """`params` parameters' gradients in equal buckets, each 1/n of the compute."""
    w = costs.workload
    grad = w.grad_bytes_of(params)
    n = costs.gradient_buckets(params)
    param_bytes = params * w.dtype_bytes
    return [Bucket(grad / n, param_bytes / n, 1.0 / n, expert) for _ in range(n)]


def expert_data_streams(engine) -> dict[tuple[int, int], Stream]:
    """Per (stage, r) with an expert-data-parallel group over replicas r, r + n, ... (n =
    `Workload.ep_replicas`, ep with the experts' TP equal to TP): one comm
    stream on the NCCL ring over its members (the engine runs every replica when ep > 1, so
    the ring is the whole group's), its collectives recorded on the members' "edp" trace
    stream beside the "dp" one."""
    plan: Plan = engine.plan
    ep = engine.costs.workload.ep_replicas
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
                                          ring.step_latency_s, len(members), ring.topology,
                                          tuple(leaves_node(h.links) for h in ring.hops), "edp"))
    return out
