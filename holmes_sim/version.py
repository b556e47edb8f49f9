"""The tool's version, from the installed distribution's metadata."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


__version__ = "0.1.0"
"""The source tree's version (pyproject.toml's); `tool_version()` prefers the installed one."""


def tool_version() -> str:
    """The installed holmes-sim version (the package's `__version__` when not installed)."""
    try:
        return version("holmes-sim")
    except PackageNotFoundError:
        return __version__
