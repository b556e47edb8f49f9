"""Whose mistake a sweep's error names: a fault in the scenario file is reported as `run`
reports it, with the file and line; the `--set` only where its value made the point invalid."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.errors import ScenarioError
from holmes_sim.prepare import prepare
from holmes_sim.search.sweep import run_sweep
from tests.conftest import SCENARIOS

DEFAULT = SCENARIOS / "mixed_ib_eth.yaml"
BAD_TYPE = ("micro_batch_size: 2", "micro_batch_size: banana")  # the schema refuses it
BAD_DEGREE = ("tensor: 4", "tensor: 3")  # the fields pass; `prepare` refuses it


def _file(tmp_path, fault: tuple[str, str]):
    path = tmp_path / "bad.yaml"
    path.write_text(DEFAULT.read_text().replace(*fault, 1))
    return path


@pytest.mark.parametrize("fault", [BAD_TYPE, BAD_DEGREE])
def test_a_fault_in_the_file_is_named_with_its_line_as_run_names_it(tmp_path, fault):
    # The sweep said "bad.yaml with --set training.global_batch_size=256,512 (value 256): ...",
    # blaming a --set that had nothing to do with it, and gave no line.
    path = _file(tmp_path, fault)
    with pytest.raises(ScenarioError) as run:
        prepare(path)
    with pytest.raises(ScenarioError) as sweep:
        run_sweep(path, ["training.global_batch_size=256,512"], ["megatron"], jobs=1)
    assert str(sweep.value) == str(run.value) and str(run.value).startswith(f"{path}:")


def test_the_cli_sweep_and_run_print_the_same_error_for_a_fault_in_the_file(tmp_path):
    path = _file(tmp_path, BAD_TYPE)
    run = CliRunner().invoke(app, ["run", str(path), "-q"])
    sweep = CliRunner().invoke(app, ["sweep", str(path), "--set", "seed=1,2", "-q", "-j", "1",
                                     "--out", str(tmp_path / "out")])
    assert run.exit_code == sweep.exit_code == 2
    assert sweep.stderr == run.stderr and f"{path}:41: training.micro_batch_size" in run.stderr


@pytest.mark.parametrize(("sets", "says"), [
    (["parallel.tensor=3"], "--set parallel.tensor=3 (value 3): parallel.tensor: tensor=3 must"),
    (["model.num_attention_heads=30"], "(value 30): model.hidden_size: hidden_size=4096 must"),
])
def test_the_set_is_named_where_its_value_is_in_force(tmp_path, sets, says):
    """The set value is the file's own (3), or the file's fault reads otherwise with it (the
    heads): the point's values are what the user must change."""
    with pytest.raises(ScenarioError) as info:
        run_sweep(_file(tmp_path, BAD_DEGREE), sets, ["megatron"], jobs=1)
    assert f"{tmp_path / 'bad.yaml'} with --set " in str(info.value) and says in str(info.value)


def test_a_set_that_mends_the_files_fault_runs_and_names_the_set_where_it_does_not(tmp_path):
    result = run_sweep(_file(tmp_path, BAD_DEGREE), ["parallel.tensor=3,2"], ["megatron"],
                       jobs=1)
    assert [r["status"] for r in result.rows] == ["infeasible", "ok"]
    assert result.rows[0]["reason"].startswith("parallel.tensor: tensor=3 must divide")
