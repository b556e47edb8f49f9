"""Classes of identical data-parallel replicas, and the flows that stand for a whole class.

Two replicas (pipelines) are in one class when swapping them changes nothing the engine sees:
each stage on the same hardware (node model, NICs, local GPUs), the same compute times, the same
point-to-point and embedding paths (links named relative to the replica's own nodes), on every
stage's data-parallel ring the same hop out to a neighbour of the same class and an incoming hop
from a neighbour of the same class, and on each node it shares the same other tenants (classes,
GPUs). Classes are found by colour refinement: start from those local signatures, then split by
the neighbours' classes until nothing splits (an equitable partition, so every member of a class
sees the same flows at the same times). The engine then checks that every member's node maps to
one node of its representative, hosting the representatives of the same tenants on the same
GPUs, so the representatives' nodes mirror every other node.

A class is simulated by its first member. Its flows stand for one flow per member: links of the
representative's own nodes keep their weights (each member loads its own copy equally), and
links no replica owns (inter-cluster uplinks) take k times the weight, since the k members'
flows all cross them. Weighted max-min sharing then gives the representative exactly the rate
each member would get. A stage spanning nodes, nodes that do not mirror, a seeded compute
spread, or a shared-CPU testbed makes every replica its own class (the full simulation).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from holmes_sim.cost.paths import PathUse, Ring

NodeMap = dict[str, Hashable]


def relabel(links: PathUse, nodes: NodeMap) -> PathUse:
    """`links` with node names replaced by their labels in `nodes` (others kept)."""
    return tuple(((lk[0], nodes.get(lk[1], lk[1]), *lk[2:]) if lk[0] in ("gpu", "nic") else lk, w)
                 for lk, w in links)


def scale_shared(links: PathUse, k: int) -> PathUse:
    """A representative's path standing for `k` members: uplink weights times k (s. module)."""
    if k == 1:
        return links
    return tuple((lk, w * k if lk[0] == "uplink" else w) for lk, w in links)


def refine(initial: Sequence[Hashable], neighbours: Callable[[int, list[int]], Hashable]) -> list[int]:
    """Colour refinement: colours (ints, numbered by first appearance) of items 0..n-1 starting
    from `initial`, split by `neighbours(i, colours)` until stable."""
    colours = _number(initial)
    while True:
        new = _number([(colours[i], neighbours(i, colours)) for i in range(len(colours))])
        if max(new, default=0) == max(colours, default=0):
            return new
        colours = new


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
