"""The straggler of the 9,216-GPU benchmark (`benchmarks/engine_scale.py`: GPT-175B, TP 8, PP 16,
DP 72, 1F1B, 192 micro-batches, racks alternately on IB and RoCE): the iteration time one slow
node adds against a hand calculation of its stage's critical path, and how `plan` ranks
placements on that cluster.

The slow node is the cluster's first, which every policy here puts in pipeline stage 0 of
replica 0. Two forms of it: the benchmark's own (`--straggler`: a GPU model with 0.85 of the
A100's peak FLOP/s and memory bandwidth) and `variability.slow_gpus` at speed factor 0.85.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest

from holmes_sim.cost.ops import OpCosts
from holmes_sim.cost.paths import group_path, link_capacities
from holmes_sim.plan import GroupKind
from holmes_sim.prepare import Prepared, prepare_text
from holmes_sim.report.stragglers import straggler_costs
from holmes_sim.runner import Outcome, plan_policy, run_policy
from holmes_sim.search import planner
from tests.conftest import REPO

GPUS, MICROBATCHES = 9216, 192  # the benchmark's cluster and its default micro-batches
FIRST_NODE = {"benchmark": "r0s-0", "speed-factor": "r0-0"}


def _engine_scale():
    spec = importlib.util.spec_from_file_location("engine_scale",
                                                  REPO / "benchmarks" / "engine_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _text(form: str | None) -> str:
    """The benchmark's scenario: nominal (None) or with its first node slow (`form`)."""
    scenario_yaml = _engine_scale().scenario_yaml
    if form == "benchmark":
        return scenario_yaml(GPUS, MICROBATCHES, straggler=True)
    text = scenario_yaml(GPUS, MICROBATCHES)
    if form == "speed-factor":
        text += f"variability: {{slow_gpus: [{{node: {FIRST_NODE[form]}, speed_factor: 0.85}}]}}\n"
    return text


def _run(form: str | None, policy: str) -> tuple[Prepared, Outcome]:
    prepared = prepare_text(_text(form))
    return prepared, run_policy(prepared, policy)


@functools.cache
def _nominal_megatron() -> tuple[Prepared, Outcome]:
    """The cluster without the straggler under Megatron-LM's placement (each form compares)."""
    return _run(None, "megatron")


def _stage_ops(prepared: Prepared, outcome: Outcome) -> tuple[list, list, list, list, float]:
    """Replica 0's per-micro-batch forward and backward of each stage (compute + TP all-reduces,
    `OpCosts`), each pipeline message's idle-network time (latency + bytes / rate) forward
    (s -> s + 1) and backward (s + 1 -> s), and stage 0's optimizer step (s)."""
    plan, cluster = outcome.plan, outcome.cluster
    costs = OpCosts(cluster, prepared.workload, prepared.compute, plan.tp)
    p, layers = plan.pp, plan.layers_per_stage
    caps, size = link_capacities(cluster), prepared.workload.pp_message_bytes(plan.tp) * plan.tp
    fwd, bwd, r_fwd, r_bwd = [], [], [], []
    for s in range(p):
        node = cluster.node(plan.entity_gpus(s, 0)[0].node)
        for out, backward in ((fwd, False), (bwd, True)):
            out.append(costs.chunk_compute_s(node, layers[s], s == 0, s == p - 1, backward)
                       + costs.tp_comm_s(node, layers[s], backward))
        if s < p - 1:
            transport = plan.transport_of(GroupKind.PIPELINE, plan.rank(s, 0, 0))
            for out, a, b in ((r_fwd, s, s + 1), (r_bwd, s + 1, s)):
                path = group_path(cluster, transport, plan.entity_gpus(a, 0),
                                  plan.entity_gpus(b, 0), caps)
                out.append(path.latency_s + size / path.idle_rate_bytes_per_s)
    node = cluster.node(plan.entity_gpus(0, 0)[0].node)
    shard = plan.dp if plan.optimizer.sharded else 1
    optimizer = costs.optimizer_s(node, costs.stage_params(layers, p, 0) / plan.tp / shard)
    return fwd, bwd, r_fwd, r_bwd, optimizer


def _predicted_added_s(nominal: tuple, slow: tuple, m: int) -> float:
    """Seconds a slow stage 0 adds to 1F1B (docs/cost_models.md, "Hardware variability").

    Q is a micro-batch's round trip from stage 0's send of its activation to the arrival of its
    gradient, through stages 1..p-1 of an idle pipeline. Each send is a rendezvous: a stage that
    posts its receive after the sender sent waits the message's r. Nominal: the slowest
    stage's cycle C paces the pipeline (a middle stage waits for both its inputs); stage 0 ends
    its last backward at F_0 + Q + (m - 1) C + B_0. With stage 0 the slowest (F', B'), it runs
    F' once, waits Q for the first gradient (its other p - 1 warm-up forwards fit inside), runs
    m - p pairs B' + F', each backward but the first waiting r, and the last activation's round
    trip Q covers its p - 1 cool-down backwards: 2 Q + (m - p + 1)(F' + B') + (m - p - 1) r.
    What follows, stage 0's reduce-scatter over the replicas (the slow replica arriving last),
    the embedding all-reduce, its optimizer step and its all-gather, differs by the slow step
    alone. Left out, alike in both runs: the last micro-batch's gradient sends share their NICs
    with the reduce-scatters of the stages it leaves (47 and 48 ms here)."""
    fwd, bwd, r_fwd, r_bwd, optimizer = nominal
    slow_f, slow_b, _, _, slow_optimizer = slow
    p = len(fwd)
    q = sum(fwd[1:]) + sum(bwd[1:]) + sum(r_fwd) + sum(r_bwd)
    cycles = [fwd[0] + bwd[0] + r_bwd[0], fwd[-1] + bwd[-1] + r_fwd[-1]] + [
        fwd[s] + bwd[s] + r_fwd[s - 1] + r_bwd[s] for s in range(1, p - 1)]
    nominal_end = fwd[0] + q + (m - 1) * max(cycles) + bwd[0]
    # Stage 0 is the slowest and its warm-up and cool-down hide inside the round trips.
    assert slow_f[0] + slow_b[0] + r_bwd[0] > max(cycles[1:])
    assert q > (p - 1) * max(slow_f[0], slow_b[0] + r_bwd[0])
    slow_end = 2 * q + (m - p + 1) * (slow_f[0] + slow_b[0]) + (m - p - 1) * r_bwd[0]
    return slow_end - nominal_end + slow_optimizer - optimizer


@pytest.mark.parametrize("form", ["benchmark", "speed-factor"])
def test_straggler_adds_what_its_stage_predicts_at_9216_gpus(form):
    """Megatron-LM's placement keeps its equal split, so the slow node's stage 0 (embedding
    included) sets the pace. The naive m (F' + B' - F_0 - B_0) gives 4.58 s for the benchmark's
    form against the engine's 3.17 s: the nominal stage 0 idles 5.9 ms a cycle behind the middle
    stages, and the slow one's warm-up and cool-down hide inside the round trips."""
    prepared, before = _nominal_megatron()
    slow, after = _run(form, "megatron")
    assert after.plan.entity_gpus(0, 0)[0].node == FIRST_NODE[form]
    assert after.plan.layers_per_stage == before.plan.layers_per_stage == (6,) * 16
    predicted = _predicted_added_s(_stage_ops(prepared, before), _stage_ops(slow, after),
                                   MICROBATCHES)
    added = after.result.iteration_time_s - before.result.iteration_time_s
    assert added > 0.05 * before.result.iteration_time_s
    assert added == pytest.approx(predicted, rel=0.02)
    if form == "speed-factor":  # the report names the stage and the engine's cost
        (cost,) = straggler_costs(slow, after)
        assert cost.stages == (0,)
        assert cost.added_s == pytest.approx(added, rel=0.02)


def test_plan_ranks_the_robust_placement_first_on_the_straggler():
    """`plan` with the degrees fixed, every candidate simulated: Holmes (NIC-aware placement,
    adaptive partition) first, its slow stage 0 given fewer layers (5 + 7, where the cluster
    without the straggler gets the equal split) beating the same placement's equal split, and
    Megatron-LM's placement last."""
    search = ("search: {tensor: [8], pipeline: [16], micro_batch_size: [1], schedule: [1f1b], "
              "recompute: [full], sequence_parallel: [true], optimizer: [distributed], "
              "policies: [holmes, holmes-no-adaptive-partition, megatron], top_k: 3}\n")
    ranked = planner.search(prepare_text(_text("benchmark") + search), jobs=1)
    by = {c.policy: c for c in ranked.candidates}
    assert [c.policy for c in ranked.candidates] == ["holmes", "holmes-no-adaptive-partition",
                                                     "megatron"]
    assert all(c.simulated for c in ranked.candidates)
    assert ranked.baseline.policy == "megatron" and ranked.speedup(by["holmes"]) > 1.25
    plan, _ = plan_policy(prepare_text(_text("benchmark")), "holmes")
    assert plan.entity_gpus(0, 0)[0].node == FIRST_NODE["benchmark"]
    assert by["holmes"].layers_per_stage[0] < by["holmes-no-adaptive-partition"].layers_per_stage[0]
    assert plan_policy(prepare_text(_text(None)), "holmes")[0].layers_per_stage == (6,) * 16
