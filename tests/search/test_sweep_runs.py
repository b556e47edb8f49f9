"""`holmes-sim sweep` as a whole: each point runs its own policy list, a sweep with no feasible
point exits 2 writing nothing, the output folder is replaced all at once or not at all, the
title names the scenario as given, and a narrow terminal never cuts a value or a number."""

from __future__ import annotations

import csv
import io
import json

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.errors import ScenarioError
from holmes_sim.report.files import OutputError
from holmes_sim.report import plots
from holmes_sim.report.tables import print_table
from holmes_sim.search.sweep import (SWEEP_FILES, SweepAxis, SweepResult, run_sweep, sweep_table,
                                     write_sweep)
from tests.conftest import SCENARIOS

DEFAULT = SCENARIOS / "mixed_ib_eth.yaml"


def _scenario(tmp_path, policies: list[str], source=DEFAULT):
    data = yaml.safe_load(source.read_text())
    data["policies"] = policies
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _sweep(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["sweep", *args, "-q", "--jobs", "1"])
    return result.exit_code, " ".join(result.output.split())


def test_a_sweep_of_the_policy_list_runs_each_points_own_list(tmp_path):
    out = tmp_path / "out"
    code, output = _sweep(str(_scenario(tmp_path, ["megatron", "holmes"])),
                          "--set", "policies[1]=holmes,megatron-llama", "--out", str(out))
    assert code == 0, output
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [(r["point"], r["policy"]) for r in rows] == [
        ("0", "megatron"), ("0", "holmes"), ("1", "megatron"), ("1", "megatron-llama")]
    times = {r["policy"]: r["iteration_time_s"] for r in rows}
    assert times["megatron-llama"] != times["holmes"]
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["policies"] == ["megatron", "holmes", "megatron-llama"]
    assert doc["point_policies"] == [["megatron", "holmes"], ["megatron", "megatron-llama"]]


def test_policy_option_overrides_every_points_list():
    result = run_sweep(DEFAULT, ["policies[1]=holmes,megatron-llama"], ["megatron"], jobs=1)
    assert [r["policy"] for r in result.rows] == ["megatron", "megatron"]
    assert result.policies == ["megatron"] and "point_policies" not in result.to_json()


@pytest.mark.parametrize(("values", "says"), [
    ("holmes,bogus", "(value 'bogus'): policies[1]: unknown policy 'bogus'"),
    ("holmes,all-ib,bogus", "(value 'all-ib'): policies[2]: policy 'all-ib' is listed twice"),
])
def test_an_unknown_or_repeated_policy_in_any_point_exits_2_before_anything_runs(tmp_path,
                                                                                values, says):
    out = tmp_path / "out"
    code, output = _sweep(str(_scenario(tmp_path, ["megatron", "holmes", "all-ib"])),
                          "--set", f"policies[1]={values}", "--out", str(out))
    assert code == 2, output
    assert f"--set policies[1]={values} {says}" in output
    assert not out.exists()


def test_a_set_of_the_whole_policy_list_points_to_an_entry_or_p(tmp_path):
    # It said only "policies: expected a list, got str 'holmes'".
    out = tmp_path / "out"
    code, output = _sweep(str(_scenario(tmp_path, ["megatron", "holmes"])),
                          "--set", "policies=holmes,megatron", "--out", str(out))
    assert code == 2, output
    message = " ".join(output.split())
    assert "--set policies=holmes,megatron: a value sets one field, and policies is a list" \
        in message and "policies[1]=holmes,megatron-llama" in message and "with -p" in message
    assert not out.exists()


@pytest.mark.parametrize("policy", [["-p", "megatron-llama"], []])
def test_a_sweep_whose_plans_all_fail_exits_2_with_the_first_reason_writing_nothing(tmp_path,
                                                                                  policy):
    source = SCENARIOS / "llama3_70b_h100.yaml"
    scenario = source if policy else _scenario(tmp_path, ["megatron-llama"], source)
    out = tmp_path / "out"
    code, output = _sweep(str(scenario), "--set", "training.micro_batch_size=1,2", *policy,
                          "--out", str(out))
    assert code == 2, output
    assert ("with --set training.micro_batch_size=1,2 (value 1): megatron-llama: Megatron-LLaMA's "
            "overlapped distributed optimizer does not run the interleaved schedule") in output
    assert "(no variant of the sweep is feasible)" in output
    assert not out.exists()


def test_run_sweep_raises_when_no_point_is_feasible():
    with pytest.raises(ScenarioError, match="no variant of the sweep is feasible"):
        run_sweep(SCENARIOS / "llama3_70b_h100.yaml", ["training.micro_batch_size=1,2"],
                  ["megatron-llama"], jobs=1)


def test_the_title_names_a_bundled_scenario_by_its_name(tmp_path):
    result = CliRunner().invoke(app, ["sweep", "mixed_ib_eth", "--set", "seed=1", "-p", "holmes",
                                      "--out", str(tmp_path / "out")], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    assert "sweep of mixed_ib_eth: 1 runs" in result.output
    assert str(SCENARIOS) not in result.output


def _result(values=(25, 100), time: float = 27.2) -> SweepResult:
    path = "inter_cluster_links[0].bandwidth_gbit_per_s"
    rows = [{path: v, "policy": "holmes", "point": i, "status": "ok", "iteration_time_s": time,
             "tflops_per_gpu": 115.6, "samples_per_s": 9.0, "bubble_fraction": 0.1,
             "peak_memory_gib": 53.9, "fits_memory": True, "reason": ""}
            for i, v in enumerate(values)]
    return SweepResult("s.yaml", [SweepAxis("", path, (), tuple(values))], ["holmes"], rows)


def _fail_at_the_second_plot(monkeypatch, error: BaseException) -> None:
    drawn = []
    real = plots.sweep_figure

    def figure(*args, **kwargs):
        drawn.append(1)
        if len(drawn) == 2:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(plots, "sweep_figure", figure)


@pytest.mark.parametrize("error", [OutputError("--out: no space left"), KeyboardInterrupt()])
def test_a_failure_while_plotting_leaves_the_earlier_sweep_files_as_they_were(tmp_path,
                                                                             monkeypatch, error):
    out = tmp_path / "out"
    write_sweep(out, _result())
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _fail_at_the_second_plot(monkeypatch, error)
    with pytest.raises(type(error)):
        write_sweep(out, _result((50, 200), 30.0))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert set(SWEEP_FILES) <= set(before)


def test_a_failure_while_plotting_removes_the_folder_the_sweep_created(tmp_path, monkeypatch):
    _fail_at_the_second_plot(monkeypatch, OutputError("--out: no space left"))
    with pytest.raises(OutputError):
        write_sweep(tmp_path / "out", _result())
    assert list(tmp_path.iterdir()) == []


def test_a_failure_while_plotting_leaves_an_existing_empty_folder_empty(tmp_path, monkeypatch):
    (tmp_path / "out").mkdir()
    _fail_at_the_second_plot(monkeypatch, OutputError("--out: no space left"))
    with pytest.raises(OutputError):
        write_sweep(tmp_path / "out", _result())
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("width", [58, 62])
def test_a_narrow_terminal_folds_headers_but_never_cuts_a_value_or_number(width):
    paths = ["clusters[1].nodes[0].nics[0].model", "clusters[0].nodes[0].nics[1].model"]
    picks = [("eth-25g", "eth-10g"), ("eth-25g", "eth-100g"), ("eth-100g", "eth-10g"),
             ("eth-100g", "eth-100g")]
    rows = [{paths[0]: a, paths[1]: b, "policy": "holmes-no-adaptive-partition", "point": i,
             "status": "ok", "iteration_time_s": 18.52 - i, "tflops_per_gpu": 115.6,
             "peak_memory_gib": 53.9, "fits_memory": True} for i, (a, b) in enumerate(picks)]
    axes = [SweepAxis("", p, (), ("eth-25g", "eth-100g")) for p in paths]
    result = SweepResult("mixed_ib_eth", axes, ["holmes-no-adaptive-partition"], rows)
    buf = io.StringIO()
    print_table(Console(file=buf, width=width), sweep_table(result, width), False)
    lines = [line for line in buf.getvalue().splitlines() if line.startswith("│")]
    assert "…" not in buf.getvalue()
    for i, (a, b) in enumerate(picks):
        cells = [c.strip() for c in lines[i].split("│")[1:-1]]
        assert cells == [a, b, "holmes-no-adaptive-partition", f"{18.52 - i:.3f}"], lines
