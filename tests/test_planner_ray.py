"""`holmes-sim plan --ray auto` ranks exactly as the local run (a local Ray instance)."""

from __future__ import annotations

import pytest

from holmes_sim import planner
from holmes_sim.prepare import prepare

from .test_planner import SMALL

ray = pytest.importorskip("ray")


def _ranking(result):
    return [(c.policy, c.layout, c.predicted_iteration_s, c.simulated) for c in result.candidates]


def test_ray_search_ranks_as_the_local_one(write_scenario):
    prepared = prepare(write_scenario(SMALL))
    local = planner.search(prepared, jobs=1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        remote = planner.search(prepared, ray="auto")
    finally:
        ray.shutdown()
    assert _ranking(remote) == _ranking(local)
    assert remote.evaluated == local.evaluated and remote.baseline == local.baseline
