"""Rings as NCCL builds them, against nccl-tests' bus-bandwidth formula.

NCCL orders a ring node by node, so intra-node hops run on NVLink/NVSwitch and each node is left
once per channel, with channels spread over the node's NICs by rail. An all-reduce of N bytes over
p ranks then takes 2(p-1)/p x N / busbw (nccl-tests doc/PERFORMANCE.md), busbw the slowest of the
intra-node link and a node's summed NIC rate.
"""

from __future__ import annotations

import dataclasses

import pytest

from holmes_sim.cost.nccl_algorithms import choose
from holmes_sim.estimate.netview import netview
from holmes_sim.prepare import prepare
from holmes_sim.runner import run_policy
from holmes_sim.sim.trace import OpKind
from tests.sim.test_engine import UniformCompute


def _dp_scenario(nodes: int, nics: str) -> str:
    return f"""name: ring
fabrics: [{{name: ib, type: ib}}]
clusters:
  - name: c
    nodes:
      - {{count: {nodes}, gpu: a100-80gb, gpus_per_node: 8, intra_node: nvlink3, nics: {nics}}}
model: {{num_layers: 2, hidden_size: 1024, num_attention_heads: 16, seq_length: 1024,
        tie_embeddings: false}}
training: {{global_batch_size: {8 * nodes}, micro_batch_size: 1, distributed_optimizer: false,
           bucket_size_mb: 1.0e9}}
parallel: {{tensor: 1, pipeline: 1}}
policies: [megatron]
"""


RAILS = "[{type: ib, model: ib-hdr, count: 8, fabric: ib}, {type: ethernet, model: eth-100g}]"
SHARED = "[{type: ib, model: ib-hdr, count: 4, fabric: ib}, {type: ethernet, model: eth-100g}]"
ETH_ONLY = "[{type: ethernet, model: eth-100g}]"


def _all_reduce_s(write_scenario, nodes: int, nics: str) -> tuple[float, float]:
    """(simulated, NCCL formula) seconds of the one gradient all-reduce of pure DP."""
    prepared = dataclasses.replace(prepare(write_scenario(_dp_scenario(nodes, nics))),
                                   compute=UniformCompute())
    out = run_policy(prepared, "megatron")
    record = next(r for r in out.trace.records if r.kind is OpKind.DP_ALL_REDUCE)
    node = prepared.cluster.nodes[0]
    w = prepared.workload
    size = w.grad_bytes_of(2 * w.layer_params + w.embedding_params + w.head_params)
    link = node.intra_link
    fabric = "ib" if node.nics_on("ib") else "ethernet"
    nic_sum = sum(n.effective_bandwidth_bytes_per_s for n in node.nics_on(fabric))
    busbw = min(link.bandwidth_bytes_per_s * link.efficiency, nic_sum)
    alpha = max(n.latency_s for n in node.nics_on(fabric))
    return record.duration_s, _nccl_ring_s(8 * nodes, nodes, size, busbw, link.latency_s, alpha)


def _nccl_ring_s(p: int, nodes: int, size: float, busbw: float, alpha_intra: float,
                 alpha_inter: float) -> float:
    """NCCL's ring all-reduce, hierarchical: 2(K-1) of its 2(p-1) steps cross nodes, the rest
    run on NVLink; the faster of Simple and LL128 (0.92 of the bandwidth, step latencies x
    1.9/3.4 on NVLink and 4.0/14 on the network: NCCL src/graph/tuning.cc `hwLatencies`)."""
    inter = 2 * (nodes - 1)
    simple = (2 * (p - 1) - inter) * alpha_intra + inter * alpha_inter + \
        2 * (p - 1) / p * size / busbw
    ll128 = (2 * (p - 1) - inter) * alpha_intra * 1.9 / 3.4 + inter * alpha_inter * 4.0 / 14 + \
        2 * (p - 1) / p * size / (0.92 * busbw)
    return min(simple, ll128)


@pytest.mark.parametrize("nodes", [4, 8])
@pytest.mark.parametrize("nics", [RAILS, SHARED, ETH_ONLY], ids=["8-rails", "4-shared", "eth"])
def test_pure_dp_all_reduce_matches_nccls_ring_formula(write_scenario, nodes, nics):
    simulated, formula = _all_reduce_s(write_scenario, nodes, nics)
    assert simulated == pytest.approx(formula, rel=0.02)


def test_node_count_barely_changes_a_bandwidth_bound_ring(write_scenario):
    """Each node is left once per channel: 4 nodes cost 2(p-1)/p more, not p times more."""
    four, _ = _all_reduce_s(write_scenario, 4, ETH_ONLY)
    eight, _ = _all_reduce_s(write_scenario, 8, ETH_ONLY)
    assert eight / four == pytest.approx((63 / 64) / (31 / 32), rel=0.02)


def test_on_two_nodes_nccl_runs_the_tree_and_beats_the_network_bound(write_scenario):
    """Two nodes sharing one Ethernet NIC each: the double binary tree is one edge per tree, so a
    node's NIC carries N (N/2 each way per tree) instead of the ring's 2(p-1)/p N; at the tree's
    efficiency (0.92 x NCCL's size correction, 0.8-0.9 here) it beats the ring formula by more
    than a quarter (nccl-tests issue 196: 'On two nodes, NCCL uses the tree')."""
    simulated, ring = _all_reduce_s(write_scenario, 2, ETH_ONLY)
    assert simulated < 0.75 * ring


def _member_by_member(cluster, transport, src, dst, caps):
    """`group_path` as a loop over member pairs only (the general case), for comparison."""
    from holmes_sim.hardware.cluster import ETHERNET
    from holmes_sim.cost import paths

    weights, latency, step = {}, 0.0, 0.0
    share = 1.0 / len(src)
    for s, d in zip(src, dst, strict=True):
        for gpu, direction in ((s, "tx"), (d, "rx")):
            nic = cluster.nic_of_gpu(gpu.node, gpu.local_index, transport.fabric or ETHERNET)
            link = ("nic", gpu.node, nic.name, direction)
            weights[link] = weights.get(link, 0.0) + share
            latency, step = max(latency, nic.latency_s), max(step, nic.step_latency_s)
    uplink = paths._add_uplink(cluster, transport, src[0], dst[0], weights)
    return paths._path(weights, caps, latency + uplink, step + uplink)


@pytest.mark.parametrize("name", ["mixed_ib_roce", "two_clusters_39b", "pure_ethernet"])
def test_node_to_node_paths_equal_the_member_by_member_loop(name):
    """A TP group's send to another node takes each side's NIC links from the cluster's kept
    ones: the same links in the same order, weights, latencies and rate as summing member by
    member."""
    import random

    from holmes_sim.bundled import bundled_scenario
    from holmes_sim.cost.paths import group_path, link_capacities
    from holmes_sim.cost.transport import best_shared_transport, tcp_transport
    from holmes_sim.plan import GpuRef

    cluster = prepare(bundled_scenario(name)).cluster
    caps = link_capacities(cluster)
    rng = random.Random(3)
    for _ in range(200):
        a, b = rng.sample(cluster.nodes, 2)
        t = rng.choice([1, 2, 4, a.num_gpus])
        if t > b.num_gpus:
            continue
        src = tuple(GpuRef(a.name, g) for g in rng.sample(range(a.num_gpus), t))
        dst = tuple(GpuRef(b.name, g) for g in rng.sample(range(b.num_gpus), t))
        for transport in (best_shared_transport(cluster, src + dst), tcp_transport(cluster, src + dst)):
            assert group_path(cluster, transport, src, dst, caps) == \
                _member_by_member(cluster, transport, src, dst, caps)


def test_step_by_step_ring_pays_the_same_hierarchical_latency(write_scenario):
    """Synchronous steps of an idle ring move the same bytes and pay the pick's latency spread
    over its steps: the same time as the steady-state flows."""
    text = _dp_scenario(4, RAILS).replace("num_layers: 2", "num_layers: 8")
    times, picks = [], []
    for extra in ("", "engine: {collectives: step-by-step}\n"):
        prepared = dataclasses.replace(prepare(write_scenario(text + extra)),
                                       compute=UniformCompute())
        out = run_policy(prepared, "megatron")
        record = next(r for r in out.trace.records if r.kind is OpKind.DP_ALL_REDUCE)
        times.append(record.duration_s)
        plan = out.plan
        topo = netview(out.cluster, plan.rank_to_gpu, plan.groups, plan.tp, plan.pp, plan.dp,
                       plan.num_chunks).dp_topology(0)
        picks.append(choose(topo, "all-reduce", record.bytes * 32 / 62))
    assert {(c.algorithm, c.protocol) for c in picks} == {("ring", "Simple")}
    assert times[1] == pytest.approx(times[0], rel=0.01)


@pytest.mark.parametrize("name", ["mixed_ib_roce", "two_clusters_39b", "pure_ethernet"])
def test_ring_hop_facts_equal_the_ring_uses_figures(name):
    """The idle-ring facts found from NIC kinds (`ring_hop_facts`) are each hop's leaving a
    node, step latency and rate of its links (`ring_uses`), on rings of TP groups that share
    nodes, span nodes and cross clusters."""
    import random

    from holmes_sim.bundled import bundled_scenario
    from holmes_sim.cost.link_uses import ring_hop_facts, ring_uses
    from holmes_sim.cost.nccl_algorithms import leaves_node
    from holmes_sim.cost.transport import best_shared_transport, tcp_transport
    from holmes_sim.plan import GpuRef

    cluster = prepare(bundled_scenario(name)).cluster
    rng = random.Random(5)
    for _ in range(60):
        t = rng.choice([1, 2, 4])
        members = []
        for node in rng.sample(cluster.nodes, rng.randint(2, min(6, len(cluster.nodes)))):
            for _ in range(rng.choice([1, 1, 2])):  # two TP groups on a node, now and then
                members.append(tuple(GpuRef(node.name, g) for g in rng.sample(range(node.num_gpus), t)))
        if rng.random() < 0.2:  # a TP group spanning two nodes
            members[0] = members[0][:1] + members[-1][1:]
        gpus = [g for m in members for g in m]
        for transport in (best_shared_transport(cluster, gpus), tcp_transport(cluster, gpus)):
            assert ring_hop_facts(cluster, transport, members) == [
                (leaves_node(links), step, rate)
                for links, step, rate in ring_uses(cluster, transport, members)]
