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


def _sweep_result():
    from holmes_sim.search.sweep import SweepAxis, SweepResult

    paths = ["clusters[0].nodes[0].nics[1].bandwidth_gbit_per_s",
             "clusters[0].nodes[1].nics[1].bandwidth_gbit_per_s", "training.micro_batch_size"]
    axes = [SweepAxis("", p, (), (10, 25)) for p in paths]
    policies = ["holmes", "holmes-no-adaptive-partition"]
    rows = [{**{p: 10 for p in paths}, "policy": name, "point": 0, "status": "ok",
             "iteration_time_s": 40.749, "tflops_per_gpu": 115.6, "peak_memory_gib": 53.9,
             "fits_memory": True} for name in policies]
    return SweepResult("mixed_ib_roce.yaml", axes, policies, rows), paths


@pytest.mark.parametrize("width", [80, 100, 120])
def test_sweep_headers_fold_at_path_separators_never_inside_a_name(width):
    import io

    from rich.console import Console

    from holmes_sim.report.tables import print_table
    from holmes_sim.search.sweep import sweep_table

    result, paths = _sweep_result()
    buf = io.StringIO()
    print_table(Console(file=buf, width=width), sweep_table(result, width), False)
    lines = buf.getvalue().splitlines()
    assert max(len(line) for line in lines) <= width
    header = [line.split("┃")[1:-1] for line in lines if line.startswith("┃")]
    for column, expected in enumerate(["nodes[0].nics[1].bandwidth_gbit_per_s",
                                       "nodes[1].nics[1].bandwidth_gbit_per_s", "micro_batch_size"]):
        pieces = [cells[column].strip() for cells in header if cells[column].strip()]
        assert "".join(pieces) == expected, pieces
        for before, after in zip(pieces, pieces[1:]):
            assert before.endswith("_") or after.startswith("."), (before, after)
    assert any(" holmes-no-adaptive-partition " in line for line in lines)
    assert f"nodes[0].nics[1].bandwidth_gbit_per_s: {paths[0]}" in " ".join(buf.getvalue().split())


def test_plan_lines_under_the_table_fold_to_80_columns(tmp_path):
    import os
    import subprocess
    import sys

    from tests.conftest import small_scenario

    path = tmp_path / "s.yaml"
    path.write_text(small_scenario(nodes_ib=2, nodes_roce=2, gpus=8, layers=8, global_batch=64,
                                   hidden=8192, heads=64, seq=4096))
    proc = subprocess.run([sys.executable, "-m", "holmes_sim", "plan", str(path), "-j", "1"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, proc.stdout
    after = proc.stdout.split("--wide shows them)")[-1]
    assert "The best plan" in after and "plans left out" in after, proc.stdout
