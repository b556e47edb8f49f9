"""What `validate --real` says when a run cannot go on: a model too big for the host's memory
(refused before anything is built), a step past testbed.timeout_s, plans the declared GPUs
could not hold, a mistyped testbed name, options a mode does not use, Ctrl-C, and an output
folder no one may write to. No root and no testbed needed: the checks and messages are tested
directly."""

from __future__ import annotations

import errno
import os
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from holmes_sim import cli
from holmes_sim.backend.launch import RankFailed, RunTimedOut
from holmes_sim.errors import ScenarioError, TestbedError
from holmes_sim.metrics import MemoryReport
from holmes_sim.prepare import prepare
from holmes_sim.spec.scenario import TestbedSpec
from holmes_sim.units import GIB
from holmes_sim.validation import host
from holmes_sim.validation.real_run import memory_notes, step
from holmes_sim.validation.testbed_plan import check_testbed, rank_memory_bytes
from tests.conftest import TESTBED, default_testbed_with

runner = CliRunner()


# ---- memory: refused before anything is built ------------------------------------------------
def test_a_model_too_big_for_the_hosts_memory_is_refused_before_building(tmp_path, monkeypatch):
    monkeypatch.setattr(host, "available_memory", lambda: 8 * GIB)
    path = default_testbed_with(tmp_path, "hidden_size: 128", "hidden_size: 6144")
    path.write_text(path.read_text().replace("bucket_size_mb: 0.5", "bucket_size_mb: 20"))
    result = runner.invoke(cli.app, ["validate", str(path), "--dry-run"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"{path}:" in text and "model: the real run needs about" in text
    assert "8.0 GiB available (MemAvailable)" in text and "4 rank processes" in text
    assert "model.hidden_size" in text and "training.micro_batch_size" in text
    assert "Traceback" not in text


def test_the_bundled_testbed_fits_where_its_ranks_fit(monkeypatch):
    per, _, _ = rank_memory_bytes(prepare(TESTBED))
    monkeypatch.setattr(host, "available_memory", lambda: int(4 * per) + 1)
    prepare(TESTBED, check=check_testbed)  # no refusal
    monkeypatch.setattr(host, "available_memory", lambda: int(4 * per) - 1)
    with pytest.raises(ScenarioError, match="MemAvailable"):
        prepare(TESTBED, check=check_testbed)


def test_rank_memory_estimate_covers_a_measured_rank(tmp_path):
    # Measured: this model's PP 2 x DP 2 run peaked at 1059 MiB resident on rank 0.
    path = default_testbed_with(tmp_path, "hidden_size: 128", "hidden_size: 1024")
    path.write_text(path.read_text().replace("num_attention_heads: 4", "num_attention_heads: 8"))
    per, params, _ = rank_memory_bytes(prepare(path))
    assert 1059 * 2**20 <= per <= 1.15 * 1059 * 2**20
    assert params == pytest.approx(25.85e6, rel=0.01)


# ---- a failed step names itself; a timeout names testbed.timeout_s -------------------------------
def test_a_step_past_the_timeout_names_the_field_and_what_it_needs():
    spec = TestbedSpec(timeout_s=2)
    with pytest.raises(TestbedError) as info, step("compute calibration", spec):
        raise RunTimedOut("run timed out after 2 s; ranks still running: [0]; rank 0 wrote no log", 2)
    text = str(info.value)
    assert text.startswith("compute calibration: testbed.timeout_s (2 s) ran out")
    assert "rank start-up" in text and "log tail" not in text
    with pytest.raises(TestbedError) as info, step("round 1/2, holmes", spec, 6, 0.342):
        raise RunTimedOut("run timed out after 2 s; ranks still running: [0, 1]", 2)
    text = str(info.value)
    assert text.startswith("round 1/2, holmes: testbed.timeout_s (2 s) ran out")
    assert "(warmup + iterations) x predicted iteration time = 6 x 0.342 s" in text
    assert "give it at least 60 s" in text


def test_a_peer_timeout_under_a_short_timeout_names_the_field():
    with pytest.raises(TestbedError) as info, step("round 1/2, holmes", TestbedSpec(timeout_s=5)):
        raise RankFailed("rank 0 exited with code 1 (ranks failed: [0]; still running: [1])", True)
    assert "gloo's operation timeout is testbed.timeout_s here (5 s" in str(info.value)
    with pytest.raises(TestbedError) as info, step("link calibration", TestbedSpec()):
        raise TestbedError("link probe on fabric 'ib' failed")
    assert str(info.value) == "link calibration: link probe on fabric 'ib' failed"


# ---- plans the declared GPUs could not hold ---------------------------------------------------
def test_plans_that_do_not_fit_the_declared_gpus_get_a_note():
    def outcome(need_gib: float):
        memory = MemoryReport((need_gib * GIB,), (0.001 * GIB,))
        return SimpleNamespace(result=SimpleNamespace(memory=memory))

    [note] = memory_notes({"megatron": [outcome(0.1)], "holmes": [outcome(0.0001)]})
    assert "megatron needs 0.1 GiB per GPU, the GPUs have 0.001" in note
    assert "holmes" not in note and "run on CPU" in note
    assert memory_notes({"holmes": [outcome(0.0001)]}) == []


# ---- the command line -------------------------------------------------------------------------
def test_a_mistyped_testbed_name_lists_the_bundled_testbeds():
    result = runner.invoke(cli.app, ["validate", "two_cluster", "--real"])
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "did you mean two_clusters?" in text and "default, ethernet," in text
    assert "holmes-sim scenarios" not in text


@pytest.mark.parametrize(("mode", "extra", "names"), [
    ("--dry-run", ["--json", "x.json"], "--json"),
    ("--dry-run", ["--iterations", "3", "--wide"], "--iterations, --wide"),
    ("--cleanup", ["--json", "x.json"], "--json"),
    ("--cleanup", ["default", "--dry-run"], "--dry-run, a testbed"),
])
def test_dry_run_and_cleanup_refuse_options_they_do_not_use(mode, extra, names, tmp_path,
                                                            monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(cli.app, ["validate", mode, *extra])
    assert result.exit_code == 2
    assert f"{mode} does not use {names}; drop" in " ".join(result.output.split())
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(("args", "line"), [(["--real"], "interrupted; testbed removed"),
                                            (["--dry-run"], "interrupted")])
def test_ctrl_c_is_one_line_and_exit_130(args, line, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_validate_on_testbed", interrupted)
    result = runner.invoke(cli.app, ["validate", *args])
    assert result.exit_code == 130
    assert result.output.strip() == line


def test_an_immutable_output_folder_is_named_once_with_a_fix_that_fits(tmp_path, monkeypatch):
    from holmes_sim.report import files

    monkeypatch.setattr(files, "_immutable", lambda folder: True)
    with pytest.raises(files.OutputError) as info:
        files.prepare_output(tmp_path / "x.json", option="--json")
    text = str(info.value)
    assert "immutable or append-only" in text and "choose another path" in text
    assert "folder you own" not in text
    monkeypatch.setattr(files, "_immutable", lambda folder: False)
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    with pytest.raises(files.OutputError) as info:
        files.prepare_output(tmp_path / "x.json", option="--json")
    assert str(info.value).lower().count("permission denied") == 1
    assert errno.EACCES in files._FIXES


@pytest.mark.skipif(os.geteuid() != 0, reason="chattr +i needs root")
def test_the_immutable_attribute_is_detected(tmp_path):
    import subprocess

    from holmes_sim.report import files

    folder = tmp_path / "ro"
    folder.mkdir()
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:
        pytest.skip("no file attributes here")
    try:
        assert files._immutable(folder)
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    assert not files._immutable(folder)



# ---- rounds: the measured iterations split over them ---------------------------------------------
@pytest.mark.parametrize(("iterations", "rounds", "split"), [(5, 2, [3, 2]), (8, 2, [4, 4]),
                                                              (7, 3, [3, 2, 2]), (1, 2, [1])])
def test_rounds_measure_exactly_the_iterations_asked_for(iterations, rounds, split, monkeypatch):
    from holmes_sim.validation import real_run

    outcome = SimpleNamespace(plan=None)
    monkeypatch.setattr(real_run, "_predict_emulated", lambda s, names, links: {
        name: ({"compute": {}}, outcome, 0.1) for name in names})
    measured = []

    def run(plan, prepared, config, spec, tb, emulated):
        measured.append(spec.iterations)
        return SimpleNamespace(iteration_times_s=(0.1,) * spec.iterations)

    monkeypatch.setattr(real_run, "_run_real", run)
    spec = TestbedSpec(iterations=iterations)
    session = real_run._Session(None, spec, None, None, lambda m: None)
    runs, _ = real_run._run_rounds(session, ["holmes"], {}, min(rounds, iterations))
    assert measured == split and sum(measured) == iterations
    assert sum(len(r.iteration_times_s) for _, _, r, _ in runs["holmes"]) == iterations


# ---- each case's plan: in the JSON and the report ------------------------------------------------
def test_each_case_records_the_plans_its_rounds_ran_in_the_json_and_the_report():
    from holmes_sim.report.document import validation_markdown
    from holmes_sim.runner import plan_policy
    from holmes_sim.validation.comparison import ValidationResult
    from holmes_sim.validation.real_run import _combine

    prepared = prepare(TESTBED)

    def round_of(name):
        outcome = SimpleNamespace(plan=plan_policy(prepared, name)[0],
                                  result=SimpleNamespace(breakdown_s={}))
        run = SimpleNamespace(iteration_times_s=(0.30, 0.31), op_times_s={}, ranks=(), losses=())
        return (0.3, outcome, run, {})

    cases = (_combine("holmes", [round_of("holmes"), round_of("holmes")]),
             _combine("megatron", [round_of("megatron")]))
    doc = ValidationResult(cases, 10.0, {}, {}).to_json()
    [holmes] = doc["cases"][0]["plans"]  # both rounds ran the same plan: recorded once
    assert holmes["layers_per_stage"] == [2, 2] and holmes["ranks"][0] == "ib-a-0/gpu0"
    assert {"kind": "dp", "ranks": [0, 1], "transport": "rdma:ib", "nics": ["ib0", "ib0"]} \
        in holmes["groups"]
    [megatron] = doc["cases"][1]["plans"]
    assert {"kind": "dp", "ranks": [0, 1], "transport": "tcp:ethernet",
            "nics": ["eth0", "eth0"]} in megatron["groups"]
    text = validation_markdown(doc)
    assert "## Plans" in text and "`--dry-run` shows the plans on the catalog's rates" in text
    assert "- **holmes**: 1f1b, layers per stage 2/2; ranks 0: ib-a-0/gpu0, 1: ib-b-0/gpu0" in text
    assert "dp(0, 1) rdma:ib ib0/ib0" in text
