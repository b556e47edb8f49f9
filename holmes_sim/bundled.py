"""The scenarios and validation testbeds shipped inside the package (holmes_sim/data), found with
importlib.resources so they are there in a wheel install as in a source checkout."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def data_dir(kind: str) -> Path:
    """The folder of bundled `kind` files ('scenarios' or 'testbeds')."""
    return Path(str(files("holmes_sim") / "data" / kind))


def scenario_names() -> list[str]:
    """Names of the bundled scenarios (file stems), sorted."""
    return sorted(p.stem for p in data_dir("scenarios").glob("*.yaml"))


def bundled_scenario(name: str) -> Path | None:
    """The bundled scenario called `name` (with or without .yaml), or None."""
    stem = name[:-5] if name.endswith(".yaml") else name
    if "/" in stem or stem not in scenario_names():
        return None
    return data_dir("scenarios") / f"{stem}.yaml"


def default_testbed() -> Path:
    """The validation testbed `holmes-sim validate` uses unless given another."""
    return data_dir("testbeds") / "default.yaml"


def testbed_names() -> list[str]:
    """Names of the bundled validation testbeds (file stems), sorted."""
    return sorted(p.stem for p in data_dir("testbeds").glob("*.yaml"))


def resolve_testbed(name: str | Path) -> Path:
    """A path as given when it exists or looks like a file path, else the bundled testbed of
    that name (e.g. `two_clusters`); otherwise the path as given."""
    path = Path(name)
    stem = path.name[:-5] if path.name.endswith(".yaml") else path.name
    if _exists(path) or path.parent != Path(".") or stem not in testbed_names():
        return path
    return data_dir("testbeds") / f"{stem}.yaml"


def testbed_file(name: str | Path | None) -> tuple[Path, str | None]:
    """The testbed file `name` gives (`resolve_testbed`; None: the default testbed), and why
    it names none (`unknown_testbed`; None when it does)."""
    path = resolve_testbed(name) if name else default_testbed()
    return path, unknown_testbed(path)


def unknown_testbed(path: Path) -> str | None:
    """Why `path` (as `resolve_testbed` gave it) names no testbed, listing the bundled ones and
    the closest name; None when it exists (or the file system refuses the name: the loader
    reports that)."""
    import difflib

    try:
        if path.exists():
            return None
    except (OSError, ValueError):
        return None
    names = testbed_names()
    close = difflib.get_close_matches(path.name.removesuffix(".yaml"), names, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return (f"{path}: no such testbed file and no bundled testbed of that name; {hint}the "
            f"bundled testbeds are {', '.join(names)}; or give a testbed file's path")


def resolve_scenario(name: str | Path) -> Path:
    """A path as given when it exists or looks like a file path, else the bundled scenario of that
    name; otherwise the path as given (so the loader names it in its error)."""
    path = Path(name)
    if _exists(path) or (path.suffix in (".yaml", ".yml") and path.parent != Path(".")):
        return path
    return bundled_scenario(str(name)) or path


def _exists(path: Path) -> bool:
    """Whether `path` exists; False for a name the file system refuses (too long, say), which
    the loader then reports."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False
