"""The tool's version, from the installed distribution's metadata, and the interface versions
and source hashes of its optional C extensions."""

from __future__ import annotations

import hashlib
import importlib
import re
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import ModuleType


__version__ = "0.1.0"
"""The source tree's version (pyproject.toml's); `tool_version()` prefers the installed one."""


def tool_version() -> str:
    """The installed holmes-sim version (the package's `__version__` when not installed)."""
    try:
        return version("holmes-sim")
    except PackageNotFoundError:
        return __version__


def extension(name: str, abi: int) -> ModuleType | None:
    """The optional C extension `name` (dotted) when its interface version, its `ABI`, is
    `abi`, the one its Python caller expects, and, where its .c file sits beside it (an editable
    install, a source checkout, an installed wheel), its `SOURCE_SHA256` (setup.py's stamp) is
    that file's and its local headers' `source_digest` now; else None and the caller runs its Python code, with the same
    results. None too when it was not built, or was built in place from other sources (an
    editable install after a pull; `pip install -e .` rebuilds it)."""
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None
    if getattr(module, "ABI", None) != abi:
        return None
    package, _, leaf = name.rpartition(".")
    source = _digest(Path(importlib.import_module(package).__file__).parent / f"{leaf}.c")
    return module if source is None or getattr(module, "SOURCE_SHA256", None) == source else None


_LOCAL_INCLUDE = re.compile(rb'^#include "([^"/]+)"', re.M)


def source_digest(path: Path) -> str:
    """The SHA-256 (hex) of the C file at `path` followed by each header of its folder it
    includes (`#include "name.h"`), in the order it includes them: setup.py's stamp."""
    text = path.read_bytes()
    digest = hashlib.sha256(text)
    for header in _LOCAL_INCLUDE.findall(text):
        digest.update((path.parent / header.decode()).read_bytes())
    return digest.hexdigest()


@cache
def _digest(path: Path) -> str | None:
    """`source_digest` of `path`, read once a process; None where the sources are not there
    (an install without them)."""
    try:
        return source_digest(path)
    except OSError:
        return None
