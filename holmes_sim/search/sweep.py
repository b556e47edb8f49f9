"""Parameter sweeps: run a scenario for every combination of values of some of its fields.

Each `--set PATH=V1,V2,...` names a field by dotted path with list indices
(`inter_cluster_links[0].bandwidth_gbit_per_s`); values are YAML scalars, and a number lands in
the point's YAML as written (`1.50` stays `1.50`, so a text field reads the text as typed). Every
variant is written as YAML and its fields checked by the ordinary loader before anything runs,
then the points run in worker processes (or as Ray tasks, `--ray`) and come back in
cartesian-product order.
"""

from __future__ import annotations

import copy
import csv
import functools
import io
import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from holmes_sim.errors import HolmesError, ScenarioError
from holmes_sim.collector import quiet_collector
from holmes_sim.prepare import Prepared, check_policies, prepare_text
from holmes_sim.hardware.catalog import build_catalog
from holmes_sim.hardware.cluster import check_catalog_names, fabric_notes
from holmes_sim.memo import clear_identity_memos
from holmes_sim.search.planner import usable_cores
from holmes_sim.search.sweep_axes import MAX_POINTS, SweepAxis, parse_axes, set_path
from holmes_sim.search.workers import run_in_pool
from holmes_sim.spec.limits import read_text_bounded
from holmes_sim.spec.load import load_plain, load_scenario_text
from holmes_sim.spec.scenario import Scenario
from holmes_sim.spec.yaml_core import Written, dump

METRICS = ("iteration_time_s", "tflops_per_gpu", "samples_per_s", "bubble_fraction",
           "peak_memory_gib", "fits_memory")


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One combination of values and the scenario YAML it produces; `picks` is the index of
    each axis's value, `policies` the policies it runs (`--policy`, else its scenario's)."""

    index: int
    values: tuple[Any, ...]
    text: str
    picks: tuple[int, ...] = ()
    policies: tuple[str, ...] = ()


@dataclass(slots=True)
class SweepResult:
    """Every point x policy row, in cartesian-product order (policies in requested order):
    `policies` every policy a point runs, in order of first use, `point_policies` each point's
    own list (they differ where a `--set` sweeps `policies`), `notes` the points' fabric notes,
    each once (`sweep_notes`)."""

    scenario: str
    axes: list[SweepAxis]
    policies: list[str]
    rows: list[dict] = field(default_factory=list)
    point_policies: list[tuple[str, ...]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def fields(self) -> list[str]:
        return [a.path for a in self.axes]

    def to_json(self) -> dict:
        document = {"scenario": self.scenario, "policies": list(self.policies)}
        if len(set(self.point_policies)) > 1:
            document["point_policies"] = [list(names) for names in self.point_policies]
        return {**document, "axes": [{"path": a.path, "values": list(a.values)} for a in self.axes],
                "rows": self.rows}


def build_points(path: Path, axes: Sequence[SweepAxis]) -> list[SweepPoint]:
    """Every combination of the axes' values as scenario YAML text (profile paths made absolute
    so they still resolve against the original scenario's folder)."""
    text = read_text_bounded(path, "scenario", "check the path (`holmes-sim scenarios` lists "
                             "the bundled ones)")
    base = load_plain(text, str(path), as_written=True)  # numbers stay as the file wrote them
    if not isinstance(base, dict):
        raise ScenarioError(f"{path}: a scenario must be a mapping of keys (clusters, model, ...)")
    points = []
    for index, picks in enumerate(itertools.product(*(range(len(a.values)) for a in axes))):
        data = copy.deepcopy(base)
        for axis, j in zip(axes, picks, strict=True):
            set_path(data, axis, axis.as_written[j])
        profile = data.get("profile")
        if isinstance(profile, str) and not Path(profile).is_absolute():
            data["profile"] = str((path.parent / profile).resolve())
        values = tuple(a.values[j] for a, j in zip(axes, picks, strict=True))
        points.append(SweepPoint(index, values, dump(data), picks))
    return points


def prepare_point(point: SweepPoint, source: Path, axes: Sequence[SweepAxis]) -> Prepared:
    """Check a point's YAML with the ordinary loader and `prepare_text`, in memory (a worker the
    memory guard kills leaves no file behind); errors as `_point_error` gives them."""
    try:
        with quiet_collector():
            return prepare_text(point.text, str(source), source.parent)
    except HolmesError as exc:
        raise _point_error(exc, str(source), point, source, axes) from None


def check_point_fields(point: SweepPoint, source: Path, axes: Sequence[SweepAxis]) -> Scenario:
    """Check a point's fields against the schema only (names, types, ranges): a mistake there is
    the user's, fatal for the whole sweep, while a valid point may still be infeasible (its
    values conflict with each other or with the rest of the scenario). The point's scenario."""
    name = "<sweep point>"
    try:
        return load_scenario_text(point.text, name, check=_check_names)
    except HolmesError as exc:
        raise _point_error(exc, name, point, source, axes) from None


def _point_error(exc: HolmesError, name: str, point: SweepPoint, source: Path,
                 axes: Sequence[SweepAxis]) -> HolmesError:
    """The error `exc` of a point's YAML (read as `name`): the scenario file's own error, with
    its file and line as `run` gives it, where the file checked the same way (schema only when
    `name` is not the file's) fails with the same message about a field no `--set` sets; else
    `exc` naming the point's `--set` values, which made the point invalid."""
    message = _unlocated(str(exc), name)
    if not any(message.startswith((f"{a.path}: ", f"{a.path}.", f"{a.path}[")) for a in axes):
        try:
            text = read_text_bounded(source, "scenario", "check the path")
        except HolmesError:
            text = None
        own = None if text is None else _file_error(text, str(source), name == str(source))
        if own is not None and _unlocated(str(own), str(source)) == message:
            return _error_of(own, str(own))
    return _error_of(exc, f"{point_label(point, source, axes)}: {message}")


def _unlocated(message: str, name: str) -> str:
    """`message` without the `name:line: ` in front."""
    return re.sub(rf"^{re.escape(name)}(:\d+)?: ", "", message)


@functools.lru_cache(maxsize=4)
def _file_error(text: str, source: str, prepared: bool) -> HolmesError | None:
    """The error of the scenario file `source` holding `text`, checked as a point is (`prepared`:
    by `prepare_text`, else its fields only); None where it passes. Once per text: the points of
    a sweep meet the file's error alike."""
    try:
        with quiet_collector():
            if prepared:
                prepare_text(text, source, Path(source).parent)
            else:
                load_scenario_text(text, source, check=_check_names)
    except HolmesError as exc:
        return exc
    return None


def _check_names(scenario: Scenario) -> None:
    """The catalog models the point's node groups name and its policies exist (a misspelt `gpu`
    or policy is the user's mistake, not an infeasible point)."""
    check_catalog_names(scenario.clusters, build_catalog(scenario.catalog))
    check_policies(scenario)


def point_label(point: SweepPoint, source: Path, axes: Sequence[SweepAxis]) -> str:
    """'<scenario> with --set A=1,2 (value 2), ...': which point an error is about (its values
    as written: `1e3`, 'eth-25g', True)."""
    written = ([a.as_written[j] for a, j in zip(axes, point.picks, strict=True)] if point.picks
               else point.values)
    values = ", ".join(f"--set {a.arg} (value {v if isinstance(v, Written) else repr(v)})"
                       for a, v in zip(axes, written, strict=True))
    return f"{source} with {values}"


def _error_of(exc: HolmesError, message: str) -> HolmesError:
    cls = ScenarioError if isinstance(exc, ScenarioError) else type(exc)
    return cls(message)


PointRun = tuple[list[dict], tuple[str, ...] | None]
"""A point's rows and the fabric notes of its cluster (None: the point does not prepare)."""


def run_point(point: SweepPoint, source: Path, axes: Sequence[SweepAxis],
              policies: Sequence[str] | None) -> PointRun:
    """Simulate one point; its rows in the requested (or scenario) policy order, and its
    cluster's `fabric_notes`. A point whose scenario or plan is invalid gives rows with status
    'infeasible', the reason and no figures; a plan that does not fit in GPU memory gives status
    'no fit'."""
    from holmes_sim.runner import run_scenario

    clear_identity_memos()  # nothing of an earlier point's (prepared anew) is met again
    notes = None
    try:
        prepared = prepare_point(point, source, axes)
        notes = fabric_notes(prepared.cluster)
        names = list(policies or prepared.scenario.policies)
        by_name = {o.plan.policy: o.result for o in run_scenario(prepared, names)}
    except HolmesError as exc:
        reason = re.sub(r"^.* with --set .*?\): ", "", str(exc))
        return [_row(point, axes, name, None, reason) for name in policies or ["-"]], notes
    return [_row(point, axes, name, by_name[name].to_json(), "") for name in names], notes


def sweep_notes(points: Sequence[SweepPoint], notes: Sequence[tuple[str, ...] | None]) -> list[str]:
    """Each fabric note of the points (`notes`, as `run_point` gives them) once, in order of
    first use, naming the points it is about when it is not about every point that prepared."""
    prepared = [p.index for p, n in zip(points, notes, strict=True) if n is not None]
    where: dict[str, list[int]] = {}
    for point, point_notes in zip(points, notes, strict=True):
        for note in point_notes or ():
            where.setdefault(note, []).append(point.index)
    return [note if found == prepared else
            f"note: at point{'s' * (len(found) > 1)} {', '.join(map(str, found))}, "
            f"{note.removeprefix('note: ')}" for note, found in where.items()]


def run_points(context: tuple[Path, Sequence[SweepAxis]], policies: Sequence[str] | None,
               points: Sequence[SweepPoint]) -> list[PointRun]:
    """`run_point` for each of `points` (one Ray task's share of a sweep)."""
    source, axes = context
    return [run_point(p, source, axes, policies) for p in points]


def _row(point: SweepPoint, axes: Sequence[SweepAxis], policy: str, record: dict | None,
         reason: str) -> dict:
    row: dict[str, Any] = {"point": point.index}
    row.update({a.path: v for a, v in zip(axes, point.values, strict=True)})
    row["policy"] = policy
    row.update({m: None if record is None else record[m] for m in METRICS})
    if record is None:
        row["status"] = "infeasible"
    else:
        row["status"] = "ok" if record["fits_memory"] else "no fit"
    row["reason"] = reason
    return row


def run_sweep(path: str | Path, sets: Sequence[str], policies: Sequence[str] | None = None,
              jobs: int | None = None,
              progress: Callable[[int, int], None] | None = None,
              ray: str | None = None, max_points: int = MAX_POINTS) -> SweepResult:
    """Run every combination of the `--set` values; rows in cartesian-product order.

    Args:
        path: the scenario YAML.
        sets: the `PATH=V1,V2,...` arguments.
        policies: policies to run (default: the scenario's list).
        jobs: worker processes (default min(2, points)); 1 runs in this process.
        progress: called with (points done, points total) after each point.
        ray: run the points as Ray tasks instead ("auto" or a cluster address, see
            `holmes_sim.search.scaleout`); rows come back in the same order as a local run's.

    Each point runs `policies`, else its own scenario's (a `--set` may sweep `policies`).
    Points whose variant is infeasible or whose plans fail are reported as infeasible rows and
    skipped. The result's `notes` say once where a fabric joins clusters, as `run` does.

    Raises:
        ScenarioError: for a bad `--set`, more than `max_points` points (repeated values
            count once), or when no point is valid, before anything runs; when no point is
            feasible, after.
    """
    from holmes_sim.runner import scenario_file
    from holmes_sim.search.scaleout import check_address

    check_address(ray)
    path = Path(path)
    axes, points = _checked_points(path, parse_axes(sets, max_points), policies)
    _first_valid(points, path, axes)  # none valid: exit 2, with --policy too
    runs = _run_points(points, path, axes, policies, jobs, progress, ray)
    rows = [row for part, _ in runs for row in part]
    _check_feasible(points, path, axes, rows)
    names = list(dict.fromkeys(name for p in points for name in p.policies))
    return SweepResult(scenario_file(path), axes, names, rows, [p.policies for p in points],
                       sweep_notes(points, [notes for _, notes in runs]))


def _run_points(points: list[SweepPoint], path: Path, axes: list[SweepAxis],
                policies: Sequence[str] | None, jobs: int | None,
                progress: Callable[[int, int], None] | None, ray: str | None) -> list[PointRun]:
    """Every point's `run_point`, in the points' order (see `run_sweep`)."""
    jobs = max(1, min(jobs if jobs is not None else 2, len(points), usable_cores()))
    results: dict[int, PointRun] = {}
    if progress:
        progress(0, len(points))
    if ray is not None:
        from holmes_sim.search.scaleout import ray_map
        options = None if policies is None else tuple(policies)
        parts = ray_map(run_points, (path, tuple(axes)), options, [[p] for p in points], ray,
                        progress, len(points))
        results = {p.index: part[0] for p, part in zip(points, parts, strict=True)}
    elif jobs == 1:
        for point in points:
            results[point.index] = run_point(point, path, axes, policies)
            if progress:
                progress(len(results), len(points))
    else:
        parts = run_in_pool(functools.partial(run_point, source=path, axes=axes, policies=policies),
                            points, min(jobs, len(points)), progress)
        results = {p.index: part for p, part in zip(points, parts, strict=True)}
    return [results[p.index] for p in points]


def _check_feasible(points: Sequence[SweepPoint], path: Path, axes: Sequence[SweepAxis],
                    rows: Sequence[dict]) -> None:
    """ScenarioError with the first point's reason when no point has a plan to show."""
    if all(r["status"] == "infeasible" for r in rows):
        raise ScenarioError(f"{point_label(points[0], path, axes)}: {rows[0]['reason']} "
                            f"({NONE_FEASIBLE})")


NONE_FEASIBLE = "no variant of the sweep is feasible"


def _field(scenario: Scenario, tokens: Sequence[str | int]) -> Any:
    """The value at `tokens` in the loaded scenario; None where the path leads nowhere."""
    node: Any = scenario
    try:
        for token in tokens:
            node = node[token] if isinstance(token, int) or isinstance(node, dict) else \
                getattr(node, token)
    except (AttributeError, IndexError, KeyError, TypeError):
        return None
    return node


def _checked_points(path: Path, axes: list[SweepAxis], policies: Sequence[str] | None = None,
                    ) -> tuple[list[SweepAxis], list[SweepPoint]]:
    """Every point built and its fields checked (a mistake there ends the sweep), with the
    policies it runs (`policies`, else its scenario's). An axis whose field reads text shows its
    numbers as written (`1e3`, not 1000.0); on the others the numbers that read alike (`100`,
    `100.0`, `1e2`, which make one scenario) are kept once, the first as written."""
    points = build_points(path, axes)
    scenarios = [check_point_fields(p, path, axes) for p in points]
    text = [isinstance(_field(scenarios[0], a.tokens), str) for a in axes]
    merged = [a if is_text else _merge_numbers(a) for a, is_text in zip(axes, text, strict=True)]
    if merged != axes:
        points = build_points(path, merged)
        scenarios = [check_point_fields(p, path, merged) for p in points]
    shown = [_as_text(a) if is_text else a for a, is_text in zip(merged, text, strict=True)]
    return shown, [replace(p, values=tuple(a.values[j] for a, j in zip(shown, p.picks, strict=True)),
                           policies=tuple(policies or s.policies))
                   for p, s in zip(points, scenarios, strict=True)]


def _merge_numbers(axis: SweepAxis) -> SweepAxis:
    """`axis` with its values that read alike kept once, the first as written: `100`, `100.0`
    and `1e2` are one number (a boolean stays apart from 1 and 0)."""
    kept: dict[tuple, int] = {}
    for j, v in enumerate(axis.values):
        kept.setdefault((isinstance(v, bool), v), j)
    if len(kept) == len(axis.values):
        return axis
    order = sorted(kept.values())
    return replace(axis, values=tuple(axis.values[j] for j in order),
                   written=tuple(axis.as_written[j] for j in order))


def _as_text(axis: SweepAxis) -> SweepAxis:
    """`axis` with each number shown as written, as its text field reads it."""
    return replace(axis, values=tuple(str(w) if isinstance(w, Written) else v
                                      for v, w in zip(axis.values, axis.as_written, strict=True)))


def _first_valid(points: Sequence[SweepPoint], path: Path, axes: Sequence[SweepAxis]) -> Prepared:
    """The first point that prepares; when none does, the first point's error."""
    first: HolmesError | None = None
    for point in points:
        try:
            return prepare_point(point, path, axes)
        except HolmesError as exc:
            first = first or exc
    assert first is not None
    raise first


def sweep_csv(result: SweepResult) -> str:
    """The rows as CSV: point, swept fields, policy, metrics."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=["point", *result.fields, "policy", *METRICS,
                                                "status", "reason"],
                            lineterminator="\n")
    writer.writeheader()
    writer.writerows(result.rows)
    return buffer.getvalue()


SWEEP_FILES = ("sweep.csv", "sweep.json", "sweep_iteration_time.png", "sweep_tflops.png")
"""The files `sweep --out` writes."""


def write_sweep(directory: str | Path, result: SweepResult) -> None:
    """Write sweep.csv, sweep.json, sweep_iteration_time.png and sweep_tflops.png as one change
    (`report.staged.write_together`): a failure, or a Ctrl-C, while they are made or swapped in
    leaves the folder's earlier files as they were (and removes a folder this run created)."""
    from holmes_sim.report import plots
    from holmes_sim.report.files import deferred_interrupt, json_text, prepare_output
    from holmes_sim.report.owned import owned_folder
    from holmes_sim.report.staged import write_together
    from holmes_sim.runner import stamp

    directory = prepare_output(directory, directory=True, option="--out")
    makers = {
        "sweep.csv": lambda: sweep_csv(result),
        "sweep.json": lambda: json_text(stamp(result.to_json())),
        "sweep_iteration_time.png": lambda: plots.figure_png(plots.sweep_figure(
            result.rows, result.fields, "iteration_time_s", "iteration time (s)")),
        "sweep_tflops.png": lambda: plots.figure_png(plots.sweep_figure(
            result.rows, result.fields, "tflops_per_gpu", "TFLOP/s per GPU")),
    }
    with deferred_interrupt() as interrupted, \
            owned_folder(directory, "--out", SWEEP_FILES) as folder:
        files = {}
        for name in SWEEP_FILES:
            files[name] = makers[name]()
            interrupted()
        write_together(directory, files, folder, "--out")


SWEEP_METRICS = ("iter s", "TFLOP/s/GPU", "mem GiB")
SWEEP_DROP_ORDER = ("mem GiB", "TFLOP/s/GPU")


def sweep_table(result: SweepResult, width: int = 80, wide: bool = False) -> Any:
    """A rich Table: one row per point x policy, the main figures (sweep.csv has them all) and a
    note saying why a point is infeasible or that a plan does not fit in GPU memory. A field's
    header is the end of its path that tells it apart (the caption gives the full path), folded
    at dots and underscores to fit `width`; the field values and the policy, which name the row,
    are never cut."""
    from holmes_sim.report.tables import fit_table, table_width

    headers = (*result.fields, "policy", *SWEEP_METRICS)
    for line in HEADER_LINES:  # fold the field headers further until the table fits
        table = fit_table(lambda shown: _sweep_table(result, shown, line), headers,
                          SWEEP_DROP_ORDER, width, wide)
        if wide or table_width(table) <= width:
            break
    return table


def field_headers(fields: Sequence[str]) -> dict[str, str]:
    """Each swept field's column header: the fewest last dotted segments that tell it apart
    from the other fields (`bandwidth_gbit_per_s`, or `nodes[1].nics[1].bandwidth_gbit_per_s`
    when two fields end alike)."""
    parts = {f: f.split(".") for f in fields}
    out = {}
    for f in fields:
        n = 1
        while n < len(parts[f]) and any(g != f and parts[g][-n:] == parts[f][-n:] for g in fields):
            n += 1
        out[f] = ".".join(parts[f][-n:])
    return out


HEADER_LINES = (40, 24, 16, 10, 1)
"""Line lengths a field header is folded to, widest first, until the table fits the console."""


def folded_header(header: str, line: int) -> str:
    """`header` on lines of at most `line` characters (or one unbreakable piece), broken only
    before a dot or after an underscore, so a narrow column folds `nics[1].bandwidth_gbit` at
    path separators and word joins, never inside a name."""
    lines: list[str] = []
    for piece in re.split(r"(?=\.)|(?<=_)", header):
        if lines and len(lines[-1]) + len(piece) <= line:
            lines[-1] += piece
        elif piece:
            lines.append(piece)
    return "\n".join(lines)


def _sweep_table(result: SweepResult, shown: Sequence[str], line: int) -> Any:
    """The table with the metric columns `shown` and field headers folded to `line` characters.
    Each value, policy and metric column is at least as wide as its widest cell, so a narrow
    console folds headers and notes and never cuts a value or a number."""
    from rich.table import Table
    from rich.text import Text

    from holmes_sim.report.tables import column_widths

    table = Table(title=Text(f"sweep of {result.scenario}: {len(result.rows)} runs"),
                  title_justify="left", caption_justify="left")
    short = field_headers(result.fields)
    metrics = [i for i, col in enumerate(SWEEP_METRICS) if col in shown]
    notes = any(r["status"] != "ok" for r in result.rows)
    rows = [[*(str(r[f]) for f in result.fields), r["policy"],
             *(cells[i] for i in metrics), *((cells[-1],) if notes else ())]
            for r in result.rows for cells in [_metric_cells(r)]]
    headers = [folded_header(short[name], line) for name in result.fields]
    # a metric's header folds, so only its cells set its width
    width = column_widths(rows, [*headers, "policy", *("" for _ in metrics)])
    for k, header in enumerate(headers):
        table.add_column(Text(header), justify="right", overflow="fold", min_width=width[k])
    table.add_column("policy", no_wrap=True, min_width=width[len(result.fields)])
    for k, i in enumerate(metrics, len(result.fields) + 1):
        table.add_column(SWEEP_METRICS[i], justify="right", overflow="fold", min_width=width[k])
    if notes:
        table.add_column("note", min_width=12, ratio=1)
    for cells in rows:
        table.add_row(*map(Text, cells))
    lines = [f"{short[f]}: {f}" for f in result.fields if short[f] != f]
    lines += [f"point {p} skipped: {why}" for p, why in
              {r["point"]: r["reason"] for r in result.rows if r["status"] == "infeasible"}.items()]
    if lines:
        table.caption = Text("\n".join(lines))
    return table


def _metric_cells(row: dict) -> tuple[str, ...]:
    if row["status"] == "infeasible":
        return ("-", "-", "-", f"infeasible (point {row['point']}, see below)")
    return (f"{row['iteration_time_s']:.3f}", f"{row['tflops_per_gpu']:.1f}",
            f"{row['peak_memory_gib']:.1f}", "" if row["fits_memory"] else "OOM: does not fit in GPU memory")
