"""What every policy shares: the request it answers, the Policy protocol, and the building blocks
(rank-to-GPU maps, communication groups, equal partition) that policies compose."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from holmes_sim.cluster import ETHERNET, Cluster, Node
from holmes_sim.cost.compute import ComputeModel
from holmes_sim.cost.transport import member_nics
from holmes_sim.errors import PlanError
from holmes_sim.memo import IdentityMemo
from holmes_sim.plan import (
    GpuRef,
    Group,
    GroupKind,
    OptimizerMode,
    Plan,
    Transport,
    TransportKind,
    megatron_rank,
)
from holmes_sim.schedule import ScheduleKind
from holmes_sim.workload import Workload

TransportChooser = Callable[[Sequence[GpuRef]], Transport]
"""A group's transport from its members' GPUs; it may depend on the members' nodes only (in
order of first appearance), so `build_groups` asks once per distinct node sequence."""
_ORDERS: IdentityMemo = IdentityMemo()
_TP_CHECKED: IdentityMemo = IdentityMemo()
_GROUPS: IdentityMemo = IdentityMemo()
"""Rank orders, checked TP layouts and groups, shared by the candidates of a search (a policy's
are the same for every micro-batch size, schedule and recompute mode of a layout)."""


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


class Policy(Protocol):
    """A named, pure function from a request to a Plan."""

    name: str
    description: str

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
        return nodes, gpus_in_node_order(nodes)
    return _ORDERS.get((cluster,), (name,), make)


def check_tp_within_nodes(rank_to_gpu: Sequence[GpuRef], tp: int) -> None:
    """Tensor parallelism must stay inside a node (it runs on NVLink); a layout that passed is
    remembered (by identity)."""
    _TP_CHECKED.get((rank_to_gpu,), (tp,), lambda: _check_tp(rank_to_gpu, tp))


def _check_tp(rank_to_gpu: Sequence[GpuRef], tp: int) -> bool:
    for start in range(0, len(rank_to_gpu), tp):
        nodes = {g.node for g in rank_to_gpu[start:start + tp]}
        if len(nodes) > 1:
            raise PlanError(f"the TP group of ranks {start}..{start + tp - 1} spans nodes "
                            f"{sorted(nodes)}; make parallel.tensor divide every node's GPU count")
    return True


def build_groups(cluster: Cluster, rank_to_gpu: Sequence[GpuRef], tp: int, pp: int, dp: int,
                 num_chunks: int, tie_embeddings: bool, choose: TransportChooser,
                 chooser_key: Hashable | None = None) -> tuple[Group, ...]:
    """TP, DP, PP and embedding groups for Megatron's rank layout, each with its transport.

    PP groups are ordered pairs (sender, receiver) for each forward boundary of virtual stages
    j -> j + 1 (the backward gradient uses the same pair in reverse); duplicates are dropped.
    With `chooser_key` (what determines `choose`'s answers besides the cluster), the groups are
    built once per (cluster, rank order, degrees, key) and the same tuple returned after.
    """
    if chooser_key is None:
        return _build_groups(cluster, rank_to_gpu, tp, pp, dp, num_chunks, tie_embeddings, choose)
    return _GROUPS.get((cluster, rank_to_gpu), (tp, pp, dp, num_chunks, tie_embeddings, chooser_key),
                       lambda: _build_groups(cluster, rank_to_gpu, tp, pp, dp, num_chunks,
                                             tie_embeddings, choose))


def _build_groups(cluster: Cluster, rank_to_gpu: Sequence[GpuRef], tp: int, pp: int, dp: int,
                  num_chunks: int, tie_embeddings: bool, choose: TransportChooser) -> tuple[Group, ...]:

    def rank(s: int, d: int, i: int) -> int:
        return megatron_rank(s, d, i, dp, tp)

    chosen: dict[tuple[str, ...], Transport] = {}

    def make(kind: GroupKind, ranks: tuple[int, ...]) -> Group:
        gpus = [rank_to_gpu[r] for r in ranks]
        nodes = tuple(dict.fromkeys(g.node for g in gpus))
        transport = chosen.get(nodes)
        if transport is None:
            transport = chosen[nodes] = choose(gpus)
        return Group(kind, ranks, transport, member_nics(cluster, gpus, transport))

    groups: list[Group] = []
    # TP ranks are consecutive, a stage's replicas tp apart (`megatron_rank`).
    if tp > 1:
        groups += [make(GroupKind.TENSOR, tuple(range(rank(s, d, 0), rank(s, d, 0) + tp)))
                   for s in range(pp) for d in range(dp)]
    if dp > 1:
        groups += [make(GroupKind.DATA, tuple(range(rank(s, 0, i), rank(s, dp, i), tp)))
                   for s in range(pp) for i in range(tp)]
    # A stage pair's rank pairs are all new or all seen (a rank names its stage): build each
    # physical pair's once, in order of first use, two members at a time.
    seen: set[tuple[int, int]] = set()
    for j in range(pp * num_chunks - 1):
        a, b = j % pp, (j + 1) % pp
        if (a, b) in seen:
            continue
        seen.add((a, b))
        for d in range(dp):
            first_a, first_b = rank(a, d, 0), rank(b, d, 0)
            for i in range(tp):
                pair = (first_a + i, first_b + i)
                src, dst = rank_to_gpu[pair[0]], rank_to_gpu[pair[1]]
                nodes = (src.node,) if src.node == dst.node else (src.node, dst.node)
                transport = chosen.get(nodes)
                if transport is None:
                    transport = chosen[nodes] = choose([src, dst])
                if transport.kind is TransportKind.LOCAL:
                    nics = ("", "")
                else:  # `member_nics`
                    fabric = transport.fabric or ETHERNET
                    nics = (_nic_of(cluster, src, fabric).name, _nic_of(cluster, dst, fabric).name)
                groups.append(Group(GroupKind.PIPELINE, pair, transport, nics))
    if pp > 1 and tie_embeddings:
        groups += [make(GroupKind.EMBEDDING, (rank(0, d, i), rank(pp - 1, d, i)))
                   for d in range(dp) for i in range(tp)]
    return tuple(groups)


def _nic_of(cluster: Cluster, gpu: GpuRef, fabric: str):
    nic = cluster.nic_of_gpu(gpu.node, gpu.local_index, fabric)
    assert nic is not None, f"{gpu} has no NIC on {fabric}"
    return nic


def equal_partition(num_layers: int, num_virtual_stages: int) -> tuple[int, ...]:
    """Megatron's uniform split; when it does not divide, the first stages get one more."""
    base, extra = divmod(num_layers, num_virtual_stages)
    return tuple(base + (1 if j < extra else 0) for j in range(num_virtual_stages))


def default_optimizer(request: PlanRequest) -> OptimizerMode:
    return OptimizerMode.DISTRIBUTED if request.distributed_optimizer else OptimizerMode.REPLICATED
