"""Checks of a calibration profile (the JSON `holmes-sim validate` writes, `profile:` reads).

Every value the simulator uses must be there, be a finite number and lie within its bound, so a
damaged or hand-edited profile is one clear error naming file, line and field, not a crash or a
hang in the engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from holmes_sim.errors import ScenarioError
from holmes_sim.spec.limits import non_finite, read_text_bounded

COMPUTE_KEYS = ("layer_forward_s", "layer_backward_s", "embedding_forward_s",
                "embedding_backward_s", "head_forward_s", "head_backward_s",
                "optimizer_s_per_param")
"""Required per GPU model; `op_overhead_s` is optional."""
FABRIC_KEYS = ("bandwidth_bytes_per_s", "latency_s")
"""Required per fabric; `collective_step_s` is optional."""
HOST_KEYS = ("effective_cores",)
"""Required when `host` is present; `compute_cv` is optional."""

# Bounds by key, (low, high, low excluded). Any other number must merely be finite.
BOUNDS: dict[str, tuple[float, float, bool]] = {
    **{k: (0.0, 3600.0, False) for k in COMPUTE_KEYS},
    "optimizer_s_per_param": (0.0, 1.0, False),
    "op_overhead_s": (0.0, 3600.0, False),
    "bandwidth_bytes_per_s": (1.0, 1e15, False),  # below 1 B/s transfer times overflow
    "latency_s": (0.0, 60.0, False),
    "collective_step_s": (0.0, 60.0, False),
    "effective_cores": (1e-3, 1e6, False),
    "compute_cv": (0.0, 2.0, False),
}
_FIX = "re-run calibration (`holmes-sim validate --real`)"


class _Refused(ValueError):
    pass


def read_profile(path: Path, schema: str) -> dict:
    """The checked profile at `path` (of `schema`) as plain JSON values.

    Raises:
        ScenarioError: naming file, line and field for anything missing, malformed or out of range.
    """
    text = read_text_bounded(path, "profile", "fix `profile:` or run `holmes-sim validate --real` "
                             "to write one")
    try:
        raw = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise ScenarioError(f"{path}:{exc.lineno}: profile is not valid JSON ({exc.msg}); "
                            f"{_FIX}") from None
    except RecursionError:
        raise ScenarioError(f"{path}: profile is nested too deeply; {_FIX}") from None
    except _Refused as exc:
        raise ScenarioError(f"{path}: profile: {exc}; {_FIX}") from None
    except ValueError:  # an integer of more digits than Python converts
        raise ScenarioError(f"{path}: profile has a number with too many digits; {_FIX}") from None
    check_profile(raw, schema, _Where(str(path), text))
    return raw


def _refuse_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a number the simulator can use")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"key {key!r} appears twice")
        out[key] = value
    return out


class _Where:
    """Turns a dotted path into `file:line: path` (the line of the path's last key)."""

    def __init__(self, source: str, text: str):
        self.source, self.text = source, text

    def error(self, path: str, message: str) -> ScenarioError:
        pos, line = 0, None
        for key in path.split("."):
            found = self.text.find(json.dumps(key), pos)
            if found < 0:
                break
            pos, line = found, self.text.count("\n", 0, found) + 1
        where = f"{self.source}:{line}" if line else self.source
        return ScenarioError(f"{where}: {path or '(top level)'}: {message}; {_FIX}")


def check_profile(raw: Any, schema: str, where: _Where) -> None:
    """Raise ScenarioError (via `where`) unless `raw` is a complete, finite, bounded profile."""
    if not isinstance(raw, dict):
        raise where.error("", "a profile must be a JSON object")
    if raw.get("schema") != schema:
        raise where.error("schema", f"is {_short(raw.get('schema'))}, expected '{schema}'")
    compute = _section(raw, "compute", where, required=True)
    if not compute:
        raise where.error("compute", "lists no GPU model")
    for name, entry in compute.items():
        _entry(entry, f"compute.{name}", COMPUTE_KEYS, where)
    for name, entry in _section(raw, "fabrics", where).items():
        _entry(entry, f"fabrics.{name}", FABRIC_KEYS, where)
    if raw.get("intra_node") is not None:  # the link between GPUs of one node, when measured
        _entry(raw["intra_node"], "intra_node", FABRIC_KEYS, where)
    if raw.get("host") is not None:
        _entry(raw["host"], "host", HOST_KEYS, where)


def _section(raw: dict, key: str, where: _Where, required: bool = False) -> dict:
    if key not in raw:
        if required:
            raise where.error(key, "is missing")
        return {}
    if not isinstance(raw[key], dict):
        raise where.error(key, f"must be a JSON object, got {_short(raw[key])}")
    return raw[key]


def _entry(entry: Any, path: str, required: tuple[str, ...], where: _Where) -> None:
    if not isinstance(entry, dict):
        raise where.error(path, f"must be a JSON object, got {_short(entry)}")
    for key in required:
        if key not in entry:
            raise where.error(f"{path}.{key}", "is missing")
    for key, value in entry.items():
        if key in BOUNDS or key in required:
            _number(value, f"{path}.{key}", BOUNDS.get(key), where)


def _number(value: Any, path: str, bound: tuple[float, float, bool] | None, where: _Where) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise where.error(path, f"expected a number, got {_short(value)}")
    if (problem := non_finite(value)) is not None:
        raise where.error(path, problem)
    if bound is None:
        return
    low, high, low_open = bound
    if value < low or (low_open and value == low) or value > high:
        side = "(" if low_open else "["
        raise where.error(path, f"{value:g} is outside {side}{low:g}, {high:g}]")


def _short(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, str | int | float | bool | None) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."
