"""`analytic.iteration_floor_s` is a lower bound of the estimate on searched plans, and with
it Holmes keeps the split it kept by estimating both."""

from __future__ import annotations

from dataclasses import replace

import pytest

from holmes_sim.bundled import bundled_scenario
from holmes_sim.errors import HolmesError
from holmes_sim.estimate import analytic
from holmes_sim.policies.base import equal_partition
from holmes_sim.policies.partition import StageTimer, adaptive_partition
from holmes_sim.prepare import prepare
from holmes_sim.search import planner


def _plans(name: str, count: int):
    """(plan, cluster, prepared layout) of every policy of `count` sampled layouts, and for
    Holmes also its plan with the equal split."""
    prepared = prepare(bundled_scenario(name))
    spec = prepared.scenario.search
    grid = list(planner.layouts(prepared, spec))
    for layout in grid[::max(1, len(grid) // count)]:
        p = planner.prepared_for(prepared, layout)
        for policy in spec.policies:
            try:
                plan, cluster = planner._plan(p, policy, layout)
            except HolmesError:
                continue
            yield plan, cluster, p
            equal = tuple(equal_partition(p.workload.num_layers, plan.pp * plan.num_chunks))
            if policy == "holmes" and plan.layers_per_stage != equal:
                yield replace(plan, layers_per_stage=equal), cluster, p


@pytest.mark.parametrize("name", ["mixed_ib_eth", "moe_mixed_nics", "llama3_70b_h100",
                                  "straggler", "large_175b_1024"])
def test_floor_is_below_the_estimate(name):
    checked = 0
    for plan, cluster, p in _plans(name, 15):
        # Without stage 0's tail (a reach the chains alone pass), then with it.
        chains = analytic.iteration_floor_s(plan, cluster, p.workload, p.compute, reach=0.0)
        floor = analytic.iteration_floor_s(plan, cluster, p.workload, p.compute)
        est = analytic.estimate_iteration(plan, cluster, p.workload, p.compute).iteration_s
        assert 0.0 < chains < floor <= est, (plan.tp, plan.pp, plan.num_chunks,
                                             plan.layers_per_stage)
        checked += 1
    assert checked >= 15


@pytest.mark.parametrize("name", ["mixed_ib_eth", "straggler", "large_175b_1024"])
def test_holmes_keeps_the_split_of_the_smaller_estimate(name):
    """The adaptive split unless the equal split's estimate is smaller (the first on a tie) and
    the equal split fits in memory or the adaptive one does not either."""
    prepared = prepare(bundled_scenario(name))
    grid = list(planner.layouts(prepared, prepared.scenario.search))
    for layout in grid[::max(1, len(grid) // 15)]:
        p = planner.prepared_for(prepared, layout)
        try:
            plan, cluster = planner._plan(p, "holmes", layout)
        except HolmesError:
            continue
        request = p.request(cluster)
        timer = StageTimer(request, plan.rank_to_gpu, plan.groups, plan.optimizer)
        adaptive = adaptive_partition(timer)
        equal = tuple(equal_partition(p.workload.num_layers, plan.pp * plan.num_chunks))
        kept = min((adaptive, equal), key=lambda layers: analytic.estimate_iteration(
            replace(plan, layers_per_stage=layers), cluster, p.workload, p.compute).iteration_s)
        if not timer.memory(equal).fits and timer.memory(adaptive).fits:
            kept = adaptive
        assert plan.layers_per_stage == kept, layout
