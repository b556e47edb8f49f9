"""Launch files only for schedules Megatron-LM starts: interleaving at pipeline 2 needs p2p overlap
(megatron/training/arguments.py `validate_args`), which the planner gives such layouts."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.errors import PlanError, ScenarioError
from holmes_sim.export.launch import launch_files
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from holmes_sim.schedule import check_megatron_interleaving
from tests.conftest import small_scenario

OVERLAP = ("micro_batch_size: 1}", "micro_batch_size: 1, overlap_p2p_comm: true}")


def interleaved_pp2(overlap: bool, extra: str = "") -> str:
    text = small_scenario(nodes_ib=2, tp=8, pp=2, layers=16, schedule="interleaved", virtual=2,
                          extra=extra)
    return text.replace(*OVERLAP) if overlap else text


@pytest.mark.parametrize(("kind", "pp", "overlap", "refused"), [
    ("interleaved", 2, False, True), ("interleaved", 2, True, False),
    ("interleaved", 3, False, False), ("1f1b", 2, False, False), ("gpipe", 2, False, False),
])
def test_megatron_refuses_only_blocking_interleaving_at_pipeline_2(kind, pp, overlap, refused):
    if refused:
        with pytest.raises(ScenarioError, match="set training.overlap_p2p_comm: true"):
            check_megatron_interleaving(kind, pp, overlap)
    else:
        check_megatron_interleaving(kind, pp, overlap)


def test_launch_files_are_refused_where_megatron_lm_would_not_start(write_scenario):
    prepared = prepare(write_scenario(interleaved_pp2(overlap=False)))
    plan, cluster = plan_policy(prepared, "megatron")
    with pytest.raises(PlanError, match="no launch files: Megatron-LM refuses the interleaved"):
        launch_files(plan, cluster, prepared.workload, "bf16")
    prepared = prepare(write_scenario(interleaved_pp2(overlap=True)))
    plan, cluster = plan_policy(prepared, "megatron")
    args = launch_files(plan, cluster, prepared.workload, "bf16").files["megatron_args.txt"]
    assert "--pipeline-model-parallel-size 2" in args and "--no-overlap-p2p-communication" not in args


def test_run_plans_writes_the_plans_and_says_why_there_are_no_launch_files(tmp_path,
                                                                          write_scenario):
    path = write_scenario(interleaved_pp2(overlap=False))
    out = tmp_path / "plans"
    result = CliRunner().invoke(app, ["run", str(path), "-q", "-p", "megatron", "-p", "all-ib",
                                      "--plans", str(out)])
    message = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "note: no launch files for megatron: Megatron-LM refuses the interleaved" in message
    assert "note: no launch files for all-ib: a reference on a hypothetical network" in message
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "plan_all-ib.json", "plan_megatron.json"]


def test_plan_interleaves_at_pipeline_2_with_p2p_overlap_and_exports_it(tmp_path, write_scenario):
    search = ("search: {tensor: [8], pipeline: [2], micro_batch_size: [1], recompute: [none], "
              "schedule: [interleaved], virtual_stages: [2]}\n")
    path = write_scenario(interleaved_pp2(overlap=False, extra=search))
    out = tmp_path / "launch"
    result = CliRunner().invoke(app, ["plan", str(path), "--jobs", "1", "--json", "-",
                                      "--export", str(out)])
    assert result.exit_code == 0, result.output
    best = json.loads(result.stdout)["candidates"][0]
    assert (best["pp"], best["schedule"]) == (2, "interleaved")
    args = (out / f"1-{best['policy']}" / "megatron_args.txt").read_text()
    assert "--num-layers-per-virtual-pipeline-stage 4" in args  # 16 layers, 2 x 2 chunks
    assert "--no-overlap-p2p-communication" not in args
