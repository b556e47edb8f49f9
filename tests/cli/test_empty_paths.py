"""An empty path value (an unset shell variable: `--plans "$OUT"`) would name the current folder:
every path option and argument refuses it with one line, exit 2, before any work."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app

runner = CliRunner()
FOLDER = "name a folder, or '.' for the current one"
FILE = "name a file, or '-' for standard output"


@pytest.mark.parametrize("args, option, fix", [
    (["run", "mixed_ib_eth", "-p", "holmes", "--plans", ""], "--plans", FOLDER),
    (["run", "mixed_ib_eth", "-p", "holmes", "--report", ""], "--report", FOLDER),
    (["run", "mixed_ib_eth", "-p", "holmes", "--json", ""], "--json", FILE),
    (["run", "mixed_ib_eth", "--plans", "p", "--hosts", ""], "--hosts", "name the hosts file"),
    (["plan", "mixed_ib_eth", "--export", ""], "--export", FOLDER),
    (["plan", "mixed_ib_eth", "--json", ""], "--json", FILE),
    (["plan", "mixed_ib_eth", "--export", "e", "--hosts", ""], "--hosts", "name the hosts file"),
    (["sweep", "mixed_ib_eth", "--set", "seed=1", "--out", ""], "--out", FOLDER),
    (["validate", "--published", "--json", ""], "--json", FILE),
    (["validate", "--real", "--json", ""], "--json", FILE),
    (["validate", "--real", "--report", ""], "--report", FOLDER),
    (["validate", "", "--dry-run"], "TESTBED", "name a testbed file or a bundled testbed"),
    (["run", ""], "SCENARIO", "name a scenario file or a bundled scenario"),
    (["plan", ""], "SCENARIO", "name a scenario file or a bundled scenario"),
    (["sweep", "", "--set", "seed=1"], "SCENARIO", "name a scenario file or a bundled scenario"),
    (["check", ""], "SCENARIO", "name a scenario file or a bundled scenario"),
])
def test_an_empty_path_is_refused_before_any_work(args, option, fix, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.output == (f"error: {option} is empty (an unset shell variable?); {fix}\n")
    assert list(tmp_path.iterdir()) == []  # nothing written in the current folder


def test_the_equals_form_is_refused_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["run", "mixed_ib_eth", "--report="])
    assert result.exit_code == 2 and "error: --report is empty" in result.output
    assert list(tmp_path.iterdir()) == []
