"""The network facts of one placement, computed once and shared by the partition search and the
analytic estimate of every candidate with that placement.

A placement is a cluster, the GPU of every rank, the groups with their transports, the degrees
and the number of model chunks; it fixes, independently of the model and batch:
- the link capacities (`cost.paths.link_capacities`, kept with the cluster);
- each stage's DP ring on an idle network (members, bottleneck rate in bytes/s, step latency s);
- each pipeline send's path, and its rate when every replica sends the same message at once
  (a link's capacity split over the summed weights of all replicas' sends; see `analytic`);
- each replica's embedding ring at the rate it gets while all replicas' run at once;
- which replicas are alike: the same hardware on every stage and the same send latencies and
  rates, so one walk stands for all of them.
`netview(...)` returns the same object for the same placement objects (`memo.IdentityMemo`); a
policy that builds its rank order and groups once (`policies.base`) then shares it across the
micro-batch sizes, schedules of equal chunk count and recompute modes of a layout, and its views
for other chunk counts share every fact above except which stage pairs send and which
replicas are alike (`GroupBuilder.family`). A stage's CP sends, a stage pair's sends and a ring
are also kept by the GPUs and transports they run on, for every placement (`_BY_GPUS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter

from holmes_sim.hardware.cluster import Cluster, Node
from holmes_sim.cost.link_uses import (pair_send_facts, pair_send_sides, ring_hop_facts,
                                       ring_uses, send_uses, side_links)
from holmes_sim.cost.nccl_algorithms import CollectiveTopology
from holmes_sim.cost.paths import link_capacities, ring_topology
from holmes_sim.memo import IdentityMemo
from holmes_sim.plan import (GpuRef, Group, GroupKind, Transport, group_lookup, megatron_rank,
                             tp_group_places)

Ring = tuple[int, float, float]
"""(members, rate in bytes/s, per-step latency in s) of a ring collective."""

_VIEWS: IdentityMemo[NetView] = IdentityMemo(64)


def _one_node(place: tuple[tuple[str, ...], tuple[int, ...]]) -> tuple[str, tuple[int, ...]] | None:
    """`cost.link_uses.on_one_node` of a TP group given as `plan.tp_group_places` gives it."""
    nodes, local = place
    return (nodes[0], local) if len(nodes) == 1 else None


def _idle_ring(cluster: Cluster, transport: Transport, members: Sequence[Sequence[GpuRef]],
               tp: int) -> tuple[Ring, CollectiveTopology]:
    """The ring over `members` (TP groups, in ring order) on an idle network and its topology:
    `Ring.idle_rate_bytes_per_s` (bytes/s), `Ring.step_latency_s` (s) and `Ring.topology` of
    `cost.paths.ring_paths`, from `link_uses.ring_hop_facts`."""
    hops = ring_hop_facts(cluster, transport, members)
    ring = (len(members), min(map(itemgetter(2), hops)), max(map(itemgetter(1), hops)))
    return ring, ring_topology(cluster, list(dict.fromkeys(m[0].node for m in members)),
                               [(leaves, rate, step) for leaves, step, rate in hops], tp)


class _Facts:
    """What the views of one placement share whatever their chunk count (`NetView`): each TP
    group's GPUs and node (and node with local GPUs when it lies on one), the rings and their topologies, stage nodes and memory, the
    embedding rings, the CP and EP sends, the sends of stage pairs whose every replica's
    pair is a pipeline group, and the transports each stage's gradients are reduced over."""

    def __init__(self) -> None:
        self.entities: dict[tuple[int, int], tuple[GpuRef, ...]] = {}
        self.nodes: list[list[Node]] | None = None
        self.rings: dict[tuple, Ring | None] = {}
        self.topologies: dict[tuple, CollectiveTopology] = {}
        self.stage_nodes: dict[int, list[Node]] = {}
        self.memory: dict[int, float] = {}
        self.embedding: list[Ring | None] | None = None
        self.cp_sends: dict[int, list[tuple[float, float]]] = {}
        self.ep_sends: dict[int, list[tuple[tuple[float, float], ...]]] = {}
        self.sends: dict[tuple[int, int], list[tuple[float, float]]] = {}
        self.hardware: list[list[tuple]] | None = None
        self.reductions: dict[tuple[int, int], tuple[Transport, ...]] = {}
        self.one_nodes: list[tuple[str, tuple[int, ...]] | None] | None = None


_FACTS: IdentityMemo[_Facts] = IdentityMemo(64)

_BY_GPUS: IdentityMemo[object] = IdentityMemo(4096)
"""A stage's CP sends, a stage pair's pipeline send figures and a ring's figures and topology,
by cluster, TP degree, the GPUs they run on (`NetView.gpus_key`) and their groups' transports:
all they depend on. Holmes' tied class orders put the same nodes on other stages, and a
search's layouts of one TP degree and replica count put them on the same ones, so most views
find them here (1,750 rings, 1,312 stage pairs and 632 CP stages asked for by the views of a
960-GPU six-kind search, 235, 320 and 191 made)."""


def netview(cluster: Cluster, rank_to_gpu: Sequence[GpuRef], groups: Sequence[Group], tp: int,
            pp: int, dp: int, num_chunks: int, cp: int = 1, ep: int = 1) -> NetView:
    """The (shared) view of this placement (`dp` replicas, each `cp` consecutive a CP group,
    each `ep` consecutive the TP groups of an EP group, `Workload.ep_replicas`)."""
    return _VIEWS.get((cluster, rank_to_gpu, groups), (tp, pp, dp, num_chunks, cp, ep),
                      lambda: NetView(cluster, rank_to_gpu, groups, tp, pp, dp, num_chunks, cp,
                                      ep))


class NetView:
    """See the module docstring; everything is computed on first use."""

    def __init__(self, cluster: Cluster, rank_to_gpu: Sequence[GpuRef], groups: Sequence[Group],
                 tp: int, pp: int, dp: int, num_chunks: int, cp: int = 1, ep: int = 1):
        self.cluster, self.rank_to_gpu, self.cp, self.ep = cluster, rank_to_gpu, cp, ep
        self.tp, self.pp, self.dp, self.nv = tp, pp, dp, pp * num_chunks
        self.caps = cluster.derived(("link capacities",), lambda: link_capacities(cluster))
        # The few groups asked for (a transport per stage pair, a ring per stage), found
        # without building all of a plan's groups where they are built lazily (`plan.Groups`).
        self._groups = group_lookup(groups)
        # Groups of one family (`policies.groups.GroupBuilder.family`) differ only in their
        # pipeline pairs: their views share every fact but those that depend on the chunk count.
        family = getattr(self._groups, "family", None)
        self._facts = facts = _FACTS.get((cluster, rank_to_gpu, groups if family is None else family),
                                         (tp, pp, dp, cp, ep), _Facts)
        self._forward = {(j % pp, (j + 1) % pp) for j in range(self.nv - 1)}
        self._entities = facts.entities
        self._places = tp_group_places(rank_to_gpu, tp)
        self._p2p: dict[tuple[int, int], list[tuple[float, float]]] = {}
        self._rings, self._topologies = facts.rings, facts.topologies
        self._stage_nodes, self._memory = facts.stage_nodes, facts.memory
        self._cp_sends, self._ep_sends = facts.cp_sends, facts.ep_sends
        self._classes: list[tuple[int, list[int]]] | None = None
        self._capacity: tuple[float, ...] | None = None
        self._combos: dict[bool, list[list[tuple[int, tuple]]]] = {}

    def rank(self, s: int, d: int, i: int = 0) -> int:
        return megatron_rank(s, d, i, self.dp, self.tp)

    def entity(self, s: int, d: int) -> tuple[GpuRef, ...]:
        """The GPUs of the TP group at (stage s, replica d), in TP-rank order."""
        got = self._entities.get((s, d))
        if got is None:
            r = self.rank(s, d)
            got = self._entities[(s, d)] = tuple(self.rank_to_gpu[r:r + self.tp])
        return got

    def gpus_key(self, firsts: Sequence[int]) -> tuple:
        """The GPUs of the runs of tp ranks from each of `firsts`, in order, as a key: each
        run's place (`plan.tp_group_places`: its node, its GPUs' local indices) where every run
        is a TP group on one node, else the GPUs themselves (a place of several nodes does not
        say which GPU is on which)."""
        tp, places = self.tp, self._places
        if all(f % tp == 0 for f in firsts):
            got = tuple(places[f // tp] for f in firsts)
            if all(len(nodes) == 1 for nodes, _ in got):
                return got
        return tuple(g for f in firsts for g in self.rank_to_gpu[f:f + tp])

    def stage_gpus(self, s: int) -> tuple:
        """`gpus_key` of stage s's TP groups in replica order."""
        return self.gpus_key([self.rank(s, d) for d in range(self.dp)])

    def node(self, s: int, d: int) -> Node:
        """The node of the TP group at (stage s, replica d) (of its first GPU)."""
        return self.node_rows()[s][d]

    def node_rows(self) -> list[list[Node]]:
        """`node` of every replica, per stage (kept with the placement's facts): TP group
        s dp + d's first node (`plan.tp_group_places`)."""
        got = self._facts.nodes
        if got is None:
            node, places, dp = self.cluster.node, self._places, self.dp
            got = self._facts.nodes = [[node(p[0][0]) for p in places[s * dp:(s + 1) * dp]]
                                       for s in range(self.pp)]
        return got

    def hardware(self, s: int, d: int) -> tuple:
        """What prices an op of (s, d): the node's GPU model and intra-node link (by identity:
        a cluster's nodes share their catalogue's objects, and ints hash faster than specs;
        equal specs in distinct objects only split classes that then price the same) and
        speed."""
        return self.hardware_rows()[s][d]

    def hardware_rows(self) -> list[list[tuple]]:
        """`hardware` of every replica, per stage (kept with the placement's facts)."""
        got = self._facts.hardware
        if got is None:
            got = self._facts.hardware = [[(id(n.gpu), id(n.intra_link), n.speed) for n in row]
                                          for row in self.node_rows()]
        return got

    def memory_bytes(self, s: int) -> float:
        """The smallest GPU memory (bytes) among stage s's replicas."""
        got = self._memory.get(s)
        if got is None:
            got = self._memory[s] = min(n.gpu.memory_bytes for n in self.node_rows()[s])
        return got

    def stage_memory_bytes(self) -> tuple[float, ...]:
        """`memory_bytes` of every stage."""
        if self._capacity is None:
            self._capacity = tuple(self.memory_bytes(s) for s in range(self.pp))
        return self._capacity

    # ---- pipeline sends ---------------------------------------------------------------------
    def p2p(self, a: int, b: int, d: int) -> tuple[float, float]:
        """(latency s, rate bytes/s) of replica d's send from stage a to stage b while every
        replica sends the same message (`analytic` adds bytes / rate): each link's capacity
        split over the summed weights of every replica's send on it (`cost.link_uses.send_uses`).
        A backward send's path is its forward pair's with every link the other way, whose
        capacity is the same (`link_capacities`), and the same weights and latency: it gets
        the forward pair's figures (with p = 2 and chunks both ways are forward pairs of two
        groups, each priced on its own)."""
        return self._pair_rates(a, b)[d]

    def _pair_rates(self, a: int, b: int) -> list[tuple[float, float]]:
        """`p2p` of the pair (a, b) for every replica."""
        got = self._p2p.get((a, b))
        if got is None:
            if (a, b) not in self._forward and (b, a) in self._forward:
                got = self._p2p[(a, b)] = self._p2p.get((b, a)) or self._send_rates(b, a)
            else:
                got = self._send_rates(a, b)
        return got

    def _send_rates(self, a: int, b: int) -> list[tuple[float, float]]:
        """`p2p` of the forward pair (a, b) for every replica, kept. When every replica's send
        goes from one node to another and no two replicas' sends touch a node, their NIC links
        are their own: a send's rate is its sides' smallest capacity / weight (kept with the
        cluster) and the uplink's capacity over the sends crossing it; else each link's load
        is summed over the replicas' sends. The same floats either way (a link's load is its
        one weight, an uplink's the count). Kept with the placement's facts when every
        replica's pair is a pipeline group, and found there without asking the groups again:
        the facts' views have the same groups, or groups of one family, whose common pairs
        have the same transports."""
        got = self._facts.sends.get((a, b))
        if got is None:
            every = getattr(self._groups, "stage_pair_transports", None)  # a builder's, at once
            transports = every(a, b) if every is not None else [
                self._groups.pair_transport((self.rank(a, d), self.rank(b, d)))
                for d in range(self.dp)]
            got = _BY_GPUS.get((self.cluster,), (
                "send", self.tp, self.stage_gpus(a), self.stage_gpus(b), tuple(transports)),
                lambda: self._new_send_rates(a, b, transports))
            if None not in transports:
                self._facts.sends[(a, b)] = got
        self._p2p[(a, b)] = got
        return got

    def _new_send_rates(self, a: int, b: int, transports: list) -> list[tuple[float, float]]:
        """`_send_rates` with the pair's transport of every replica, from stages a's and b's
        GPUs, the transports and the cluster alone (`_BY_GPUS`)."""
        dp, ones = self.dp, self._one_nodes()
        ends = list(zip(ones[a * dp:(a + 1) * dp], ones[b * dp:(b + 1) * dp]))
        placed = [e for pair in ends for e in pair]
        # Every end on one node, each on a node of its own: the sends' NIC links are their own.
        if None not in placed and len({e[0] for e in placed}) == 2 * dp:
            return self._own_links(a, b, pair_send_facts(self.cluster, transports, ends))
        # Sides exist only where both ends are on one node each: their nodes. A send with NIC
        # sides is those sides and the uplink (`send_uses`).
        sides = pair_send_sides(self.cluster, transports, ends)
        uses = [send_uses(self.cluster, t, self.entity(a, d), self.entity(b, d)) if side is None
                else side_links(side)
                for d, (t, side) in enumerate(zip(transports, sides, strict=True))]
        load: dict = {}
        get = load.get
        for links, _ in uses:
            for lk, w in links:
                load[lk] = get(lk, 0.0) + w
        caps = self.caps
        return [(latency, min([caps[lk] / load[lk] for lk, _ in links])) for links, latency in uses]

    def _one_nodes(self) -> list[tuple[str, tuple[int, ...]] | None]:
        """`_one_node` of every TP group (kept with the placement's facts)."""
        got = self._facts.one_nodes
        if got is None:
            got = self._facts.one_nodes = [_one_node(p) for p in self._places]
        return got

    def _own_links(self, a: int, b: int, sends: list) -> list[tuple[float, float]]:
        """`_send_rates` of sends whose NIC links no other send of the pair uses, each as its
        sides' (latency s, rate bytes/s) and its uplink (`link_uses.pair_send_facts`)."""
        crossing: dict = {}
        for _, _, up in sends:
            if up is not None:
                crossing[up[0]] = crossing.get(up[0], 0.0) + 1.0
        got = []
        for out, into, up in sends:
            latency, rate = max(out[0], into[0]), min(out[1], into[1])
            if up is not None:
                latency, rate = latency + up[1], min(rate, self.caps[up[0]] / crossing[up[0]])
            got.append((latency, rate))
        return got

    # ---- context-parallel rings -------------------------------------------------------------
    def cp_send(self, s: int, d: int) -> tuple[float, float] | None:
        """(latency s, rate bytes/s) of replica d's send to the next replica of its CP ring on
        stage s while every replica of the stage sends to its own next (the ring's steps run at
        once on every CP group of a stage), each link's capacity split over the summed weights
        of those sends; None without CP."""
        if self.cp == 1:
            return None
        got = self._cp_sends.get(s)
        if got is None:
            transports = tuple(self._groups.first(GroupKind.CONTEXT, self.rank(s, d0))[1]
                               for d0 in range(0, self.dp, self.cp))
            got = self._cp_sends[s] = _BY_GPUS.get(
                (self.cluster,), ("cp", self.tp, self.cp, self.stage_gpus(s), transports),
                lambda: self._new_cp_sends(s, transports))
        return got[d]

    def _new_cp_sends(self, s: int, transports: tuple[Transport, ...]) -> list[tuple[float, float]]:
        """`cp_send` of every replica of stage s, its CP groups' `transports` in order, from the
        stage's GPUs, the transports and the cluster alone (`_BY_GPUS`)."""
        uses = []
        for d0, transport in zip(range(0, self.dp, self.cp), transports, strict=True):
            uses += [send_uses(self.cluster, transport, self.entity(s, d0 + c),
                               self.entity(s, d0 + (c + 1) % self.cp)) for c in range(self.cp)]
        load: dict = {}
        for links, _ in uses:
            for lk, w in links:
                load[lk] = load.get(lk, 0.0) + w
        return [(latency, min(self.caps[lk] / load[lk] for lk, _ in links))
                for links, latency in uses]

    # ---- expert-parallel all-to-alls -----------------------------------------------------------
    def ep_sends(self, s: int, d: int) -> tuple[tuple[float, float], ...]:
        """(latency s, rate bytes/s) of replica d's send to each other replica of its EP group on
        stage s while every replica of the stage sends to each of its peers (the all-to-alls of
        a stage's EP groups run at once), each link's capacity split over the summed weights of
        those sends; empty without EP."""
        if self.ep == 1:
            return ()
        got = self._ep_sends.get(s)
        if got is None:
            uses: list[list] = [[] for _ in range(self.dp)]
            for d0 in range(0, self.dp, self.ep):
                transport = self._groups.first(GroupKind.EXPERT, self.rank(s, d0))[1]
                for a in range(d0, d0 + self.ep):
                    uses[a] = [send_uses(self.cluster, transport, self.entity(s, a),
                                         self.entity(s, b)) for b in range(d0, d0 + self.ep)
                               if b != a]
            load: dict = {}
            for links, _ in (u for per in uses for u in per):
                for lk, w in links:
                    load[lk] = load.get(lk, 0.0) + w
            got = self._ep_sends[s] = [
                tuple((latency, min(self.caps[lk] / load[lk] for lk, _ in links))
                      for links, latency in per) for per in uses]
        return got[d]

    # ---- rings --------------------------------------------------------------------------------
    def idle_ring(self, kind: GroupKind, s: int, d: int = 0) -> Ring | None:
        """On an idle network, the ring of the `kind` group that starts at stage s's rank of
        replica d (DATA: stage s's replicas; EXPERT_DATA: replicas d, d + ep, ...; EMBEDDING:
        replica 0's first and last stage), over its members' TP groups (None: no such group)."""
        key = (kind, s) if d == 0 else (kind, s, d)
        if kind is GroupKind.PIPELINE:  # which pair is first depends on the chunk count
            key += (self.nv,)
        if key not in self._rings:
            group = self._groups.first(kind, self.rank(s, d))
            if group is None:
                self._rings[key] = None
            else:
                (ranks, transport), tp, gpus = group, self.tp, self.rank_to_gpu
                self._rings[key], self._topologies[key] = _BY_GPUS.get(
                    (self.cluster,), ("ring", tp, self.gpus_key(ranks), transport),
                    lambda: _idle_ring(self.cluster, transport, [gpus[r:r + tp] for r in ranks],
                                       tp))
        return self._rings[key]

    def dp_topology(self, s: int) -> CollectiveTopology | None:
        """Stage s's data-parallel group as NCCL's algorithm choice sees it (None: no DP group)."""
        self.idle_ring(GroupKind.DATA, s)
        return self._topologies.get((GroupKind.DATA, s))

    def dp_ring(self, s: int) -> Ring | None:
        """Stage s's data-parallel ring on an idle network (None: no DP group)."""
        return self.idle_ring(GroupKind.DATA, s)

    def edp_ring(self, s: int, d: int) -> Ring | None:
        """Stage s's expert-data-parallel ring of replica d on an idle network (the replicas
        d % ep, d % ep + ep, ...; None: no such group, ep = 1 or dp = ep)."""
        return self.idle_ring(GroupKind.EXPERT_DATA, s, d % self.ep)

    def edp_topology(self, s: int, d: int) -> CollectiveTopology | None:
        """That group as NCCL's algorithm choice sees it (None: no such group)."""
        r = d % self.ep
        if self.edp_ring(s, d) is None:
            return None
        return self._topologies[(GroupKind.EXPERT_DATA, s) if r == 0 else (GroupKind.EXPERT_DATA, s, r)]

    def reduction_transports(self, s: int, d: int) -> tuple[Transport, ...]:
        """The transports of the groups stage s's gradients on replica d are reduced over
        (`cost.ops.node_comm_sms`): its DP group's and, where there is one, its
        expert-data-parallel group's (`edp_ring`)."""
        key = (s, d % self.ep)
        got = self._facts.reductions.get(key)
        if got is None:
            first = self._groups.first
            groups = (first(GroupKind.DATA, self.rank(s, 0)),
                      first(GroupKind.EXPERT_DATA, self.rank(*key)))
            got = self._facts.reductions[key] = tuple(g[1] for g in groups if g is not None)
        return got

    def stage_nodes(self, s: int) -> list[Node]:
        """One node per distinct (GPU, intra-node link, speed) among stage s's replicas, in replica
        order (replicas on identical hardware cost the same)."""
        got = self._stage_nodes.get(s)
        if got is None:
            got = self._stage_nodes[s] = list(dict(zip(self.hardware_rows()[s],
                                                       self.node_rows()[s])).values())
        return got

    def embedding_ring(self, d: int) -> Ring | None:
        """Replica d's embedding all-reduce ring (first and last stage) at the rate it gets while
        every replica's runs at once: each hop link's capacity split over the summed weights of
        all replicas' rings (None: no embedding group)."""
        return self._embedding_rings()[d]

    def _embedding_rings(self) -> list[Ring | None]:
        """`embedding_ring` of every replica, kept with the placement's facts."""
        if self._facts.embedding is None:
            rings, load = {}, {}
            every = getattr(self._groups, "embedding_transports", None)  # a builder's, at once
            transports = every() if every is not None else [
                None if group is None else group[1] for group in
                (self._groups.first(GroupKind.EMBEDDING, self.rank(0, r)) for r in range(self.dp))]
            for r, transport in enumerate(transports):
                if transport is not None:
                    rings[r] = ring_uses(self.cluster, transport,
                                         [self.entity(0, r), self.entity(self.pp - 1, r)])
            for hops in rings.values():
                for links, _, _ in hops:
                    for lk, w in links:
                        load[lk] = load.get(lk, 0.0) + w
            caps = self.caps
            self._facts.embedding = [None if r not in rings else
                         (2, min(caps[lk] / load[lk] for links, _, _ in rings[r] for lk, _ in links),
                          max(step for _, step, _ in rings[r])) for r in range(self.dp)]
        return self._facts.embedding

    # ---- alike replicas -----------------------------------------------------------------------
    def replica_classes(self) -> list[tuple[int, list[int]]]:
        """(representative, members) of each class of replicas with the same hardware on every
        stage and the same send latencies and rates in both directions, in replica order.

        The estimate walks each replica's pipeline on its own until the DP sync (`analytic`),
        with each send at the rate it gets while every replica sends at once (`p2p`) and the
        stage's DP ring the same for every replica; the work after the walk is priced per
        stage by `stage_combos`. Replicas alike in these figures walk the same, so one walk
        stands for a class. The engine's classes (`sim.symmetry`) are a different, finer
        partition: its replicas share links while they run, so a class there must also agree
        on DP-ring neighbours, node tenants and paths relative to its own nodes (an equitable
        partition by colour refinement); those would walk more replicas here and need the
        engine's paths and op costs, which this view does not build."""
        if self._classes is None:
            # Each stage pair once (its chunks' sends are the same sends), both ways.
            pairs = dict.fromkeys((j % self.pp, (j + 1) % self.pp) for j in range(self.nv - 1))
            rates = [self._pair_rates(a, b) for a, b in pairs] + \
                [self._pair_rates(b, a) for a, b in pairs]
            by_signature: dict[tuple, tuple[int, list[int]]] = {}
            stages = range(self.pp)
            # Per replica: its hardware on every stage, its sends' figures.
            hardware = list(zip(*self.hardware_rows()))
            sends = list(zip(*rates)) if rates else [()] * self.dp
            # Without CP or EP every replica has no CP sends (None) and no EP sends (()).
            no_cp, no_ep = (None,) * self.pp, ((),) * self.pp
            for d in range(self.dp):
                signature = (hardware[d], sends[d],
                             no_cp if self.cp == 1 else tuple(self.cp_send(s, d) for s in stages),
                             no_ep if self.ep == 1 else tuple(self.ep_sends(s, d) for s in stages))
                by_signature.setdefault(signature, (d, []))[1].append(d)
            self._classes = list(by_signature.values())
        return self._classes

    def stage_combos(self, embedding: bool) -> list[list[tuple[int, int, int]]]:
        """Per stage, the distinct (replica class index, tail index) of its replicas, with a
        replica that has them. Replicas of one tail index have the same hardware and embedding
        ring (or none), which price the work after the stage's last op. `embedding`: the first
        and last stages all-reduce tied embeddings."""
        got = self._combos.get(embedding)
        if got is None:
            class_of = [0] * self.dp
            for c, (_, members) in enumerate(self.replica_classes()):
                for d in members:
                    class_of[d] = c
            got = []
            rows = self.hardware_rows()
            for s in range(self.pp):
                emb = embedding and self.pp > 1 and s in (0, self.pp - 1)
                tails: dict = {}
                combos: dict[tuple[int, int], int] = {}
                if not emb and self.ep == 1:  # no embedding ring, one EDP group (or none):
                    for d, (c, hardware) in enumerate(zip(class_of, rows[s])):  # by hardware
                        combos.setdefault((c, tails.setdefault(hardware, len(tails))), d)
                    got.append([(c, t, d) for (c, t), d in combos.items()])
                    continue
                rings = self._embedding_rings() if emb else [None] * self.dp
                edp = self.edp_ring(s, 0) if self.ep == 1 else None  # one group (or none)
                for d, (hardware, ring) in enumerate(zip(rows[s], rings)):
                    tail = (hardware, ring, edp if self.ep == 1 else self.edp_ring(s, d))
                    combos.setdefault((class_of[d], tails.setdefault(tail, len(tails))), d)
                got.append([(c, t, d) for (c, t), d in combos.items()])
            self._combos[embedding] = got
        return got
