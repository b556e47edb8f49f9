"""Documents name the scenario as the user gave it: a bundled scenario by its name, a file by
the path as typed; never the package's install path, so the same run gives the same bytes from
any checkout or install."""

from __future__ import annotations

import json

from typer.testing import CliRunner

import holmes_sim
from holmes_sim.bundled import data_dir
from holmes_sim.cli import app
from tests.conftest import small_scenario

runner = CliRunner()


def test_a_bundled_scenario_is_named_by_its_name_in_results_and_report(tmp_path):
    out, report = tmp_path / "r.json", tmp_path / "report"
    result = runner.invoke(app, ["run", "mixed_ib_eth", "-p", "holmes", "-q", "--json", str(out),
                                 "--report", str(report)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["scenario"]["file"] == "mixed_ib_eth"
    assert "Source: `mixed_ib_eth`." in (report / "report.md").read_text()
    installed = str(data_dir("scenarios"))
    for path in (out, report / "results.json", report / "report.md"):
        assert installed not in path.read_text(), path


def test_a_scenario_file_is_named_by_the_path_as_given(tmp_path, monkeypatch):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "small.yaml").write_text(small_scenario())
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["run", "mine/small.yaml", "-q", "--json", "r.json"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "r.json").read_text())["scenario"]["file"] == "mine/small.yaml"


def test_a_sweep_of_a_bundled_scenario_names_it(tmp_path):
    out = tmp_path / "sweep"
    result = runner.invoke(app, ["sweep", "mixed_ib_eth", "-p", "holmes", "-q", "--out", str(out),
                                 "--set", "training.micro_batch_size=1,2"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "sweep.json").read_text())["scenario"] == "mixed_ib_eth"


def test_simulate_names_a_bundled_scenario_by_its_name():
    doc = holmes_sim.simulate("mixed_ib_eth", policies=["holmes"]).to_json()
    assert doc["scenario"]["file"] == "mixed_ib_eth"
