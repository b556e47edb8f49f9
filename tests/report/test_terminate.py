"""SIGTERM and SIGHUP (timeout, Slurm, docker stop, a closed terminal) stop a command as Ctrl-C
does: the output folder it created is removed and it exits 128 + the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from holmes_sim.report import files as report_files
from holmes_sim.report.files import terminate_unwinds
from holmes_sim.report.owned import owned_folder
from tests.conftest import REPO


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_during_a_run_removes_the_new_report_folder(tmp_path, sig):
    folder = tmp_path / "x"
    child = subprocess.Popen([sys.executable, "-m", "holmes_sim", "run", "mixed_ib_eth", "-q",
                              "--report", str(folder)], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 15
        while not folder.exists():
            assert child.poll() is None and time.monotonic() < deadline, child.stderr.read()
            time.sleep(0.01)
        child.send_signal(sig)
        assert child.wait(timeout=15) == 128 + sig, child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert not folder.exists()


def test_a_sigterm_just_after_the_folder_is_made_removes_it(tmp_path, monkeypatch):
    from holmes_sim.report import owned

    def made_then_terminated(path, option):
        made = report_files.make_folder(path, option)
        os.kill(os.getpid(), signal.SIGTERM)  # held back until the folder is recorded as new
        return made

    monkeypatch.setattr(owned, "make_folder", made_then_terminated)
    with pytest.raises(SystemExit) as stopped, terminate_unwinds():
        with owned_folder(tmp_path / "report", "--report", ["a.txt"]):
            pass
    assert stopped.value.code == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_an_ignored_hangup_stays_ignored_and_handlers_come_back():
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    term = signal.getsignal(signal.SIGTERM)
    try:
        with terminate_unwinds():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) != term
        assert signal.getsignal(signal.SIGTERM) == term
    finally:
        signal.signal(signal.SIGHUP, before)
