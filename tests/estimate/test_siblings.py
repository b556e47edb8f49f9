"""`analytic.Siblings`: the estimates of one plan's placements (Holmes' tied class orders)
share a stage's prices where its stage, `_alike` and DP topology agree, and each gets exactly
what it gets alone."""

from __future__ import annotations

import pytest

from holmes_sim.estimate import analytic
from holmes_sim.memo import clear_identity_memos
from holmes_sim.policies.base import equal_partition
from holmes_sim.policies.holmes import HolmesPolicy
from holmes_sim.prepare import prepare

_SCENARIO = """name: siblings
fabrics: [{name: ib-a, type: ib}, {name: roce-a, type: roce}, {name: ib-h, type: ib},
          {name: roce-h, type: roce}]
clusters:
  - name: ampere
    nodes:
      - {name: a-ib, count: 2, gpu: a100-80gb, nics: [{type: ib, model: ib-hdr, count: 4,
         fabric: ib-a}, {type: ethernet, model: eth-100g}]}
      - {name: a-roce, gpu: a100-80gb, nics: [{type: roce, model: roce-200g, count: 2,
         fabric: roce-a}, {type: ethernet, model: eth-100g}]}
      - {name: a-eth, gpu: a100-80gb, nics: [{type: ethernet, model: eth-100g, count: 2}]}
  - name: hopper
    nodes:
      - {name: h-ib, count: 2, gpu: h100-sxm, nics: [{type: ib, model: connectx-7, count: 8,
         fabric: ib-h}, {type: ethernet, model: eth-100g}]}
      - {name: h-roce, gpu: h100-sxm, nics: [{type: roce, model: roce-200g, count: 8,
         fabric: roce-h}, {type: ethernet, model: eth-100g}]}
      - {name: h-eth, gpu: h100-sxm, nics: [{type: ethernet, model: eth-100g, count: 2}]}
inter_cluster_links: [{clusters: [ampere, hopper], bandwidth_gbit_per_s: 400, latency_us: 100}]
model: {num_layers: 16, hidden_size: 4096, num_attention_heads: 32, num_query_groups: 8,
        seq_length: 8192, ffn_hidden_size: 14336, swiglu: true}
training: {global_batch_size: 64, micro_batch_size: 1, flash_attention: true,
           sequence_parallel: true}
parallel: PARALLEL
"""
"""IB, RoCE and Ethernet-only nodes of two GPU models in two clusters (the six node kinds of
docs/performance.md's 960-GPU search, 64 GPUs): at PP 4 six class orders tie, with estimates
apart."""


def _request(write_scenario, parallel: str):
    return prepare(write_scenario(_SCENARIO.replace("PARALLEL", parallel))).request()


def _plans(request):
    """Holmes' plan of every tied class order with the equal split."""
    policy = HolmesPolicy()
    equal = tuple(equal_partition(request.workload.num_layers, request.pp * request.num_chunks))
    return [policy._layout(request, *ranks)(equal) for ranks in policy.orders(request)]


@pytest.mark.parametrize("parallel", [
    "{tensor: 4, pipeline: 4}", "{tensor: 2, pipeline: 4, context: 2}",
    "{tensor: 2, pipeline: 4, schedule: interleaved, virtual_stages: 2}",
    "{tensor: 2, pipeline: 2, context: 2, schedule: interleaved, virtual_stages: 2}"])
def test_sibling_estimates_equal_their_estimates_alone(write_scenario, parallel, monkeypatch):
    request = _request(write_scenario, parallel)
    priced = (request.cluster, request.workload, request.compute)
    made = []
    new_stage = analytic._Estimator._new_stage
    monkeypatch.setattr(analytic._Estimator, "_new_stage",
                        lambda self, *a: made.append(a) or new_stage(self, *a))
    clear_identity_memos()
    analytic._WALKS.clear()
    siblings = analytic.Siblings()
    together = [analytic.estimate_iteration(plan, *priced, siblings) for plan in _plans(request)]
    assert len(together) > 2
    shared, made[:] = len(made), []
    clear_identity_memos()  # no walk, view or estimate of the estimates above is found again
    analytic._WALKS.clear()
    alone = [analytic.estimate_iteration(plan, *priced) for plan in _plans(request)]
    assert together == alone
    assert shared < len(made)  # stages of one placement priced once for all


def test_moe_estimates_share_nothing():
    """Where a stage's MoE layers start is not in `_alike`: MoE estimates keep their own."""
    from holmes_sim.bundled import bundled_scenario
    from holmes_sim.runner import plan_policy

    p = prepare(bundled_scenario("moe_mixed_nics"))
    plan, cluster = plan_policy(p, "holmes")
    estimator = analytic._Estimator(plan, cluster, p.workload, p.compute, analytic.Siblings())
    assert estimator._siblings is None


def test_holmes_shares_prices_among_the_plans_of_one_split(write_scenario, monkeypatch):
    """Every estimate Holmes makes to choose among its class orders (their equal splits, the
    leading ones' searched splits) shares one `Siblings` with the other plans of its split."""
    from holmes_sim.policies import holmes

    request = _request(write_scenario, "{tensor: 2, pipeline: 4, context: 2}")
    calls = []
    real = holmes.estimate_iteration
    monkeypatch.setattr(holmes, "estimate_iteration", lambda plan, *a: calls.append(
        (plan.layers_per_stage, plan.rank_to_gpu, a[3] if len(a) > 3 else None)) or real(plan, *a))
    HolmesPolicy().plan(request)
    assert None not in {shared for _, _, shared in calls}
    by_split = {}
    for layers, _, shared in calls:
        assert by_split.setdefault(layers, shared) is shared
    orders = {ranks for _, ranks, _ in calls}
    assert len(orders) > 2 and len(calls) > len(orders)  # the leading orders' own splits
