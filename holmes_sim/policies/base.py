"""What every policy shares: the request it answers, the Policy protocol, and the building blocks
(rank-to-GPU maps, communication groups, equal partition) that policies compose."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from itertools import chain
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
        # Each node's GPUs once per cluster: every order of a search reuses them.
        refs = cluster.derived(("gpu refs",), lambda: {n.name: gpus_in_node_order((n,))
                                                       for n in cluster.nodes})
        return nodes, tuple(chain.from_iterable(refs[n.name] for n in nodes))
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
    """See `build_groups`. What each group needs is taken from its members' TP groups
    (`_Entities`): their nodes and each GPU's NIC name, found once per TP group and fabric."""
    ent = _Entities(cluster, rank_to_gpu, tp, dp, choose)
    groups: list[Group] = []
    if tp > 1:
        groups += [ent.tensor_group(s, d) for s in range(pp) for d in range(dp)]
    if dp > 1:
        groups += [g for s in range(pp) for g in ent.data_groups(s)]
    # A stage pair's rank pairs are all new or all seen (a rank names its stage): build each
    # physical pair's once, in order of first use.
    seen: set[tuple[int, int]] = set()
    for j in range(pp * num_chunks - 1):
        a, b = j % pp, (j + 1) % pp
        if (a, b) not in seen:
            seen.add((a, b))
            groups += [g for d in range(dp) for g in ent.pipeline_groups(a, b, d)]
    if pp > 1 and tie_embeddings:
        groups += [ent.group(GroupKind.EMBEDDING, (ent.rank(0, d, i), ent.rank(pp - 1, d, i)))
                   for d in range(dp) for i in range(tp)]
    return tuple(groups)


class _Entities:
    """The TP groups of a rank order (stage s, replica d: ranks `rank(s, d, 0)` on): their
    nodes in order of first appearance and their GPUs' NIC names per fabric, each found once;
    groups made from them with the transport `choose` gives their members' node sequence."""

    def __init__(self, cluster: Cluster, rank_to_gpu: Sequence[GpuRef], tp: int, dp: int,
                 choose: TransportChooser):
        self.cluster, self.gpus, self.tp, self.dp, self.choose = cluster, rank_to_gpu, tp, dp, choose
        self._chosen: dict[tuple[str, ...], Transport] = {}
        self._nodes: dict[int, tuple[str, ...]] = {}
        self._names: dict[tuple[int, str], tuple[str, ...]] = {}
        self._blank = ("",) * tp

    def rank(self, s: int, d: int, i: int) -> int:
        return megatron_rank(s, d, i, self.dp, self.tp)

    def transport(self, nodes: tuple[str, ...], gpus: Sequence[GpuRef]) -> Transport:
        """`choose(gpus)`, asked once per node sequence (`TransportChooser`)."""
        got = self._chosen.get(nodes)
        if got is None:
            got = self._chosen[nodes] = self.choose(gpus)
        return got

    def nodes(self, first: int) -> tuple[str, ...]:
        """The nodes of the TP group whose first rank is `first`, in order of first appearance."""
        got = self._nodes.get(first)
        if got is None:
            got = self._nodes[first] = tuple(dict.fromkeys(
                g.node for g in self.gpus[first:first + self.tp]))
        return got

    def names(self, first: int, transport: Transport) -> tuple[str, ...]:
        """Each GPU's NIC name of that TP group on `transport` ("" for LOCAL; `member_nics`)."""
        if transport.kind is TransportKind.LOCAL:
            return self._blank
        fabric = transport.fabric or ETHERNET
        got = self._names.get((first, fabric))
        if got is None:
            got = self._names[(first, fabric)] = tuple(
                _nic_of(self.cluster, g, fabric).name for g in self.gpus[first:first + self.tp])
        return got

    def group(self, kind: GroupKind, ranks: tuple[int, ...]) -> Group:
        """Any group, member by member."""
        gpus = [self.gpus[r] for r in ranks]
        transport = self.transport(tuple(dict.fromkeys(g.node for g in gpus)), gpus)
        return Group(kind, ranks, transport, member_nics(self.cluster, gpus, transport))

    def tensor_group(self, s: int, d: int) -> Group:
        first = self.rank(s, d, 0)
        gpus = self.gpus[first:first + self.tp]
        transport = self.transport(self.nodes(first), gpus)
        return Group(GroupKind.TENSOR, tuple(range(first, first + self.tp)), transport,
                     self.names(first, transport))

    def data_groups(self, s: int) -> list[Group]:
        """Stage s's DP groups (TP rank i: the replicas' GPU i). When every replica's TP group
        lies on one node, their members' nodes, so their transport, are the same for every i."""
        firsts = [self.rank(s, d, 0) for d in range(self.dp)]
        if any(len(self.nodes(f)) > 1 for f in firsts):
            return [self.group(GroupKind.DATA, tuple(f + i for f in firsts)) for i in range(self.tp)]
        gpus = [self.gpus[f] for f in firsts]
        transport = self.transport(tuple(dict.fromkeys(g.node for g in gpus)), gpus)
        names = [self.names(f, transport) for f in firsts]
        return [Group(GroupKind.DATA, tuple(f + i for f in firsts), transport,
                      tuple(n[i] for n in names)) for i in range(self.tp)]

    def pipeline_groups(self, a: int, b: int, d: int) -> list[Group]:
        """The sender-receiver pairs (GPU i of stage a's TP group, GPU i of stage b's) of
        replica d; one transport for all when each TP group lies on one node."""
        fa, fb = self.rank(a, d, 0), self.rank(b, d, 0)
        na, nb = self.nodes(fa), self.nodes(fb)
        if len(na) > 1 or len(nb) > 1:
            return [self.group(GroupKind.PIPELINE, (fa + i, fb + i)) for i in range(self.tp)]
        pair = [self.gpus[fa], self.gpus[fb]]
        transport = self.transport(na if na == nb else na + nb, pair)
        names_a, names_b = self.names(fa, transport), self.names(fb, transport)
        return [Group(GroupKind.PIPELINE, (fa + i, fb + i), transport, (names_a[i], names_b[i]))
                for i in range(self.tp)]


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
