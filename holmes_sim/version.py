"""The tool's version, from the installed distribution's metadata."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from holmes_sim import __version__


def tool_version() -> str:
    """The installed holmes-sim version (the package's `__version__` when not installed)."""
    try:
        return version("holmes-sim")
    except PackageNotFoundError:
        return __version__
