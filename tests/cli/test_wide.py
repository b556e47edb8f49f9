"""Every command that prints a table takes --wide; help text prints literally."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app


@pytest.mark.parametrize("command", ["run", "plan", "validate", "sweep"])
def test_every_table_command_takes_wide(command):
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "--wide" in result.output


def test_sweep_help_shows_index_brackets_literally():
    result = CliRunner().invoke(app, ["sweep", "--help"], env={"COLUMNS": "200"})
    assert "[index]" in result.output and "\\[index]" not in result.output
