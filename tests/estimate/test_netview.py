"""A placement's network facts (`NetView`) and its groups (`build_groups`) against their
definitions, member by member with `Path` objects, on random placements: the fast ways (NIC
sides kept with the cluster, a backward send's figures from its forward pair, groups from each
TP group's nodes and NIC names, single groups found without building them all) must give the
very same numbers and groups."""

from __future__ import annotations

import random

import pytest

from holmes_sim.bundled import bundled_scenario
from holmes_sim.cost.paths import group_path, link_capacities, ring_paths
from holmes_sim.cost.transport import (
    best_shared_transport,
    job_wide_fabric,
    job_wide_transport,
    member_nics,
    tcp_transport,
)
from holmes_sim.estimate.netview import NetView
from holmes_sim.plan import GpuRef, Group, GroupKind, Groups, _Index, megatron_rank
from holmes_sim.policies.base import build_groups
from holmes_sim.prepare import prepare

UNEVEN = """name: uneven
seed: 0
fabrics:
  - {name: ib, type: ib}
  - {name: roce, type: roce}
clusters:
  - name: a
    nodes:
      - {name: fat, count: 2, gpu: h100-sxm,
         nics: [{type: ib, bandwidth_gbit_per_s: 400, latency_us: 2, count: 2, fabric: ib},
                {type: ethernet, bandwidth_gbit_per_s: 100, latency_us: 40}]}
      - {name: thin, count: 2, gpu: a100-80gb,
         nics: [{type: ib, bandwidth_gbit_per_s: 200, latency_us: 5, count: 8, fabric: ib},
                {type: ethernet, bandwidth_gbit_per_s: 50, latency_us: 60}]}
  - name: b
    nodes:
      - {count: 2, gpu: a100-80gb,
         nics: [{type: roce, bandwidth_gbit_per_s: 200, latency_us: 7, count: 4, fabric: roce},
                {type: ethernet, bandwidth_gbit_per_s: 100, latency_us: 25, count: 2}]}
inter_cluster_links:
  - {clusters: [a, b], bandwidth_gbit_per_s: 150, latency_us: 200}
model: {num_layers: 16, hidden_size: 1024, num_attention_heads: 16, seq_length: 1024}
training: {global_batch_size: 48, micro_batch_size: 1}
parallel: {tensor: 8, pipeline: 2}
"""
"""Nodes whose NICs differ in latency, rate and sharing (two GPUs to a NIC, four), in two
clusters joined by an uplink."""


def _cluster(name: str, tmp_path):
    if name != "uneven":
        return prepare(bundled_scenario(name)).cluster
    path = tmp_path / "uneven.yaml"
    path.write_text(UNEVEN)
    return prepare(path).cluster


def _placements(cluster, count: int, seed: int):
    """Random placements of the cluster: nodes and their GPUs shuffled (so TP groups stay on
    one node), degrees, chunks and one of the policies' transport choosers."""
    rng = random.Random(seed)
    n = cluster.num_gpus
    per_node = min(node.num_gpus for node in cluster.nodes)
    for _ in range(count):
        nodes = list(cluster.nodes)
        rng.shuffle(nodes)
        gpus = []
        for node in nodes:
            local = list(range(node.num_gpus))
            if rng.random() < 0.5:
                rng.shuffle(local)
            gpus += [GpuRef(node.name, g) for g in local]
        tp = rng.choice([t for t in (1, 2, 4, 8) if per_node % t == 0])
        pp = rng.choice([p for p in (1, 2, 3, 4, 8, 16) if n % (tp * p) == 0 and p <= n // tp])
        dp = n // (tp * pp)
        chunks = rng.choice([1, 2]) if pp > 1 else 1
        kind = rng.choice(["best", "tcp", "job"])
        fabric = job_wide_fabric(cluster, gpus)
        choose = {"best": lambda g, c=cluster: best_shared_transport(c, g),
                  "tcp": lambda g, c=cluster: tcp_transport(c, g),
                  "job": lambda g, c=cluster, f=fabric: job_wide_transport(c, g, f)}[kind]
        yield cluster, tuple(gpus), tp, pp, dp, chunks, choose


def _reference_groups(cluster, rank_to_gpu, tp, pp, dp, chunks, tie, choose):
    """`build_groups` as it was written first: every group member by member."""
    def rank(s, d, i):
        return megatron_rank(s, d, i, dp, tp)

    chosen = {}

    def make(kind, ranks):
        gpus = [rank_to_gpu[r] for r in ranks]
        nodes = tuple(dict.fromkeys(g.node for g in gpus))
        if nodes not in chosen:
            chosen[nodes] = choose(gpus)
        return Group(kind, ranks, chosen[nodes], member_nics(cluster, gpus, chosen[nodes]))

    groups = []
    if tp > 1:
        groups += [make(GroupKind.TENSOR, tuple(rank(s, d, i) for i in range(tp)))
                   for s in range(pp) for d in range(dp)]
    if dp > 1:
        groups += [make(GroupKind.DATA, tuple(rank(s, d, i) for d in range(dp)))
                   for s in range(pp) for i in range(tp)]
    seen = set()
    for j in range(pp * chunks - 1):
        a, b = j % pp, (j + 1) % pp
        if (a, b) not in seen:
            seen.add((a, b))
            groups += [make(GroupKind.PIPELINE, (rank(a, d, i), rank(b, d, i)))
                       for d in range(dp) for i in range(tp)]
    if pp > 1 and tie:
        groups += [make(GroupKind.EMBEDDING, (rank(0, d, i), rank(pp - 1, d, i)))
                   for d in range(dp) for i in range(tp)]
    return tuple(groups)


def _loaded(paths, caps):
    """(latency, rate) of each path while all of them run: link capacity over summed weights."""
    load = {}
    for path in paths:
        for lk, w in path.links:
            load[lk] = load.get(lk, 0.0) + w
    return [(p.latency_s, min(caps[lk] / load[lk] for lk, _ in p.links)) for p in paths]


@pytest.mark.parametrize("name", ["uneven", "mixed_ib_roce", "two_clusters_39b", "pure_ethernet",
                                  "mixed_ib_eth"])
def test_groups_equal_the_member_by_member_builder(name, tmp_path):
    for cluster, gpus, tp, pp, dp, chunks, choose in _placements(_cluster(name, tmp_path), 25, 1):
        for tie in (True, False):
            groups = build_groups(cluster, gpus, tp, pp, dp, chunks, tie, choose)
            built = _reference_groups(cluster, gpus, tp, pp, dp, chunks, tie, choose)
            assert isinstance(groups, Groups)
            _same_lookups(groups, built, tp * pp * dp)  # before and after they are built
            assert groups == built and built == groups and hash(groups) == hash(built)
            _same_lookups(groups, built, tp * pp * dp)
            index = _Index(built)
            for a in range(pp):
                for b in range(pp):
                    assert groups.lookup.stage_pair_transports(a, b) == [
                        index.pair_transport((megatron_rank(a, d, 0, dp, tp),
                                              megatron_rank(b, d, 0, dp, tp)))
                        for d in range(dp)], (a, b)


def _same_lookups(groups: Groups, built: tuple[Group, ...], world: int) -> None:
    """The builder's answers for single groups (`first`, `pair_transport`) are the built
    tuple's."""
    index = _Index(built)
    for rank in range(-1, world + 1):
        for kind in GroupKind:
            assert groups.lookup.first(kind, rank) == index.first(kind, rank), (kind, rank)
    for g in built:
        if g.kind is GroupKind.PIPELINE:
            assert groups.lookup.pair_transport(g.ranks) == g.transport
            assert groups.lookup.pair_transport(g.ranks[::-1]) == index.pair_transport(g.ranks[::-1])


def test_groups_of_tp_groups_across_nodes_are_built_member_by_member():
    """A TP group across two nodes (policies refuse it; `build_groups` itself does not)."""
    cluster = prepare(bundled_scenario("mixed_ib_roce")).cluster
    gpus = tuple(GpuRef(n.name, g) for n in cluster.nodes for g in range(n.num_gpus))
    gpus = gpus[4:] + gpus[:4]  # every TP group of 8 straddles two nodes

    def choose(g):
        return best_shared_transport(cluster, g)

    groups = build_groups(cluster, gpus, 8, 2, len(gpus) // 16, 2, True, choose)
    built = _reference_groups(cluster, gpus, 8, 2, len(gpus) // 16, 2, True, choose)
    _same_lookups(groups, built, len(gpus))
    assert groups == built


@pytest.mark.parametrize("name", ["uneven", "mixed_ib_roce", "two_clusters_39b", "pure_ethernet",
                                  "large_175b_1024"])
def test_send_rates_and_rings_equal_their_paths(name, tmp_path):
    """`NetView.p2p` equals every replica's `group_path` (over the forward pair's group, either
    way) loaded together; `idle_ring` and `embedding_ring` equal `ring_paths`' figures."""
    checked = 0
    for cluster, gpus, tp, pp, dp, chunks, choose in _placements(_cluster(name, tmp_path), 12, 2):
        groups = build_groups(cluster, gpus, tp, pp, dp, chunks, True, choose)
        net = NetView(cluster, gpus, groups, tp, pp, dp, chunks)  # finds single groups lazily
        caps = link_capacities(cluster)
        by_ranks = {g.ranks: g for g in groups if g.kind is GroupKind.PIPELINE}

        def entity(s, d, dp=dp, tp=tp, gpus=gpus):
            r = megatron_rank(s, d, 0, dp, tp)
            return gpus[r:r + tp]

        forward = {(j % pp, (j + 1) % pp) for j in range(pp * chunks - 1)}
        for a, b in sorted(forward | {(b, a) for a, b in forward}):
            fwd = (a, b) if (a, b) in forward else (b, a)
            paths = [group_path(cluster, by_ranks[(megatron_rank(fwd[0], d, 0, dp, tp),
                                                   megatron_rank(fwd[1], d, 0, dp, tp))].transport,
                                entity(a, d), entity(b, d), caps) for d in range(dp)]
            assert [net.p2p(a, b, d) for d in range(dp)] == _loaded(paths, caps), (a, b)
            checked += 1
        for s in range(pp):
            first = {g.ranks[0]: g for g in reversed(groups) if g.kind is GroupKind.DATA}
            group = first.get(megatron_rank(s, 0, 0, dp, tp))
            if group is None:
                assert net.dp_ring(s) is None
                continue
            ring = ring_paths(cluster, group.transport, [entity(s, d) for d in range(dp)], caps)
            assert net.dp_ring(s) == (dp, ring.idle_rate_bytes_per_s, ring.step_latency_s)
        emb = {g.ranks[0]: g for g in reversed(groups) if g.kind is GroupKind.EMBEDDING}
        if pp > 1:
            rings = [ring_paths(cluster, emb[megatron_rank(0, d, 0, dp, tp)].transport,
                                [entity(0, d), entity(pp - 1, d)], caps) for d in range(dp)]
            loaded = _loaded([hop for ring in rings for hop in ring.hops], caps)
            for d, ring in enumerate(rings):
                rate = min(rate for _, rate in loaded[2 * d:2 * d + 2])
                assert net.embedding_ring(d) == (2, rate, ring.step_latency_s)
    assert checked >= 20


@pytest.mark.parametrize("name", ["uneven", "mixed_ib_roce", "mixed_ib_eth", "two_clusters_39b",
                                  "large_175b_1024"])
def test_transport_kept_per_nic_layouts_equals_the_choice_made_each_time(name, tmp_path):
    """`best_shared_transport` keeps its answer per sequence of the members' NIC layouts; the
    answer made afresh from the nodes (their common RDMA fabrics, the fastest by its slowest
    member, else TCP) is the same."""
    from holmes_sim.cost import transport
    from holmes_sim.plan import Transport, TransportKind

    cluster = _cluster(name, tmp_path)
    rng = random.Random(5)
    for _ in range(300):
        members = [GpuRef(n.name, rng.randrange(n.num_gpus))
                   for n in rng.sample(cluster.nodes, min(len(cluster.nodes), rng.choice([1, 2, 2, 3, 8])))]
        nodes = transport._nodes(cluster, members)
        common = transport._common_rdma_fabrics(nodes)
        fresh = transport.LOCAL if len(nodes) == 1 else Transport(
            TransportKind.RDMA, max(common, key=lambda f, ns=nodes: transport._slowest_member_rate(ns, f))) \
            if common else transport._tcp(nodes)
        assert best_shared_transport(cluster, members) == fresh


def _figures(net, pp: int, dp: int, chunks: int) -> tuple:
    """Everything a view answers for a placement of pp stages, dp replicas and `chunks` chunks."""
    forward = {(j % pp, (j + 1) % pp) for j in range(pp * chunks - 1)}
    return ([net.p2p(a, b, d) for a, b in sorted(forward | {(b, a) for a, b in forward})
             for d in range(dp)],
            [(net.dp_ring(s), net.dp_topology(s), net.idle_ring(GroupKind.PIPELINE, s),
              net.stage_nodes(s), net.memory_bytes(s)) for s in range(pp)],
            [net.embedding_ring(d) for d in range(dp)], net.replica_classes(),
            net.stage_combos(True), net.stage_combos(False))


@pytest.mark.parametrize("name", ["uneven", "mixed_ib_roce", "two_clusters_39b"])
def test_views_of_other_chunk_counts_share_the_placements_facts_and_figures(name, tmp_path):
    """Groups of one rank order, degrees and chooser that differ only in their chunk count are
    one family: their views share what does not depend on the chunk count, and each gives the
    figures of a view made on its own (its pipeline pairs, its own first pipeline group)."""
    from holmes_sim.estimate import netview as nv_module

    shared = 0
    for cluster, gpus, tp, pp, dp, _, choose in _placements(_cluster(name, tmp_path), 12, 3):
        if pp == 1:
            continue
        groups = {v: build_groups(cluster, gpus, tp, pp, dp, v, True, choose, chooser_key=name)
                  for v in (1, 2, 3)}
        alone = {}
        for v in (1, 2, 3):
            nv_module._FACTS.clear()
            alone[v] = _figures(nv_module.netview(cluster, gpus, groups[v], tp, pp, dp, v), pp, dp, v)
        nv_module._FACTS.clear()
        nv_module._VIEWS.clear()
        views = {v: nv_module.netview(cluster, gpus, groups[v], tp, pp, dp, v) for v in (2, 1, 3)}
        for v in (2, 1, 3):
            assert _figures(views[v], pp, dp, v) == alone[v], v
        assert views[1]._facts is views[2]._facts is views[3]._facts
        assert views[1].replica_classes() is not views[2].replica_classes()
        shared += 1
    assert shared >= 5
