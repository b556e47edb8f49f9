"""Scenario variability: stragglers, a seeded speed spread, slow NICs and uplinks."""

from __future__ import annotations

import json
import random

import pytest

from holmes_sim.cost.ops import OpCosts
from holmes_sim.errors import ScenarioError
from holmes_sim.prepare import prepare, prepare_text
from holmes_sim.report.document import report_markdown
from holmes_sim.report.stragglers import straggler_costs, with_stragglers
from holmes_sim.search import planner
from holmes_sim.runner import results_document, run_policy, run_scenario
from tests.conftest import SCENARIOS, small_scenario
from tests.sim.test_symmetry import assert_same

BASE = small_scenario(nodes_ib=4, layers=8, global_batch=16)  # TP 8, PP 2, DP 2, 8 micro-batches


def _with(variability: str, text: str = BASE) -> str:
    return text + "variability:\n" + "".join(f"  {line}\n" for line in variability.splitlines())


def test_straggler_adds_what_its_stage_predicts():
    """One node at 0.85x holding the last stage of one replica: that stage is the critical path
    (it holds the head), so each of its m forward and backward ops takes 1/0.85 as long."""
    nominal = prepare_text(BASE)
    before = run_policy(nominal, "megatron")
    plan = before.plan
    node = plan.entity_gpus(1, 0)[0].node
    slow = prepare_text(_with(f"slow_gpus: [{{node: {node}, speed_factor: 0.85}}]"))
    after = run_policy(slow, "megatron")
    assert after.plan.layers_per_stage == plan.layers_per_stage
    costs = OpCosts(nominal.cluster, nominal.workload, nominal.compute, plan.tp)
    layers = plan.layers_per_stage[1]
    per_microbatch = sum(costs.chunk_compute_s(nominal.cluster.node(node), layers, False, True, b)
                         for b in (False, True))
    predicted = nominal.num_microbatches * per_microbatch * (1 / 0.85 - 1)
    added = after.result.iteration_time_s - before.result.iteration_time_s
    assert added > 0.03 * before.result.iteration_time_s
    assert added == pytest.approx(predicted, rel=0.02)
    # The report names the stage and the same cost (the analytic estimate agrees here).
    (cost,) = straggler_costs(slow, after)
    assert cost.stages == (1,)
    assert cost.added_s == pytest.approx(added, rel=0.02)
    assert f"stage 1 (node {node} at 0.85x speed) adds" in cost.sentence()


@pytest.mark.parametrize("variability", [
    "slow_gpus: [{node: ib-2, speed_factor: 0.85}]",
    "slow_gpus: [{node: ib-0, gpus: [3], speed_factor: 0.7}]",
    "compute_spread: 0.05\nseed: 3",
    "compute_spread: 0.1\ndistribution: uniform",
    "slow_links: [{node: ib-1, nic: ib0, rate_factor: 0.25}]",
    "slow_links: [{cluster: c, fabric: ethernet, rate_factor: 0.5}]",
])
@pytest.mark.parametrize("policy", ["megatron", "holmes"])
def test_symmetric_equals_full_simulation_under_variability(variability, policy):
    prepared = prepare_text(_with(variability, small_scenario(nodes_ib=4, layers=8,
                                                              global_batch=32, tp=4)))
    assert_same(prepared, policy)


def test_uniform_hardware_is_untouched():
    """Without variability the cluster is the one built from the file (bundled results stay)."""
    prepared = prepare(SCENARIOS / "mixed_ib_roce.yaml")
    assert prepared.nominal_cluster is None
    assert all(n.speed == 1.0 and n.gpu_speeds == () for n in prepared.cluster.nodes)
    same = prepare_text(_with("compute_spread: 0\nslow_gpus: []"))
    assert same.nominal_cluster is None


def test_slow_nic_and_uplink_scale_their_rates():
    text = small_scenario(nodes_ib=2)
    base = prepare_text(text).cluster
    slow = prepare_text(_with("slow_links: [{node: ib-1, fabric: ib, rate_factor: 0.4}]",
                              text)).cluster
    nominal_nic, slow_nic = base.node("ib-1").nics[0], slow.node("ib-1").nics[0]
    assert slow_nic.bandwidth_bytes_per_s == pytest.approx(0.4 * nominal_nic.bandwidth_bytes_per_s)
    assert slow.node("ib-1").nics[1] == base.node("ib-1").nics[1]  # Ethernet untouched
    assert slow.node("ib-0") == base.node("ib-0")
    two = (SCENARIOS / "two_clusters_39b.yaml").read_text()
    clusters = prepare(SCENARIOS / "two_clusters_39b.yaml").cluster.uplinks[0].clusters
    up = prepare_text(_with(f"slow_uplinks: [{{clusters: [{clusters[1]}, {clusters[0]}], "
                            "rate_factor: 0.5}]", two)).cluster.uplinks[0]
    nominal_up = prepare(SCENARIOS / "two_clusters_39b.yaml").cluster.uplinks[0]
    assert up.bandwidth_bytes_per_s == pytest.approx(0.5 * nominal_up.bandwidth_bytes_per_s)


def test_holmes_gives_the_slow_stage_fewer_layers():
    text = small_scenario(nodes_ib=4, layers=16, global_batch=32)
    nominal = run_policy(prepare_text(text), "holmes").plan
    node = nominal.entity_gpus(0, 0)[0].node
    slow = run_policy(prepare_text(_with(f"slow_gpus: [{{node: {node}, speed_factor: 0.7}}]",
                                         text)), "holmes").plan
    assert slow.entity_gpus(0, 0)[0].node == node
    assert slow.layers_per_stage[0] < nominal.layers_per_stage[0]


def _document(variability: str) -> str:
    prepared = prepare_text(_with(variability))
    outcomes = run_scenario(prepared)
    return json.dumps(results_document(prepared, outcomes, prepared.scenario.seed), sort_keys=True)


def test_seeded_spread_is_deterministic():
    a = _document("compute_spread: 0.08\nseed: 11")
    assert a == _document("compute_spread: 0.08\nseed: 11")
    assert a != _document("compute_spread: 0.08\nseed: 12")
    speeds = prepare_text(_with("compute_spread: 0.08\nseed: 11")).cluster.nodes[0].gpu_speeds
    assert len(speeds) == 8 and len(set(speeds)) == 8
    assert all(1 - 3 * 0.08 <= v <= 1 + 3 * 0.08 for v in speeds)


@pytest.mark.parametrize("variability, where, fix", [
    ("slow_gpus: [{node: ib-9, speed_factor: 0.8}]", "variability.slow_gpus[0].node",
     "ib-0..ib-3"),
    ("slow_gpus: [{node: ib-0, gpus: [8], speed_factor: 0.8}]",
     "variability.slow_gpus[0].gpus[0]", "GPUs 0..7"),
    ("slow_gpus: [{node: ib-0, gpus: [2, 2], speed_factor: 0.8}]",
     "variability.slow_gpus[0].gpus[1]", "named by variability.slow_gpus[0].gpus[0] already"),
    ("slow_gpus: [{node: ib-0, gpus: [], speed_factor: 0.8}]",
     "variability.slow_gpus[0].gpus", "remove `gpus` for the whole node"),
    ("slow_gpus: [{node: ib-0, speed_factor: 0}]", "variability.slow_gpus[0].speed_factor",
     "greater than 0"),
    ("slow_gpus: [{node: ib-0, speed_factor: 3}]", "variability.slow_gpus[0].speed_factor",
     "at most 2"),
    ("slow_gpus: [{node: ib-0}]", "variability.slow_gpus[0]", "missing required key 'speed_factor'"),
    ("slow_links: [{node: ib-0, rate_factor: 1.5}]", "variability.slow_links[0].rate_factor",
     "at most 1"),
    ("slow_links: [{node: ib-0, cluster: c, rate_factor: 0.5}]", "variability.slow_links[0]",
     "exactly one of `node`"),
    ("slow_links: [{node: ib-0, nic: roce7, rate_factor: 0.5}]",
     "variability.slow_links[0].nic", "ib-0 has ib0 (fabric ib), eth0 (fabric ethernet)"),
    ("slow_links: [{cluster: d, rate_factor: 0.5}]", "variability.slow_links[0].cluster",
     "clusters: c"),
    ("slow_uplinks: [{clusters: [c, d], rate_factor: 0.5}]",
     "variability.slow_uplinks[0].clusters", "name two joined clusters"),
    ("compute_spread: 0.5", "variability.compute_spread", "at most 0.25"),
    ("distribution: normall", "variability.distribution", "did you mean 'normal'"),
    ("speed_factor: 0.9", "variability.speed_factor", "known keys: compute_spread"),
])
def test_loader_errors_name_field_and_fix(variability, where, fix):
    with pytest.raises(ScenarioError) as err:
        prepare_text(_with(variability))
    message = str(err.value)
    assert f": {where}: " in message
    assert fix in message


def test_an_unknown_node_is_refused_with_each_groups_names(write_scenario):
    """Several node groups: the error lists each group's names, not the first and last node of
    the job (which read as one range, "ib-0 .. eth-2"); `holmes-sim check` prints it on one
    line with the file and line and exits 2."""
    from typer.testing import CliRunner

    from holmes_sim.cli import app

    text = _with("slow_gpus: [{node: roce-3, speed_factor: 0.8}]",
                 small_scenario(nodes_ib=2, nodes_roce=1, nodes_eth=3, pp=3, global_batch=12))
    with pytest.raises(ScenarioError) as err:
        prepare_text(text)
    assert str(err.value).endswith(": variability.slow_gpus[0].node: no node named 'roce-3' "
                                   "(nodes are named <group name or cluster>-<index>, here "
                                   "ib-0..ib-1, roce-0, eth-0..eth-2)")
    path = write_scenario(text)
    out = CliRunner().invoke(app, ["check", str(path)])
    assert out.exit_code == 2
    assert out.output.splitlines() == [
        f"error: {path}:18: variability.slow_gpus[0].node: no node named 'roce-3' (nodes are "
        "named <group name or cluster>-<index>, here ib-0..ib-1, roce-0, eth-0..eth-2)"]


def test_an_unknown_node_among_many_groups_lists_the_first_and_counts_the_rest():
    """Ten groups: the first eight are listed, the other two counted."""
    groups = "\n".join(f"      - {{name: g{k}, count: 2, gpu: a100-80gb, gpus_per_node: 8, "
                       f"nics: [{{type: ethernet, bandwidth_gbit_per_s: 100}}]}}"
                       for k in range(10))
    base = small_scenario(nodes_ib=1, pp=1, global_batch=16)
    text = base.replace(base[base.index("      - {name: ib"):base.index("\nmodel:")], groups)
    with pytest.raises(ScenarioError) as err:
        prepare_text(_with("slow_gpus: [{node: g3-2, speed_factor: 0.8}]", text))
    assert str(err.value).endswith(
        "here g0-0..g0-1, g1-0..g1-1, g2-0..g2-1, g3-0..g3-1, g4-0..g4-1, g5-0..g5-1, "
        "g6-0..g6-1, g7-0..g7-1, and 2 more groups)")


MIXED = small_scenario(nodes_ib=2, nodes_roce=2)  # ib-0, ib-1: ib0, eth0; roce-0, roce-1: roce0, eth0


@pytest.mark.parametrize("entry, where, offered, not_offered", [
    ("{node: ib-1, nic: roce0, rate_factor: 0.5}", "variability.slow_links[0].nic",
     "ib-1 has ib0 (fabric ib), eth0 (fabric ethernet)", "roce0"),
    ("{node: roce-0, fabric: ib, rate_factor: 0.5}", "variability.slow_links[0].fabric",
     "roce-0 has roce0 (fabric roce), eth0 (fabric ethernet)", "ib0"),
    ("{node: ib-0, nic: ib0, fabric: roce, rate_factor: 0.5}",
     "variability.slow_links[0].fabric", "ib-0 has ib0 (fabric ib), eth0 (fabric ethernet)",
     "roce0"),
    ("{cluster: c, nic: ib7, rate_factor: 0.5}", "variability.slow_links[0].nic",
     "the nodes of cluster c have ib0 (fabric ib), roce0 (fabric roce), eth0 (fabric ethernet)",
     "ib7"),
])
def test_slow_link_error_offers_the_nodes_own_nics(entry, where, offered, not_offered):
    """A slow link that matches no NIC is refused with the NICs and fabrics the named node (or
    the cluster's nodes) really have, not a fixed list of examples."""
    with pytest.raises(ScenarioError) as err:
        prepare_text(_with(f"slow_links: [{entry}]", MIXED))
    message = str(err.value)
    assert f": {where}: " in message
    assert offered in message
    assert not_offered not in message.rsplit("; ", 1)[-1]  # the NICs offered
    assert "name one of those NICs or fabrics" in message


def test_bundled_straggler_report_shows_why_holmes_wins():
    prepared = prepare(SCENARIOS / "straggler.yaml")
    outcomes = run_scenario(prepared)
    by = {o.plan.policy: o for o in outcomes}
    document = with_stragglers(results_document(prepared, outcomes, 0), prepared, outcomes)
    cost = {p: c[0]["added_s"] for p, c in document["stragglers"].items()}
    # Holmes' partition gives the slow node's stage fewer layers, so the straggler costs it less
    # than the equal split on the same placement, and Holmes beats Megatron-LM's default.
    slow_stage = document["stragglers"]["holmes"][0]["stages"][0]
    assert by["holmes"].plan.layers_per_stage[slow_stage] < 18
    assert cost["holmes"] < 0.5 * cost["holmes-no-adaptive-partition"]
    assert by["holmes"].result.iteration_time_s < \
        by["holmes-no-adaptive-partition"].result.iteration_time_s < \
        by["megatron"].result.iteration_time_s
    markdown = report_markdown(prepared, outcomes)
    assert "## Slow hardware" in markdown
    assert f"stage {slow_stage} (node roce-a-1 at 0.85x speed) adds" in markdown
    assert "Slow hardware" not in report_markdown(prepare(SCENARIOS / "mixed_ib_roce.yaml"),
                                                  outcomes)


def test_plan_ranks_under_the_scenarios_variability():
    search = ("search: {tensor: [1], pipeline: [2], micro_batch_size: [4], schedule: [1f1b], "
              "recompute: [selective], sequence_parallel: [false], optimizer: [distributed], "
              "top_k: 1}\n")
    text = (SCENARIOS / "straggler.yaml").read_text()
    slow = planner.search(prepare_text(text + search))
    nominal = planner.search(prepare_text(text.split("variability:")[0] + search))
    assert slow.candidates[0].policy == "holmes" and slow.speedup(slow.candidates[0]) > 1.3
    assert slow.candidates[0].predicted_iteration_s > nominal.candidates[0].predicted_iteration_s
    assert slow.baseline.predicted_iteration_s > nominal.baseline.predicted_iteration_s
    assert nominal.candidates[0].layers_per_stage == (18, 18)
    assert slow.candidates[0].layers_per_stage == (20, 16)  # the slow node holds stage 1


def test_the_real_run_testbed_refuses_variability(tmp_path):
    from holmes_sim.bundled import default_testbed
    from holmes_sim.errors import FieldError
    from holmes_sim.validation.testbed_plan import check_backend

    path = tmp_path / "spread.yaml"
    path.write_text(_with("compute_spread: 0.05", default_testbed().read_text()))
    with pytest.raises(FieldError, match="variability: the testbed runs every rank at one speed"):
        check_backend(prepare(path))
    check_backend(prepare(default_testbed()))


@pytest.mark.parametrize("seed", range(8))
def test_symmetric_equals_full_on_random_variability(seed):
    """Random stragglers and slow NICs on a mixed cluster: the classes the engine keeps still
    give the full simulation's figures."""
    rng = random.Random(seed)
    nodes = [f"{kind}-{k}" for kind in ("ib", "roce", "eth") for k in range(2)]
    gpus = rng.sample(nodes, rng.randint(1, 2))
    slow = ", ".join(f"{{node: {n}, speed_factor: {rng.uniform(0.5, 1.2):.3f}}}" for n in gpus)
    lines = [f"slow_gpus: [{slow}]",
             f"slow_links: [{{node: {rng.choice(nodes)}, fabric: ethernet, "
             f"rate_factor: {rng.uniform(0.2, 1):.3f}}}]"]
    if rng.random() < 0.5:
        lines.append(f"compute_spread: {rng.uniform(0, 0.1):.3f}")
    text = small_scenario(nodes_ib=2, nodes_roce=2, nodes_eth=2, tp=rng.choice([2, 4, 8]),
                          layers=8, global_batch=48)
    prepared = prepare_text(_with("\n".join(lines), text))
    for policy in ("megatron", "holmes"):
        assert_same(prepared, policy)


def test_holmes_puts_stragglers_in_one_stage():
    """Two slow nodes that Megatron-LM's order puts in different stages share Holmes' first
    stage, which its partition then unloads."""
    text = _with("slow_gpus: [{node: ib-1, speed_factor: 0.85}, {node: ib-6, speed_factor: 0.85}]",
                 small_scenario(nodes_ib=8, tp=8, pp=2, layers=16, global_batch=64))
    prepared = prepare_text(text)
    stages = {}
    for policy in ("megatron", "holmes"):
        plan = run_policy(prepared, policy).plan
        stages[policy] = {s for s in range(plan.pp) for d in range(plan.dp)
                          if plan.entity_gpus(s, d)[0].node in ("ib-1", "ib-6")}
    assert stages == {"megatron": {0, 1}, "holmes": {0}}
    times = {o.plan.policy: o.result.iteration_time_s for o in run_scenario(prepared)}
    assert times["holmes"] < times["megatron"]


def test_variability_note_words_the_spread_as_a_coefficient_of_variation():
    """`plan` prints this note; a spread's factor is a CV, not every GPU at that speed."""
    from holmes_sim.report.stragglers import variability_note
    note = variability_note(prepare_text(_with(
        "compute_spread: 0.05\nslow_gpus: [{node: ib-2, speed_factor: 0.85}]")))
    assert "gpu ib-2 all GPUs at 0.85x" in note
    assert note.endswith("a normal spread of GPU speed (coefficient of variation 0.05)")
    assert "0.05x" not in note
