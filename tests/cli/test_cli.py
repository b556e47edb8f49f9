"""The command line: the default scenario end to end, JSON output, and exit 2 on bad input."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from tests.conftest import SCENARIOS, small_scenario

runner = CliRunner()


@pytest.mark.parametrize("command", ["run", "check", "scenarios", "validate", "sweep"])
def test_help_of_every_command(command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0 and "Usage" in result.output


def test_run_default_scenario_writes_json(tmp_path):
    out = tmp_path / "out.json"
    result = runner.invoke(app, ["run", str(SCENARIOS / "mixed_ib_eth.yaml"), "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["scenario"]["name"] == "mixed-ib-eth"
    names = [r["policy"] for r in doc["results"]]
    assert set(names) == {"megatron", "holmes", "holmes-no-nic-aware-order", "holmes-no-nic-selection",
                          "holmes-no-adaptive-partition", "holmes-no-overlap", "all-ib", "all-ethernet"}
    times = [r["iteration_time_s"] for r in doc["results"]]
    assert times == sorted(times)  # fastest first
    for r in doc["results"]:
        for key in ("policy", "iteration_time_s", "tflops_per_gpu", "samples_per_s", "tokens_per_s",
                    "mfu", "bubble_fraction", "breakdown_s", "layers_per_stage", "peak_memory_gib",
                    "fits_memory"):
            assert key in r
    # the table shows the same policies, fastest first
    rows = [line.split("│")[1].strip().removesuffix(" *") for line in result.output.splitlines()
            if line.startswith("│")]
    assert rows == names


def test_run_selected_policies_and_seed(tmp_path):
    out = tmp_path / "o.json"
    result = runner.invoke(app, ["run", "mixed_ib_eth", "-p", "holmes", "-p", "megatron",
                                 "--seed", "7", "--json", str(out), "-q"])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert {r["policy"] for r in doc["results"]} == {"holmes", "megatron"}
    assert doc["scenario"]["seed"] == 7
    holmes = next(r for r in doc["results"] if r["policy"] == "holmes")
    assert holmes["speedup_over_megatron"] > 1.0


def test_json_is_byte_identical_across_runs(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path in (a, b):
        assert runner.invoke(app, ["run", "mixed_ib_roce", "--json", str(path), "-q"]).exit_code == 0
    assert a.read_bytes() == b.read_bytes()


def test_bad_input_exits_2_with_one_line_naming_the_field(write_scenario, tmp_path):
    path = write_scenario(small_scenario().replace("micro_batch_size: 1", "micro_batch_size: 0"))
    out = tmp_path / "keep.json"
    out.write_text("previous results")
    result = runner.invoke(app, ["run", str(path), "--json", str(out)])
    assert result.exit_code == 2
    assert "training.micro_batch_size" in result.output and "at least 1" in result.output
    assert "Traceback" not in result.output
    assert out.read_text() == "previous results"  # nothing the user had is lost


def test_malformed_yaml_and_missing_file_exit_2(write_scenario):
    assert runner.invoke(app, ["run", str(write_scenario("a: [1, 2"))]).exit_code == 2
    result = runner.invoke(app, ["check", "no/such/file.yaml"])
    assert result.exit_code == 2 and "cannot read scenario file" in result.output


def test_unknown_policy_flag_exits_2():
    result = runner.invoke(app, ["run", "mixed_ib_eth", "-p", "holmez"])
    assert result.exit_code == 2 and "unknown policy 'holmez'" in result.output


def test_check_reports_plans_without_simulating():
    result = runner.invoke(app, ["check", "two_clusters_39b"])
    assert result.exit_code == 0, result.output
    assert "ok:" in result.output and "TP 8 x PP 2 x DP 8" in result.output


def test_check_and_run_name_the_expert_parallel_degrees():
    result = runner.invoke(app, ["check", "moe_mixed_nics"])
    assert result.exit_code == 0, result.output
    assert "TP 8 x PP 2 x DP 4 x EP 4," in result.output
    from holmes_sim.prepare import prepare
    from holmes_sim.report.tables import layout_label
    from tests.conftest import SCENARIOS

    prepared = prepare(SCENARIOS / "moe_mixed_nics.yaml")
    etp = replace(prepared.scenario.parallel, expert_tensor=1)
    prepared = replace(prepared, scenario=replace(prepared.scenario, parallel=etp))
    assert layout_label(prepared) == "TP 8 PP 2 DP 4 EP 4 ETP 1"


def test_scenarios_lists_every_bundled_file():
    result = runner.invoke(app, ["scenarios"])
    assert result.exit_code == 0
    for path in SCENARIOS.glob("*.yaml"):
        assert path.stem in result.output


def test_check_fails_when_the_model_does_not_fit(write_scenario):
    # 7.5B-class layers, no recomputation, big micro-batches on one pipeline stage: far over 80 GiB
    text = small_scenario(nodes_ib=1, tp=8, pp=1, layers=32, hidden=4096, heads=32, seq=2048,
                          global_batch=16, micro=16, policies="[megatron]")
    result = runner.invoke(app, ["check", str(write_scenario(text))])
    assert result.exit_code == 2
    assert "does not fit in GPU memory" in result.output and "training.micro_batch_size" in result.output
    run = runner.invoke(app, ["run", str(write_scenario(text))])
    assert run.exit_code == 0 and "OOM" in run.output and "do not fit" in run.output


def test_plans_are_written_for_real_runs(tmp_path):
    from holmes_sim.plan import Plan

    result = runner.invoke(app, ["run", "mixed_ib_roce", "-p", "holmes", "--plans", str(tmp_path), "-q"])
    assert result.exit_code == 0, result.output
    plan = Plan.from_json((tmp_path / "plan_holmes.json").read_text())
    assert plan.policy == "holmes" and plan.world_size == 64 and plan.pp == 2
