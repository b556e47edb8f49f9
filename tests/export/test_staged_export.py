"""Launch folders are written as one change: a folder or file that cannot be written leaves the
earlier export exactly as it was, and a new export drops the files holmes-sim wrote there before
that the new plan lacks, never a user's file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.report import staged
from holmes_sim.report.staged import write_together
from holmes_sim.report.files import OutputError
from holmes_sim.report.owned import MANIFEST_NAME, OutputFolder
from tests.conftest import small_scenario

runner = CliRunner()


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones too) by relative path, with its bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _hosts(tmp_path: Path, prefix: str) -> Path:
    path = tmp_path / f"hosts-{prefix}"
    path.write_text("".join(f"{prefix}{k}\n" for k in range(8)))
    return path


def _run_plans(plans: Path, hosts: Path, scenario: str = "mixed_ib_roce"):
    return runner.invoke(app, ["run", scenario, "-q", "-p", "megatron", "-p", "holmes",
                               "--plans", str(plans), "--hosts", str(hosts)])


@pytest.fixture
def chattr():
    """`chattr +i PATH` (or another flag: +a append-only; undone after the test), or a skip
    where it is unavailable."""
    if os.geteuid() != 0 or shutil.which("chattr") is None:
        pytest.skip("chattr +i needs root and chattr")
    done: list[tuple[Path, str]] = []

    def immutable(path: Path, flag: str = "i") -> None:
        if subprocess.run(["chattr", f"+{flag}", str(path)], capture_output=True).returncode:
            pytest.skip(f"this file system has no {flag} flag")
        done.append((path, flag))

    yield immutable
    for path, flag in done:
        subprocess.run(["chattr", f"-{flag}", str(path)], check=True)


def test_an_immutable_launch_folder_stops_the_export_before_any_file_changes(tmp_path, chattr):
    plans = tmp_path / "p"
    assert _run_plans(plans, _hosts(tmp_path, "old")).exit_code == 0
    before = snapshot(plans)
    chattr(plans / "megatron")  # written after every file of holmes/
    result = _run_plans(plans, _hosts(tmp_path, "new"))
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert snapshot(plans) == before  # holmes' folder and both plan files too
    assert (f"--plans: cannot write {plans / 'megatron'}: the folder is immutable or append-only"
            in text)
    assert "chattr -i" in text and "Traceback" not in result.output


def test_an_immutable_launch_file_leaves_the_earlier_export_as_it_was(tmp_path, chattr):
    plans = tmp_path / "p"
    assert _run_plans(plans, _hosts(tmp_path, "old")).exit_code == 0
    before = snapshot(plans)
    chattr(plans / "megatron" / "hostfile")  # written after every file of holmes/
    result = _run_plans(plans, _hosts(tmp_path, "new"))
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert snapshot(plans) == before  # no half-new folder, no temporary file left
    assert f"--plans: cannot replace {plans / 'megatron' / 'hostfile'}" in text
    assert "immutable" in text and "nothing was changed" in text


def test_a_failed_replacement_puts_back_every_file_replaced_before_it(tmp_path, monkeypatch):
    """Where no immutable flag exists: the third replacement fails, the first two are undone."""
    root = tmp_path / "ex"
    files = {f"{d}/{n}": f"old {d} {n}\n" for d in ("1-a", "2-a") for n in ("x", "y.sh")}
    root.mkdir()
    write_together(root, files, OutputFolder(root, "--export"))
    before = snapshot(root)
    real_replace, calls = os.replace, []

    def failing_replace(src, dst):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(staged.os, "replace", failing_replace)
    new = {name: text.replace("old", "new") for name, text in files.items()} | {"2-a/z": "z\n"}
    with pytest.raises(OutputError, match="cannot replace .*2-a/x: No space left on device; "
                                          "the disk is full.*nothing was changed"):
        write_together(root, new, OutputFolder(root, "--export"), "--export")
    monkeypatch.undo()
    assert snapshot(root) == before
    assert os.access(root / "1-a" / "y.sh", os.X_OK)


def test_a_new_folder_that_cannot_be_written_is_removed_again(tmp_path, monkeypatch):
    real_mkstemp, made = staged.tempfile.mkstemp, []

    def failing_mkstemp(*args, dir=None, **kwargs):
        made.append(dir)
        if len(made) == 3:
            raise OSError(13, "Permission denied")
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(staged.tempfile, "mkstemp", failing_mkstemp)
    with pytest.raises(OutputError, match="Permission denied"):
        write_together(tmp_path, {"1-a/x": "x", "1-a/y": "y", "2-a/x": "x"})
    assert list(tmp_path.iterdir()) == []


def _scenario(tmp_path: Path, **fields) -> Path:
    path = tmp_path / f"s{len(list(tmp_path.glob('s*.yaml')))}.yaml"
    path.write_text(small_scenario(nodes_ib=2, nodes_roce=2, layers=16, global_batch=16,
                                   policies="[holmes]", **{"pp": 2, **fields}))
    return path


def test_a_new_export_drops_the_launch_files_an_earlier_one_wrote_and_keeps_the_users(tmp_path):
    """1F1B: the fork runs the plan (holmes_config.json); interleaved: it cannot (no file)."""
    plans = tmp_path / "p"
    first = runner.invoke(app, ["run", str(_scenario(tmp_path)), "-q", "--plans", str(plans)])
    assert first.exit_code == 0, first.output
    assert (plans / "holmes" / "holmes_config.json").is_file()
    (plans / "holmes" / "my_notes.txt").write_text("mine\n")
    later = _scenario(tmp_path, pp=4, schedule="interleaved", virtual=2)
    second = runner.invoke(app, ["run", str(later), "-q", "--plans", str(plans)])
    assert second.exit_code == 0, second.output
    folder = plans / "holmes"
    assert not (folder / "holmes_config.json").exists()
    assert (folder / "holmes_args.txt").read_text().startswith("# not expressible")
    assert (folder / "my_notes.txt").read_text() == "mine\n"
    record = json.loads((plans / MANIFEST_NAME).read_text())
    assert "holmes/holmes_config.json" not in record and "holmes/launch.sh" in record
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []


def test_an_obsolete_launch_file_the_user_changed_is_refused_not_removed(tmp_path):
    root = tmp_path / "ex"
    root.mkdir()
    write_together(root, {"1-a/hostfile": "h\n", "1-a/holmes_config.json": "{}\n"},
                   OutputFolder(root, "--export"), known=("hostfile", "holmes_config.json"))
    (root / "1-a" / "holmes_config.json").write_text('{"edited": 1}\n')
    with pytest.raises(OutputError, match="holmes_config.json was changed since holmes-sim "
                                          "wrote it"):
        write_together(root, {"1-a/hostfile": "h2\n"}, OutputFolder(root, "--export"),
                       known=("hostfile", "holmes_config.json"))
    assert (root / "1-a" / "hostfile").read_text() == "h\n"
    assert (root / "1-a" / "holmes_config.json").read_text() == '{"edited": 1}\n'


@pytest.mark.parametrize("flag", ["i", "a"])
def test_plan_export_refuses_an_immutable_launch_folder_before_the_search(tmp_path, chattr,
                                                                          monkeypatch, flag):
    from holmes_sim.search import planner

    def no_search(*args, **kwargs):
        raise AssertionError("the search ran")

    monkeypatch.setattr(planner, "search", no_search)
    export = tmp_path / "ex"
    (export / "2-holmes").mkdir(parents=True)
    chattr(export / "2-holmes", flag)
    result = runner.invoke(app, ["plan", "mixed_ib_roce", "--export", str(export)])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert (f"--export: cannot write {export / '2-holmes'}: the folder is immutable or "
            "append-only" in text)
    assert sorted(p.name for p in export.iterdir()) == ["2-holmes"]
