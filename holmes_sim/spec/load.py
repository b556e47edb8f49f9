"""YAML -> Scenario. One loader; every error names file, line, dotted path, what is wrong and the fix.

- Duplicate keys are rejected (PyYAML silently keeps the last one, yaml/pyyaml#165).
- Unknown keys are rejected with a did-you-mean hint.
- Values are checked against the dataclass field types, plus the numeric rules below.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml

from holmes_sim.errors import FieldError, ScenarioError
from holmes_sim.spec.scenario import Scenario

# Numeric rules by field name (units are in the names, so the rules are too).
_AT_LEAST_ONE = {
    "count", "gpus_per_node", "num_layers", "hidden_size", "num_attention_heads", "seq_length",
    "vocab_size", "ffn_hidden_size", "global_batch_size", "micro_batch_size", "tensor", "pipeline",
    "data", "virtual_stages", "sm_count", "iterations", "calibration_repeats", "link_probe_bytes",
}
_POSITIVE = {"bandwidth_gbit_per_s", "peak_tflops", "memory_gib", "memory_bandwidth_gbyte_per_s",
             "bandwidth_gbyte_per_s", "bucket_size_mb", "tolerance_pct", "timeout_s",
             "learning_rate"}
_FRACTION = {"efficiency", "compute_efficiency", "memory_efficiency", "attention_efficiency"}
_NON_NEGATIVE = {"latency_us", "seed", "warmup", "compute_cv"}


class _Doc:
    """The YAML tree as plain Python values, with the line of every dotted path."""

    def __init__(self, source: str):
        self.source = source
        self.lines: dict[str, int] = {}

    def line(self, path: str) -> int | None:
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path.rsplit(".", 1)[0] if "." in path else ""
        return self.lines.get("")

    def error(self, path: str, message: str) -> ScenarioError:
        line = self.line(path)
        where = f"{self.source}:{line}" if line else self.source
        return ScenarioError(f"{where}: {path or '(top level)'}: {message}")


def load_scenario(path: str | Path, check: Callable[[Scenario], Any] | None = None) -> Scenario:
    """Read and validate a scenario file.

    Args:
        path: the YAML file.
        check: optional semantic check run on the built Scenario; a `FieldError` it raises is
            reported with the file and line of its path.

    Raises:
        ScenarioError: naming file, line and field for anything wrong.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read scenario file: {exc.strerror}; check the path "
                            "(`holmes-sim scenarios` lists the bundled ones)") from None
    return load_scenario_text(text, str(path), check)


def load_scenario_text(text: str, source: str = "<scenario>",
                       check: Callable[[Scenario], Any] | None = None) -> Scenario:
    """Parse YAML text into a Scenario (see `load_scenario`)."""
    doc = _Doc(source)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise ScenarioError(f"{where}: malformed YAML: {problem}; fix the syntax "
                            "(indentation, a missing ':' or an unclosed bracket)") from None
    if node is None:
        raise ScenarioError(f"{source}: the file is empty; a scenario needs at least "
                            "clusters, model and training")
    data = _to_python(node, "", doc)
    if not isinstance(data, dict):
        raise doc.error("", "a scenario must be a mapping of keys (clusters, model, training, ...)")
    scenario = _build(Scenario, data, "", doc)
    if check is not None:
        try:
            check(scenario)
        except FieldError as exc:
            raise doc.error(exc.path, exc.message) from None
    return scenario


def _to_python(node: yaml.Node, path: str, doc: _Doc) -> Any:
    doc.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            sub = f"{path}.{key}" if path else str(key)
            if key in out:
                raise ScenarioError(f"{doc.source}:{key_node.start_mark.line + 1}: {sub}: "
                                    "duplicate key; keep only one")
            doc.lines[sub] = key_node.start_mark.line + 1
            out[key] = _to_python(value_node, sub, doc)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(v, f"{path}[{i}]", doc) for i, v in enumerate(node.value)]
    return _scalar(node)


def _scalar(node: yaml.ScalarNode) -> Any:
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


def _build(cls: type, data: Any, path: str, doc: _Doc) -> Any:
    """Build dataclass `cls` from a mapping, checking keys, types and rules."""
    if not isinstance(data, dict):
        raise doc.error(path, f"expected a mapping with keys {_field_names(cls)}, got "
                              f"{_describe(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            hint = difflib.get_close_matches(str(key), list(fields), n=1)
            fix = f"did you mean '{hint[0]}'?" if hint else f"known keys: {', '.join(fields)}"
            raise doc.error(_join(path, key), f"unknown key; {fix}")
    kwargs = {}
    for name, f in fields.items():
        sub = _join(path, name)
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise doc.error(path, f"missing required key '{name}'")
            continue
        kwargs[name] = _convert(hints[name], data[name], sub, doc)
        _check_rule(name, kwargs[name], sub, doc)
    return cls(**kwargs)


def _convert(tp: Any, value: Any, path: str, doc: _Doc) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        return _convert(non_none[0], value, path, doc)
    if origin is Literal:
        if value not in args:
            hint = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            extra = f"; did you mean '{hint[0]}'?" if hint else ""
            raise doc.error(path, f"'{value}' is not allowed (expected one of: "
                                  f"{', '.join(map(str, args))}){extra}")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise doc.error(path, f"expected a list, got {_describe(value)}")
        item = args[0]
        if len(args) == 2 and args[1] is not Ellipsis:  # fixed pair
            if len(value) != 2:
                raise doc.error(path, f"expected exactly 2 items, got {len(value)}")
            return tuple(_convert(a, v, f"{path}[{i}]", doc) for i, (a, v) in
                         enumerate(zip(args, value, strict=True)))
        return tuple(_convert(item, v, f"{path}[{i}]", doc) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise doc.error(path, f"expected a mapping of name: entry, got {_describe(value)}")
        return {str(k): _convert(args[1], v, _join(path, k), doc) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, doc)
    return _convert_scalar(tp, value, path, doc)


def _convert_scalar(tp: type, value: Any, path: str, doc: _Doc) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            raise doc.error(path, f"expected true or false, got {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise doc.error(path, f"expected a whole number, got {_describe(value)}")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML (YAML 1.1) reads 1e9 as a string; accept it
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise doc.error(path, f"expected a number, got {_describe(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise doc.error(path, f"expected a string, got {_describe(value)}")
        return str(value)
    raise AssertionError(f"unsupported spec type {tp}")


def _check_rule(name: str, value: Any, path: str, doc: _Doc) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return
    if name in _AT_LEAST_ONE and value < 1:
        raise doc.error(path, f"must be at least 1, got {value}")
    if name in _POSITIVE and value <= 0:
        raise doc.error(path, f"must be greater than 0, got {value}")
    if name in _FRACTION and not 0 < value <= 1:
        raise doc.error(path, f"must be a fraction in (0, 1], got {value}")
    if name in _NON_NEGATIVE and value < 0:
        raise doc.error(path, f"must not be negative, got {value}")


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _field_names(cls: type) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls))


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "nothing (null)"
    return f"{type(value).__name__} {value!r}"
