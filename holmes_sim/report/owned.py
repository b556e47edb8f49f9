"""Which files of an output folder holmes-sim wrote, so a run replaces only those.

Every command that writes several files into a folder (`run --report`, `run --plans`,
`plan --export`, `sweep --out`, `validate --report`) records each file it writes, by its path
relative to the folder and the SHA-256 of its bytes, in the folder's `MANIFEST_NAME`. Before the
first write, every file the run is about to replace is checked against that record: a file
holmes-sim has no record of (the user's own) or whose bytes changed since (a `launch.sh` the user
edited) is refused by name, so no run overwrites work that is not its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from holmes_sim.report.files import (STDOUT, OutputError, check_file, deferred_interrupt,
                                     make_folder, os_error, output_lock, write_atomic,
                                     write_json)

MANIFEST_NAME = ".holmes-sim-files.json"
"""The record of what holmes-sim wrote in an output folder: relative path -> SHA-256 (hex)."""
MAX_MANIFEST_BYTES = 4 * 2**20
"""Largest record read; a larger one is not holmes-sim's and vouches for nothing."""
_CHUNK_BYTES = 2**20


class OutputFolder:
    """An output folder holmes-sim writes into, with its record of the files it wrote there."""

    def __init__(self, directory: str | Path, option: str):
        self.directory = Path(directory)
        self.option = option
        self._digests, self._unreadable = _read_manifest(self.directory / MANIFEST_NAME)

    def check(self, names: Iterable[str | Path]) -> None:
        """OutputError unless the record can be written and every existing file among `names`
        (relative to the folder) is one holmes-sim wrote and nobody has changed since."""
        check_file(self.directory / MANIFEST_NAME)
        for name in names:
            path = self.directory / name
            check_file(path)
            if not _is_regular(path):
                continue
            key = self._key(path)
            recorded = self._digests.get(key)
            if recorded is None:
                why = f" ({MANIFEST_NAME} cannot be read)" if self._unreadable else ""
                raise OutputError(f"{self.option}: {path} exists and is not in holmes-sim's record "
                                  f"of the files it wrote here{why}; move it away or choose "
                                  "another folder")
            if recorded != file_digest(path):
                raise OutputError(f"{self.option}: {path} was changed since holmes-sim wrote it; "
                                  "move your copy away or choose another folder")

    def recorded(self) -> list[str]:
        """The files the record lists, relative to the folder."""
        return list(self._digests)

    def holds(self, name: str) -> bool:
        """Whether the record lists `name` (relative to the folder)."""
        return name in self._digests

    def write(self, name: str, writer: Callable[[Path], object]) -> None:
        """Write the file `name` (relative to the folder) with `writer(path)`, then record it."""
        path = self.directory / name
        writer(path)
        self.record(path)

    def record(self, path: str | Path) -> None:
        """Record the file `path` (inside the folder) as written by this run."""
        path = Path(path)
        self._digests[self._key(path)] = file_digest(path)
        self._save()

    def _key(self, path: Path) -> str:
        return path.relative_to(self.directory).as_posix()

    def _save(self) -> None:
        kept = {k: v for k, v in sorted(self._digests.items())
                if _is_regular(self.directory / k)}
        write_atomic(self.directory / MANIFEST_NAME, json.dumps(kept, indent=1) + "\n")


@contextlib.contextmanager
def owned_folder(directory: str | Path, option: str,
                 names: Iterable[str | Path]) -> Iterator[OutputFolder]:
    """Hold `directory`'s lock, check the files `names` a run will write there (see
    `OutputFolder.check`) and yield the folder to record them in. A folder this creates (its
    parent must exist) is removed again, with the files recorded in it, when the run fails or
    is interrupted, so a failed first write leaves nothing behind."""
    directory = Path(directory)
    created, folder = False, None
    try:
        with deferred_interrupt():  # a Ctrl-C during the creation comes once it is recorded
            if not os.path.lexists(directory):
                make_folder(directory, option)
                created = True
        with output_lock(directory, option):
            folder = OutputFolder(directory, option)
            folder.check(names)
            yield folder
    except BaseException:
        if created:
            _remove_new_folder(directory, folder)
        raise


def _remove_new_folder(directory: Path, folder: OutputFolder | None) -> None:
    """Remove the files `folder` recorded, its record, and the folders at and below
    `directory` that this leaves empty; anything else found there stays, with its folders."""
    names = [] if folder is None else folder.recorded()
    for name in (*names, MANIFEST_NAME):
        with contextlib.suppress(OSError):
            (directory / name).unlink()
    inner = {parent for name in names for parent in Path(name).parents if parent != Path(".")}
    for path in sorted(inner, key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            (directory / path).rmdir()
    with contextlib.suppress(OSError):
        directory.rmdir()


def check_owned(directory: str | Path, option: str, names: Iterable[str | Path]) -> None:
    """`OutputFolder.check` before any work, where `directory` already exists."""
    if Path(directory).is_dir():
        OutputFolder(directory, option).check(names)


def file_digest(path: str | Path) -> str:
    """SHA-256 (hex) of the bytes of the regular file `path`."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK_BYTES):
                digest.update(chunk)
    except OSError as exc:
        raise os_error(path, exc, "read") from None
    return digest.hexdigest()


def _read_manifest(path: Path) -> tuple[dict[str, str], bool]:
    """The record in `path` (empty when absent), and whether a file there could not be read as
    one (too large, not JSON, not a mapping of names to digests)."""
    if not _is_regular(path):
        return {}, False
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            return {}, True
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}, True
    if not isinstance(document, dict):
        return {}, True
    digests = {k: v for k, v in document.items() if isinstance(k, str) and isinstance(v, str)}
    return digests, len(digests) != len(document)


def write_result_json(path: str | Path, document: object) -> None:
    """`files.write_json`, then, where `path` is a file its folder's record lists (a `--json`
    naming a report's results.json), its new digest in the record, so that the next run still
    knows the file as its own."""
    write_json(path, document)
    path = Path(path)
    if str(path) != STDOUT and _is_regular(path):
        folder = OutputFolder(path.parent, "--json")
        if folder.holds(path.name):
            folder.record(path)


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
