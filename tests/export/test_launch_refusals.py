"""No launch that no framework starts: a GPipe plan (Megatron-LM has no GPipe schedule) and the
plans of Megatron-LLaMA and Megatron-DeepSpeed (whose own arguments the export does not write;
upstream Megatron-LM refuses `--overlapped-distributed-optimizer` and `--deepspeed
--zero-stage 1`) get no launch folder, with the reason on the command's output."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.errors import PlanError
from holmes_sim.export.launch import launch_files
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from tests.conftest import small_scenario

FORKS = "[megatron, megatron-llama, megatron-llama-2023-08, megatron-deepspeed, holmes]"


def _listing(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def test_a_gpipe_plan_gets_no_launch_files(write_scenario):
    prepared = prepare(write_scenario(small_scenario(nodes_ib=2, pp=2, schedule="gpipe")))
    for policy in ("megatron", "holmes"):
        plan, cluster = plan_policy(prepared, policy)
        with pytest.raises(PlanError, match="no launch files: Megatron-LM has no GPipe schedule"):
            launch_files(plan, cluster, prepared.workload, "bf16")


def _run_plans(path, tmp_path):
    """`run PATH --plans tmp_path/plans` (exit 0): its output on one line, and the folder."""
    out = tmp_path / "plans"
    result = CliRunner().invoke(app, ["run", str(path), "-q", "--plans", str(out)])
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split()), out


def test_run_plans_simulates_gpipe_and_says_why_it_writes_no_launch(tmp_path, write_scenario):
    path = write_scenario(small_scenario(nodes_ib=2, pp=2, schedule="gpipe"))
    message, out = _run_plans(path, tmp_path)
    assert ("note: no launch files for holmes, megatron: Megatron-LM has no GPipe schedule "
            "(get_forward_backward_func, megatron/core/pipeline_parallel/schedules.py, runs no "
            "pipelining, 1F1B or interleaved)") in message
    assert _listing(out) == ["plan_holmes.json", "plan_megatron.json"]


@pytest.mark.parametrize("policy", ["megatron-llama", "megatron-llama-2023-08", "megatron-deepspeed"])
def test_forks_the_export_does_not_write_for_get_no_launch(write_scenario, policy):
    prepared = prepare(write_scenario(small_scenario(nodes_ib=2, pp=2, policies=FORKS)))
    plan, cluster = plan_policy(prepared, policy)
    with pytest.raises(PlanError, match="no launch files: the export writes arguments for upstream "
                                        "Megatron-LM and the Holmes fork"):
        launch_files(plan, cluster, prepared.workload, "bf16")


def test_run_plans_writes_launches_only_for_megatron_and_holmes(tmp_path, write_scenario):
    """Before, megatron-llama's and megatron-deepspeed's folders held `megatron_args.txt` with
    `--overlapped-distributed-optimizer` and `--deepspeed --zero-stage 1`, which upstream
    Megatron-LM refuses, and a README saying to start them with upstream Megatron-LM."""
    path = write_scenario(small_scenario(nodes_ib=2, pp=2, policies=FORKS))
    message, out = _run_plans(path, tmp_path)
    assert ("note: no launch files for megatron-llama, megatron-llama-2023-08: the export writes "
            "arguments for upstream Megatron-LM and the Holmes fork (policies megatron and "
            "holmes), not for Megatron-LLaMA: upstream Megatron-LM refuses its "
            "--overlapped-distributed-optimizer") in message
    assert ("note: no launch files for megatron-deepspeed: the export writes arguments for "
            "upstream Megatron-LM and the Holmes fork (policies megatron and holmes), not for "
            "Megatron-DeepSpeed: its ZeRO-1 run needs --deepspeed with a DeepSpeed "
            "configuration file") in message
    assert [p for p in _listing(out) if not p.startswith("plan_")] == ["holmes", "megatron"]
    assert len([p for p in _listing(out) if p.startswith("plan_")]) == 5
    written = "".join(f.read_text() for f in out.glob("*/*") if f.is_file())
    assert "--overlapped-distributed-optimizer" not in written and "--deepspeed" not in written


def test_a_refused_folder_from_an_earlier_run_is_named_stale(tmp_path, write_scenario):
    path = write_scenario(small_scenario(nodes_ib=2, pp=2))
    out = tmp_path / "plans"
    assert CliRunner().invoke(app, ["run", str(path), "-q", "--plans", str(out)]).exit_code == 0
    gpipe = write_scenario(small_scenario(nodes_ib=2, pp=2, schedule="gpipe"))
    result = CliRunner().invoke(app, ["run", str(gpipe), "-q", "--plans", str(out)])
    assert result.exit_code == 0, result.output
    assert (f"note: --plans {out} also holds holmes, megatron from an earlier run"
            in " ".join(result.output.split()))


def test_plan_export_of_forks_alone_is_refused_before_the_search(tmp_path, write_scenario):
    search = "search: {policies: [megatron-llama, megatron-deepspeed], tensor: [8], pipeline: [2]}\n"
    path = write_scenario(small_scenario(nodes_ib=2, pp=2, extra=search))
    out = tmp_path / "export"
    result = CliRunner().invoke(app, ["plan", str(path), "--jobs", "1", "--export", str(out)])
    message = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert message.startswith("error: --export: no policy of search.policies gets launch files: "
                              "megatron-llama: the export writes arguments for upstream")
    assert "add holmes or megatron to search.policies, or drop --export" in message
    assert not out.exists()


def test_plan_export_of_gpipe_plans_alone_makes_no_folder(tmp_path, write_scenario):
    search = "search: {schedule: [gpipe], tensor: [8], pipeline: [2], top_k: 2}\n"
    path = write_scenario(small_scenario(nodes_ib=2, pp=2, extra=search))
    out = tmp_path / "export"
    result = CliRunner().invoke(app, ["plan", str(path), "--jobs", "1", "--export", str(out)])
    assert result.exit_code == 0, result.output
    assert "Megatron-LM has no GPipe schedule" in " ".join(result.output.split())
    assert not out.exists()  # an empty folder of no launches was left before
