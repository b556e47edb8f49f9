"""Where outputs go, checked before any work, and written safely.

`prepare_output` is the one check every command runs on each output option: a file target must
be `-` (standard output), a regular file or a new name in an existing folder, or a character
device or FIFO (written as a stream, so `/dev/stdout` stays what it is); a folder target may be
new (`report.owned.owned_folder` creates it), but never its missing parents; the folder must be
writable and not on a kernel file system (/proc, /sys). Regular files are written to a temporary file in the same folder and
renamed, so a failure or Ctrl-C never leaves a half-written result. Folders inside an output
folder are made with `make_folder`, which never follows a symlink it did not create. Every
operating-system error becomes one `OutputError` naming the path and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import io
import json
import os
import re
import signal
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from holmes_sim.errors import HolmesError

STDOUT = "-"
KERNEL_FILE_SYSTEMS = ("/proc", "/sys")
"""Pseudo file systems an output never goes to (their files are the kernel's, not results)."""

_FIXES = {
    errno.ENOSPC: "the disk is full; free some space or write to another folder",
    errno.EDQUOT: "the disk quota is used up; free some space or write to another folder",
    errno.EROFS: "the file system is read-only; write to a folder on a writable disk",
    errno.EACCES: "write to a folder you may write to, or choose another path",
    errno.EPERM: "the file system refuses it (an immutable or append-only file or folder?); "
                 "choose another path",
    errno.EEXIST: "something already exists there; remove it or choose another name",
    errno.ENOTDIR: "part of the path is a file, not a folder; remove it or choose another folder",
    errno.EISDIR: "it is a folder; remove it or name a file",
    errno.ENOENT: "its folder does not exist; create it first",
}


class OutputError(HolmesError):
    """An output target that cannot be written (exit 2)."""


def os_error(path: str | Path, exc: OSError, action: str = "write") -> OutputError:
    """One message for an operating-system error on `path`: what failed and the fix."""
    fix = _FIXES.get(exc.errno or 0, "choose another target")
    return OutputError(f"cannot {action} {path}: {exc.strerror or exc}; {fix}")


def prepare_output(path: str | Path, directory: bool = False, option: str = "output") -> Path:
    """Check `path` as the target of `option` (a new folder is created by its writer,
    `report.owned.owned_folder`).

    Raises:
        OutputError: a directory where a file is expected or the reverse, a missing parent
            folder, a folder that cannot be written, a /proc or /sys target, or a target that
            is neither a file, a folder, a character device nor a FIFO.
    """
    path = Path(path)
    if str(path) == STDOUT:
        if directory:
            raise OutputError(f"{option}: '-' (standard output) is for files; name a folder")
        return path
    mode = _mode(path)
    if path.is_symlink() and (mode is None or not (directory or _streamable(mode))):
        raise _link_error(path, option, directory)
    if mode is None or not _streamable(mode):
        _check_not_kernel(path, option)
    if mode is None:
        _check_parent(path, option)
        check_writable(path.parent, option)
    elif directory and not stat.S_ISDIR(mode):
        raise OutputError(f"{option}: {path} exists and is not a folder; name a new or existing folder")
    elif not directory and stat.S_ISDIR(mode):
        raise OutputError(f"{option}: {path} is a folder; name a file in it, e.g. {path / 'results.json'}")
    elif not directory and not _streamable(mode) and not stat.S_ISREG(mode):
        raise OutputError(f"{option}: {path} is not a regular file, a character device or a FIFO")
    elif not _streamable(mode):
        check_writable(path if directory else path.parent, option)
    return path


Target = tuple[Path | None, bool, str]
"""An output option's (path or None, whether it is a folder, the option's name)."""


def check_outputs(targets: Sequence[Target], inputs: Sequence[str | Path | None] = ()) -> None:
    """Check every output before any work (`prepare_output`), and that they stay apart: none
    is one of the command's `inputs` (the scenario, the hosts file), no two are one path, and
    none lies where an output folder of another option writes its own files (`_WRITES`; a
    `--json` may be the `--report` folder's results.json, which holds the same document).

    Raises:
        OutputError: naming the option, the path and what it collides with.
    """
    given = [(Path(path), folder, option) for path, folder, option in targets if path is not None]
    for path, folder, option in given:
        prepare_output(path, directory=folder, option=option)
    files = [Path(os.path.realpath(p)) for p in inputs if p is not None and _is_file(p)]
    for path, folder, option in given:
        if str(path) != STDOUT and not _is_stream(path):
            _check_apart(path, folder, option, given, files)


def _check_apart(path: Path, folder: bool, option: str, given: list[tuple[Path, bool, str]],
                 inputs: list[Path]) -> None:
    here = Path(os.path.realpath(path))
    what = "folder" if folder else "file"
    if here in inputs:
        raise OutputError(f"{option}: {path} is a file this command reads (the scenario, its "
                          f"profile, --hosts or testbed file); name another {what}")
    if option == "--json" and any(o == "--report" and Path(os.path.realpath(p)) / "results.json"
                                  == here for p, _, o in given):
        return  # the report's own results.json: the same document
    for other, other_folder, other_option in given:
        there = Path(os.path.realpath(other))
        if other_option == option or str(other) == STDOUT:
            continue
        if here == there and not (folder and other_folder):
            raise OutputError(f"{option}: {path} is also the {other_option} target; name "
                              f"another {what}")
        if other_folder and there in here.parents and _written_in(other_option,
                                                                  here.relative_to(there)):
            raise OutputError(f"{option}: {path} is inside the {other_option} folder {other}, "
                              f"where holmes-sim writes its own files; name another {what}")


_WRITES = {"--report": ("*.md", "*.png", "trace_*.json", "results.json"), "--out": ("sweep*",),
           "--plans": ("plan_*.json",), "--export": ("[0-9]*-*",)}
"""What a folder option writes at its top level (glob patterns), besides its record
(`.holmes-sim-*`); --plans also a launch folder per policy (`_written_in`)."""


def _written_in(option: str, inside: Path) -> bool:
    """Whether the folder of `option` writes (or may write) the entry of `inside`, a path
    relative to it."""
    from holmes_sim.policies import POLICIES

    top = inside.parts[0]
    if option == "--plans" and top in POLICIES:
        return True
    return any(fnmatch.fnmatch(top, p) for p in (*_WRITES.get(option, ()), ".holmes-sim-*"))


def _is_file(path: str | Path) -> bool:
    """Whether `path` is a file; False where it cannot be read (its reader says why)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def _is_stream(path: Path) -> bool:
    try:
        return _streamable(path.stat().st_mode)
    except OSError:
        return False


def closed_stdout() -> HolmesError | None:
    """The error for a command run with standard output closed (`>&-`), where Python has no
    stream to print to; None when it is open."""
    if sys.stdout is not None:
        return None
    return HolmesError("standard output is closed; redirect it instead (> /dev/null drops the "
                       "tables; --json FILE and --report DIR still write their files)")


_STDOUT_ERRNOS = (errno.EPIPE, errno.ENOSPC, errno.EBADF, errno.EIO, errno.EDQUOT)


def stdout_write_error(exc: OSError) -> HolmesError | None:
    """For `exc` raised writing standard output (a full disk, a closed pipe: an error of a write
    with no file name, which the commands' other writes all carry), the error to report, with
    standard output pointed at /dev/null so the interpreter's own flush at exit fails no more;
    None for another OSError."""
    if exc.filename is not None or exc.errno not in _STDOUT_ERRNOS or sys.stdout is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return HolmesError(f"cannot write standard output ({exc.strerror}); redirect it where there "
                       "is room and a reader, or write JSON with --json FILE")


def is_stdout(path: Path | None) -> bool:
    """Whether output to `path` goes to standard output ('-', /dev/stdout, ...), so tables
    must not."""
    if path is None:
        return False
    if str(path) == STDOUT:
        return True
    try:
        return os.path.samestat(path.stat(), os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return False


def make_folder(path: str | Path, option: str = "output") -> Path:
    """Create the folder `path` (its parent must exist) or reuse it when it is a real folder;
    see `check_folder`."""
    path = Path(path)
    try:
        path.mkdir()
    except FileExistsError:
        check_folder(path, option)
    except OSError as exc:
        raise os_error(path, exc, "create folder") from None
    return path


def check_folder(path: str | Path, option: str = "output") -> None:
    """OutputError unless `path` is absent or a real folder: a symlink, file or anything else
    there is refused, so writes never leave the output folder."""
    path = Path(path)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise os_error(path, exc, "use") from None
    if stat.S_ISLNK(mode):
        raise OutputError(f"{option}: {path} is a symlink; holmes-sim does not write through "
                          "links it did not create; remove it or choose another folder")
    if not stat.S_ISDIR(mode):
        raise OutputError(f"{option}: {path} exists and is not a folder; remove it or choose "
                          "another folder")


LOCK_NAME = ".holmes-sim.lock"
"""The lock file a run holds in its output folder while it writes there."""


@contextlib.contextmanager
def output_lock(directory: str | Path, option: str = "output") -> Iterator[None]:
    """Hold `directory`'s lock while writing into it: a second run that writes there at the same
    time is refused by name (flock on LOCK_NAME, removed again when done)."""
    path = Path(directory) / LOCK_NAME
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise os_error(path, exc, "lock") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OutputError(f"{option}: {directory} is being written by another holmes-sim run "
                              f"(pid {holder}); wait for it to finish or choose another folder") from None
        if _same_file(fd, path):  # not a lock file an ending run has just removed
            break
        os.close(fd)
    try:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            raise os_error(path, exc, "lock") from None
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), path.lstat())
    except OSError:
        return False


def stale_entries(directory: str | Path, written: set[str], patterns: Sequence[str]) -> list[str]:
    """Names in `directory` that match `patterns` (globs of this kind of output) but that this
    run did not write: left by an earlier run, so a reader could mix them up with this one's."""
    directory = Path(directory)
    found = {p.relative_to(directory).parts[0] for pattern in patterns
             for p in directory.glob(pattern)}
    return sorted(found - written - {LOCK_NAME})


def stale_note(option: str, directory: str | Path, names: Sequence[str]) -> str:
    """A note on the files `stale_entries` found in `directory` ('' when none)."""
    if not names:
        return ""
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return (f"note: {option} {directory} also holds {shown} from an earlier run, not this one; "
            "remove them or write to a new folder")


def refused_notes(refused: dict[str, str]) -> list[str]:
    """A note per reason on the launch folders left out (`refused`: why, by policy or folder)."""
    return [f"note: no launch files for {', '.join(p for p, r in refused.items() if r == why)}: {why}"
            for why in dict.fromkeys(refused.values())]


def write_output(path: str | Path, data: str | bytes) -> None:
    """Write to standard output (`-`), as a stream to a device or FIFO, else atomically."""
    path = Path(path)
    if str(path) == STDOUT:
        sys.stdout.write(data if isinstance(data, str) else data.decode())
        sys.stdout.flush()
        return
    mode = _mode(path)
    if mode is not None and _streamable(mode):
        try:
            with open(path, "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
        except OSError as exc:
            raise os_error(path, exc) from None
        return
    write_atomic(path, data)


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` to the regular file `path` atomically (same-folder temp file + os.replace);
    the folder must exist. A folder or symlink at `path` is refused, not replaced."""
    path = Path(path)
    check_file(path)
    with deferred_interrupt():
        _replace_with(path, data)


def _replace_with(path: Path, data: str | bytes) -> None:
    """`write_atomic`'s temp file and replacement."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise os_error(path, exc) from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the user's usual mode
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):  # an append-only folder refuses this too
            Path(tmp).unlink(missing_ok=True)
        raise os_error(path, exc) from None
    except BaseException:
        with contextlib.suppress(OSError):
            Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | Path, document: object) -> None:
    """`json_text(document)`, see `write_output`."""
    write_output(path, json_text(document))


def json_text(document: object) -> str:
    """Deterministic JSON (sorted keys, fixed indentation), ending in a newline."""
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def check_file(path: Path) -> None:
    """OutputError when a folder or a symlink is where the regular file `path` goes."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise os_error(path, exc) from None
    if stat.S_ISLNK(mode):
        raise OutputError(f"cannot write {path}: it is a symlink; holmes-sim does not replace "
                          "links it did not create; remove it or choose another folder")
    if stat.S_ISDIR(mode):
        raise OutputError(f"cannot write {path}: it is a folder; remove it or choose another folder")
    if not stat.S_ISREG(mode):
        raise OutputError(f"cannot write {path}: it is a {_kind(mode)}, not a file holmes-sim "
                          "wrote; remove it or choose another folder")


def _kind(mode: int) -> str:
    """What a special file is, in words."""
    for test, kind in ((stat.S_ISFIFO, "named pipe (FIFO)"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return kind
    return "special file"


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[Callable[[], None]]:
    """Hold back Ctrl-C (SIGINT), and SIGTERM and SIGHUP where a Python handler takes them
    (`terminate_unwinds`), while a write runs, so that it ends whole or undone and leaves no
    temporary file beside its target; a signal that came meanwhile is raised once it is done,
    or at once by the function this yields, for work that may stop at points of its own
    choosing. A signal held back is never lost, even where it lands in code that would drop
    the exception it raises (a finalizer or weakref callback). Only the main thread receives
    signals: elsewhere this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    came: list[int] = []
    previous = {s: signal.getsignal(s) for s in _HELD}
    held = [s for s in _HELD if s == signal.SIGINT or callable(previous[s])]
    for number in held:
        signal.signal(number, lambda number, frame: came.append(number))

    def check() -> None:
        if came:
            number = came[0]
            came.clear()
            _deliver(number, previous[number])

    try:
        yield check
    finally:
        for number in held:
            signal.signal(number, previous[number])
        check()


_HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _deliver(number: int, handler: object) -> None:
    """Hand a signal held back to `handler`, the one in place before it was held."""
    if callable(handler):
        handler(number, None)
    elif handler == signal.SIG_DFL:
        raise KeyboardInterrupt


@contextlib.contextmanager
def terminate_unwinds() -> Iterator[None]:
    """Make SIGTERM and SIGHUP (timeout, Slurm, docker stop, a closed terminal) raise
    SystemExit(128 + signal) while a command runs, so that the cleanup Ctrl-C gets (a new output
    folder removed, staged files undone) runs for them too, and restore the handlers after. A
    signal ignored (nohup) stays ignored; a forked worker that inherits the handler dies of the
    signal as before. Only the main thread receives signals: elsewhere this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pid = os.getpid()

    def unwind(number: int, frame: object) -> None:
        if os.getpid() != pid:
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
            return
        raise SystemExit(128 + number)

    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    taken = [s for s, h in previous.items() if h != signal.SIG_IGN]
    for number in taken:
        signal.signal(number, unwind)
    try:
        yield
    finally:
        for number in taken:
            signal.signal(number, signal.SIG_DFL if previous[number] is None else previous[number])


def _mode(path: Path) -> int | None:
    try:
        return path.stat().st_mode  # follows symlinks: /dev/stdout is judged by what it points to
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise os_error(path, exc, "use") from None


FD_LINKS = ("/dev/stdout", "/dev/stderr", "/dev/fd/", "/proc/self/fd/", "/proc/thread-self/fd/")
"""Where a link stands for an open file of this process (`/dev/stdout`, `/proc/self/fd/1`)."""


def _link_error(path: Path, option: str, directory: bool) -> OutputError:
    """The refusal of a symlink target: one that stands for an open file of this process
    (standard output redirected to a file) points to `-`, never to removing it."""
    hops, link, target = [os.path.abspath(path)], str(path), "?"
    for _ in range(8):  # the link chain, /dev/stdout -> /proc/self/fd/1 -> the file
        try:
            target = os.readlink(link)
        except OSError:  # gone since it was seen
            break
        link = os.path.join(os.path.dirname(link), target)
        if not os.path.islink(link):
            break
        hops.append(os.path.abspath(link))
    if any(h.startswith(FD_LINKS) for h in hops):
        fix = "name the folder itself" if directory else _stream_fix(hops, option)
        return OutputError(f"{option}: {path} is a link to {target}, an open file of this "
                           f"process, which holmes-sim does not write through; {fix}")
    return OutputError(f"{option}: {path} is a symlink; holmes-sim does not write through links "
                       "it did not create; remove it or choose another name")


def _stream_fix(hops: list[str], option: str) -> str:
    """The advice for a link to an open file: '-' where it is standard output (descriptor 1),
    a file of its own otherwise (standard error's file would be replaced under the shell)."""
    if any(h == "/dev/stdout" or re.fullmatch(r"/(dev|proc/(self|thread-self))/fd/1", h)
           for h in hops):
        return f"use '{option} -' for standard output"
    return f"give {option} a file of its own, or '{option} -' for standard output"


def _streamable(mode: int) -> bool:
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def _check_not_kernel(path: Path, option: str) -> None:
    real = os.path.realpath(path)
    for root in KERNEL_FILE_SYSTEMS:
        if real == root or real.startswith(root + "/"):
            raise OutputError(f"{option}: {path} is on {root}, the kernel's file system, not a "
                              "place for results; write to a folder on disk")


def check_writable(folder: Path, option: str) -> None:
    """OutputError unless this process may create and replace files in the existing `folder`:
    an append-only folder passes os.access but refuses the rename that writes a result."""
    if _immutable(folder):
        raise OutputError(f"{option}: cannot write {folder}: the folder is immutable or "
                          "append-only (chattr +i / +a), so not even root may replace files in "
                          "it; clear the flag (chattr -i -a) or choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        code = errno.EROFS if _read_only(folder) else errno.EACCES
        raise OutputError(f"{option}: {os_error(folder, OSError(code, os.strerror(code)))}")


_IMMUTABLE_FLAGS = 0x10 | 0x20  # FS_IMMUTABLE_FL, FS_APPEND_FL (linux/fs.h)
_FS_IOC_GETFLAGS = 0x80086601


def _immutable(folder: Path) -> bool:
    """Whether `folder` carries the immutable or append-only attribute (False where it cannot
    be read, e.g. on a file system without attributes)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        flags = bytearray(8)
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags)
        return bool(int.from_bytes(flags[:4], sys.byteorder) & _IMMUTABLE_FLAGS)
    except OSError:
        return False
    finally:
        os.close(fd)


def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _check_parent(path: Path, option: str) -> None:
    parent = path.parent
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist"
        raise OutputError(f"{option}: {parent} {what}; create it first (holmes-sim creates no "
                          "parent folders)")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
