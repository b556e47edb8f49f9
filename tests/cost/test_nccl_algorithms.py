"""NCCL's algorithm choice (src/graph/tuning.cc) and its cost, against closed forms and against
published nccl-tests bus bandwidths on H100 (tests/cost/nccl_tests_h100.json)."""

from __future__ import annotations

import dataclasses
import json
from math import log2
from pathlib import Path

import pytest
import simpy

from holmes_sim.cost.nccl_algorithms import (KINDS, CollectiveTopology, candidates, choose,
                                              with_nvls)
from holmes_sim.cost.ops import OpCosts
from holmes_sim.cost.paths import link_capacities, ring_paths
from holmes_sim.cost.transport import best_shared_transport
from holmes_sim.estimate import analytic
from holmes_sim.hardware.catalog import NICS
from holmes_sim.estimate.netview import netview
from holmes_sim.plan import GpuRef
from holmes_sim.policies.partition import StageTimer
from holmes_sim.prepare import prepare
from holmes_sim.runner import run_policy
from holmes_sim.sim.collectives import nccl_collective
from holmes_sim.sim.network import FlowNetwork
from holmes_sim.sim.trace import OpKind
from tests.sim.test_engine import UniformCompute

ROWS = json.loads((Path(__file__).parent / "nccl_tests_h100.json").read_text())["rows"]

# A DGX H100-like node: NVLink 4 at the catalog's 0.77, 8 rails of 400 Gb/s at 0.92.
NVLINK4 = 450e9 * 0.77
RAILS_400G = 8 * 50e9 * 0.92


def _topology(nodes: int, per_node: int, nvls: float | None = 0.85) -> CollectiveTopology:
    inf = float("inf")
    return CollectiveTopology(nodes * per_node, nodes, NVLINK4 if per_node > 1 else inf,
                              RAILS_400G if nodes > 1 else inf, 10e-6 if nodes > 1 else 3e-6,
                              3e-6, 10e-6, "nvlink", nvls)


def _roce_400g() -> str:
    """A 400 Gb/s RoCE NIC for a scenario's catalog: the catalog has RoCE at 100 and 200 Gb/s
    only; its RoCE entries' efficiency and latency at the 400 Gb/s of a ConnectX-7 port."""
    roce = NICS["roce-200g"]
    return (f"catalog:\n  nics:\n    roce-400g: {{type: roce, bandwidth_gbit_per_s: 400, "
            f"latency_us: {roce.latency_s * 1e6:g}, efficiency: {roce.efficiency}, "
            f"source: 'ConnectX-7 400GbE RoCE; efficiency and latency of {roce.name}'}}\n")


def _h100_scenario(nodes: int, gpus_per_node: int = 8, tensor: int = 1,
                   average: bool = False, fabric: str = "ib", nvls: bool = True) -> str:
    nic = "connectx-7" if fabric == "ib" else "roce-400g"
    return (_roce_400g() if fabric == "roce" else "") + f"""name: h100
fabrics: [{{name: {fabric}, type: {fabric}}}]
clusters:
  - name: c
    nodes:
      - {{count: {nodes}, gpu: h100-sxm, gpus_per_node: {gpus_per_node}, intra_node: nvlink4,
         nics: [{{type: {fabric}, model: {nic}, count: 8, fabric: {fabric}}}]}}
model: {{num_layers: 2, hidden_size: 1024, num_attention_heads: 16, seq_length: 1024,
        tie_embeddings: false}}
training: {{global_batch_size: {nodes * gpus_per_node // tensor}, micro_batch_size: 1,
           distributed_optimizer: false, bucket_size_mb: 1.0e9,
           ddp_average_in_collective: {str(average).lower()},
           nccl_nvls_enable: {str(nvls).lower()}}}
parallel: {{tensor: {tensor}, pipeline: 1}}
policies: [megatron]
"""


# ---- the choice ------------------------------------------------------------------------------
def test_small_all_reduce_across_many_nodes_runs_a_tree_with_a_low_latency_protocol():
    """Latency-bound: 2 floor(log2 K) network steps instead of 2(n-1)."""
    topo = _topology(256, 1)
    got = choose(topo, "all-reduce", 64 * 1024)
    assert got.algorithm == "tree" and got.protocol in ("LL", "LL128")
    ring = next(c for c in candidates(topo, "all-reduce", 64 * 1024)
                if (c.algorithm, c.protocol) == ("ring", "Simple"))
    assert ring.latency_s == pytest.approx(2 * 255 * 10e-6)
    assert got.time_s < ring.time_s / 10


def test_large_all_reduce_without_nvlink_sharp_stays_on_the_ring():
    """Bandwidth-bound on A100 nodes (no NVLS): the ring moves 2(n-1)/n N, the tree 2N / 0.92."""
    got = choose(_topology(32, 8, nvls=None), "all-reduce", 8 << 30)
    assert (got.algorithm, got.protocol) == ("ring", "Simple")


def test_nvlink_sharp_is_chosen_where_the_switch_has_it():
    one_node = _topology(1, 8)
    assert choose(one_node, "all-reduce", 4 << 30).algorithm == "nvls"
    # NVLS reduce-scatter moves (ppn-1)/ppn N at 0.85: slower than the ring's (n-1)/n N.
    assert choose(one_node, "reduce-scatter", 4 << 30).algorithm == "ring"
    assert choose(_topology(32, 8), "all-reduce", 8 << 30).algorithm == "nvls-tree"
    assert all(c.algorithm not in ("nvls", "nvls-tree")
               for c in candidates(_topology(32, 8, nvls=None), "all-reduce", 8 << 30))


def test_tiny_messages_pick_the_ll_protocol_on_one_node():
    got = choose(_topology(1, 8, nvls=None), "all-reduce", 1024)
    assert (got.algorithm, got.protocol) == ("ring", "LL")
    assert got.latency_s == pytest.approx(14 * 3e-6 * 0.6 / 3.4)


@pytest.mark.parametrize("nodes,per_node,lanes", [(2, 8, 1), (4, 8, 1), (32, 8, 1), (256, 8, 1),
                                                 (16, 1, 8), (256, 1, 8), (1024, 1, 1),
                                                 (2048, 2, 1)])
def test_more_bytes_never_take_less_time(nodes, per_node, lanes):
    """NCCL's `treeCorrectionFactor` holds a sample per power of two up to the next, so its
    tree's time falls where the factor rises (tree/LL128 over 4,096 one-GPU nodes: 186.1 us at
    3.67 MiB, 178.8 at 4 MiB); joined linearly in log2 size it rises with the size, and so does
    NCCL's pick, the least of rising times. 1 KiB to 16 GiB, 8 sizes per doubling."""
    inf = float("inf")
    for nvls in (0.85, None):
        topo = CollectiveTopology(nodes * per_node, nodes, NVLINK4 * lanes if per_node > 1 else inf,
                                  RAILS_400G * (lanes if per_node == 1 else 1), 10e-6, 3e-6, 10e-6,
                                  "nvlink", nvls, lanes)
        for kind in ("all-reduce", "reduce-scatter", "all-gather"):
            times = [choose(topo, kind, 1024 * 2 ** (i / 8)).time_s for i in range(24 * 8 + 1)]
            assert all(b >= a for a, b in zip(times, times[1:])), (kind, nvls)


def test_the_tree_correction_is_nccls_at_every_power_of_two():
    """At 64 x 2^i bytes the tree's bandwidth is NCCL's x treeCorrectionFactor[p][i]; halfway
    (in log2) to the next power of two, the mean of the two samples."""
    topo = _topology(64, 1)

    def tree(protocol: str, size: float):
        return next(c for c in candidates(topo, "all-reduce", size)
                    if (c.algorithm, c.protocol) == ("tree", protocol))
    eff = {"LL": min(0.92 / 3.8, 20.4e9 / RAILS_400G), "LL128": 0.92 * 120 / 128, "Simple": 0.92}
    table = {"LL": (.6, .5), "LL128": (.6, .6), "Simple": (.6, .5)}  # entries 10 and 11
    for protocol, (f10, f11) in table.items():
        assert tree(protocol, 64 * 2 ** 10).exit_share == pytest.approx(2 / eff[protocol] / f10)
        assert tree(protocol, 64 * 2 ** 10.5).exit_share == pytest.approx(
            2 / eff[protocol] / ((f10 + f11) / 2))


def test_intra_node_steps_of_a_ring_across_nodes_pay_at_least_the_net_overhead():
    """tuning.cc: a ring spanning nodes floors each intra-node step at getNetOverhead (1 us on
    x86 Intel, x3 for Simple): NVLink's LL 0.6 us becomes 1.0; LL128 (1.9) and Simple (3.4
    against 3.0) keep theirs; on one node LL keeps 0.6."""
    def ring(topo, protocol):
        return next(c for c in candidates(topo, "all-gather", 1 << 16)
                    if (c.algorithm, c.protocol) == ("ring", protocol))
    nodes = _topology(32, 8)
    intra, inter = 255 - 31, 31
    assert ring(nodes, "LL").latency_s == pytest.approx(
        intra * 3e-6 * 1.0 / 3.4 + inter * 10e-6 * 2.7 / 14)
    assert ring(nodes, "LL128").latency_s == pytest.approx(
        intra * 3e-6 * 1.9 / 3.4 + inter * 10e-6 * 4.0 / 14)
    assert ring(nodes, "Simple").latency_s == pytest.approx(intra * 3e-6 + inter * 10e-6)
    assert ring(_topology(1, 8), "LL").latency_s == pytest.approx(7 * 3e-6 * 0.6 / 3.4)


def test_pat_serves_small_gathers_with_one_member_per_node():
    topo = _topology(64, 1)
    got = choose(topo, "all-gather", 1 << 20)
    assert got.algorithm == "pat"
    assert got.latency_s == pytest.approx(10e-6 * (6 / 3.5 + 64 * 2.8 / 14))


@pytest.mark.parametrize("gpu,link,cc,cap_gbps", [("a100-80gb", "nvlink3", 8, 87.7),
                                                   ("h100-sxm", "nvlink4", 9, 141.0),
                                                   ("b200", "nvlink5", 10, 282.0)])
def test_one_node_ll_cap_follows_the_gpu_architecture(write_scenario, gpu, link, cc, cap_gbps):
    """tuning.cc `llMaxBws[compCapIndex][0]` on one node: Ampere 87.7, Hopper 141, Blackwell 282
    GB/s; ring LL runs at min(0.5 B, llMaxBw). The ring's topology carries the GPUs' compute
    capability from the catalog."""
    text = _h100_scenario(1).replace("gpu: h100-sxm", f"gpu: {gpu}").replace(
        "intra_node: nvlink4", f"intra_node: {link}")
    cluster = prepare(write_scenario(text)).cluster
    members = [[GpuRef(cluster.nodes[0].name, g)] for g in range(8)]
    topo = ring_paths(cluster, best_shared_transport(cluster, [m[0] for m in members]), members,
                      link_capacities(cluster)).topology
    assert topo.compute_capability == cc
    size = 1 << 20
    ll = next(c for c in candidates(topo, "all-gather", size) if (c.algorithm, c.protocol) ==
              ("ring", "LL"))
    eff = min(0.5, cap_gbps * 1e9 / topo.bus_rate)
    assert ll.time_s == pytest.approx(ll.latency_s + 7 / 8 * size / eff / topo.intra_rate)


def test_nvls_gathers_and_scatters_need_at_most_32_gpus_on_the_node():
    """enqueue.cc skips NVLS for reduce-scatter and all-gather past NCCL_MAX_NVLS_ARITY (32)
    local ranks: a GB200 NVL72 rack (72 GPUs, one node) runs them on the ring; all-reduce keeps
    NVLS, and so do 32 GPUs."""
    inf = float("inf")

    def rack(gpus: int) -> CollectiveTopology:
        return CollectiveTopology(gpus, 1, 900e9 * 0.77, inf, 3e-6, 3e-6, 3e-6, "nvlink", 0.74)
    for kind in ("reduce-scatter", "all-gather"):
        assert all(c.algorithm != "nvls" for c in candidates(rack(72), kind, 16 << 20))
        assert choose(rack(72), kind, 16 << 20).algorithm == "ring"
        assert "nvls" in {c.algorithm for c in candidates(rack(32), kind, 16 << 20)}
    assert "nvls" in {c.algorithm for c in candidates(rack(72), "all-reduce", 16 << 20)}


def test_ll128_is_left_out_between_pcie_gpus_of_a_node():
    """tuning.cc enables LL128 only up to `typeIntra` PATH_NVB: not on nodes whose GPUs talk
    over PCIe (1 MiB on 8 PCIe 4 GPUs was ring/LL128), still with one GPU per node (PATH_LOC)."""
    inf = float("inf")
    pcie = 32e9 * 0.8
    for nodes, per_node in ((1, 8), (4, 8)):
        topo = CollectiveTopology(nodes * per_node, nodes, pcie, 100e9 if nodes > 1 else inf,
                                  10e-6, 5e-6, 10e-6, "pci", None)
        for kind in ("all-reduce", "reduce-scatter"):
            assert {c.protocol for c in candidates(topo, kind, 1 << 20)} == {"LL", "Simple"}
        assert choose(topo, "all-reduce", 1 << 20).protocol != "LL128"
    lone = CollectiveTopology(4, 4, inf, 100e9, 10e-6, 5e-6, 10e-6, "pci", None)
    assert "LL128" in {c.protocol for c in candidates(lone, "all-reduce", 1 << 20)}


def test_a_re_declared_catalog_entry_keeps_what_nccl_sees_of_it(write_scenario):
    """Re-declaring nvlink4 with another efficiency (docs/scenario_schema.md: "add or override
    catalog entries") kept no NVLink SHARP, so a 160 MB all-reduce over two DGX H100s lost
    NVLS-tree; pcie4 re-declared stays PCIe, a new link is PCIe when its `type` says so, and a
    re-declared h100-sxm keeps its compute capability."""
    catalog = ("catalog:\n  links:\n    nvlink4: {bandwidth_gbyte_per_s: 450, latency_us: 3, "
               "efficiency: 0.82}\n    pcie4: {bandwidth_gbyte_per_s: 32, latency_us: 5, "
               "efficiency: 0.8}\n    my-link: {bandwidth_gbyte_per_s: 64, latency_us: 5, "
               "efficiency: 0.8, type: pcie}\n  gpus:\n    h100-sxm: {peak_tflops: 989, "
               "memory_gib: 80, memory_bandwidth_gbyte_per_s: 3350}\n")
    prepared = prepare(write_scenario(catalog + _h100_scenario(2)))
    cluster = prepared.cluster
    link = cluster.nodes[0].intra_link
    assert (link.efficiency, link.nvls_efficiency, link.pcie) == (0.82, 0.85, False)
    assert cluster.nodes[0].gpu.compute_capability == 9
    members = [[GpuRef(n.name, g)] for n in cluster.nodes for g in range(8)]
    topo = ring_paths(cluster, best_shared_transport(cluster, [m[0] for m in members]), members,
                      link_capacities(cluster)).topology
    assert choose(topo, "all-reduce", 160e6).algorithm == "nvls-tree"
    for text, name in ((catalog + _h100_scenario(1).replace("intra_node: nvlink4",
                                                           "intra_node: pcie4"), "pcie4"),
                       (catalog + _h100_scenario(1).replace("intra_node: nvlink4",
                                                           "intra_node: my-link"), "my-link")):
        node = prepare(write_scenario(text)).cluster.nodes[0]
        assert node.intra_link.name == name and node.intra_link.pcie
        assert node.intra_link.nvls_efficiency is None


# ---- the reduction op ------------------------------------------------------------------------
def test_an_averaging_reduction_has_no_nvls_and_no_pat_reduce_scatter():
    """AVG is NCCL's PreMulSum on float types: no NVLS kernels (device.h `ncclNvlsSupported`), no
    PAT reduce-scatter (enqueue.cc `updateCollCostTable`); an all-gather keeps both."""
    one_node, nodes, spread = _topology(1, 8), _topology(32, 8), _topology(64, 1)
    assert choose(one_node, "all-reduce", 160e6).algorithm == "nvls"
    assert choose(one_node, "all-reduce", 160e6, "avg").algorithm == "ring"
    assert choose(nodes, "all-reduce", 8 << 30).algorithm == "nvls-tree"
    assert all(c.algorithm not in ("nvls", "nvls-tree")
               for c in candidates(nodes, "all-reduce", 8 << 30, "avg"))
    assert choose(spread, "reduce-scatter", 40e6).algorithm == "pat"
    assert all(c.algorithm != "pat" for c in candidates(spread, "reduce-scatter", 40e6, "avg"))
    assert choose(spread, "all-gather", 40e6, "avg") == choose(spread, "all-gather", 40e6)
    assert "nvls" in {c.algorithm for c in candidates(one_node, "all-gather", 1 << 20, "avg")}
    with pytest.raises(ValueError, match="reduction op"):
        candidates(one_node, "all-reduce", 1e6, "prod")


def _dp_all_reduce_prices(write_scenario, text: str) -> tuple:
    """The scenario's one DP all-reduce (megatron, TP 1, all-reduce optimizer) as the engine
    runs it (s), the estimate's iteration (s), the partition's exposed DP time (s), its gradient
    bytes, and the cluster."""
    prepared = dataclasses.replace(prepare(write_scenario(text)), compute=UniformCompute())
    out = run_policy(prepared, "megatron")
    plan = out.plan
    record = next(r for r in out.trace.records if r.kind is OpKind.DP_ALL_REDUCE)
    estimate = analytic.estimate_iteration(plan, out.cluster, prepared.workload,
                                           prepared.compute).iteration_s
    timer = StageTimer(prepared.request(out.cluster), plan.rank_to_gpu, plan.groups, plan.optimizer)
    w = prepared.workload
    params = 2 * w.layer_params + w.embedding_params + w.head_params
    return (record.duration_s, estimate, timer._dp_exposed_s(0, params, 0.0, 0.0),
            w.grad_bytes_of(params), out.cluster)


def _dp_topology(cluster) -> CollectiveTopology:
    """The DP ring of every GPU of `cluster` (8 per node), as the cluster's links give it."""
    members = [[GpuRef(n.name, g)] for n in cluster.nodes for g in range(8)]
    return ring_paths(cluster, best_shared_transport(cluster, [m[0] for m in members]), members,
                      link_capacities(cluster)).topology


def test_ddp_average_in_collective_reduces_gradients_without_nvls_everywhere(write_scenario):
    """One DGX H100: with `ddp_average_in_collective` the DP all-reduce runs as the ring (NVLS
    cannot average), 1.5 times NVLS's time, in the engine, the estimate and the partition."""
    runs = {average: _dp_all_reduce_prices(write_scenario, _h100_scenario(1, average=average))
            for average in (False, True)}
    size, topo = runs[True][3], _dp_topology(runs[True][4])
    summed, averaged = choose(topo, "all-reduce", size), choose(topo, "all-reduce", size, "avg")
    assert (summed.algorithm, averaged.algorithm) == ("nvls", "ring")
    assert averaged.time_s > 1.3 * summed.time_s
    for average, choice in ((False, summed), (True, averaged)):
        assert runs[average][0] == pytest.approx(choice.time_s, rel=1e-6)
        assert runs[average][2] == pytest.approx(choice.time_s, rel=1e-9)
    assert runs[True][1] - runs[False][1] == pytest.approx(averaged.time_s - summed.time_s,
                                                           rel=1e-6)


def test_nccl_nvls_enable_false_prices_no_collective_as_nvls(write_scenario):
    """Two DGX H100s, TP 1: NCCL's default runs the DP all-reduce as NVLS-tree; with
    `training.nccl_nvls_enable: false` (NCCL_NVLS_ENABLE=0, NeMo's and Megatron-Bridge's launch
    setting) as the ring or tree NCCL picks without NVLink SHARP, in the engine, the estimate
    and the partition alike. A TP 8 group on one node loses NVLS the same way."""
    runs = {nvls: _dp_all_reduce_prices(write_scenario, _h100_scenario(2, nvls=nvls))
            for nvls in (True, False)}
    size, topo = runs[False][3], _dp_topology(runs[False][4])
    on, off = choose(topo, "all-reduce", size), choose(with_nvls(topo, False), "all-reduce", size)
    assert on.algorithm == "nvls-tree" and off.algorithm in ("ring", "tree")
    assert off.time_s > 1.1 * on.time_s
    for nvls, choice in ((True, on), (False, off)):
        assert runs[nvls][0] == pytest.approx(choice.time_s, rel=1e-6)
        assert runs[nvls][2] == pytest.approx(choice.time_s, rel=1e-9)
    assert runs[False][1] - runs[True][1] == pytest.approx(off.time_s - on.time_s, rel=1e-6)
    for nvls in (True, False):
        prepared = prepare(write_scenario(_h100_scenario(1, tensor=8, nvls=nvls)))
        tp = OpCosts(prepared.cluster, prepared.workload, prepared.compute, 8).tp_topology(
            prepared.cluster.nodes[0])
        picks = {choose(tp, kind, 32 << 20).algorithm for kind in KINDS}
        assert ("nvls" in picks) is nvls and (tp.nvls_efficiency is None) is not nvls


# ---- the oracle: a DP all-reduce over 1,024 H100s ---------------------------------------------
def _nvls_tree_s(size: float, nodes: int, nvlink: float, rails: float, alpha_nvlink: float,
                 alpha_net: float) -> float:
    """NCCL's NVLS-tree all-reduce (tuning.cc: latency intraLat + 2 log2(nodes) interLat,
    NVLS 25 us on NVLink against the ring's 3.4, NVLS-tree 20.9 us on the network against 14):
    each GPU sends and receives N through the NVLink SHARP switch at 0.85 of the link, each node
    sends and receives 2N across the double binary tree."""
    latency = alpha_nvlink * 25 / 3.4 + 2 * int(log2(nodes)) * alpha_net * 20.9 / 14
    return latency + max(size / (0.85 * nvlink), 2 * size / rails)


def test_dp_all_reduce_over_1024_h100s_equals_nccls_nvls_tree_formula(write_scenario):
    prepared = dataclasses.replace(prepare(write_scenario(_h100_scenario(128))),
                                   compute=UniformCompute())
    out = run_policy(prepared, "megatron")
    record = next(r for r in out.trace.records if r.kind is OpKind.DP_ALL_REDUCE)
    w = prepared.workload
    size = w.grad_bytes_of(2 * w.layer_params + w.embedding_params + w.head_params)
    node = prepared.cluster.nodes[0]
    rails = sum(n.effective_bandwidth_bytes_per_s for n in node.nics_on("ib"))
    link = node.intra_link
    formula = _nvls_tree_s(size, 128, link.bandwidth_bytes_per_s * link.efficiency, rails,
                           link.latency_s, node.nics_on("ib")[0].latency_s)
    plan = out.plan
    topo = netview(out.cluster, plan.rank_to_gpu, plan.groups, plan.tp, plan.pp, plan.dp,
                   plan.num_chunks).dp_topology(0)
    analytic = choose(topo, "all-reduce", size)
    assert plan.dp == 1024 and analytic.algorithm == "nvls-tree"
    assert analytic.time_s == pytest.approx(formula, rel=0.02)
    assert record.duration_s == pytest.approx(formula, rel=0.02)


# ---- published nccl-tests ------------------------------------------------------------------
def _modelled_busbw(write_scenario, row: dict) -> float:
    """Bus bandwidth (GB/s) of the row's collective as the simulator prices it: NCCL's pick
    (or the row's forced algorithm with its Simple protocol) on the catalog's H100 node with the
    row's rails (`fabric`: ConnectX-7 on InfiniBand NDR, or RoCE at 400 Gb/s) and its
    NCCL_NVLS_ENABLE (`nvls_enable`: `training.nccl_nvls_enable`, as the engine applies it)."""
    prepared = prepare(write_scenario(_h100_scenario(row["nodes"], fabric=row["fabric"],
                                                     nvls=row.get("nvls_enable", True))))
    cluster = prepared.cluster
    members = [[GpuRef(n.name, g)] for n in cluster.nodes for g in range(row["gpus_per_node"])]
    transport = best_shared_transport(cluster, [m[0] for m in members])
    topo = with_nvls(ring_paths(cluster, transport, members, link_capacities(cluster)).topology,
                     prepared.workload.nvls_enable)
    kind, size, n = row["collective"], row["size_bytes"], len(members)
    if row["algorithm"] is None:
        t = choose(topo, kind, size).time_s
    else:
        t = next(c.time_s for c in candidates(topo, kind, size)
                 if (c.algorithm, c.protocol) == (row["algorithm"], "Simple"))
    factor = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
    return factor * size / t / 1e9


ANOMALOUS = {
    "32node-allgather": "the source reports it as anomalously low (200 GB/s against its own "
                        "340 GB/s all-reduce); the model gives about 300",
    "2node-allreduce-nvls-on": "NVLS-tree on two nodes: the model gives 551 GB/s (NVLS at 0.85 of "
                               "NVLink, each node's NICs carrying N); NCCL's own model would hold "
                               "it to 462 (8 NVLS channels x perChMaxNVLSTreeBw 57.7, left out), "
                               "the run gave 430 for reasons its source does not show",
}


@pytest.mark.parametrize("row", [pytest.param(r, id=r["id"], marks=pytest.mark.xfail(
    reason=ANOMALOUS[r["id"]], strict=True)) if r["id"] in ANOMALOUS else pytest.param(r, id=r["id"])
    for r in ROWS])
def test_bus_bandwidth_within_10_percent_of_published_nccl_tests(write_scenario, row):
    modelled = _modelled_busbw(write_scenario, row)
    assert modelled == pytest.approx(row["busbw_gbyte_per_s"], rel=0.10)


def test_latency_bound_dp_all_reduce_runs_as_a_tree_in_engine_and_estimate(write_scenario):
    """TP 8 on 64 nodes: a DP group of one member per node, a few MB of gradients: NCCL's
    double binary tree (2 log2(64) network steps) beats the ring's 126, in both estimators."""
    text = _h100_scenario(64, tensor=8).replace("num_layers: 2, hidden_size: 1024",
                                                "num_layers: 1, hidden_size: 256")
    prepared = dataclasses.replace(prepare(write_scenario(text)), compute=UniformCompute())
    out = run_policy(prepared, "megatron")
    record = next(r for r in out.trace.records if r.kind is OpKind.DP_ALL_REDUCE)
    plan = out.plan
    topo = netview(out.cluster, plan.rank_to_gpu, plan.groups, plan.tp, plan.pp, plan.dp,
                   plan.num_chunks).dp_topology(0)
    w = prepared.workload
    # A member (TP group) all-reduces its 8 GPUs' gradients: 8 communicators of 1/8 each.
    size = w.grad_bytes_of(w.layer_params + w.embedding_params + w.head_params)
    got = choose(topo, "all-reduce", size)
    assert (plan.dp, topo.nodes, topo.per_node, topo.lanes) == (64, 64, 1, 8)
    assert got.algorithm == "tree"
    nic = prepared.cluster.nodes[0].nics_on("ib")[0]
    steps = {"LL": 5.0 / 14, "LL128": 8.5 / 14, "Simple": 1.0}[got.protocol]
    assert got.latency_s == pytest.approx(2 * 6 * nic.latency_s * steps)
    assert record.duration_s == pytest.approx(got.time_s, rel=0.02)


def test_a_tree_shares_its_links_with_other_traffic_in_the_engine():
    """`nccl_collective` on a FlowNetwork: a tree all-reduce over 16 one-GPU nodes alone takes its
    pick's time; with a bulk transfer on one node's NIC (tx) for the whole collective, that node's
    exit gets half the NIC and the collective's bandwidth term doubles."""
    cap, k = 50e9, 16
    hops = tuple(((("nic", i, "tx"), 1.0), (("nic", (i + 1) % k, "rx"), 1.0)) for i in range(k))
    caps = {(kind, i, d): cap for i in range(k) for kind, d in (("nic", "tx"), ("nic", "rx"))}
    topo = CollectiveTopology(k, k, float("inf"), cap, 10e-6, 10e-6, 10e-6, "nvlink", None)
    size = 1 << 20
    choice = choose(topo, "all-reduce", size)
    assert choice.algorithm == "tree"

    def run(bulk: bool) -> float:
        env = simpy.Environment()
        net = FlowNetwork(env, caps)
        if bulk:
            net.transfer(((("nic", 0, "tx"), 1.0),), 1e12)
        proc = env.process(nccl_collective(env, net, choice, hops, (True,) * k, size))
        env.run(until=proc)
        return env.now

    bandwidth = choice.time_s - choice.latency_s
    assert run(False) == pytest.approx(choice.time_s, rel=1e-9)
    assert run(True) == pytest.approx(choice.latency_s + 2 * bandwidth, rel=1e-6)
