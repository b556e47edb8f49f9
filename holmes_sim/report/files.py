"""Where outputs go, checked before any work, and written safely.

`prepare_output` is the one check every command runs on each output option: a file target must
be `-` (standard output), a regular file or a new name in an existing folder, or a character
device or FIFO (written as a stream, so `/dev/stdout` stays what it is); a folder target may be
created, but never its missing parents. Regular files are written to a temporary file in the
same folder and renamed, so a failure or Ctrl-C never leaves a half-written result.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
from pathlib import Path

from holmes_sim.errors import HolmesError

STDOUT = "-"


class OutputError(HolmesError):
    """An output target that cannot be written (exit 2)."""


def prepare_output(path: str | Path, directory: bool = False, option: str = "output",
                   create: bool = True) -> Path:
    """Check `path` as the target of `option` (and create it when it is a new folder and
    `create`; commands check every output with `create=False` before any work).

    Raises:
        OutputError: a directory where a file is expected or the reverse, a missing parent
            folder, or a target that is neither a file, a folder, a character device nor a FIFO.
    """
    path = Path(path)
    if str(path) == STDOUT:
        if directory:
            raise OutputError(f"{option}: '-' (standard output) is for files; name a folder")
        return path
    mode = _mode(path)
    if mode is None:
        _check_parent(path, option)
        if directory and create:
            _mkdir(path, option)
    elif directory and not stat.S_ISDIR(mode):
        raise OutputError(f"{option}: {path} exists and is not a folder; name a new or existing folder")
    elif not directory and stat.S_ISDIR(mode):
        raise OutputError(f"{option}: {path} is a folder; name a file in it, e.g. {path / 'results.json'}")
    elif not directory and not _streamable(mode) and not stat.S_ISREG(mode):
        raise OutputError(f"{option}: {path} is not a regular file, a character device or a FIFO")
    return path


def write_output(path: str | Path, data: str | bytes) -> None:
    """Write to standard output (`-`), as a stream to a device or FIFO, else atomically."""
    path = Path(path)
    if str(path) == STDOUT:
        sys.stdout.write(data if isinstance(data, str) else data.decode())
        sys.stdout.flush()
        return
    mode = _mode(path)
    if mode is not None and _streamable(mode):
        with open(path, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        return
    write_atomic(path, data)


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` to the regular file `path` atomically (same-folder temp file + os.replace);
    the folder must exist."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror}") from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the user's usual mode
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {exc.strerror}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | Path, document: object) -> None:
    """Deterministic JSON (sorted keys, fixed indentation), see `write_output`."""
    write_output(path, json.dumps(document, indent=2, sort_keys=True) + "\n")


def _mode(path: Path) -> int | None:
    try:
        return path.stat().st_mode  # follows symlinks: /dev/stdout is judged by what it points to
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise OutputError(f"cannot use {path}: {exc.strerror}") from None


def _streamable(mode: int) -> bool:
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def _check_parent(path: Path, option: str) -> None:
    parent = path.parent
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist"
        raise OutputError(f"{option}: {parent} {what}; create it first (holmes-sim creates no "
                          "parent folders)")


def _mkdir(path: Path, option: str) -> None:
    try:
        path.mkdir()
    except OSError as exc:
        raise OutputError(f"{option}: cannot create folder {path}: {exc.strerror}") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
