"""The `--set PATH=V1,V2,...` arguments of a sweep: each read as an axis (a field path and the
values to try, numbers kept as written) and checked against the limits on values, paths and
points before any point is built; `set_path` puts a value into a scenario's plain YAML data."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from holmes_sim.errors import ScenarioError
from holmes_sim.spec.load import load_plain
from holmes_sim.spec.yaml_core import MAX_DEPTH, Written

MAX_POINTS = 500
"""Most points a sweep runs unless raised with `--max-points` (each simulates every policy)."""
VALUES_PER_POINT = 20
"""A `--set` lists at most this many values per point `--max-points` allows (repeats count
once as points, so a list may repeat some), up to `MAX_SET_VALUES`."""
MAX_SET_VALUES = 100_000
"""Most values one `--set` lists whatever `--max-points`. Reading them takes 2 s for 10,000, 28 s
for 100,000 and 70 s for 200,000 (the cost per value grows with the count), and 1,000,000 did not
finish in 15 minutes; building and checking each distinct value's point takes 5-13 ms more, so
100,000 is already tens of minutes before anything runs. A command-line argument holds at most
128 KiB on Linux, about 65,000 values."""
MAX_VALUE_CHARS = 200
"""Longest `--set` value (a number, name or boolean; longer text is refused before parsing)."""
MAX_PATH_CHARS = 300
"""Longest `--set` field path (a deep one, `clusters[0].nodes[1].nics[0].bandwidth_gbit_per_s`,
has 50)."""
MAX_PATH_PARTS = MAX_DEPTH - 1
"""Most names and [indices] in a `--set` path: the scenario's top mapping and the value under
the path make it as deep as the loader allows (`yaml_core.MAX_DEPTH`)."""
_SEGMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_-]*)((?:\[\d+\])*)")


@dataclass(frozen=True, slots=True)
class SweepAxis:
    """One `--set` argument: the field path, its parsed tokens and the values to try: `values`
    as the outputs show them (a number, or the text as written where the field reads text),
    `written` as they land in the point's YAML (numbers as `Written` text; empty: `values`)."""

    arg: str
    path: str
    tokens: tuple[str | int, ...]
    values: tuple[Any, ...]
    written: tuple[Any, ...] = ()

    @property
    def as_written(self) -> tuple[Any, ...]:
        return self.written or self.values



def parse_set(arg: str, max_points: int = MAX_POINTS) -> SweepAxis:
    """Parse `PATH=V1,V2,...`; values are YAML scalars (100 is an int, eth-25g a string), each
    number also kept as written (`SweepAxis.written`). At most `VALUES_PER_POINT` x `max_points`
    values (and `MAX_SET_VALUES`), counted before any is read.

    Raises:
        ScenarioError: naming `arg` and what is wrong with it.
    """
    path, sep, raw = arg.partition("=")
    path = path.strip()
    if not sep or not path:
        raise ScenarioError(f"--set {arg}: expected PATH=V1,V2,... (e.g. "
                            "training.global_batch_size=256,512)")
    tokens = parse_path(path, arg)
    if path == "policies":  # a value is one scalar; the field is a list
        raise ScenarioError(f"--set {arg}: a value sets one field, and policies is a list; "
                            "sweep one of its entries (e.g. --set 'policies[1]=holmes,"
                            "megatron-llama'), or run chosen policies at every point with -p")
    _check_value_count(path, raw.count(",") + 1, max_points)
    texts = raw.split(",")
    distinct: dict[tuple[type, Any], Any] = {}  # by the text of a number: 1.50 and 1.5 apart,
    for text in texts:                          # and 1, 1.0 and true apart
        written, value = _read_value(text, arg, path)
        distinct.setdefault((type(written), written), value)
    return SweepAxis(arg, path, tokens, tuple(distinct.values()),
                     tuple(written for _, written in distinct))


def _check_value_count(path: str, count: int, max_points: int) -> None:
    """ScenarioError when a `--set` of `path` lists more values than `parse_set` reads."""
    limit = min(VALUES_PER_POINT * max_points, MAX_SET_VALUES)
    if count <= limit:
        return
    if limit == MAX_SET_VALUES:
        raise ScenarioError(f"--set {path}=...: {count:,} values; one --set lists at most "
                            f"{limit:,} whatever --max-points; give fewer values")
    raise ScenarioError(f"--set {path}=...: {count:,} values; with --max-points {max_points:,} "
                        f"one --set lists at most {limit:,}; give fewer values or raise "
                        "--max-points")


def _read_value(text: str, arg: str, path: str) -> tuple[Any, Any]:
    """One `--set` value as written (a number as `Written` text) and as its YAML value."""
    if not text.strip():
        raise ScenarioError(f"--set {arg}: empty value; list values separated by commas")
    if len(text) > MAX_VALUE_CHARS:
        raise ScenarioError(f"--set {path}=...: a value of {len(text):,} characters; values are "
                            f"single numbers, names or booleans (at most {MAX_VALUE_CHARS})")
    try:
        written = load_plain(text.strip(), f"--set {arg}", as_written=True)
    except ScenarioError:
        raise ScenarioError(f"--set {arg}: cannot read value '{text.strip()}' as a YAML "
                            "scalar") from None
    if isinstance(written, dict | list) or written is None:
        raise ScenarioError(f"--set {arg}: value '{text.strip()}' is not a single number, "
                            "string or boolean")
    if isinstance(written, Written):
        return written, load_plain(str(written), f"--set {arg}")
    return written, written


def parse_path(path: str, arg: str) -> tuple[str | int, ...]:
    """`a.b[1].c` -> ('a', 'b', 1, 'c'); at most MAX_PATH_CHARS and MAX_PATH_PARTS, indices
    plain decimals (`[01]` is refused, as the loader refuses `01` for a number)."""
    shown = path if len(path) <= 40 else f"{path[:40]}..."
    if len(path) > MAX_PATH_CHARS:
        raise ScenarioError(f"--set {shown}=...: a path of {len(path):,} characters; field paths "
                            f"are at most {MAX_PATH_CHARS} (e.g. clusters[0].nodes[1].count)")
    tokens: list[str | int] = []
    for segment in path.split("."):
        m = _SEGMENT.fullmatch(segment)  # not match + `$`, which takes a trailing newline
        if m is None:
            raise ScenarioError(f"--set {arg}: '{segment}' is not a field name with optional "
                                "[index] (e.g. clusters[0].nodes[1].count)")
        tokens.append(m.group(1))
        for index in re.findall(r"\[(\d+)\]", m.group(2)):
            if index != str(int(index)):
                raise ScenarioError(f"--set {arg}: index [{index}] has a leading zero; write "
                                    f"[{int(index)}]")
            tokens.append(int(index))
    if len(tokens) > MAX_PATH_PARTS:
        raise ScenarioError(f"--set {shown}=...: a path of {len(tokens)} parts; scenario fields "
                            f"nest at most {MAX_PATH_PARTS} deep (each name and [index] is a "
                            "part); check the path")
    return tuple(tokens)


def set_path(data: Any, axis: SweepAxis, value: Any) -> None:
    """Set `axis.path` to `value` in the plain YAML data (in place). A missing mapping key is
    added, as an empty mapping where more keys follow (a section the file leaves out, such as
    `variability`); the loader then rejects keys the scenario does not know.

    Raises:
        ScenarioError: naming the `--set` argument for a missing key or list index out of range.
    """
    node, where = data, ""
    for k, token in enumerate(axis.tokens):
        last = k == len(axis.tokens) - 1
        if isinstance(token, int):
            if not isinstance(node, list):
                raise ScenarioError(f"--set {axis.arg}: {where or 'the scenario'} is not a list, "
                                    f"so [{token}] does not apply")
            if token >= len(node):
                raise ScenarioError(f"--set {axis.arg}: index [{token}] out of range: {where} has "
                                    f"{len(node)} item(s)")
            where = f"{where}[{token}]"
        else:
            if not isinstance(node, dict):
                raise ScenarioError(f"--set {axis.arg}: {where or 'the scenario'} is not a "
                                    f"mapping, so '.{token}' does not apply")
            if token not in node and not last:
                if isinstance(axis.tokens[k + 1], int):
                    raise ScenarioError(f"--set {axis.arg}: {where or 'the scenario'} has no "
                                        f"list '{token}' to index; add it to the file first")
                node[token] = {}
            where = f"{where}.{token}" if where else token
        if last:
            node[token] = value
        else:
            node = node[token]


def parse_axes(sets: Sequence[str], max_points: int) -> list[SweepAxis]:
    """The `--set` arguments as axes, each field swept once, at most `max_points` points."""
    if not sets:
        raise ScenarioError("give at least one --set PATH=V1,V2,...")
    axes = [parse_set(s, max_points) for s in sets]
    seen = [a.tokens for a in axes]
    for a in axes:
        if seen.count(a.tokens) > 1:
            raise ScenarioError(f"--set {a.arg}: {a.path} is swept more than once; give its "
                                "values in one --set")
    check_point_count(axes, max_points)
    return axes


def check_point_count(axes: Sequence[SweepAxis], max_points: int) -> None:
    """ScenarioError when the axes make more than `max_points` points."""
    count = math.prod(len(a.values) for a in axes)
    if count > max_points:
        sizes = " x ".join(f"{len(a.values)} ({a.path})" for a in axes)
        raise ScenarioError(f"--set: {sizes} = {count:,} points, above the limit of "
                            f"{max_points:,}; give fewer values or raise --max-points")
