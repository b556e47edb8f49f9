"""What every policy shares: the request it answers, the Policy protocol, and the building blocks
(rank-to-GPU maps, communication groups, equal partition) that policies compose."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Protocol

from holmes_sim.hardware.cluster import Cluster, Node
from holmes_sim.cost.compute import ComputeModel
from holmes_sim.cost.transport import job_wide_fabric
from holmes_sim.errors import PlanError
from holmes_sim.memo import IdentityMemo
from holmes_sim.plan import GpuRef, Groups, OptimizerMode, Plan, tp_group_places
from holmes_sim.policies.groups import GroupBuilder, TransportChooser
from holmes_sim.schedule import ScheduleKind
from holmes_sim.model.workload import Workload

_ORDERS: IdentityMemo = IdentityMemo()
_TP_CHECKED: IdentityMemo = IdentityMemo()
_GROUPS: IdentityMemo = IdentityMemo()
_FAMILIES: IdentityMemo = IdentityMemo()
_FABRICS: IdentityMemo = IdentityMemo()
"""Rank orders, checked TP layouts, groups and their families (`GroupBuilder.family`) and job-wide
fabrics, shared by the candidates of a search (a policy's are the same for every micro-batch
size, schedule and recompute mode of a layout)."""


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """Everything a policy needs: the hardware, the model and the parallel set-up."""

    cluster: Cluster
    workload: Workload
    compute: ComputeModel
    tp: int
    pp: int
    dp: int
    schedule_kind: ScheduleKind
    num_microbatches: int
    num_chunks: int
    distributed_optimizer: bool
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    """Megatron-LM `--overlap-param-gather` (megatron policy; `TrainingSpec`)."""
    cp: int = 1
    """Context-parallel degree; `dp` counts replicas, DP x CP (`plan`)."""


MEGATRON_SCHEDULES = ("1f1b", "interleaved")
"""The pipeline schedules of Megatron-LM and the frameworks built on its schedules (the Holmes
fork, Megatron-LLaMA): `get_forward_backward_func` (megatron/core/pipeline_parallel/schedules.py)
picks no pipelining (1F1B's layout at pipeline 1), 1F1B or interleaved; none runs GPipe."""
DEEPSPEED_SCHEDULES = ("1f1b",)
"""Megatron-DeepSpeed's with `--deepspeed`: DeepSpeed's pipeline engine runs its `TrainSchedule`
(deepspeed/runtime/pipe/schedule.py), forwards and backwards alternating after a warm-up (1F1B's
order, PipeDream-Flush) with every gradient reduced after the flush; no GPipe, no virtual
stages."""


class Policy(Protocol):
    """A named, pure function from a request to a Plan."""

    name: str
    description: str
    schedules: tuple[str, ...]
    """The pipeline schedules its framework runs, which `holmes-sim plan` searches for it unless
    the scenario's `search.schedule` lists others (`MEGATRON_SCHEDULES`)."""

    def cluster_view(self, cluster: Cluster) -> Cluster:
        """The hardware this policy assumes (references replace the NICs; others keep it)."""
        ...

    def plan(self, request: PlanRequest) -> Plan: ...


def gpus_in_node_order(nodes: Sequence[Node]) -> tuple[GpuRef, ...]:
    """Every GPU, node by node in the given order."""
    return tuple(GpuRef(n.name, g) for n in nodes for g in range(n.num_gpus))


def rank_order(cluster: Cluster, name: str, order: Callable[[Sequence[Node]], Sequence[Node]]
               ) -> tuple[tuple[Node, ...], tuple[GpuRef, ...]]:
    """The cluster's nodes in `order` (called `name`) and their GPUs node by node, built once
    per cluster and order: every candidate of a search gets the same tuples."""
    def make():
        nodes = tuple(order(cluster.nodes))
        # Each node's GPUs once per cluster: every order of a search reuses them.
        refs = cluster.derived(("gpu refs",), lambda: {n.name: gpus_in_node_order((n,))
                                                       for n in cluster.nodes})
        return nodes, tuple(chain.from_iterable(refs[n.name] for n in nodes))
    return _ORDERS.get((cluster,), (name,), make)


def job_fabric(cluster: Cluster, rank_to_gpu: Sequence[GpuRef]) -> str | None:
    """`cost.transport.job_wide_fabric` of a rank order's job, found once per rank order (by
    identity; it looks at every node)."""
    return _FABRICS.get((cluster, rank_to_gpu), (),
                        lambda: job_wide_fabric(cluster, rank_to_gpu))


def check_tp_within_nodes(rank_to_gpu: Sequence[GpuRef], tp: int) -> None:
    """Tensor parallelism must stay inside a node (it runs on NVLink); a layout that passed is
    remembered (by identity)."""
    _TP_CHECKED.get((rank_to_gpu,), (tp,), lambda: _check_tp(rank_to_gpu, tp))


def _check_tp(rank_to_gpu: Sequence[GpuRef], tp: int) -> bool:
    for k, (nodes, _) in enumerate(tp_group_places(rank_to_gpu, tp)):
        if len(nodes) > 1:
            start = k * tp
            raise PlanError(f"the TP group of ranks {start}..{start + tp - 1} spans nodes "
                            f"{sorted(nodes)}; make parallel.tensor divide every node's GPU count")
    return True


def build_groups(cluster: Cluster, rank_to_gpu: Sequence[GpuRef], tp: int, pp: int, dp: int,
                 num_chunks: int, tie_embeddings: bool, choose: TransportChooser,
                 chooser_key: Hashable | None = None, cp: int = 1, ep: int = 1,
                 etp: int | None = None) -> Groups:
    """TP, CP, EP, DP, PP and embedding groups for Megatron's rank layout (`dp` replicas of
    which each `cp` consecutive form a CP group; EP and expert-DP groups in Megatron-Core's expert
    order with the experts' TP degree `etp`, None: tp), each with its transport
    (`policies.groups`), built when first read; single groups are found without building them
    all. With `chooser_key` (what determines `choose`'s answers besides the cluster), the
    groups are made once per (cluster, rank order, degrees, key) and the same object returned
    after."""
    def make() -> Groups:
        builder = GroupBuilder(cluster, rank_to_gpu, tp, pp, dp, num_chunks, tie_embeddings, choose,
                               cp, ep, etp)
        if chooser_key is not None:  # `GroupBuilder.family`: all but the chunk count
            family = (tp, pp, dp, tie_embeddings, chooser_key, cp, ep, etp)
            builder.family = _FAMILIES.get((cluster, rank_to_gpu), family, object)
        return Groups(builder.build, builder)

    if chooser_key is None:
        return make()
    return _GROUPS.get((cluster, rank_to_gpu),
                       (tp, pp, dp, num_chunks, tie_embeddings, chooser_key, cp, ep, etp), make)


def equal_partition(num_layers: int, num_virtual_stages: int) -> tuple[int, ...]:
    """Megatron's uniform split; when it does not divide, the first stages get one more."""
    base, extra = divmod(num_layers, num_virtual_stages)
    return tuple(base + (1 if j < extra else 0) for j in range(num_virtual_stages))


def default_optimizer(request: PlanRequest) -> OptimizerMode:
    """Megatron-LM's optimizer for the request's flags; `--overlap-param-gather` (with
    `--overlap-grad-reduce`) gathers the parameters ahead of the next forward."""
    if not request.distributed_optimizer:
        return OptimizerMode.REPLICATED
    if request.overlap_param_gather and request.overlap_grad_reduce:
        return OptimizerMode.DISTRIBUTED_OVERLAPPED
    return OptimizerMode.DISTRIBUTED
