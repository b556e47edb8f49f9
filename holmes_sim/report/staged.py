"""Files of one output written as one change: `run --report` replaces every file of a report,
`plan --export` and `run --plans` every launch folder, or, when one folder or file cannot be
written, none (the earlier files stay as they were); launch folders also drop the launch files
holmes-sim wrote there before that the new plans lack."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import tempfile
from pathlib import Path

from holmes_sim.report.files import (OutputError, check_file, deferred_interrupt, make_folder,
                                     os_error)
from holmes_sim.report.owned import OutputFolder


def write_together(root: Path, files: dict[str, str | bytes], owner: OutputFolder | None = None,
                   option: str = "output", known: tuple[str, ...] = ()) -> list[str]:
    """Write `files` (path under `root` -> text or bytes; `*.sh` executable) as one change,
    with each file recorded in `owner`, and remove the files named `known` that `owner`'s
    record holds in the folders of `files` but `files` no longer include (returned, relative to
    `root`).

    Every new file is first written beside its target and every file it replaces or removes is
    linked aside, so a folder or file that cannot be written stops the change before any target
    changes, and a replacement that fails (or is interrupted) puts back the files replaced
    before it.

    Raises:
        OutputError: naming the file or folder that cannot be written, with the fix.
    """
    obsolete = _obsolete(root, files, owner, known)
    stage = _Stage(root, option)
    with deferred_interrupt():  # a Ctrl-C meanwhile comes once the change is whole or undone
        try:
            stage.prepare(files, obsolete)
            stage.commit([*sorted(files), *obsolete])
        finally:
            stage.clean()
        if owner is not None:
            for rel in sorted(files):
                owner.record(root / rel)
    return obsolete


def _obsolete(root: Path, files: dict[str, str | bytes], owner: OutputFolder | None,
              known: tuple[str, ...]) -> list[str]:
    """The files named `known` in `files`' folders that `owner`'s record lists but `files`
    lacks."""
    if owner is None:
        return []
    folders = {rel.split("/", 1)[0] for rel in files if "/" in rel}
    found = sorted(rel for d in folders for rel in (f"{d}/{f}" for f in known)
                   if rel not in files and owner.holds(rel) and (root / rel).is_file())
    owner.check(found)  # written here by holmes-sim and unchanged since, else refused by name
    return found


class _Stage:
    """One change to the files under `root`: the new files written beside their targets, the
    old ones they replace or remove linked aside until the change is done or undone."""

    def __init__(self, root: Path, option: str):
        self.root, self.option = root, option
        self.temps: dict[str, Path] = {}
        self.aside: dict[str, Path] = {}
        self.created: list[Path] = []
        self.done: list[str] = []
        self.failed = True

    def prepare(self, files: dict[str, str | bytes], obsolete: list[str]) -> None:
        for rel, data in sorted(files.items()):
            target = self.root / rel
            if not target.parent.is_dir():
                self.created.append(make_folder(target.parent, self.option))
            check_file(target)
            self.temps[rel] = _write_beside(target, data, rel.endswith(".sh"))
        for rel in [*files, *obsolete]:
            if (self.root / rel).is_file():
                self.aside[rel] = _link_aside(self.root / rel)

    def commit(self, names: list[str]) -> None:
        for rel in names:
            target = self.root / rel
            try:
                if rel in self.temps:
                    os.replace(self.temps[rel], target)
                else:
                    target.unlink()
            except OSError as exc:
                self._undo()
                raise _undone(target, exc, self.option) from None
            except BaseException:
                self._undo()
                raise
            self.done.append(rel)
        self.failed = False

    def _undo(self) -> None:
        for rel in reversed(self.done):
            with contextlib.suppress(OSError):
                if rel in self.aside:
                    os.replace(self.aside.pop(rel), self.root / rel)
                else:
                    (self.root / rel).unlink()

    def clean(self) -> None:
        for path in [*self.temps.values(), *self.aside.values()]:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        for folder in reversed(self.created if self.failed else []):
            with contextlib.suppress(OSError):
                folder.rmdir()


def _undone(target: Path, exc: OSError, option: str) -> OutputError:
    """The error of a change undone because `target` could not be replaced or removed."""
    why = "it may be immutable or append-only (lsattr shows it; chattr -i)" \
        if exc.errno == errno.EPERM else str(os_error(target, exc, "replace")).split("; ", 1)[-1]
    return OutputError(f"{option}: cannot replace {target}: {exc.strerror or exc}; {why}; "
                       "nothing was changed")


def _write_beside(target: Path, data: str | bytes, executable: bool) -> Path:
    """A new file with `data` (text as UTF-8) in `target`'s folder, under a hidden temporary
    name."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise os_error(target, exc) from None
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.fchmod(fd, (0o777 if executable else 0o666) & ~mask)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise os_error(target, exc) from None
    return Path(tmp)


def _link_aside(target: Path) -> Path:
    """A second name for the file `target` in its folder (a copy where links are not
    supported), to put it back with if the change is undone."""
    aside = target.with_name(f".{target.name}.{secrets.token_hex(6)}.old")
    try:
        os.link(target, aside)
    except OSError:
        try:
            shutil.copy2(target, aside)
        except OSError as exc:
            aside.unlink(missing_ok=True)
            raise os_error(target, exc, "replace") from None
    return aside
