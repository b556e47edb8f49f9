"""The MoE set from the Megatron-Core MoE Model Zoo (Mixtral 8x22B on 128 H100s): its rows carry
their sources and launch settings, each rendered scenario loads with the source's settings, the
published TFLOP/s are in holmes-sim's reporting formula, and the one row holmes-sim cannot run is
reported with its reason."""

from __future__ import annotations

import json

import pytest

from holmes_sim.errors import ScenarioError
from holmes_sim.prepare import prepare
from holmes_sim.spec.load import load_scenario_text
from holmes_sim.validation import moe_model_zoo
from holmes_sim.validation.published import PUBLISHED_DIR, case_name, cases, evaluate, scenario_text

STEM = "megatron_moe_h100"
ZOO_COMMIT = "e8650517d60d71ab73fc6b3b0388cac4ba435181"
# best_practice/mixtral/run_mixtral_8x22B.sh at ZOO_COMMIT: the TFLOP/s each launch should reach.
PUBLISHED_TFLOPS = {"dropless": 445, "force-balanced": 465, "token-drop": 470, "fp8-blockwise": 560}


def _data():
    return json.loads((PUBLISHED_DIR / f"{STEM}.json").read_text())


def _cases():
    return {c.name: c for c in cases() if c.dataset == STEM}


def test_rows_parse_with_their_source_and_launch_settings():
    data = _data()
    assert moe_model_zoo.is_zoo_dataset(data)
    source = data["sources"]["moe-model-zoo"]
    assert ZOO_COMMIT in source["measurements"] and "run_mixtral_8x22B.sh" in source["measurements"]
    assert "runtime.conf" in source["software"] and "Mixtral-8x22B.yaml" in source["software"]
    assert {r["variant"]: r["measured_tflops_per_gpu"] for r in data["rows"]} == PUBLISHED_TFLOPS
    for row in data["rows"]:
        # runtime.conf's Mixtral-8x22B line and the YAML's --expert-tensor-parallel-size 1
        launch = (row["tp"], row["pp"], row["ep"], row["cp"], row["vp"], row["micro_batch"],
                  row["global_batch"], row["seq_length"], row["etp"], row["dispatcher"])
        assert launch == (2, 8, 8, 1, 7, 1, 256, 4096, 1, "alltoall"), row
        assert row["gpus"] == 16 * data["common"]["gpus_per_node"]
        assert (row["gpus"] // (row["tp"] * row["pp"])) % row["ep"] == 0


@pytest.mark.parametrize("variant", sorted(PUBLISHED_TFLOPS))
def test_each_rendered_scenario_loads_with_the_sources_settings(variant):
    data = _data()
    row = next(r for r in data["rows"] if r["variant"] == variant)
    scenario = load_scenario_text(scenario_text(data, row))
    m, t, p = scenario.model, scenario.training, scenario.parallel
    assert (m.num_layers, m.hidden_size, m.num_experts, m.moe_router_topk) == (56, 6144, 8, 2)
    assert m.seq_length == 4096 and m.moe_expert_capacity_factor == row["capacity_factor"]
    assert (p.tensor, p.pipeline, p.expert, p.context) == (2, 8, 8, 1)
    assert (p.schedule, p.virtual_stages) == ("interleaved", 7)
    assert (t.global_batch_size, t.micro_batch_size, t.recompute) == (256, 1, "none")
    assert t.precision == row["precision"]
    assert t.sequence_parallel and t.distributed_optimizer and t.flash_attention
    assert t.overlap_grad_reduce and t.overlap_param_gather and t.overlap_p2p_comm
    assert t.grad_reduce_in_fp32
    # sbatch_benchmarking.sh adds --tp-comm-overlap for bf16 only
    assert t.tp_comm_overlap == (row["precision"] == "bf16")
    assert "{count: 16, gpu: h100-sxm, gpus_per_node: 8, intra_node: nvlink4" in scenario_text(data, row)


def test_every_row_says_its_expert_layout_is_approximated():
    """ETP 1 with TP 2 runs as ETP = TP, and the scenario file says so; ETP = TP needs no note."""
    data = _data()
    for row in data["rows"]:
        note = moe_model_zoo.approximation(row)
        assert note and "expert tensor parallelism 1 simulated as TP 2" in note
        assert f"# Approximation: {note}." in scenario_text(data, row)
    same = dict(data["rows"][0], etp=2)
    assert moe_model_zoo.approximation(same) is None
    assert "Approximation" not in moe_model_zoo.render_scenario(data, same)


def test_published_tflops_are_in_the_simulators_reporting_formula():
    """Megatron-LM logs num_floating_point_operations / (step x GPUs): the step derived from it
    gives back the published TFLOP/s through Workload.megatron_tflops_per_gpu."""
    case = _cases()["mixtral-8x22b-128gpu-force-balanced"]
    row = next(r for r in _data()["rows"] if r["variant"] == "force-balanced")
    workload = prepare(case.scenario).workload
    tflops = workload.megatron_tflops_per_gpu(row["seconds_per_iteration_derived"], 128)
    assert tflops == pytest.approx(465, rel=2e-4)


def test_blockwise_fp8_row_is_recorded_not_simulated():
    case = _cases()["mixtral-8x22b-128gpu-fp8-blockwise"]
    assert case.not_simulated == "needs the blockwise FP8 recipe" and case.scenario.exists()
    with pytest.raises(ScenarioError, match="not simulated"):
        evaluate(case)
    assert sum(c.not_simulated is None for c in _cases().values()) == 3


def test_force_balanced_row_is_within_the_issue_tolerance():
    """The row whose routing is the catalog default (imbalance 1): within 20% of 465 TFLOP/s."""
    result = evaluate(_cases()["mixtral-8x22b-128gpu-force-balanced"])
    assert result.error == pytest.approx(465 / result.predicted_tflops_per_gpu - 1)
    assert abs(result.error) < 0.20, result.error


def test_case_names_are_unique_and_match_the_files():
    data = _data()
    names = [case_name(data, r) for r in data["rows"]]
    assert len(names) == len(set(names)) == 4
    assert {p.stem for p in (PUBLISHED_DIR / "scenarios" / STEM).glob("*.yaml")} == set(names)
