"""Reading user files within limits: bounded size, text only, one clear error naming the file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from holmes_sim.errors import ScenarioError

MAX_FILE_BYTES = 1 << 20
"""Largest scenario, testbed or profile file read (1 MiB; the bundled ones are a few KiB)."""


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
