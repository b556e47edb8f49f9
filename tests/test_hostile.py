"""Hostile invocations of plan, sweep, validate, outputs, the API and --ray: each one exit 2 with a
single message naming what is wrong, in under 2 s and without a traceback."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from tests.conftest import small_scenario

runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def _imported() -> None:
    """Import what the commands import, so the 2 s limit times the checks, not module loading."""
    import holmes_sim.cost.ops  # noqa: F401
    import holmes_sim.metrics  # noqa: F401
    import holmes_sim.runner  # noqa: F401
    import holmes_sim.search.planner  # noqa: F401
    import holmes_sim.search.sweep  # noqa: F401
    import holmes_sim.validation.real_run  # noqa: F401


def refused(args: list[str], *fragments: str, limit_s: float = 2.0) -> str:
    """Run the CLI with `args`: exit 2, every fragment in the message, no traceback, fast."""
    start = time.monotonic()
    result = runner.invoke(app, [str(a) for a in args])
    elapsed = time.monotonic() - start
    text = " ".join(result.output.split())
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in text, text
    assert elapsed < limit_s, f"{elapsed:.2f} s"
    return text


def _deep(tmp_path: Path) -> Path:
    path = tmp_path / "deep.yaml"
    path.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    return path


def _binary(tmp_path: Path) -> Path:
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" * 100)
    return path


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo.yaml"
    os.mkfifo(path)
    return path


# ---- one way in: every command reads its scenario through the bounded loader ----------------
INPUTS = {"binary": (_binary, "not UTF-8 text"), "deep": (_deep, "nested deeper than"),
          "fifo": (_fifo, "a FIFO (named pipe), not a regular file"),
          "folder": (lambda p: p, "a folder, not a regular file"),
          "/dev/zero": (lambda p: Path("/dev/zero"), "a character device")}
COMMANDS = {"check": [], "run": ["-q"], "plan": [], "sweep": ["--set", "seed=1,2"]}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("case", sorted(INPUTS))
def test_every_command_reads_through_the_loader(command: str, case: str, tmp_path: Path) -> None:
    make, fragment = INPUTS[case]
    path = make(tmp_path)
    extra = ["--out", tmp_path / "out"] if command == "sweep" else []
    refused([command, path, *COMMANDS[command], *extra], str(path), fragment)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", sorted(INPUTS))
def test_testbed_files_read_through_the_loader(case: str, tmp_path: Path) -> None:
    make, fragment = INPUTS[case]
    path = make(tmp_path)
    refused(["validate", path, "--dry-run"], str(path), fragment)


def test_deep_set_value_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(small_scenario())
    refused(["sweep", path, "--set", "seed=" + "[" * 3000, "--out", tmp_path / "o"], "--set seed=")
