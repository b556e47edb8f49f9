"""Reading user files within limits: bounded size, text only, one clear error naming the file."""

from __future__ import annotations

import os
from pathlib import Path

from holmes_sim.errors import ScenarioError

MAX_FILE_BYTES = 1 << 20
"""Largest scenario, testbed or profile file read (1 MiB; the bundled ones are a few KiB)."""


def read_text_bounded(path: Path, what: str, fix: str, limit: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of `path`, reading at most `limit` + 1 bytes (so /dev/zero is refused too).

    Raises:
        ScenarioError: unreadable, larger than `limit`, or not UTF-8 text; `fix` says what to do
            when it cannot be read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
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
