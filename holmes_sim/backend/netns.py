"""The host operations the testbed is built from: ``ip``/``tc`` commands, network namespaces,
processes and signals.

Commands run as argument lists (``subprocess.run([...])``), never through a shell. Processes
started for a run die with their parent (``PR_SET_PDEATHSIG``); a namespace is removed with
every process inside it. SIGINT, SIGTERM and SIGHUP are held off while a run writes down what
it is about to create (`signals_deferred`), so a signal cannot split the record from the thing.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from holmes_sim.errors import TestbedError

log = logging.getLogger(__name__)

KILL_GRACE_S = 2.0
COMMAND_TIMEOUT_S = 30.0

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here, not in a child between fork and exec
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_command(argv: Sequence[str], check: bool = True,
                stdin_text: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run one command (argument list, no shell; `stdin_text` fed to it); raise TestbedError
    on failure if `check`."""
    try:
        proc = subprocess.run(
            list(argv), check=False, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
            input=stdin_text,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        if check:
            raise TestbedError(f"`{' '.join(argv)}` failed: {exc}") from exc
        return subprocess.CompletedProcess(list(argv), 1, "", str(exc))
    if check and proc.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when its parent (thread) dies (Linux PR_SET_PDEATHSIG)."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def process_start(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (/proc/PID/stat field 22), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return int(fh.read().rsplit(")", 1)[-1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def killpg(pgid: int, sig: int) -> None:
    """Send `sig` to process group `pgid`, ignoring a group that is already gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (`ip netns list`)."""
    out = run_command(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL every process inside namespace `ns` and wait up to 2 s for them to go."""
    out = run_command(["ip", "netns", "pids", ns], check=False).stdout
    pids = [int(tok) for tok in out.split() if tok.isdigit() and int(tok) != os.getpid()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + KILL_GRACE_S
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def remove_namespace(ns: str) -> bool:
    """Kill what runs in `ns` and delete it; True if it existed. Never raises."""
    if ns not in list_namespaces():
        return False
    _kill_namespace_processes(ns)
    res = run_command(["ip", "netns", "delete", ns], check=False)
    if res.returncode != 0 and ns in list_namespaces():
        log.warning("could not delete network namespace %s: %s", ns, res.stderr.strip())
    return True


@contextlib.contextmanager
def signals_deferred(restore: dict[int, Any] | None = None) -> Iterator[None]:
    """Hold off SIGINT, SIGTERM and SIGHUP (main thread only); re-deliver them afterwards.

    Afterwards each signal gets back its previous handler, or the one given in `restore`.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _f: pending.append(signum)) for s in _SIGNALS}
    previous.update(restore or {})
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for sig in dict.fromkeys(pending):
            signal.raise_signal(sig)
