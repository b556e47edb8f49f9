"""The tool's version, from the installed distribution's metadata, and the interface versions
of its optional C extensions."""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
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
    `abi`, the one its Python caller expects; else None and the caller runs its Python code,
    with the same results. None too when it was not built, or was built in place from other
    sources (an editable install after a pull; `pip install -e .` rebuilds it)."""
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None
    return module if getattr(module, "ABI", None) == abi else None
