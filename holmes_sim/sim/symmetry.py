"""Classes of identical data-parallel replicas, and the flows that stand for a whole class.

Two replicas (pipelines) are in one class when swapping them changes nothing the engine sees:
each stage on the same hardware (node model, NICs, local GPUs), the same compute times, the same
point-to-point and embedding paths (links named relative to the replica's own nodes), on every
stage's data-parallel ring the same hop out to a neighbour of the same class and an incoming hop
from a neighbour of the same class, and on each node it shares the same other tenants (classes,
GPUs). Classes are found by colour refinement: start from those local signatures, then split by
the neighbours' classes until nothing splits (an equitable partition, so every member of a class
sees the same flows at the same times). `ReplicaSignatures.classes` then checks that every
member's node maps to one node of its representative, hosting the representatives of the same
tenants on the same GPUs, so the representatives' nodes mirror every other node.

A class is simulated by its first member. Its flows stand for one flow per member: links of the
representative's own nodes keep their weights (each member loads its own copy equally), and
links no replica owns (inter-cluster uplinks) take k times the weight, since the k members'
flows all cross them. Weighted max-min sharing then gives the representative exactly the rate
each member would get. A stage spanning nodes, nodes that do not mirror, a seeded compute
spread, or a shared-CPU testbed makes every replica its own class (the full simulation).

The analytic estimate groups replicas too (`estimate.netview.NetView.replica_classes`), by a
weaker rule: it walks each replica's pipeline alone, its sends already priced as if every
replica sent at once, so alike hardware per stage and alike send latencies and rates suffice
there. These classes must guarantee more, because the engine's replicas meet on shared links
while they run: a representative must see, flow for flow and instant for instant, what every
member sees, which needs the DP-ring neighbours, the node tenants and the mirrored nodes above.
The estimate's classes would merge replicas the engine must keep apart; these would split
replicas the estimate can walk once and need the engine's paths and op costs, which the
estimate's view does not build.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

from holmes_sim.cost.paths import PathUse, Ring, ring_paths
from holmes_sim.hardware.cluster import Cluster, Node
from holmes_sim.plan import Group, Plan, tp_group_places

NodeMap = dict[str, Hashable]


_NODE_LINKS = frozenset(("gpu", "nic"))
_UNSEEN = object()  # the look of a colour no round has looked at yet


def relabel(links: PathUse, nodes: NodeMap) -> PathUse:
    """`links` with node names replaced by their labels in `nodes` (others kept)."""
    get = nodes.get
    return tuple([((lk[0], get(lk[1], lk[1]), *lk[2:]) if lk[0] in _NODE_LINKS else lk, w)
                  for lk, w in links])


def scale_shared(links: PathUse, k: int) -> PathUse:
    """A representative's path standing for `k` members: uplink weights times k (s. module)."""
    if k == 1:
        return links
    return tuple((lk, w * k if lk[0] == "uplink" else w) for lk, w in links)


def refine(initial: Sequence[Hashable], neighbours: Callable[[int, list[int]], Hashable],
           reads: Callable[[int], Iterable[int]]) -> list[int]:
    """Colour refinement: colours (ints, numbered by first appearance) of items 0..n-1 starting
    from `initial`, split by `neighbours(i, colours)` until stable: the coarsest partition
    refining `initial` in which the members of a class have equal `neighbours`.

    `reads(i)`: the items whose colours `neighbours(i, ...)` reads. Each round looks again
    only at the items that read a colour changed by the last round (at first every item); a
    class that splits keeps its colour on its largest part (Hopcroft's rule), so an item takes
    a new colour at most log2(n) times and the work is about log2(n) looks per reading pair,
    however many rounds a split takes to travel round a ring. Stops once every item is alone."""
    n = len(initial)
    colours = _number(initial)
    readers: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        for j in reads(i):
            readers[j].append(i)
    members: dict[int, set[int]] = {}
    for i, c in enumerate(colours):
        members.setdefault(c, set()).add(i)
    looks: dict[int, Hashable] = {}  # colour -> what every member's `neighbours` gave
    dirty: Iterable[int] = range(n)
    while dirty and len(members) < n:
        seen = {i: neighbours(i, colours) for i in dirty}  # all read before any colour changes
        by_colour: dict[int, list[int]] = {}
        for i in seen:
            by_colour.setdefault(colours[i], []).append(i)
        moved: list[int] = []
        for c, items in by_colour.items():
            moved += _split(c, items, seen, colours, members, looks)
        dirty = {r for i in moved for r in readers[i]}
    return _number(colours)


def _split(c: int, items: list[int], seen: dict[int, Hashable], colours: list[int],
           members: dict[int, set[int]], looks: dict[int, Hashable]) -> list[int]:
    """Split colour `c` by what its looked-at `items` now see (the others still see
    `looks[c]`); the largest part keeps `c`. Returns the items given a new colour; the work is
    in proportion to the items looked at and moved, not to the class."""
    old = looks.get(c, _UNSEEN)
    parts: dict[Hashable, list[int]] = {}
    for i in items:
        if seen[i] != old:
            parts.setdefault(seen[i], []).append(i)
    if not parts:
        return []
    group = members[c]
    changed = sum(map(len, parts.values()))
    look, largest = max(parts.items(), key=lambda p: len(p[1]))
    if len(group) - changed >= len(largest):  # the unchanged rest keeps c
        for part in parts.values():
            group.difference_update(part)
    else:  # the largest changed part keeps c, the rest (fewer than `changed`) moves
        del parts[look]
        members[c] = set(largest)
        rest = group.difference(largest)
        for part in parts.values():
            rest.difference_update(part)
        if rest:
            parts[old] = list(rest)
        looks[c] = look
    moved: list[int] = []
    for look, part in parts.items():
        new = len(colours) + len(members)  # above every colour so far
        members[new], looks[new] = set(part), look
        for i in part:
            colours[i] = new
        moved += part
    return moved


def _number(signatures: Sequence[Hashable]) -> list[int]:
    ids: dict[Hashable, int] = {}
    return [ids.setdefault(sig, len(ids)) for sig in signatures]


def classes_of(colours: Sequence[int]) -> list[tuple[int, ...]]:
    """Items grouped by colour, each group in index order, groups by their first item."""
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(colours):
        groups.setdefault(c, []).append(i)
    return [tuple(g) for g in groups.values()]


def ring_neighbours(ring: Ring) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """(position, next member, previous member) of each member of `ring`."""
    order = ring.order
    p = len(order)
    pos = {m: k for k, m in enumerate(order)}
    nxt = {m: order[(k + 1) % p] for k, m in enumerate(order)}
    prv = {m: order[(k - 1) % p] for k, m in enumerate(order)}
    return pos, nxt, prv


def quotient_hops(ring: Ring, reps: Sequence[int], rep_of: Sequence[int],
                  node_of: Callable[[int], frozenset[str]],
                  weight: Callable[[int], int]) -> tuple[PathUse, ...]:
    """One hop per representative, in ring order: its hop out, entering the representative of
    its neighbour's class instead of the neighbour (same hardware), shared links scaled by the
    class size."""
    pos, nxt, _ = ring_neighbours(ring)
    hops = []
    for r in sorted(reps, key=pos.__getitem__):
        n = nxt[r]
        target = rep_of[n]
        mapping: NodeMap = {}
        if target != n:
            mapping = dict(zip(sorted(node_of(n)), sorted(node_of(target)), strict=True))
        hops.append(scale_shared(relabel(ring.hops[pos[r]].links, mapping), weight(r)))
    return tuple(hops)


def singletons(n: int) -> list[tuple[int, ...]]:
    """Every one of `n` replicas its own class (the full simulation)."""
    return [(d,) for d in range(n)]


class ReplicaClasses:
    """Replicas grouped into classes (tuples in replica order, ordered by first member), each
    class simulated by its first member, its representative."""

    __slots__ = ("members", "reps", "rep_of", "_size")

    def __init__(self, members: list[tuple[int, ...]]):
        self.members = members
        self.reps = [c[0] for c in members]
        self.rep_of = [0] * sum(map(len, members))
        for c in members:
            for d in c:
                self.rep_of[d] = c[0]
        self._size = {c[0]: len(c) for c in members}

    def weight(self, d: int) -> int:
        """How many replicas representative `d` stands for (1 for any other replica)."""
        return self._size.get(d, 1)


class ReplicaSignatures:
    """What the engine sees of each replica, refined into classes (see the module docstring).

    Args:
        plan, cluster, capacities: the simulation's plan, cluster and link capacities (bytes/s).
        nodes_of: (stage, replica) -> the nodes of that entity's GPUs.
        dp_rings: stage -> its data-parallel ring over every replica (stages with a DP group).
        send_group: (kind "F" or "B", virtual stage from, virtual stage to, replica) -> the
            pipeline group that carries the send.
        embedding_group: replica -> its embedding group (None: none).
        stage_costs: (node, stage) -> what prices the stage's work on that node (its ops' and
            optimizer step's seconds); equal values mean equal compute.
    """

    def __init__(self, plan: Plan, cluster: Cluster, capacities: dict, *,
                 nodes_of: Callable[[int, int], frozenset[str]], dp_rings: Mapping[int, Ring],
                 send_group: Callable[[str, int, int, int], Group],
                 embedding_group: Callable[[int], Group | None],
                 stage_costs: Callable[[Node, int], Hashable]):
        self.plan, self.cluster, self.caps = plan, cluster, capacities
        self._nodes, self._dp_rings = nodes_of, dp_rings
        self._send_group, self._embedding_group = send_group, embedding_group
        self._stage_costs = stage_costs
        self._places = tp_group_places(plan.rank_to_gpu, plan.tp)
        self._ring_order = {s: ring_neighbours(r) for s, r in dp_rings.items()}
        self._tenants = self._tenants_by_node()
        self._relative: dict[tuple, int] = {}
        self._hw_ids: dict[str, int] = {}
        self._node_hw: dict[str, tuple[str, int]] = {}
        self._hw_models: dict[tuple, int] = {}
        self._hw_objects: dict[tuple, int] = {}  # by the ids of the cluster's model objects
        self._neighbours: dict[int, tuple] = {}

    def classes(self) -> list[tuple[int, ...]]:
        """Classes of identical replicas (`classes_of` order); every replica alone when the
        representatives' nodes do not mirror the other members' nodes."""
        dp = self.plan.dp
        classes = classes_of(refine([self.local(d) for d in range(dp)], self.neighbours,
                                    self.reads))
        return classes if len(classes) == dp or self._mirrors(classes) else singletons(dp)

    def _tenants_by_node(self) -> dict[str, list[tuple[int, int]]]:
        """Node -> the entities (stage, replica) with GPUs on it, in entity order."""
        p = self.plan
        tenants: dict[str, list[tuple[int, int]]] = {}
        for s in range(p.pp):
            for d in range(p.dp):
                for node in self._places[s * p.dp + d][0]:
                    tenants.setdefault(node, []).append((s, d))
        return tenants

    def local(self, d: int) -> tuple:
        """What replica d's stages run on and send over, with its own nodes named by position."""
        p = self.plan
        places = [self._places[s * p.dp + d] for s in range(p.pp)]  # (nodes, local GPUs)
        if any(len(nodes) != 1 for nodes, _ in places):
            return ("own", d)  # a stage spans nodes
        labels: dict[str, int] = {}
        for nodes, _ in places:
            labels.setdefault(nodes[0], len(labels))
        stages = []
        for s, (nodes, gpus) in enumerate(places):
            name = nodes[0]
            costs = self._stage_costs(self.cluster.node(name), s)
            stages.append((labels[name], self._hardware(name), gpus, costs))
        nv = p.pp * p.num_chunks
        sends = tuple(self._relative_send(kind, j, j + 1 if kind == "F" else j - 1, d, labels,
                                          places)
                      for j in range(nv) for kind in "FB"
                      if (kind == "F" and j < nv - 1) or (kind == "B" and j > 0))
        return (tuple(stages), sends, self._embedding_signature(d, labels))

    def _embedding_signature(self, d: int, labels: dict[str, int]) -> tuple:
        """Replica d's embedding ring: its hops relabeled and its step latency (s); () if none."""
        group = self._embedding_group(d)
        if group is None:
            return ()
        p = self.plan
        ring = ring_paths(self.cluster, group.transport,
                          [p.entity_gpus(0, d), p.entity_gpus(p.pp - 1, d)], self.caps)
        return (tuple(relabel(h.links, labels) for h in ring.hops), ring.step_latency_s)

    def neighbours(self, d: int, colours: list[int]) -> tuple:
        """Replica d's neighbours: on each DP ring, its hop out (relabeled) and the colours of
        the next and previous members; on each of its nodes, the other tenants' colours."""
        hops, tenants = self._local_neighbours(d)
        rings = tuple((hop, colours[n], colours[prv]) for hop, n, prv in hops)
        return rings, tuple(tuple(sorted((s2, g, colours[d2]) for s2, g, d2 in t)) for t in tenants)

    def reads(self, d: int) -> list[int]:
        """The replicas whose colours `neighbours(d, ...)` reads."""
        hops, tenants = self._local_neighbours(d)
        return [m for _, n, prv in hops for m in (n, prv)] + [d2 for t in tenants for *_, d2 in t]

    def _local_neighbours(self, d: int) -> tuple[tuple, tuple]:
        """What `neighbours` needs that colours do not change, cached per replica."""
        got = self._neighbours.get(d)
        if got is None:
            p, places = self.plan, self._places
            tenants = tuple(tuple((s2, places[s2 * p.dp + d2][1][0], d2)
                                  for s2, d2 in self._tenants[next(iter(self._nodes(s, d)))])
                            for s in range(p.pp))
            got = self._neighbours[d] = (self._ring_hops_out(d), tenants)
        return got

    def _mirrors(self, classes: list[tuple[int, ...]]) -> bool:
        """Whether every node of a class member maps to one node of its representative that
        hosts the representatives of the same tenants on the same GPUs (else no symmetry)."""
        p = self.plan
        rep_of = {d: c[0] for c in classes for d in c}
        image: dict[str, str] = {}
        for c in classes:
            for m in c:
                for s in range(p.pp):
                    for a, b in zip(sorted(self._nodes(s, m)), sorted(self._nodes(s, c[0])), strict=True):
                        if image.setdefault(a, b) != b:
                            return False

        def slots(node: str, rep) -> list:
            return sorted((s, rep(d), self._places[s * p.dp + d][1])
                          for s, d in self._tenants[node])

        return all(slots(a, rep_of.__getitem__) == slots(b, lambda d: d) for a, b in image.items())

    def _ring_hops_out(self, d: int) -> tuple:
        """Replica d on each stage's DP ring: (its hop out relabeled, next member, previous)."""
        out = []
        for s, (pos, nxt, prv) in self._ring_order.items():
            hop = self._dp_rings[s].hops[pos[d]]
            n = nxt[d]
            mapping = {next(iter(self._nodes(s, d))): "self", next(iter(self._nodes(s, n))): "next"}
            out.append(((relabel(hop.links, mapping), hop.latency_s), n, prv[d]))
        return tuple(out)

    def _relative_send(self, kind: str, j_from: int, j_to: int, d: int, labels: dict,
                       places: list[tuple[tuple[str, ...], tuple[int, ...]]]) -> tuple:
        """One send of replica d as (kind, j, path model id, sender and receiver node labels):
        its path is a function of the transport, node models, GPUs and clusters (the model).
        `places`: each stage's (nodes, local GPUs) of replica d, one node each."""
        p = self.plan
        (a,), gpus_a = places[j_from % p.pp]
        (b,), gpus_b = places[j_to % p.pp]
        (cluster_a, hw_a), (cluster_b, hw_b) = self._hardware(a), self._hardware(b)
        key = (self._send_group(kind, j_from, j_to, d).transport, hw_a, hw_b, a == b,
               cluster_a, cluster_b, gpus_a, gpus_b)
        model = self._relative.setdefault(key, len(self._relative))
        return kind, j_from, model, labels[a], labels[b]

    def _hardware(self, node: str) -> tuple[str, int]:
        """(cluster, `_hw_id`) of a node, cached per node."""
        got = self._node_hw.get(node)
        if got is None:
            got = self._node_hw[node] = (self.cluster.node(node).cluster, self._hw_id(node))
        return got

    def _hw_id(self, node: str) -> int:
        """A small id per distinct node model (GPU, links, NICs), cached per node and per
        model objects (the cluster's nodes share their catalogue's and node group's)."""
        got = self._hw_ids.get(node)
        if got is None:
            n = self.cluster.node(node)
            objects = (id(n.gpu), n.num_gpus, id(n.intra_link), id(n.nics), n.speed)
            got = self._hw_objects.get(objects)
            if got is None:
                model = (n.gpu, n.num_gpus, n.intra_link, n.nics, n.speed)
                got = self._hw_objects[objects] = self._hw_models.setdefault(
                    model, len(self._hw_models))
            self._hw_ids[node] = got
        return got
