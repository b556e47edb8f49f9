"""YAML -> Scenario. One loader; every error names file, line, dotted path, what is wrong and the fix.

- Duplicate keys are rejected (PyYAML silently keeps the last one, yaml/pyyaml#165).
- Unknown keys are rejected with a did-you-mean hint.
- Plain scalars are read as YAML 1.2's core schema reads them, not as PyYAML's YAML 1.1 does
  (`yaml_core`): numbers only as plain decimals (`8:32`, `0x200`, `0o1000`, `01000`, `5_12` are
  text, so a number field refuses them), booleans only as true/false (`yes`, `no`, `on`, `off`
  are text: a bool field refuses them, a name may be `no`), no timestamps.
- Values are checked against the dataclass field types, plus the numeric rules below.
- Limits: file size, nesting depth, aliases and expanded values are bounded, numbers must be
  finite and within the bound of their field, so no input can hang, crash or exhaust memory.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml

from holmes_sim.errors import FieldError, HolmesError, ScenarioError, printable
from holmes_sim.spec.limits import MAX_FILE_BYTES, non_finite, read_text_bounded
from holmes_sim.spec.presets import PRESETS, preset_fields
from holmes_sim.spec.scenario import MIN_LINK_PROBE_BYTES, Scenario
from holmes_sim.spec.yaml_core import (MAX_DEPTH, TAG, Written, compose_limited, core_form, dump,
                                       yaml11_reading)

MAX_VALUES = 100_000
"""Most values after expanding aliases (an alias bomb expands to billions)."""
MAX_NUMBER = 1e15
"""Bound of any number whose field has no rule of its own."""


@dataclasses.dataclass(frozen=True, slots=True)
class Bound:
    """Closed range [low, high] of a numeric field; `low_open` makes it (low, high], and a
    positive `floor` refuses the values between `low` and it as well."""

    low: float
    high: float
    low_open: bool = False
    floor: float = 0.0
    rule: str = ""
    """What the range means, added to a violation's message."""

    def violation(self, value: float) -> str | None:
        """What is wrong with `value`, or None when it is in range."""
        problem = self._problem(value)
        return f"{problem}; {self.rule}" if problem and self.rule else problem

    def _problem(self, value: float) -> str | None:
        if self.low_open and value <= self.low:
            return f"must be greater than {_fmt(self.low)}, got {_fmt(value)}"
        if value < self.low:
            return f"must be at least {_fmt(self.low)}, got {_fmt(value)}"
        if value < self.floor:
            return (f"must be at least {_fmt(self.floor)}, got {_fmt(value)}: a rate or share "
                    "that small would make the simulated times overflow")
        if value > self.high:
            return f"must be at most {_fmt(self.high)}, got {_fmt(value)}"
        return None


SMALLEST_POSITIVE = 1e-6
"""Least value of a positive rate, efficiency or factor: products of a few such values with the
largest byte and FLOP counts stay finite (a denormal such as 5e-324 makes them infinite)."""


def _positive(high: float) -> Bound:
    return Bound(0, high, low_open=True, floor=SMALLEST_POSITIVE)


# Numeric rules by field name (units are in the names, so the rules are too). A new numeric field
# gets its bound here in one line; without one it is only held to be finite and within MAX_NUMBER.
FIELD_BOUNDS: dict[str, Bound] = {
    "count": Bound(1, 100_000),
    "gpus_per_node": Bound(1, 1024),
    "num_layers": Bound(1, 10_000),
    "hidden_size": Bound(1, 2**20),
    "num_attention_heads": Bound(1, 2**16),
    "seq_length": Bound(1, 2**24),
    "vocab_size": Bound(1, 2**24),
    "ffn_hidden_size": Bound(1, 2**22),
    "num_query_groups": Bound(1, 2**16),
    "make_vocab_size_divisible_by": Bound(1, 2**16),
    "hidden_dropout": Bound(0, 1),
    "attention_dropout": Bound(0, 1),
    "rotary_base": Bound(1, 10**12, low_open=True, rule="the RoPE base theta (rope_theta): "
                                                       "10000 for Llama 2, 500000 for Llama 3"),
    "rotary_percent": Bound(0, 1, low_open=True, rule="the share of a head RoPE rotates"),
    "rope_scaling_factor": Bound(1, 1024, rule="Llama 3.1 scales by 8, Llama 3.2 by 32"),
    "norm_epsilon": Bound(0, 1, low_open=True, rule="the norms' epsilon, 1e-5 or 1e-6"),
    "global_batch_size": Bound(1, 2**24),
    "micro_batch_size": Bound(1, 2**24),
    "tensor": Bound(1, 1024),
    "pipeline": Bound(1, 10_000),
    "data": Bound(1, 2**24),
    "virtual_stages": Bound(1, 1000),
    "context": Bound(1, 2**16),
    "expert": Bound(1, 2**16),
    "expert_tensor": Bound(1, 1024),
    "iterations": Bound(1, 10_000),
    "warmup": Bound(0, 1000),
    "calibration_repeats": Bound(1, 10_000),
    "emulated_layer_forward_ms": _positive(60_000),
    # Each probe rank holds a buffer this large; `MIN_LINK_PROBE_BYTES` says why the floor.
    "link_probe_bytes": Bound(MIN_LINK_PROBE_BYTES, 2**28, rule="the probe measures a fabric's throughput, so "
                              "it must take far longer than the link's latency and its shaper's "
                              "burst: give at least 1048576 (1 MiB; default 4000000)"),
    "seed": Bound(0, 2**63 - 1),
    "bandwidth_gbit_per_s": _positive(1e9),  # tests model free communication with 1e9
    "bandwidth_gbyte_per_s": _positive(1e9),
    "memory_bandwidth_gbyte_per_s": _positive(1e9),
    "peak_tflops": _positive(1e6),
    "memory_gib": _positive(1e6),
    "latency_us": Bound(0, 1e7),
    "efficiency": _positive(1),
    "compute_efficiency": _positive(1),
    "memory_efficiency": _positive(1),
    "attention_efficiency": _positive(1),
    "fp8_peak_tflops": _positive(1e6),
    "fp8_compute_efficiency": _positive(1),
    "sm_count": Bound(1, 100_000),
    "top_k": Bound(1, 1000),
    "bucket_size_mb": Bound(1e-3, 1e9),  # 1e9: one bucket for any model
    "tp_comm_overlap_rs_sms": Bound(0, 64),  # of an H100's 132 SMs, NeMo's configs use 1-32
    "compute_cv": Bound(0, 2),
    "tolerance_pct": _positive(1000),
    "timeout_s": _positive(7 * 86400),
    "learning_rate": _positive(1000),
    "speed_factor": _positive(2),  # variability: a GPU at most twice its model's speed
    "rate_factor": _positive(1),  # variability: a degraded link runs below its rate
    "compute_spread": Bound(0, 0.25),  # 3 standard deviations below 1 stay above 0.25
    "decoder_first_pipeline_num_layers": Bound(1, 10_000),
    "decoder_last_pipeline_num_layers": Bound(1, 10_000),
    "num_experts": Bound(1, 2**16),
    "moe_router_topk": Bound(1, 2**16),
    "moe_ffn_hidden_size": Bound(1, 2**22),
    "moe_shared_expert_intermediate_size": Bound(1, 2**22),
    "moe_layer_freq": Bound(1, 10_000, rule="an interval N makes every N-th layer MoE; or give "
                                          "a list of 0/1, one entry per layer"),
    "moe_expert_capacity_factor": _positive(1e6),
    "moe_aux_loss_coeff": Bound(0, 1000, rule="the load-balancing loss's weight: 0.01 to start "
                                              "(Megatron-Core), 0 for none"),
    "moe_router_topk_scaling_factor": _positive(1000),
    "moe_router_num_groups": Bound(1, 2**16),
    "moe_router_group_topk": Bound(1, 2**16),
    "moe_expert_imbalance": Bound(1, 2**16),
    "q_lora_rank": Bound(1, 2**20),
    "kv_lora_rank": Bound(1, 2**20),
    "qk_head_dim": Bound(1, 2**16),
    "qk_pos_emb_head_dim": Bound(1, 2**16),
    "v_head_dim": Bound(1, 2**16),
}
ITEM_BOUNDS: dict[str, Bound] = {
    "moe_layer_freq": Bound(0, 1, rule="each entry is 0 (a dense layer) or 1 (an MoE layer)"),
}
"""Bounds of a list's items where they differ from the field's (a layer pattern's 0/1)."""
NON_EMPTY = {"clusters", "nodes", "nics"}
"""Lists that must have at least one item."""
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")
"""The rule of names: clusters, fabrics and node groups (`TEXT_RULES`), catalog keys."""
NAME_FIX = "use a letter then letters, digits, '-' or '_' (at most 32 characters)"
_NAME_RULE = (NAME.fullmatch, "'{}' is not a valid name; " + NAME_FIX)
MODEL_NAME = re.compile(r"[A-Za-z][A-Za-z0-9._-]{0,63}")
"""The name rule with '.' (versions and sizes: llama3.1-8b, gpt-7.5b), as presets are named."""
DEVICE_NAME = re.compile(r"[A-Za-z0-9_.:][A-Za-z0-9_.:-]{0,62}")
"""A NIC's OS device name as NCCL's interface lists take it (no ',' '^' '=', 63 characters)."""
TEXT_RULES: dict[str, tuple[Callable[[str], object], str]] = {
    "name": (lambda t: t.strip() and len(t) <= 128, "a scenario name is 1 to 128 characters, "
             "not all spaces (it titles tables, reports and plots); shorten or write it"),
    "model.name": (MODEL_NAME.fullmatch, "{!r} is not a valid model name; use a letter then "
                                         "letters, digits, '.', '-' or '_' (at most 64 "
                                         "characters)"),
    "profile": (str.strip, "is empty; give the path of a profile JSON (relative to this file) or "
                           "remove `profile:`"),
    "clusters[].name": _NAME_RULE, "clusters[].nodes[].name": _NAME_RULE,
    "fabrics[].name": _NAME_RULE,
    "clusters[].nodes[].nics[].devices[]": (
        DEVICE_NAME.fullmatch, "{!r} is not a device name NCCL can take; use letters, digits, "
                               "'_', '.', ':' or '-', not '-' first, at most 63 characters "
                               "(e.g. ens1f0, bond0, mlx5_0:1)"),
}
"""Rules of string fields by dotted path, `[]` for any list index: a test of the text (false:
refused), and the message (`{}`: the text)."""
FREE_TEXT = {"description", "source"}
"""String fields that may hold any printable text, line breaks included."""


class _Doc:
    """The YAML tree as plain Python values, with the line of every dotted path."""

    def __init__(self, source: str):
        self.source = source
        self.lines: dict[str, int] = {}
        self.constructor = yaml.constructor.SafeConstructor()
        """Constructs this document's non-string scalars (`_scalar`)."""
        self.quoted: set[str] = set()
        """Paths of the quoted and block scalars (text however they read)."""
        self.as_written = False
        """Give numbers as `Written` text (`load_plain`)."""
        self.written: dict[str, str] = {}
        """The source text of each plain non-string scalar, by path (a text field takes a
        number as written: `description: 1e9` is '1e9')."""

    def line(self, path: str) -> int | None:
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path.rsplit(".", 1)[0] if "." in path else ""
        return self.lines.get("")

    def error(self, path: str, message: str, at: str | None = None) -> ScenarioError:
        """`message` about `path`, at the line of `at` (default: of `path`)."""
        line = self.line(path if at is None else at)
        where = f"{self.source}:{line}" if line else self.source
        return ScenarioError(printable(f"{where}: {path or '(top level)'}: {message}"))


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
    text = read_text_bounded(path, "scenario", "check the path (`holmes-sim scenarios` lists the "
                             "bundled ones)")
    return load_scenario_text(text, str(path), check)


def load_scenario_text(text: str, source: str = "<scenario>",
                       check: Callable[[Scenario], Any] | None = None) -> Scenario:
    """Parse YAML text into a Scenario (see `load_scenario`)."""
    doc = _Doc(source)
    node = compose_limited(text, source)
    if node is None:
        raise ScenarioError(f"{source}: the file is empty; a scenario needs at least "
                            "clusters, model and training")
    data = _to_python(node, "", doc, [0])
    if not isinstance(data, dict):
        raise doc.error("", "a scenario must be a mapping of keys (clusters, model, training, ...)")
    scenario = _build(Scenario, data, "", doc)
    if check is not None:
        try:
            check(scenario)
        except FieldError as exc:
            raise doc.error(exc.path, exc.message) from None
    return scenario


def located(source: str, exc: FieldError) -> HolmesError:
    """`exc` with the file and line of its path in the scenario file `source`, as the loader
    reports its errors (the file is read again); `exc` itself where `source` is no file or the
    file now reads otherwise."""
    def fail(_scenario) -> None:
        raise exc

    path = Path(source)
    try:
        if path.is_file():
            load_scenario(path, check=fail)
    except ScenarioError as found:
        if str(found).endswith(str(exc)):
            return found
    return exc


def load_plain(text: str, source: str, as_written: bool = False) -> Any:
    """YAML text -> plain Python values within the loader's limits (depth, aliases, values,
    tags), before any schema check; ScenarioError naming `source` and the line otherwise.
    `as_written`: each number is its text as written (`yaml_core.Written`), which `dump`
    writes back unchanged."""
    node = compose_limited(text, source)
    doc = _Doc(source)
    doc.as_written = as_written
    return None if node is None else _to_python(node, "", doc, [0])


def mapping_text(data: Any, source: str) -> str:
    """A scenario given as a mapping, as the YAML text a file would hold, within the same limits
    (depth, values, MAX_FILE_BYTES); ScenarioError naming the field that is not a plain value."""
    budget = [0, 0]  # values seen, characters of text seen
    plain = _plain(data, "", budget, source)
    text = dump(plain)
    if len(text.encode()) > MAX_FILE_BYTES:
        raise ScenarioError(f"{source}: larger than the limit of {MAX_FILE_BYTES // 1024} KiB "
                            "of a scenario file; is it the right mapping?")
    return text


def _plain(value: Any, path: str, budget: list[int], source: str, depth: int = 0) -> Any:
    """`value` as plain YAML values (str, int, float, bool, None, lists and str-keyed dicts)."""
    def fail(message: str) -> ScenarioError:
        return ScenarioError(printable(f"{source}: {path or '(top level)'}: {message}"))

    budget[0] += 1
    if budget[0] > MAX_VALUES or budget[1] > MAX_FILE_BYTES:
        raise fail(f"more than {MAX_VALUES} values or {MAX_FILE_BYTES // 1024} KiB of text")
    if depth > MAX_DEPTH:
        raise fail(f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise fail(f"key {key!r:.40} is a {type(key).__name__}; keys are names (str)")
            budget[1] += len(key)
        return {str.__str__(k): _plain(v, _join(path, k), budget, source, depth + 1)
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, f"{path}[{i}]", budget, source, depth + 1) for i, v in enumerate(value)]
    if isinstance(value, str):
        budget[1] += len(value)
        if budget[1] > MAX_FILE_BYTES:
            raise fail(f"more than {MAX_FILE_BYTES // 1024} KiB of text")
        return str.__str__(value)  # a str subclass (numpy.str_, StrEnum) as plain str
    if value is None or type(value) in (bool, int, float):
        return value
    raise fail(f"a {type(value).__module__}.{type(value).__name__} is not a plain value; give "
               "a str, int, float, bool, list or dict (e.g. int(x), float(x), str(path))")


_PLAIN_TAGS = {f"{TAG}{t}" for t in ("str", "int", "float", "bool", "null")}


def _to_python(node: yaml.Node, path: str, doc: _Doc, seen: list[int], depth: int = 0) -> Any:
    """Plain values of `node`; `seen[0]` counts values so aliases cannot expand without bound."""
    seen[0] += 1
    if seen[0] > MAX_VALUES:  # at the key it expands under: an alias's own place is not kept
        raise doc.error(path, f"more than {MAX_VALUES} values after expanding aliases",
                        at=re.sub(r"(\[\d+\])+$", "", path))
    if depth > MAX_DEPTH:
        raise doc.error(path, f"nested deeper than {MAX_DEPTH} levels (a recursive alias?)")
    doc.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        _check_tag(node, f"{TAG}map", path, doc)
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = _key(key_node, path, doc)
            sub = f"{path}.{key}" if path else key
            if key in out:
                raise ScenarioError(printable(f"{doc.source}:{key_node.start_mark.line + 1}: "
                                              f"{sub}: duplicate key; keep only one"))
            doc.lines[sub] = key_node.start_mark.line + 1
            out[key] = _to_python(value_node, sub, doc, seen, depth + 1)
        return out
    if isinstance(node, yaml.SequenceNode):
        _check_tag(node, f"{TAG}seq", path, doc)
        return [_to_python(v, f"{path}[{i}]", doc, seen, depth + 1) for i, v in enumerate(node.value)]
    if node.tag not in _PLAIN_TAGS:
        _check_tag(node, f"{TAG}str", path, doc)
    return _scalar(node, path, doc)


def _check_tag(node: yaml.Node, expected: str, path: str, doc: _Doc) -> None:
    if node.tag != expected:
        raise doc.error(path, f"YAML tag {node.tag!r} is not allowed; remove it (plain values "
                              "only)")


def _key(node: yaml.Node, path: str, doc: _Doc) -> str:
    """A mapping key: a plain scalar, taken as written."""
    if not isinstance(node, yaml.ScalarNode) or node.tag not in _PLAIN_TAGS:
        where = f"{doc.source}:{node.start_mark.line + 1}"
        raise ScenarioError(f"{where}: {path or '(top level)'}: a key must be a plain name, not "
                            "a list, mapping or tagged value")
    return str(node.value)


_STR_TAG = f"{TAG}str"
_NUMBER_TAGS = (f"{TAG}int", f"{TAG}float")


def _scalar(node: yaml.ScalarNode, path: str, doc: _Doc) -> Any:
    """The value of a scalar of YAML 1.2's core forms (`yaml_core`; a string is its text, as
    `SafeConstructor.construct_yaml_str` returns it); the document's constructor serves every
    scalar. An explicit tag (`!!int 0x10`) needs its core form too."""
    if node.tag == _STR_TAG:
        if node.style:  # quoted or a block scalar; plain is None (Python parser) or ''
            doc.quoted.add(path)
        return node.value
    if not core_form(node.tag, node.value):
        kind = node.tag.rsplit(":", 1)[-1]
        raise doc.error(path, f"{node.value[:40]!r} is not a YAML 1.2 {kind}; "
                              f"{_FIXES.get(kind, 'write the value plainly')}")
    doc.written[path] = node.value
    constructor = doc.constructor
    try:
        value = constructor.construct_object(node, deep=True)
        if doc.as_written and node.tag in _NUMBER_TAGS:
            return Written(node.value, node.tag)
        return value
    except ValueError:  # e.g. an integer of more digits than Python converts
        raise doc.error(path, f"number too long ({len(node.value)} characters); numbers are "
                              f"bounded by {_fmt(MAX_NUMBER)}") from None
    except yaml.YAMLError as exc:
        raise doc.error(path, f"cannot read value: {getattr(exc, 'problem', exc)}") from None
    finally:  # forget the node, as a new loader would
        constructor.constructed_objects.clear()
        constructor.recursive_objects.clear()


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """`typing.get_type_hints(cls)`, once per class (a scenario builds thousands of nodes)."""
    return typing.get_type_hints(cls)


def _build(cls: type, data: Any, path: str, doc: _Doc) -> Any:
    """Build dataclass `cls` from a mapping, checking keys, types and rules."""
    if not isinstance(data, dict):
        raise doc.error(path, f"expected a mapping with keys {_field_names(cls)}, got "
                              f"{_describe(data)}")
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    data = _with_preset(data, fields, _join(path, "preset"), doc)
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
        if name in NON_EMPTY and not kwargs[name]:
            raise doc.error(sub, "must list at least one entry")
    try:
        return cls(**kwargs)
    except FieldError as exc:  # a spec's own check of its values, its path relative to it
        raise doc.error(_join(path, exc.path), exc.message) from None


def _with_preset(data: dict, fields: dict, path: str, doc: _Doc) -> dict:
    """`data` over the fields of the preset it names (`spec.presets`), if its class has one."""
    name = data.get("preset")
    if "preset" not in fields or name is None:
        return data
    if not isinstance(name, str) or name not in PRESETS:
        hint = difflib.get_close_matches(str(name), list(PRESETS), n=1)
        fix = f"did you mean '{hint[0]}'?" if hint else "or drop preset and give every field"
        raise doc.error(path, f"unknown preset {str(name)!r}; known: {', '.join(PRESETS)}; {fix}")
    preset = {k: list(v) if isinstance(v, tuple) else v for k, v in preset_fields(name).items()}
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    line = doc.line(path)
    for key in preset.keys() - data.keys():  # errors about a preset's value point at `preset:`
        if line is not None:
            doc.lines.setdefault(_join(parent, key), line)
    return {**preset, **data}  # a preset's tuple (a layer pattern) read as the YAML list it is


def _convert(tp: Any, value: Any, path: str, doc: _Doc) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        listed = [a for a in non_none if typing.get_origin(a) is tuple]
        if isinstance(value, list) and listed:  # `int | tuple[int, ...]`: a list picks the tuple
            return _convert(listed[0], value, path, doc)
        return _convert(non_none[0], value, path, doc)
    if origin is Literal:
        if value not in args:
            hint = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            extra = f"; did you mean '{hint[0]}'?" if hint else ""
            got = f"'{value}'" if isinstance(value, (str, int, float)) else _describe(value)
            raise doc.error(path, f"{got} is not allowed (expected one of: "
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
        for k in value:
            _check_text(str(k), _join(path, k), doc, free=False)
            if not NAME.fullmatch(str(k)):
                raise doc.error(_join(path, k), f"'{k}' is not a valid name; {NAME_FIX}")
        return {str(k): _convert(args[1], v, _join(path, k), doc) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, doc)
    return _convert_scalar(tp, value, path, doc)


_FIXES = {"bool": "write true or false", "int": "write it as a plain decimal whole number",
          "float": "write it as a plain decimal number", "null": "write null"}


def _wrong_type(expected: str, kind: str, value: Any, path: str, doc: _Doc) -> ScenarioError:
    """The error for `value` where `expected` (a `kind` of `_FIXES`) belongs; for text that
    YAML 1.1 reads as a number or bool (`yaml_core`), what it would have read."""
    fix = _FIXES[kind]
    if path in doc.quoted and isinstance(value, str) and core_form(f"{TAG}{kind}", value):
        fix = f"{fix}, without quotes"  # plain, the text would be read as wanted
    elif isinstance(value, str) and (old := yaml11_reading(value)) is not None:
        fix = f"YAML 1.1 would read {old!r} but this loader reads YAML 1.2; {fix}"
    return doc.error(path, f"expected {expected}, got {_describe(value)}; {fix}")


def _convert_scalar(tp: type, value: Any, path: str, doc: _Doc) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            raise _wrong_type("true or false", "bool", value, path, doc)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _wrong_type("a whole number", "int", value, path, doc)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _wrong_type("a number", "float", value, path, doc)
        if (problem := non_finite(value)) is not None:
            raise doc.error(path, problem)
        return float(value)
    if tp is str:
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise doc.error(path, f"expected a string, got {_describe(value)}")
        text = value if isinstance(value, str) else doc.written.get(path, str(value))
        _check_text(text, path, doc, free=path.rsplit(".", 1)[-1] in FREE_TEXT)
        rule = TEXT_RULES.get(re.sub(r"\[\d+\]", "[]", path) if "[" in path else path)
        if rule is not None and not rule[0](text):
            raise doc.error(path, rule[1].format(text[:40]))
        return text
    raise AssertionError(f"unsupported spec type {tp}")


def _check_text(text: str, path: str, doc: _Doc, free: bool) -> None:
    """Refuse control characters (line breaks too, unless `free`) in a string."""
    bad = next((c for c in text if not c.isprintable() and not (free and c in "\n\t")), None)
    if bad is not None:
        raise doc.error(path, f"contains the control character {bad!r}; remove it")


def _check_rule(name: str, value: Any, path: str, doc: _Doc, item: bool = False) -> None:
    if isinstance(value, tuple):  # a list of values (search.virtual_stages): each one in range
        for i, entry in enumerate(value):
            _check_rule(name, entry, f"{path}[{i}]", doc, item=True)
        return
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return
    bound = (item and ITEM_BOUNDS.get(name)) or FIELD_BOUNDS.get(name, Bound(-MAX_NUMBER,
                                                                             MAX_NUMBER))
    problem = bound.violation(value)
    if problem is not None:
        raise doc.error(path, problem)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _field_names(cls: type) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls))


def _fmt(value: float) -> str:
    """A bound or value, short: 100000, 1e+15, 0.001."""
    if isinstance(value, int) and abs(value) >= 10**16:
        digits = len(str(abs(value)))
        return f"{float(value):.3g}" if digits < 300 else f"a {digits}-digit number"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "nothing (null)"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
