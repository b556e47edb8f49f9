"""What each testbed run created, its lock, the host's measurement lock, and the cleanup of
runs that died.

Locks and records live in ``/run/holmes-sim`` (root only, mode 0700, never followed through a
symlink). Each run holds an ``flock`` on ``<runid>.lock`` while it lives and keeps
``<runid>.json``, the record of what it created (namespaces, interfaces, processes with their
start times, temporary folders), written before each thing is made. `cleanup_leftovers` undoes
exactly what the records of dead runs (e.g. one killed with SIGKILL) list, verifies each
removal, and only reports other objects with matching names. `measurement_lock` lets one real
measurement run on a host at a time.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from holmes_sim.backend.netns import (
    KILL_GRACE_S,
    list_namespaces,
    pid_alive,
    process_start,
    remove_namespace,
    run_command,
)
from holmes_sim.backend.topology import NS_PREFIX, PREFIX, RUN_ID_RE
from holmes_sim.errors import TestbedError

RUN_DIR = Path("/run/holmes-sim")
"""Root-only directory of run locks, run records and the measurement lock."""
TEMP_PREFIXES = ("holmes-probe-", "holmes-run-")
"""Prefixes of the temporary folders runs create (and record)."""


OWNER_FILE = ".owner"
"""In each temporary folder: '<pid> <start time>' of the process that made it, so `--cleanup`
can remove the folder of a killed run that had no record (a --dry-run)."""


def mark_owner(folder: Path) -> None:
    """Write this process's pid and start time into `folder`/OWNER_FILE."""
    (folder / OWNER_FILE).write_text(f"{os.getpid()} {process_start(os.getpid())}\n")


def owner_gone(folder: Path) -> bool:
    """Whether `folder`'s OWNER_FILE names a process that no longer runs (False without one)."""
    try:
        pid, start = (folder / OWNER_FILE).read_text()[:64].split()
        return process_start(int(pid)) != int(start)
    except (OSError, ValueError):
        return False


def run_dir() -> Path:
    """/run/holmes-sim, made root-only (0700); TestbedError unless it is a real directory of root's."""
    if os.geteuid() != 0:
        raise TestbedError(f"testbed needs root (network namespaces, tc and its records in "
                           f"{RUN_DIR}); run it as root")
    try:
        os.mkdir(RUN_DIR, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise TestbedError(f"cannot create {RUN_DIR}: {exc.strerror}") from None
    info = os.lstat(RUN_DIR)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0:
        raise TestbedError(f"{RUN_DIR} is not a directory owned by root (a symlink?); remove it")
    if info.st_mode & 0o077:
        os.chmod(RUN_DIR, 0o700, follow_symlinks=False)  # a looser mode would let others read the records
    return RUN_DIR


def open_record_file(name: str, flags: int, mode: int = 0o600) -> int:
    """Open `name` inside the run directory, never through a symlink."""
    return os.open(run_dir() / name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def acquire_run_lock(run_id: str) -> int:
    """Lock run `run_id` for this process; return the lock's fd. TestbedError if it is taken."""
    fd = open_record_file(f"{run_id}.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise TestbedError(f"testbed run id {run_id!r} is in use by a live process") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode("ascii"))
    return fd


def release_run_lock(run_id: str, fd: int) -> None:
    """Remove the lock file of `run_id` and drop the lock."""
    with contextlib.suppress(OSError, TestbedError):
        (run_dir() / f"{run_id}.lock").unlink()
    with contextlib.suppress(OSError):
        os.close(fd)


def run_is_live(run_id: str) -> bool:
    """Whether a live process holds the lock of run `run_id`."""
    try:
        fd = open_record_file(f"{run_id}.lock", os.O_RDONLY)
    except (OSError, TestbedError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@dataclass
class RunRecord:
    """What one run created, saved to `<runid>.json` before each thing is made."""

    run_id: str
    namespaces: list[str] = field(default_factory=list)
    interfaces: list[list[str]] = field(default_factory=list)
    """[namespace, interface] pairs."""
    processes: list[dict[str, int]] = field(default_factory=list)
    """{"pid", "start"}: start is the clock-tick start time, so a reused pid is not mistaken."""
    temp_dirs: list[str] = field(default_factory=list)

    def add(self, kind: str, item: Any) -> None:
        """Append `item` to list `kind` and save the record."""
        getattr(self, kind).append(item)
        self.save()

    def save(self) -> None:
        """Write the record atomically (temporary file, then rename)."""
        doc = {"run_id": self.run_id, "pid": os.getpid(), "namespaces": self.namespaces,
               "interfaces": self.interfaces, "processes": self.processes,
               "temp_dirs": self.temp_dirs}
        tmp = f"{self.run_id}.json.tmp"
        fd = open_record_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh)
        os.replace(run_dir() / tmp, run_dir() / f"{self.run_id}.json")

    def delete(self) -> None:
        """Remove the saved record, and its temporary file when a signal arrived mid-save."""
        for name in (f"{self.run_id}.json", f"{self.run_id}.json.tmp"):
            with contextlib.suppress(OSError, TestbedError):
                (run_dir() / name).unlink()

    @classmethod
    def load(cls, path: Path) -> RunRecord | None:
        """The record at `path`, or None when it is not a well-formed record."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd) as fh:
                doc = json.loads(fh.read(1 << 20))
            record = cls(doc["run_id"], [str(n) for n in doc["namespaces"]],
                         [[str(a), str(b)] for a, b in doc["interfaces"]],
                         [{"pid": int(p["pid"]), "start": int(p["start"])} for p in doc["processes"]],
                         [str(t) for t in doc["temp_dirs"]])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return record if RUN_ID_RE.fullmatch(str(record.run_id)) else None


def _records() -> list[RunRecord]:
    """Every well-formed run record in the run directory."""
    paths = sorted(run_dir().glob("*.json"))
    return [r for r in map(RunRecord.load, paths) if r is not None]


@contextlib.contextmanager
def measurement_lock(what: str) -> Iterator[None]:
    """Hold the host-wide lock of real measurements (two at once corrupt each other's timings).

    Raises:
        TestbedError: at once, naming the PID and start time of the measurement that holds it.
    """
    fd = open_record_file("measurement.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "unknown process"
        os.close(fd)
        raise TestbedError(f"another measurement is running on this host ({holder}); two at once "
                           "corrupt each other's timings: wait for it to finish") from None
    try:
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"PID {os.getpid()}, started {started}: {what}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


@dataclass
class Cleanup:
    """What `cleanup_leftovers` did: removed, left alone (not ours), and could not remove."""

    removed: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def cleanup_leftovers() -> Cleanup:
    """Undo what the records of dead runs list; report, but never touch, anything else.

    Namespaces, interfaces, processes (matched by pid and start time) and temporary folders of
    runs whose process still holds its lock are left alone. Each removal is verified; what could
    not be removed stays in its record and in `failed`.

    Raises:
        TestbedError: not root (the records and namespaces need it).
    """
    if os.geteuid() != 0:
        raise TestbedError("--cleanup needs root (network namespaces and the records in "
                           f"{RUN_DIR}); nothing was removed")
    report = Cleanup()
    known_ns: set[str] = set()
    known_tmp: set[str] = set()
    for record in _records():
        known_ns.update(record.namespaces)
        known_tmp.update(record.temp_dirs)
        if not run_is_live(record.run_id):
            _undo(record, report)
    _report_foreign(known_ns, known_tmp, report)
    _remove_stale_locks()
    return report


def _undo(record: RunRecord, report: Cleanup) -> None:
    """Remove what `record` lists, verifying each; drop the record when all is gone."""
    failed_before = len(report.failed)
    for proc in record.processes:
        if process_start(proc["pid"]) == proc["start"]:
            _kill_verified(proc["pid"], report)
    present = set(list_namespaces())
    for ns in reversed(record.namespaces):
        if ns not in present:
            continue
        remove_namespace(ns)
        if ns in list_namespaces():
            report.failed.append(f"namespace {ns}")
        else:
            report.removed.append(ns)
    for path in record.temp_dirs:
        _remove_temp_dir(Path(path), report)
    if len(report.failed) == failed_before:
        record.delete()


def _kill_verified(pid: int, report: Cleanup) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + KILL_GRACE_S
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    (report.failed if pid_alive(pid) else report.removed).append(f"process {pid}")


def _remove_temp_dir(path: Path, report: Cleanup) -> None:
    """Remove a recorded temporary folder: only a real directory named like ours."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode) or not path.name.startswith(TEMP_PREFIXES):
        report.foreign.append(f"{path} (recorded, but not one of our folders)")
        return
    shutil.rmtree(path, ignore_errors=True)
    (report.failed if os.path.lexists(path) else report.removed).append(str(path))


def _report_foreign(known_ns: set[str], known_tmp: set[str], report: Cleanup) -> None:
    """Note objects named like ours that no record lists (left untouched)."""
    for ns in list_namespaces():
        if ns.startswith(NS_PREFIX) and ns not in known_ns:
            report.foreign.append(f"namespace {ns}")
    out = run_command(["ip", "-o", "link", "show"], check=False).stdout
    for line in out.splitlines():
        parts = line.split(":", 2)
        name = parts[1].strip().split("@", 1)[0] if len(parts) > 2 else ""
        if name.startswith(PREFIX):
            report.foreign.append(f"interface {name}")
    for prefix in TEMP_PREFIXES:
        for path in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
            if str(path) in known_tmp:
                continue
            if owner_gone(path):  # an unrecorded run's (a --dry-run) whose process died
                _remove_temp_dir(path, report)
            else:
                report.foreign.append(str(path))


def _remove_stale_locks() -> None:
    """Delete lock files of runs that are no longer live and have no record left."""
    with contextlib.suppress(OSError, TestbedError):
        for path in run_dir().glob("*.lock"):
            stale = RUN_ID_RE.fullmatch(path.stem) and not run_is_live(path.stem)
            if stale and not (path.parent / f"{path.stem}.json").exists():
                with contextlib.suppress(OSError):
                    path.unlink()

