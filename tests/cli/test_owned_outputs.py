"""Output folders: a run replaces only files holmes-sim wrote there and nobody changed since; a
user's own file in the way is refused by name before any work, and left as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.export.launch import LAUNCH_FILE_NAMES, launch_files
from holmes_sim.policies import get_policy
from holmes_sim.prepare import prepare
from holmes_sim.report.files import OutputError
from holmes_sim.report.owned import MANIFEST_NAME, OutputFolder, file_digest, owned_folder
from tests.conftest import SCENARIOS

runner = CliRunner()
USER_TEXT = "my own notes, not holmes-sim's\n"


def refused(args: list, *fragments: str) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in text, text
    return text


def entries(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_users_file_in_a_report_folder_is_refused_before_the_run(tmp_path):
    (tmp_path / "report.md").write_text(USER_TEXT)
    refused(["run", "mixed_ib_eth", "-q", "-p", "holmes", "--report", tmp_path,
             "--json", tmp_path / "out.json"],
            "--report", "report.md exists and is not in holmes-sim's record", "move it away")
    assert (tmp_path / "report.md").read_text() == USER_TEXT
    assert entries(tmp_path) == ["report.md"]  # refused before the simulation wrote anything


def test_a_report_folder_is_written_again_over_its_own_files(tmp_path):
    args = ["run", "mixed_ib_eth", "-q", "-p", "holmes", "--report", str(tmp_path)]
    assert runner.invoke(app, args).exit_code == 0
    first = {name: (tmp_path / name).read_bytes() for name in entries(tmp_path)}
    record = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert set(record) == set(first) - {MANIFEST_NAME}
    assert all(record[n] == file_digest(tmp_path / n) for n in record)
    assert runner.invoke(app, args).exit_code == 0
    assert {n: (tmp_path / n).read_bytes() for n in entries(tmp_path)} == first  # deterministic


def test_a_launch_script_the_user_edited_is_not_replaced(tmp_path):
    args = ["run", "mixed_ib_eth", "-q", "-p", "holmes", "--plans", str(tmp_path)]
    assert runner.invoke(app, args).exit_code == 0
    script = tmp_path / "holmes" / "launch.sh"
    edited = script.read_text() + "# my change\n"
    script.write_text(edited)
    refused(args, "--plans", "holmes/launch.sh was changed since holmes-sim wrote it",
            "move your copy away")
    assert script.read_text() == edited


def test_a_users_file_in_a_launch_folder_is_refused_before_the_search(tmp_path, write_scenario):
    from tests.search.test_planner import SMALL

    export = tmp_path / "launch"
    (export / "1-holmes").mkdir(parents=True)
    (export / "1-holmes" / "README.md").write_text(USER_TEXT)
    refused(["plan", write_scenario(SMALL), "--export", export],
            "--export", "1-holmes/README.md exists and is not in holmes-sim's record")
    assert entries(export) == ["1-holmes", "1-holmes/README.md"]


def test_a_users_file_in_a_sweep_folder_is_refused_before_the_sweep(tmp_path):
    (tmp_path / "sweep.csv").write_text(USER_TEXT)
    refused(["sweep", "mixed_ib_eth", "--set", "seed=1,2", "-q", "--out", tmp_path],
            "--out", "sweep.csv exists and is not in holmes-sim's record")
    assert entries(tmp_path) == ["sweep.csv"]


def test_a_users_file_in_a_validation_report_is_refused_before_the_real_run(tmp_path):
    (tmp_path / "validation.md").write_text(USER_TEXT)
    refused(["validate", "--real", "--report", tmp_path],
            "--report", "validation.md exists and is not in holmes-sim's record")
    assert entries(tmp_path) == ["validation.md"]


@pytest.mark.parametrize("record", ["not json{", "[1, 2]", '{"report.md": 5}'])
def test_a_malformed_record_vouches_for_nothing(tmp_path, record):
    (tmp_path / "report.md").write_text(USER_TEXT)
    (tmp_path / MANIFEST_NAME).write_text(record)
    with pytest.raises(OutputError, match=f"record of the files it wrote here .{MANIFEST_NAME} "
                                          "cannot be read"):
        OutputFolder(tmp_path, "--report").check(["report.md"])


def test_a_record_is_kept_to_files_that_still_exist(tmp_path):
    with owned_folder(tmp_path, "--out", ["a.txt", "b.txt"]) as folder:
        for name in ("a.txt", "b.txt"):
            (tmp_path / name).write_text(name)
            folder.record(tmp_path / name)
    (tmp_path / "a.txt").unlink()
    with owned_folder(tmp_path, "--out", ["b.txt", "c.txt"]) as folder:
        (tmp_path / "c.txt").write_text("c")
        folder.record(tmp_path / "c.txt")
    assert sorted(json.loads((tmp_path / MANIFEST_NAME).read_text())) == ["b.txt", "c.txt"]


def test_every_launch_file_is_among_the_names_checked_before_writing():
    prepared = prepare(SCENARIOS / "llama3_70b_h100.yaml")
    for policy in ("megatron", "holmes"):
        plan = get_policy(policy).plan(prepared.request())
        files = launch_files(plan, prepared.cluster, prepared.workload,
                             prepared.scenario.training.precision).files
        assert set(files) <= set(LAUNCH_FILE_NAMES), policy


def test_json_may_name_the_reports_own_results_file(tmp_path):
    args = ["run", "mixed_ib_eth", "-q", "-p", "holmes", "--json", str(tmp_path / "results.json"),
            "--report", str(tmp_path)]
    for _ in range(2):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert record["results.json"] == file_digest(tmp_path / "results.json")


@pytest.mark.parametrize("kind", ["folder", "symlink"])
def test_a_record_that_cannot_be_written_is_refused_before_the_first_file(tmp_path, kind):
    out = tmp_path / "plans"
    out.mkdir()
    if kind == "folder":
        (out / MANIFEST_NAME).mkdir()
    else:
        (out / MANIFEST_NAME).symlink_to(tmp_path / "elsewhere.json")
    refused(["run", "mixed_ib_eth", "-q", "-p", "megatron", "--plans", out], MANIFEST_NAME)
    assert entries(out) == [MANIFEST_NAME]


def test_a_json_over_a_reports_results_keeps_the_record_current(tmp_path):
    report = ["run", "mixed_ib_eth", "-q", "-p", "megatron", "--report", str(tmp_path)]
    assert runner.invoke(app, report).exit_code == 0
    other_seed = ["run", "mixed_ib_eth", "-q", "-p", "megatron", "--seed", "5",
                  "--json", str(tmp_path / "results.json")]
    assert runner.invoke(app, other_seed).exit_code == 0
    record = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert record["results.json"] == file_digest(tmp_path / "results.json")
    result = runner.invoke(app, report)
    assert result.exit_code == 0, result.output


def test_a_report_that_fails_halfway_leaves_no_new_folder(tmp_path, monkeypatch):
    import errno
    import os

    from holmes_sim.report import staged

    real, made = staged.tempfile.mkstemp, []

    def full_disk(*args, **kwargs):  # the disk fills up at the fifth file
        made.append(True)
        if len(made) == 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    monkeypatch.setattr(staged.tempfile, "mkstemp", full_disk)
    refused(["run", "mixed_ib_eth", "-q", "-p", "holmes", "--report", tmp_path / "new"],
            "No space left on device", "the disk is full")
    assert entries(tmp_path) == []
