"""The launch README says when a plan was simulated with Megatron-LM 2021-2022's scatter-gather of
pipeline messages, which Megatron-Core (what the launch runs) no longer does."""

from __future__ import annotations

import pytest

from holmes_sim.export.launch import launch_files
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from tests.conftest import small_scenario


def _readme(write_scenario, tp: int, training: str) -> str:
    text = small_scenario(nodes_ib=2, tp=tp, pp=2).replace(
        "micro_batch_size: 1}", f"micro_batch_size: 1{training}}}")
    prepared = prepare(write_scenario(text))
    plan, cluster = plan_policy(prepared, "megatron")
    return " ".join(launch_files(plan, cluster, prepared.workload, "bf16").files["README.md"]
                    .split())


def test_a_scatter_gathered_plan_is_named_in_the_readme(write_scenario):
    readme = _readme(write_scenario, 8, ", scatter_gather_tensors_in_pipeline: true")
    assert "simulated with pipeline messages split over the TP group" in readme
    assert "the launch moves 8 times the pipeline bytes simulated" in readme


@pytest.mark.parametrize("tp, training", [
    (8, ""), (8, ", scatter_gather_tensors_in_pipeline: true, sequence_parallel: true"),
    (1, ", scatter_gather_tensors_in_pipeline: true")])
def test_no_note_where_the_launch_sends_what_was_simulated(write_scenario, tp, training):
    assert "pipeline messages split over the TP group" not in _readme(write_scenario, tp, training)
