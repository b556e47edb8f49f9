"""One replica per class of identical replicas gives the full simulation's figures (1e-9)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from holmes_sim.errors import HolmesError
from holmes_sim.prepare import prepare, prepare_text
from holmes_sim.runner import plan_policy, run_policy
from holmes_sim.sim import symmetry
from holmes_sim.sim.engine import EngineOptions, _Simulation
from tests.conftest import SCENARIOS

REL = 1e-9
POLICY_MIX = ["megatron", "holmes", "holmes-no-overlap", "holmes-no-adaptive-partition",
              "holmes-no-nic-aware-order"]
# The 1,024-GPU scenario's full simulation takes seconds per policy; two policies cover it.
POLICIES = {"large_175b_1024": ["megatron", "holmes"]}


def assert_same(prepared, policy: str, every_op: bool = True) -> int:
    """Symmetric and full results of `policy` agree; returns the symmetric run's entities."""
    sym = run_policy(prepared, policy)
    full = run_policy(prepared, policy, full_simulation=True)
    a, b = sym.result, full.result
    assert a.iteration_time_s == pytest.approx(b.iteration_time_s, rel=REL, abs=0)
    for key, value in b.breakdown_s.items():
        assert a.breakdown_s[key] == pytest.approx(value, rel=REL, abs=1e-12 * b.iteration_time_s), key
    assert a.stage_busy_s == pytest.approx(b.stage_busy_s, rel=REL)
    if every_op:
        assert_same_ops(sym.trace, full.trace, b.iteration_time_s)
    return len({r.entity for r in sym.trace.compact})


def assert_same_ops(sym, full, scale: float) -> None:
    """Every entity's ops (the representatives' copied to members) match the full trace's."""
    def ops(trace):
        return sorted((r.entity, r.stream, r.kind, r.microbatch, r.chunk, r.start_s, r.end_s, r.bytes)
                      for r in trace.records)

    a, b = ops(sym), ops(full)
    assert len(a) == len(b)
    assert [x[:5] for x in a] == [x[:5] for x in b]
    ta, tb = (np.array([x[5:] for x in ops_]) for ops_ in (a, b))
    assert np.all(np.abs(ta - tb) <= REL * np.maximum(np.abs(tb), scale))


@pytest.mark.parametrize("name", sorted(p.stem for p in SCENARIOS.glob("*.yaml")))
def test_bundled_scenarios_symmetric_equals_full(name):
    prepared = prepare(SCENARIOS / f"{name}.yaml")
    for policy in POLICIES.get(name, prepared.scenario.policies):
        assert_same(prepared, policy, every_op=name not in POLICIES)  # 180k ops: figures only


def _nics(rng: random.Random, kind: str) -> str:
    eth = f"{{type: ethernet, bandwidth_gbit_per_s: {rng.choice([25, 100])}}}"
    if kind == "eth":
        return f"[{eth}]"
    gbit = rng.choice([100, 200])
    return f"[{{type: {kind}, bandwidth_gbit_per_s: {gbit}, count: {rng.choice([1, 2])}, " \
           f"fabric: {kind}}}, {eth}]"


def random_scenario(seed: int) -> str:
    """A small scenario: 1-2 clusters of IB / RoCE / Ethernet-only node groups, any schedule."""
    rng = random.Random(seed)
    tp = rng.choice([1, 2, 4, 8])
    gpus = tp if rng.random() < 0.6 else rng.choice([g for g in (1, 2, 4, 8) if g >= tp])
    pp = rng.choice([1, 2, 2, 3, 4])
    dp = rng.choice([2, 3, 4, 6])
    schedule = rng.choice(["gpipe", "1f1b", "interleaved"]) if pp > 1 else "1f1b"
    virtual = 2 if schedule == "interleaved" else 1
    nodes = tp * pp * dp // gpus
    if nodes * gpus != tp * pp * dp:
        nodes, dp = pp * dp, dp * gpus // tp  # whole nodes: scale the replicas up
    clusters = 2 if nodes >= 2 and rng.random() < 0.35 else 1
    uneven = nodes > 1 and rng.random() < 0.5  # node groups of different hardware
    split = sorted(rng.sample(range(1, nodes), min(2, nodes - 1))) if uneven else []
    cuts = [0, *split, nodes]
    groups = [(f"g{i}", cuts[i + 1] - cuts[i], rng.choice(["ib", "ib", "roce", "eth"]))
              for i in range(len(cuts) - 1)]
    if clusters == 2 and len(groups) == 1:  # the same hardware in both clusters
        half = nodes // 2
        groups = [(n, half, kind) for n, _, kind in groups] + [("h", nodes - half, groups[0][2])]
    per_cluster = [groups[:1], groups[1:]] if clusters == 2 else [groups]
    lines = ["name: random", f"seed: {seed}", "fabrics: [{name: ib, type: ib}, {name: roce, type: roce}]",
             "clusters:"]
    for c, gs in enumerate(per_cluster):
        lines += [f"  - name: c{c}", "    nodes:"]
        lines += [f"      - {{name: {n}, count: {k}, gpu: a100-80gb, gpus_per_node: {gpus}, "
                  f"nics: {_nics(rng, kind)}}}" for n, k, kind in gs]
    if len(per_cluster) == 2:
        lines.append(f"inter_cluster_links: [{{clusters: [c0, c1], bandwidth_gbit_per_s: "
                     f"{rng.choice([10, 100])}, latency_us: 50}}]")
    m = pp * rng.choice([1, 2, 3])
    layers = pp * virtual * rng.choice([2, 3])
    lines += [
        f"model: {{num_layers: {layers}, hidden_size: 512, num_attention_heads: 8, seq_length: 512, "
        f"vocab_size: 8192, tie_embeddings: {rng.choice(['true', 'false'])}}}",
        f"training: {{global_batch_size: {m * dp}, micro_batch_size: 1, "
        f"overlap_grad_reduce: {rng.choice(['true', 'false'])}, "
        f"distributed_optimizer: {rng.choice(['true', 'false'])}, bucket_size_mb: 4}}",
        f"parallel: {{tensor: {tp}, pipeline: {pp}, schedule: {schedule}, virtual_stages: {virtual}}}",
        f"policies: [{', '.join(rng.sample(POLICY_MIX, 2))}]",
        f"engine: {{collectives: {rng.choice(['steady-state', 'steady-state', 'step-by-step'])}}}", ""]
    return "\n".join(lines)


def test_random_scenarios_symmetric_equals_full():
    merged = checked = 0
    for seed in range(64):
        try:
            prepared = prepare_text(random_scenario(seed), f"<random {seed}>")
        except HolmesError:
            continue  # e.g. more stages than layers allow
        for policy in prepared.scenario.policies:
            try:
                entities = assert_same(prepared, policy)
            except HolmesError:
                continue  # a plan this hardware cannot run
            checked += 1
            merged += entities < prepared.pp * prepared.dp
    assert checked >= 50 and merged >= 20, (checked, merged)


def test_full_simulation_flag_simulates_every_replica():
    prepared = prepare(SCENARIOS / "two_clusters_39b.yaml")  # identical replicas, one uplink
    plan, cluster = plan_policy(prepared, "megatron")
    for full, reps in ((False, 1), (True, plan.dp)):
        sim = _Simulation(plan, cluster, prepared.workload, prepared.compute,
                          EngineOptions(full_simulation=full))
        assert len(sim.classes.reps) == reps


def test_replicas_sharing_nodes_form_classes_by_position_on_the_node():
    prepared = prepare(SCENARIOS / "pure_ib.yaml")  # TP 1: eight replicas per node, DP 32
    plan, cluster = plan_policy(prepared, "megatron")
    sim = _Simulation(plan, cluster, prepared.workload, prepared.compute, EngineOptions())
    assert sim.classes.reps == list(range(8)) and {len(c) for c in sim.classes.members} == {4}


def test_compute_spread_falls_back_to_full():
    prepared = prepare(SCENARIOS / "two_clusters_39b.yaml")
    plan, cluster = plan_policy(prepared, "holmes")
    sim = _Simulation(plan, cluster, prepared.workload, prepared.compute,
                      EngineOptions(compute_cv=0.05, seed=3))
    assert sim.classes.reps == list(range(plan.dp))


def test_symmetric_run_is_deterministic():
    prepared = prepare(SCENARIOS / "two_clusters_39b.yaml")
    a, b = (run_policy(prepared, "holmes").result.to_json() for _ in range(2))
    assert a == b


def test_cli_full_simulation_flag_gives_the_same_figures():
    from typer.testing import CliRunner

    from holmes_sim.cli import app

    docs = []
    for flags in ([], ["--full-simulation"]):
        result = CliRunner().invoke(app, ["run", "two_clusters_39b", "-p", "holmes", "--json", "-",
                                          "-q", *flags])
        assert result.exit_code == 0, result.output
        docs.append(json.loads(result.stdout)["results"][0])
    assert docs[0]["iteration_time_s"] == pytest.approx(docs[1]["iteration_time_s"], rel=REL)


def _refine_every_round(initial, neighbours):
    """Reference colour refinement: every item looked at again each round until none splits."""
    colours = symmetry._number(initial)
    while True:
        new = symmetry._number([(colours[i], neighbours(i, colours)) for i in range(len(colours))])
        if max(new, default=0) == max(colours, default=0):
            return new
        colours = new


def test_refine_matches_round_by_round_refinement_on_random_graphs():
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 40)
        reads = [[rng.randrange(n) for _ in range(rng.randint(0, 3))] for _ in range(n)]

        def neighbours(i, colours, reads=reads):  # an ordered read and a multiset
            return (colours[reads[i][0]] if reads[i] else None,
                    tuple(sorted(colours[j] for j in reads[i][1:])))

        initial = [rng.randint(0, 2) for _ in range(n)]
        assert symmetry.classes_of(symmetry.refine(initial, neighbours, reads.__getitem__)) == \
            symmetry.classes_of(_refine_every_round(initial, neighbours))


def test_refine_looks_again_only_where_colours_changed():
    """One marked item on a ring of 512: the split travels 256 rounds round the ring; looking
    at every item each round took 256 x 512 looks."""
    n = 512
    looked = []

    def neighbours(i, colours):
        looked.append(i)
        return tuple(sorted((colours[(i + 1) % n], colours[(i - 1) % n])))

    colours = symmetry.refine([i == 0 for i in range(n)], neighbours,
                              lambda i: ((i + 1) % n, (i - 1) % n))
    assert symmetry.classes_of(colours) == [(0,), *((k, n - k) for k in range(1, n // 2)),
                                            (n // 2,)]
    assert len(looked) <= 4 * n


ASYMMETRIC = """name: asym-256
fabrics: [{name: ib-a, type: ib}, {name: roce-b, type: roce}]
clusters:
  - name: ibc
    nodes: [{count: 16, gpu: h100-sxm, gpus_per_node: 8, nics: [{type: ib, model: ib-hdr, count: 8, fabric: ib-a}, {type: ethernet, model: eth-100g}]}]
  - name: rocec
    nodes: [{count: 8, gpu: a100-80gb, gpus_per_node: 8, nics: [{type: roce, model: roce-200g, count: 8, fabric: roce-b}, {type: ethernet, model: eth-100g}]}]
  - name: ethc
    nodes: [{count: 16, gpu: a100-80gb, gpus_per_node: 4, nics: [{type: ethernet, model: eth-100g}]}]
inter_cluster_links:
  - {clusters: [ibc, rocec], bandwidth_gbit_per_s: 400, latency_us: 100}
  - {clusters: [ibc, ethc], bandwidth_gbit_per_s: 400, latency_us: 100}
  - {clusters: [rocec, ethc], bandwidth_gbit_per_s: 400, latency_us: 100}
model: {name: gpt-7.5b, num_layers: 36, hidden_size: 4096, num_attention_heads: 32, seq_length: 2048}
training: {global_batch_size: 256, micro_batch_size: 1}
parallel: {tensor: 1, pipeline: 1, schedule: 1f1b}
policies: [holmes]
"""


def test_ring_across_nic_kinds_splits_every_replica_in_few_looks(monkeypatch):
    """A DP ring through three NIC kinds leaves no two replicas alike: the refinement reaches
    all singletons looking at each replica a few times (round by round it took 17 looks per
    replica here, dp/16 at any size), and the run is the full simulation, byte for byte."""
    prepared = prepare_text(ASYMMETRIC, "<asym>")
    plan, cluster = plan_policy(prepared, "holmes")
    looked = []
    neighbours = symmetry.ReplicaSignatures.neighbours
    monkeypatch.setattr(symmetry.ReplicaSignatures, "neighbours",
                        lambda self, d, colours: looked.append(d) or neighbours(self, d, colours))
    sim = _Simulation(plan, cluster, prepared.workload, prepared.compute, EngineOptions())
    assert plan.dp == 256 and sim.classes.reps == list(range(plan.dp))
    assert len(looked) <= 5 * plan.dp
    sym, full = (run_policy(prepared, "holmes", full_simulation=f) for f in (False, True))
    assert sym.result.to_json() == full.result.to_json()
