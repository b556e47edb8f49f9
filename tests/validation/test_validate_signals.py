"""Signals at the setup, calibration and training stages of `validate --real` (root only): afterwards no
namespace, interface, process or temporary folder that the run recorded remains (after SIGKILL,
once `validate --cleanup` ran), and a second real validation meanwhile is refused at once."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from holmes_sim.backend import records
from holmes_sim.backend.netns import pid_alive, process_start
from holmes_sim.cli import app
from tests.conftest import REPO

TESTBED = REPO / "validation" / "testbeds" / "default.yaml"
runner = CliRunner()
pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                       reason="needs root, ip and tc for network namespaces"),
]


def _wait_for(predicate, timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _record_of(pid: int) -> records.RunRecord | None:
    """The record of the testbed run process `pid` holds (not its preflight probe)."""
    for path in records.run_dir().glob("*.json"):
        record = records.RunRecord.load(path)
        try:  # another run on the host (another checkout's tests) may delete its record meanwhile
            text = path.read_text() if record else ""
        except FileNotFoundError:
            continue
        if record and f'"pid": {pid}' in text and not record.namespaces[0].endswith("-probe"):
            return record
    return None


def _start(log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "holmes_sim", "validate", str(TESTBED), "--real",
                             "-p", "holmes", "--iterations", "1"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=log.open("w"),
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def _gone(record: records.RunRecord) -> list[str]:
    """What of `record` is still there."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    present = {line.split()[0] for line in out.splitlines() if line.strip()}
    left = [ns for ns in record.namespaces if ns in present]
    left += [f"process {p['pid']}" for p in record.processes
             if process_start(p["pid"]) == p["start"] and pid_alive(p["pid"])]
    left += [t for t in record.temp_dirs if os.path.lexists(t)]
    return left


@pytest.mark.parametrize("stage", ["setup", "calibration", "training"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL],
                         ids=lambda s: s.name)
def test_signal_leaves_nothing_behind(stage: str, sig: signal.Signals, tmp_path: Path) -> None:
    log = tmp_path / "stderr.log"
    child = _start(log)
    try:
        _wait_for(lambda: _record_of(child.pid) is not None, what="the testbed's record")
        if stage == "training":
            _wait_for(lambda: "; running" in log.read_text(), 120.0, "training to start")
            time.sleep(1.0)  # the ranks are up and exchanging
        elif stage == "calibration":
            _wait_for(lambda: "calibrating the links" in log.read_text(), what="calibration")
            _wait_for(lambda: len(_record_of(child.pid).processes) >= 2
                      and _record_of(child.pid).temp_dirs, what="CPU burners and a probe folder")
        else:
            second = runner.invoke(app, ["validate", str(TESTBED), "--real"])
            assert second.exit_code == 2, second.output
            assert "another measurement is running" in second.output
            assert f"PID {child.pid}" in second.output
        record = _record_of(child.pid)
        assert record is not None
        child.send_signal(sig)
        child.wait(timeout=30)
        record = _record_of(child.pid) or record  # the latest version, if it is still there
        if sig == signal.SIGKILL:
            # Helpers outside the namespaces die with their parent (PR_SET_PDEATHSIG), at once.
            _wait_for(lambda: not _helpers_outside(record), 10.0, "helpers to die with their parent")
            cleanup = runner.invoke(app, ["validate", "--cleanup"])
            assert cleanup.exit_code == 0, cleanup.output
        _wait_for(lambda: not _gone(record), 10.0, "removal of what the run recorded")
        assert _record_of(child.pid) is None
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def _helpers_outside(record: records.RunRecord) -> list[int]:
    """Live recorded processes that are not inside the record's namespaces."""
    return [p["pid"] for p in record.processes if pid_alive(p["pid"])
            and process_start(p["pid"]) == p["start"] and not _in_namespace(p["pid"], record)]


def _in_namespace(pid: int, record: records.RunRecord) -> bool:
    """Whether `pid` runs inside one of the record's namespaces (--cleanup removes it)."""
    for ns in record.namespaces:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        if str(pid) in out.split():
            return True
    return False
