"""Writes that Ctrl-C cannot leave half done: an interrupt during a launch folder's change, a
report's or an atomic file write comes once the change is whole or undone, leaving no temporary
or set-aside file, even one that lands where Python would drop it (a finalizer); a special file
where an output goes is refused; a full disk while taking an output folder's lock
is one message; a folder a failed or interrupted run created is removed with what it wrote."""

from __future__ import annotations

import errno
import json
import os
import signal
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.report import files as report_files
from holmes_sim.report import plots, staged
from holmes_sim.report.files import OutputError, output_lock, write_atomic
from holmes_sim.report.owned import MANIFEST_NAME, OutputFolder, file_digest, owned_folder
from holmes_sim.report.staged import write_together
from tests.conftest import small_scenario


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob(".*") if p.name != ".holmes-sim-files.json")


def _interrupting(monkeypatch, module, name: str) -> None:
    """Make `module.os.<name>` send this process SIGINT before doing its work, once."""
    real, sent = getattr(os, name), []

    def interrupted(*args, **kwargs):
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(module.os, name, interrupted)


@pytest.mark.parametrize("step", ["replace", "link", "fchmod"])
def test_ctrl_c_during_a_launch_folder_change_comes_after_it_is_whole(tmp_path, monkeypatch,
                                                                      step):
    owner = OutputFolder(tmp_path, "--plans")
    old = {"a/launch.sh": "old\n", "a/hostfile": "h0\n", "b/plan.json": "{}\n"}
    write_together(tmp_path, old, owner)
    _interrupting(monkeypatch, staged, step)
    new = {rel: text.upper() for rel, text in old.items()}
    with pytest.raises(KeyboardInterrupt):
        write_together(tmp_path, new, OutputFolder(tmp_path, "--plans"))
    assert {rel: (tmp_path / rel).read_text() for rel in new} == new
    assert _hidden(tmp_path) == []


def test_ctrl_c_during_an_atomic_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    _interrupting(monkeypatch, report_files, "fchmod")
    with pytest.raises(KeyboardInterrupt):
        write_atomic(tmp_path / "results.json", "{}\n")
    assert (tmp_path / "results.json").read_text() == "{}\n"
    assert _hidden(tmp_path) == []


def test_a_named_pipe_where_a_launch_file_goes_is_refused_and_kept(tmp_path):
    (tmp_path / "a").mkdir()
    os.mkfifo(tmp_path / "a" / "hostfile")
    with pytest.raises(OutputError, match=r"hostfile: it is a named pipe \(FIFO\)"):
        write_together(tmp_path, {"a/hostfile": "h0\n"}, OutputFolder(tmp_path, "--plans"))
    assert (tmp_path / "a" / "hostfile").is_fifo()


def test_a_full_disk_while_taking_the_lock_is_one_message(tmp_path, monkeypatch):
    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(report_files.os, "pwrite", full)
    with pytest.raises(OutputError, match="the disk is full; free some space"):
        with output_lock(tmp_path, "--plans"):
            pass
    assert not any(tmp_path.iterdir())


def test_a_new_folder_whose_lock_fails_on_a_full_disk_is_removed(tmp_path, monkeypatch):
    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(report_files.os, "pwrite", full)
    with pytest.raises(OutputError, match="the disk is full"):
        with owned_folder(tmp_path / "launch", "--export", ["1-holmes/launch.sh"]):
            pass
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("failure", [OutputError("--report: disk full"), KeyboardInterrupt()])
def test_a_new_folder_is_removed_with_what_the_failed_run_wrote(tmp_path, failure):
    new = tmp_path / "report"
    with pytest.raises(type(failure)):
        with owned_folder(new, "--report", ["a.txt", "sub/b.txt"]) as folder:
            folder.write("a.txt", lambda path: path.write_text("a"))
            (new / "sub").mkdir()
            folder.write("sub/b.txt", lambda path: path.write_text("b"))
            raise failure
    assert list(tmp_path.iterdir()) == []


def test_a_failed_run_leaves_an_existing_folder_and_foreign_files_alone(tmp_path):
    (tmp_path / "old").mkdir()
    with pytest.raises(OutputError):
        with owned_folder(tmp_path / "old", "--report", ["a.txt"]) as folder:
            folder.write("a.txt", lambda path: path.write_text("a"))
            raise OutputError("--report: disk full")
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == [
        MANIFEST_NAME, "a.txt"]  # a folder the run did not create keeps what it wrote
    with pytest.raises(OutputError):
        with owned_folder(tmp_path / "new", "--report", ["a.txt"]) as folder:
            folder.write("a.txt", lambda path: path.write_text("a"))
            (tmp_path / "new" / "users.txt").write_text("mine")
            raise OutputError("--report: disk full")
    assert [p.name for p in (tmp_path / "new").iterdir()] == ["users.txt"]


def _report_run(folder: Path, scenario: Path) -> Result:
    return CliRunner().invoke(app, ["run", str(scenario), "--report", str(folder), "-q"])


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


class _Interrupts:
    """Sends this process SIGINT when the timeline figure is drawn for the `at`-th time, from
    `where`: 'call' (the figure function itself) or 'finalizer' (an object's __del__, where
    Python would print 'Exception ignored' and drop a KeyboardInterrupt raised there)."""

    def __init__(self, monkeypatch, at: int = 1, where: str = "call"):
        self.calls, self.at, self.where = 0, at, where
        self.real = plots.timeline_figure
        monkeypatch.setattr(plots, "timeline_figure", self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            if self.where == "finalizer":
                _Finalized()  # dropped at once: its __del__ runs here
            else:
                os.kill(os.getpid(), signal.SIGINT)
        return self.real(*args, **kwargs)


class _Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_that_lands_in_a_finalizer_still_stops_a_report(tmp_path, monkeypatch,
                                                                 write_scenario):
    scenario = write_scenario(small_scenario())
    _Interrupts(monkeypatch, where="finalizer")
    result = _report_run(tmp_path / "report", scenario)
    assert result.exit_code == 130, result.output
    assert not (tmp_path / "report").exists()  # the folder this run created is gone again


def test_ctrl_c_during_a_rerun_leaves_the_earlier_report_whole(tmp_path, monkeypatch,
                                                               write_scenario):
    folder = tmp_path / "report"
    assert _report_run(folder, write_scenario(small_scenario())).exit_code == 0
    before = _files(folder)
    _Interrupts(monkeypatch, at=2)  # the second timeline: the three figures and one are drawn
    result = _report_run(folder, write_scenario(small_scenario(global_batch=32)))
    assert result.exit_code == 130, result.output
    assert _files(folder) == before and _hidden(folder) == []


def test_ctrl_c_while_a_rerun_swaps_its_files_in_finishes_the_swap(tmp_path, monkeypatch,
                                                                    write_scenario):
    folder = tmp_path / "report"
    assert _report_run(folder, write_scenario(small_scenario())).exit_code == 0
    _interrupting(monkeypatch, staged, "replace")
    result = _report_run(folder, write_scenario(small_scenario(global_batch=32)))
    assert result.exit_code == 130, result.output
    record = json.loads((folder / MANIFEST_NAME).read_text())
    assert set(record) == set(_files(folder)) - {MANIFEST_NAME}
    assert all(record[name] == file_digest(folder / name) for name in record)
    doc = json.loads((folder / "results.json").read_text())
    assert doc["results"][0]["samples_per_s"] > 0 and "32" in (folder / "report.md").read_text()
    assert _hidden(folder) == []


def test_a_rerun_that_cannot_replace_a_file_changes_nothing(tmp_path, monkeypatch,
                                                            write_scenario):
    folder = tmp_path / "report"
    assert _report_run(folder, write_scenario(small_scenario())).exit_code == 0
    before = _files(folder)
    real, calls = staged.os.replace, []

    def failing(src, dst, *args, **kwargs):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(staged.os, "replace", failing)
    result = _report_run(folder, write_scenario(small_scenario(global_batch=32)))
    assert result.exit_code == 2, result.output
    assert "nothing was changed" in " ".join(result.output.split())
    assert _files(folder) == before and _hidden(folder) == []


def test_a_ctrl_c_just_after_the_folder_is_made_removes_it(tmp_path, monkeypatch):
    from holmes_sim.report import owned

    def made_then_interrupted(path, option):
        made = report_files.make_folder(path, option)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C as the folder has just been made
        return made

    monkeypatch.setattr(owned, "make_folder", made_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        with owned_folder(tmp_path / "report", "--report", ["a.txt"]):
            pass
    assert list(tmp_path.iterdir()) == []
