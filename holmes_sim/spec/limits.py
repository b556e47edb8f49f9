"""Reading user files within limits (bounded size, text only, one clear error naming the file;
numbers that are finite floats), and the memory bound of a command and its worker processes.

`MemoryGuard` samples the resident memory (RSS, /proc/PID/statm) of this process and every
process it started, on entry and then every `interval_s` (a command that ends within one
interval is measured only on entry): past the per-worker bound or the whole group's bound it
kills the workers and raises `MemoryBoundError` in the main thread, so a runaway search or
sweep ends in one message instead of the kernel's OOM killer. The bounds come from
HOLMES_SIM_MAX_MEMORY_GIB (the group, default GROUP_MEMORY_GIB) and
HOLMES_SIM_WORKER_MEMORY_GIB (each worker, default WORKER_MEMORY_GIB). Linux only (elsewhere
the guard does nothing); a sample may overshoot by what the group allocates in one interval.
"""

from __future__ import annotations

import math
import os
import signal
import stat
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from holmes_sim.errors import HolmesError, ScenarioError

MAX_FILE_BYTES = 1 << 20
"""Largest scenario, testbed or profile file read (1 MiB; the bundled ones are a few KiB)."""


def non_finite(value: int | float) -> str | None:
    """What keeps a number read from a user's file from being a finite float (NaN, infinity,
    or a whole number past the float range, whose `float()` raises OverflowError), or None."""
    if isinstance(value, int) and abs(value) > sys.float_info.max:
        return f"must be a finite number, got a whole number of {len(str(abs(value)))} digits"
    if not math.isfinite(value):
        return f"must be a finite number, got {value}"
    return None


def read_text_bounded(path: Path, what: str, fix: str, limit: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of the regular file `path`, reading at most `limit` + 1 bytes.

    Raises:
        ScenarioError: unreadable, not a regular file (a folder, FIFO or device), larger
            than `limit`, or not UTF-8 text; `fix` says what to do when it cannot be read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens without a writer
        try:
            _check_regular(path, os.fstat(fd).st_mode, what)
            data = _read_up_to(fd, limit + 1)
        finally:
            os.close(fd)
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ScenarioError(f"{path}: cannot read {what} file: {reason}; {fix}") from None
    if len(data) > limit:
        raise ScenarioError(f"{path}: {what} file is larger than the limit of {limit // 1024} KiB; "
                            f"is it the right file?")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ScenarioError(f"{path}:{line}: {what} file is not UTF-8 text (byte {exc.start}); "
                            "save it as UTF-8") from None


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _check_regular(path: Path, mode: int, what: str) -> None:
    """ScenarioError unless `mode` is a regular file's (a FIFO would hang, /dev/zero never end)."""
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise ScenarioError(f"{path}: cannot read {what} file: it is {kind}, not a regular file; "
                            f"give the path of a {what} file")


def _read_up_to(fd: int, size: int) -> bytes:
    chunks: list[bytes] = []
    left = size
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


GROUP_MEMORY_GIB = 8.0
"""Default bound of a command's whole process group (GiB of resident memory): `run` at the
loader's limits peaks at 0.66 GiB (131,072 GPUs) and 0.50 GiB (16,384 micro-batches),
`plan mixed_ib_roce -j 2` at 0.57 GiB for its three processes (docs/reports.md, "Memory bounds
and progress")."""
WORKER_MEMORY_GIB = 1.0
"""Default bound of one `--jobs` worker (GiB): a `plan` worker peaks at 0.26 GiB on
mixed_ib_roce, a `sweep` worker at 0.04 GiB a point of mixed_ib_roce (`run large_175b_1024`, a
whole process, at 0.10 GiB)."""
MAX_BOUND_GIB = 1 << 20
"""Largest bound accepted (1 PiB): past any machine, and still exact in bytes."""
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class MemoryBoundError(MemoryError):
    """A command or one of its workers went past its memory bound (the message says which, how
    much, and how to narrow the work or raise the bound). A MemoryError, not a HolmesError, so
    code that turns bad input into a result row never takes it for one."""


def memory_bound_gib(variable: str, default: float) -> float:
    """The bound in GiB from environment `variable`, else `default`.

    Raises:
        ScenarioError: naming the variable when its value is not a positive number of GiB.
    """
    text = os.environ.get(variable)
    if text is None or not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0 < value <= MAX_BOUND_GIB:
        raise ScenarioError(f"{variable}={text!r}: expected a positive number of GiB up to "
                            f"{MAX_BOUND_GIB:,}, e.g. {variable}={default:g}")
    return value


def available_memory_bytes() -> int | None:
    """The memory the kernel says new work can use (MemAvailable, /proc/meminfo), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def descendants(root: int) -> list[int]:
    """Every live process below `root` (its workers, their helpers): from each thread's
    /proc/PID/task/TID/children where the kernel has it, else from every process's parent id."""
    if not os.path.exists(f"/proc/{root}/task/{root}/children"):
        return _descendants_by_scan(root)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                    kids = [int(k) for k in f.read().split()]
            except (OSError, ValueError):
                continue
            out += kids
            todo += kids
    return out


def _descendants_by_scan(root: int) -> list[int]:
    parent: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parent.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        kids = parent.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _gib(n: float) -> str:
    """`n` bytes in GiB, with the significant digits a small bound needs (0.0001 GiB)."""
    gib = n / 2**30
    return f"{gib:.2f} GiB" if gib >= 0.01 else f"{gib:.2g} GiB"


GUARD_SIGNAL = signal.SIGUSR1
"""The signal `MemoryGuard` sends the main thread, whose handler raises MemoryBoundError."""


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT), SIGTERM, SIGHUP and the memory guard's GUARD_SIGNAL in this thread
    until the block ends, then deliver them: cleanup that must finish (stopping worker
    processes) is not cut short by an exception raised inside it. The block must not wait
    without bound."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM,
                                                     signal.SIGHUP, GUARD_SIGNAL})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


class MemoryGuard:
    """`with MemoryGuard():` holds this process and the processes it starts within the bounds
    (module docstring); `workers=False` bounds this process alone (Ray's daemons are its
    children but not its workers). Raises MemoryBoundError in the main thread when exceeded."""

    def __init__(self, workers: bool = True, interval_s: float = 0.2) -> None:
        self.group_bytes = int(memory_bound_gib("HOLMES_SIM_MAX_MEMORY_GIB", GROUP_MEMORY_GIB) * 2**30)
        self.worker_bytes = int(memory_bound_gib("HOLMES_SIM_WORKER_MEMORY_GIB",
                                                 WORKER_MEMORY_GIB) * 2**30)
        self.workers, self.interval_s = workers, interval_s
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._old_handler = None
        self._before: set[int] = set()

    def __enter__(self) -> MemoryGuard:
        if os.path.exists("/proc/self/statm") and threading.current_thread() is threading.main_thread():
            self._before = set(descendants(os.getpid()))  # not this command's: never counted
            self._sample()  # already past the bound as the command starts: stop before it
            if self.reason is not None:
                raise MemoryBoundError(self.reason)
            self._old_handler = signal.signal(GUARD_SIGNAL, self._raise)
            self._thread = threading.Thread(target=self._watch, name="memory-guard", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            signal.signal(GUARD_SIGNAL, self._old_handler)

    def _raise(self, signum: int, frame: object) -> None:
        if self.reason is not None:
            raise MemoryBoundError(self.reason)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            kids = self._sample()
            if self.reason is not None:
                self._kill(kids)
                signal.pthread_kill(threading.main_thread().ident, GUARD_SIGNAL)
                return

    def _sample(self) -> list[int]:
        """Measure this process and the ones it started; set `reason` when past a bound.
        Returns the started processes' ids."""
        me = os.getpid()
        kids = [pid for pid in descendants(me) if pid not in self._before]
        sizes = {pid: _rss_bytes(pid) for pid in kids} if self.workers else {}
        total = _rss_bytes(me) + sum(sizes.values())
        worst = max(sizes, key=sizes.__getitem__, default=None)
        if worst is not None and sizes[worst] > self.worker_bytes:
            self.reason = (f"worker process {worst} used {_gib(sizes[worst])}, above the "
                           f"bound of {_gib(self.worker_bytes)} per worker; narrow the work "
                           "(fewer search values or --set values) or raise "
                           "HOLMES_SIM_WORKER_MEMORY_GIB")
        elif total > self.group_bytes:
            self.reason = (f"this command and its workers used {_gib(total)}, above the bound "
                           f"of {_gib(self.group_bytes)}; use fewer --jobs, narrow the work, "
                           "or raise HOLMES_SIM_MAX_MEMORY_GIB")
        return kids

    def _kill(self, pids: list[int]) -> None:
        """SIGKILL the processes this command started (pool workers stop taking memory now)."""
        for pid in pids if self.workers else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def worker_cap(cores: int) -> tuple[int, str]:
    """The most `--jobs` workers the `cores` and the memory allow, and what limits it (for the
    note): every worker may use the worker bound out of the memory available now."""
    worker = memory_bound_gib("HOLMES_SIM_WORKER_MEMORY_GIB", WORKER_MEMORY_GIB) * 2**30
    caps = [(cores, "the CPU cores available")]
    avail = available_memory_bytes()
    if avail is not None:
        caps.append((int(avail // worker), f"{_gib(avail)} of memory available over "
                                           f"{_gib(worker)} per worker"))
    n, why = min(caps, key=lambda c: c[0])
    return max(1, n), why


@contextmanager
def memory_bounded(workers: bool = True) -> Iterator[None]:
    """Run the body under a `MemoryGuard` (its worker processes bounded too unless `workers` is
    False); past a bound, or when a worker dies, raise one HolmesError that says why and how to
    narrow the work."""
    from concurrent.futures.process import BrokenProcessPool

    try:
        with (guard := MemoryGuard(workers)):
            yield
    except (MemoryBoundError, BrokenProcessPool) as exc:
        why = guard.reason or (str(exc) if isinstance(exc, MemoryBoundError) else
                               "a worker process died (killed by the system, perhaps out of "
                               "memory); run again with fewer --jobs")
        raise HolmesError(f"stopped: {why}") from None
