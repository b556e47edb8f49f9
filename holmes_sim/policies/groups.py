"""The communication groups of a rank order (Megatron's layout: TP ranks consecutive, a stage's
replicas tp apart, `plan.megatron_rank`), each with its transport and its members' NICs.

A group's members come from TP groups (stage s, replica d), each on one node (the policies
check it): their nodes and their GPUs' NIC names on a fabric are found once per TP group, and a
transport once per sequence of member nodes (`TransportChooser`). A 1,024-GPU plan has 1,344
groups, most of them pipeline pairs; the estimate needs a few of them (a transport per stage
pair, a ring per stage), so the builder also answers for single groups (`plan.GroupLookup`)
with what `build` gives them, without NIC names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from holmes_sim.hardware.cluster import ETHERNET, Cluster
from holmes_sim.cost.paths import nic_kind
from holmes_sim.cost.transport import member_nics
from holmes_sim.plan import (
    GpuRef,
    Group,
    GroupKind,
    Transport,
    TransportKind,
    megatron_rank,
    tp_group_places,
)

TransportChooser = Callable[[Sequence[GpuRef]], Transport]
"""A group's transport from its members' GPUs; it may depend on the members' nodes only (in
order of first appearance), so it is asked once per distinct node sequence."""


class GroupBuilder:
    """TP, CP, EP, DP, expert-DP, PP and embedding groups of one rank order and degrees
    (`build`: all, in order;
    `pair_transport`, `first`: one, as `plan.GroupLookup`). PP groups are ordered pairs (sender,
    receiver) for each forward boundary of virtual stages j -> j + 1 (the backward gradient
    uses the same pair in reverse), each physical pair once, in order of first use."""

    family: object | None = None
    """Shared by the builders of one cluster, rank order, degrees and chooser that differ only
    in their chunk count (`policies.base.build_groups`): their groups but the pipeline pairs
    are the same, with the same transports, and so are the pairs they both have (None: none)."""

    def __init__(self, cluster: Cluster, rank_to_gpu: Sequence[GpuRef], tp: int, pp: int, dp: int,
                 num_chunks: int, tie_embeddings: bool, choose: TransportChooser, cp: int = 1,
                 ep: int = 1, etp: int | None = None):
        self.cluster, self.gpus, self.choose, self.cp = cluster, rank_to_gpu, choose, cp
        self.ep, self.etp = ep, tp if etp is None else etp
        self.edp = tp * dp // (self.ep * self.etp)  # expert-data-parallel degree
        self.tp, self.pp, self.dp, self.tie = tp, pp, dp, tie_embeddings and pp > 1
        self.pairs = list(dict.fromkeys((j % pp, (j + 1) % pp) for j in range(pp * num_chunks - 1)))
        self._pair_set = set(self.pairs)
        self._chosen: dict[tuple[str, ...], Transport] = {}
        self._places = tp_group_places(rank_to_gpu, tp)
        self._names: dict[tuple[int, str], tuple[str, ...]] = {}
        self._kind_names: dict[tuple | None, tuple[str, ...]] = {}
        self._data: dict[int, tuple] = {}
        self._pipe: dict[tuple[int, int, int], tuple[int, int, Transport | None]] = {}
        self._blank = ("",) * tp

    # ---- all of them --------------------------------------------------------------------------
    def build(self) -> tuple[Group, ...]:
        tp, pp, dp = self.tp, self.pp, self.dp
        groups: list[Group] = []
        if tp > 1:
            groups += [self._tensor(s, d) for s in range(pp) for d in range(dp)]
        if self.cp > 1:
            groups += [self._context(s, d, i) for s in range(pp) for d in range(0, dp, self.cp)
                       for i in range(tp)]
        if self.ep > 1:
            groups += [self._expert(s, k, j) for s in range(pp) for k in range(self.edp)
                       for j in range(self.etp)]
        if dp > 1:
            groups += [self._data_group(s, i) for s in range(pp) for i in range(tp)]
        if self._has_expert_data:
            groups += [self._expert_data(s, e, j) for s in range(pp) for e in range(self.ep)
                       for j in range(self.etp)]
        for a, b in self.pairs:
            for d in range(dp):
                groups += self._pipelines(a, b, d)
        if self.tie:
            groups += [self._embedding(d, i) for d in range(dp) for i in range(tp)]
        return tuple(groups)

    # ---- one of them (`plan.GroupLookup`): ranks and transport, no NIC names -----------------
    def pair_transport(self, ranks: tuple[int, ...]) -> Transport | None:
        """The transport of the pipeline group of these (sender, receiver) ranks, or None."""
        (a, d, i), (b, e, k) = self._coords(ranks[0]), self._coords(ranks[1])
        if (d, i) != (e, k) or (a, b) not in self._pair_set:
            return None
        return self._pipe_of(a, b, d)[2] or self._member_by_member(GroupKind.PIPELINE, ranks).transport

    def stage_pair_transports(self, a: int, b: int) -> list[Transport | None]:
        """`pair_transport` of every replica's pair (stage a, stage b), TP rank 0, in replica
        order."""
        if (a, b) not in self._pair_set:
            return [None] * self.dp
        dp, gpus, chosen = self.dp, self.gpus, self._chosen
        out = []
        # `_pipe_of`'s transport per replica d, its TP groups' places read in order (TP group
        # s dp + d is stage s's of replica d, `_nodes_of`).
        for d, (na, nb) in enumerate(zip(self._places[a * dp:(a + 1) * dp],
                                         self._places[b * dp:(b + 1) * dp])):
            na, nb = na[0], nb[0]
            if len(na) > 1 or len(nb) > 1:
                out.append(self._member_by_member(GroupKind.PIPELINE, (
                    self._rank(a, d, 0), self._rank(b, d, 0))).transport)
                continue
            nodes = na if na == nb else na + nb
            got = chosen.get(nodes)
            if got is None:
                fa, fb = self._rank(a, d, 0), self._rank(b, d, 0)
                got = self._transport(nodes, [gpus[fa], gpus[fb]])
            out.append(got)
        return out

    def embedding_transports(self) -> list[Transport | None]:
        """The transport of `first(EMBEDDING, ...)` of every replica's TP rank 0, in replica
        order (None: no embedding group)."""
        if not self.tie:
            return [None] * self.dp
        return [self._ranks_transport(self._embedding_ranks(d, 0)) for d in range(self.dp)]

    def first(self, kind: GroupKind, rank: int) -> tuple[tuple[int, ...], Transport] | None:
        """Ranks and transport of the first group of `kind` (in `build`'s order) whose first
        rank is `rank`, or None."""
        s, d, i = self._coords(rank)
        group, local = None, d * self.tp + i  # the stage-local rank
        if s < 0:
            return None
        if kind is GroupKind.DATA and self.dp > 1 and d == 0:
            firsts, transport, _ = self._data_of(s)
            if transport is not None:
                return tuple(f + i for f in firsts), transport
            group = self._data_group(s, i)
        elif kind is GroupKind.TENSOR and self.tp > 1 and i == 0:
            group = self._tensor(s, d)
        elif kind is GroupKind.CONTEXT and self.cp > 1 and d % self.cp == 0:
            group = self._context(s, d, i)
        elif kind is GroupKind.EXPERT and self.ep > 1 and local % (self.ep * self.etp) < self.etp:
            group = self._expert(s, local // (self.ep * self.etp), local % self.etp)
        elif kind is GroupKind.EXPERT_DATA and self._has_expert_data and \
                local < self.ep * self.etp:
            group = self._expert_data(s, local // self.etp, local % self.etp)
        elif kind is GroupKind.EMBEDDING and self.tie and s == 0:
            ranks = self._embedding_ranks(d, i)  # without the NIC names a Group carries
            return ranks, self._ranks_transport(ranks)
        elif kind is GroupKind.PIPELINE:
            b = next((b for a, b in self.pairs if a == s), None)
            if b is not None:
                ranks = (rank, self._rank(b, d, i))
                return ranks, self.pair_transport(ranks)
        return None if group is None else (group.ranks, group.transport)

    # ---- the groups ---------------------------------------------------------------------------
    def _coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, replica, TP rank) of a rank; stage -1 outside the world."""
        if not 0 <= rank < self.pp * self.dp * self.tp:
            return -1, 0, 0
        s, rest = divmod(rank, self.dp * self.tp)
        return (s, *divmod(rest, self.tp))

    def _rank(self, s: int, d: int, i: int) -> int:
        return megatron_rank(s, d, i, self.dp, self.tp)

    def _tensor(self, s: int, d: int) -> Group:
        first = self._rank(s, d, 0)
        transport = self._transport(self._nodes_of(first), self.gpus[first:first + self.tp])
        return Group(GroupKind.TENSOR, tuple(range(first, first + self.tp)), transport,
                     self._names_of(first, transport))

    def _data_of(self, s: int) -> tuple[list[int], Transport | None, list | None]:
        """Stage s's replicas' first ranks and, when every replica's TP group lies on one node
        (so the members' nodes, and the transport, are the same for every TP rank), the DP
        groups' transport and each replica's NIC names (made when first asked for)."""
        got = self._data.get(s)
        if got is None:
            firsts = [self._rank(s, d, 0) for d in range(self.dp)]
            if any(len(self._nodes_of(f)) > 1 for f in firsts):
                got = self._data[s] = (firsts, None, None)
            else:
                gpus = [self.gpus[f] for f in firsts]
                transport = self._transport(tuple(dict.fromkeys(g.node for g in gpus)), gpus)
                got = self._data[s] = (firsts, transport, [])
        return got

    def _data_group(self, s: int, i: int) -> Group:
        """Stage s's DP group of TP rank i (every replica's GPU i)."""
        firsts, transport, names = self._data_of(s)
        ranks = tuple(f + i for f in firsts)
        if transport is None:
            return self._member_by_member(GroupKind.DATA, ranks)
        if not names:
            names += [self._names_of(f, transport) for f in firsts]
        return Group(GroupKind.DATA, ranks, transport, tuple(n[i] for n in names))

    def _pipe_of(self, a: int, b: int, d: int) -> tuple[int, int, Transport | None]:
        """First ranks of replica d's TP groups on stages a and b and, when each lies on one
        node, the transport of all their pairs."""
        got = self._pipe.get((a, b, d))
        if got is None:
            fa, fb = self._rank(a, d, 0), self._rank(b, d, 0)
            na, nb = self._nodes_of(fa), self._nodes_of(fb)
            transport = None if len(na) > 1 or len(nb) > 1 else self._transport(
                na if na == nb else na + nb, [self.gpus[fa], self.gpus[fb]])
            got = self._pipe[(a, b, d)] = (fa, fb, transport)
        return got

    def _pipelines(self, a: int, b: int, d: int) -> list[Group]:
        """The pairs (GPU i of stage a's TP group of replica d, GPU i of stage b's) of every TP
        rank i, in TP-rank order."""
        fa, fb, transport = self._pipe_of(a, b, d)
        if transport is None:
            return [self._member_by_member(GroupKind.PIPELINE, (fa + i, fb + i))
                    for i in range(self.tp)]
        kind, names_a, names_b = GroupKind.PIPELINE, self._names_of(fa, transport), \
            self._names_of(fb, transport)
        return [Group(kind, (fa + i, fb + i), transport, (names_a[i], names_b[i]))
                for i in range(self.tp)]

    def _context(self, s: int, d: int, i: int) -> Group:
        """Stage s's CP group of TP rank i over replicas d .. d + cp - 1 (d a multiple of cp):
        consecutive CP ranks, Megatron-Core's "tp-cp-ep-dp-pp" order (`plan`)."""
        return self._member_by_member(GroupKind.CONTEXT,
                                      tuple(self._rank(s, d + c, i) for c in range(self.cp)))

    def _expert_rank(self, s: int, j: int, e: int, k: int) -> int:
        """Global rank of stage s's expert coordinates (expert-TP rank j, EP rank e, expert-DP
        rank k): Megatron-Core's expert `RankGenerator` of order "tp-ep-dp-pp" over the stage's
        tp x cp x dp ranks, ETP fastest (`initialize_model_parallel`,
        megatron/core/parallel_state.py): stage-local j + etp (e + ep k). With etp = tp it is
        TP rank j of replica e + ep k."""
        return s * self.dp * self.tp + j + self.etp * (e + self.ep * k)

    def _expert(self, s: int, k: int, j: int) -> Group:
        """Stage s's EP group of expert-DP rank k and expert-TP rank j: ranks with EP rank
        0 .. ep - 1 (`_expert_rank`); with etp = tp, TP rank j of replicas k ep .. k ep + ep - 1."""
        return self._member_by_member(GroupKind.EXPERT, tuple(
            self._expert_rank(s, j, e, k) for e in range(self.ep)))

    @property
    def _has_expert_data(self) -> bool:
        """Expert-data-parallel groups of more than one member exist: ep > 1 and edp > 1."""
        return self.ep > 1 and self.edp > 1

    def _expert_data(self, s: int, e: int, j: int) -> Group:
        """Stage s's expert-data-parallel group of EP rank e and expert-TP rank j: the ranks
        holding the same experts' same shard, whose expert gradients Megatron-Core reduces
        together (expert-DP ranks 0 .. edp - 1 of `_expert_rank`); with etp = tp, TP rank j of
        replicas e, e + ep, e + 2 ep, ...; in general every (ep etp / tp)-th replica."""
        return self._member_by_member(GroupKind.EXPERT_DATA, tuple(
            self._expert_rank(s, j, e, k) for k in range(self.edp)))

    def _embedding_ranks(self, d: int, i: int) -> tuple[int, int]:
        return self._rank(0, d, i), self._rank(self.pp - 1, d, i)

    def _embedding(self, d: int, i: int) -> Group:
        return self._member_by_member(GroupKind.EMBEDDING, self._embedding_ranks(d, i))

    def _member_by_member(self, kind: GroupKind, ranks: tuple[int, ...]) -> Group:
        transport = self._ranks_transport(ranks)
        return Group(kind, ranks, transport,
                     member_nics(self.cluster, [self.gpus[r] for r in ranks], transport))

    def _ranks_transport(self, ranks: tuple[int, ...]) -> Transport:
        """The transport of the group of these ranks, chosen by their nodes."""
        gpus = [self.gpus[r] for r in ranks]
        return self._transport(tuple(dict.fromkeys(g.node for g in gpus)), gpus)

    # ---- what groups are made of ----------------------------------------------------------------
    def _transport(self, nodes: tuple[str, ...], gpus: Sequence[GpuRef]) -> Transport:
        """`choose(gpus)`, asked once per node sequence."""
        got = self._chosen.get(nodes)
        if got is None:
            got = self._chosen[nodes] = self.choose(gpus)
        return got

    def _nodes_of(self, first: int) -> tuple[str, ...]:
        """The nodes of the TP group whose first rank is `first`, in order of first appearance."""
        return self._places[first // self.tp][0]

    def _names_of(self, first: int, transport: Transport) -> tuple[str, ...]:
        """Each GPU's NIC name of that TP group on `transport` ("" for LOCAL; `member_nics`),
        found once per NIC kind of its node (`cost.paths.nic_kind`) and local GPUs when the TP
        group lies on one node."""
        if transport.kind is TransportKind.LOCAL:
            return self._blank
        fabric = transport.fabric or ETHERNET
        got = self._names.get((first, fabric))
        if got is None:
            nodes, local = self._places[first // self.tp]
            kind = (nic_kind(self.cluster, nodes[0]), local, fabric) if len(nodes) == 1 else None
            got = self._kind_names.get(kind)
            if got is None:
                names = []
                for g in self.gpus[first:first + self.tp]:
                    nic = self.cluster.nic_of_gpu(g.node, g.local_index, fabric)
                    assert nic is not None, f"{g} has no NIC on {fabric}"
                    names.append(nic.name)
                got = tuple(names)
                if kind is not None:
                    self._kind_names[kind] = got
            self._names[(first, fabric)] = got
        return got
