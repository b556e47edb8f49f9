"""Figures of a run, a validation and a sweep (matplotlib, Agg backend, imported lazily).

Each `*_figure` function returns a matplotlib Figure so tests can read the plotted data back;
`save_figure` writes it as a deterministic PNG (fixed size and dpi, no Software/date metadata).
"""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from holmes_sim.metrics import BREAKDOWN_KEYS, Result
from holmes_sim.report.files import write_atomic
from holmes_sim.report.sampling import sample_entities
from holmes_sim.sim.trace import Entity, OpKind, Trace
from holmes_sim.units import GIB

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

P = ParamSpec("P")
R = TypeVar("R")
DPI = 110
MAX_TIMELINE_ROWS = 32

CATEGORY_COLOURS = {
    "compute": "#4C72B0", "tp_comm": "#8172B2", "cp_comm": "#B07AA1", "ep_comm": "#64B5CD",
    "pp_exposed": "#DD8452",
    "dp_exposed": "#C44E52", "optimizer": "#333333", "bubble": "#C8C8C8",
}
CATEGORY_LABELS = {
    "compute": "compute (F+B)", "tp_comm": "TP comm", "cp_comm": "CP exposed",
    "ep_comm": "EP all-to-all",
    "pp_exposed": "PP exposed (wait)",
    "dp_exposed": "DP exposed (wait)", "optimizer": "optimizer", "bubble": "bubble / idle",
}
OP_COLOURS = {
    OpKind.FORWARD: "#4C72B0", OpKind.BACKWARD: "#55A868", OpKind.TP_COMM: "#8172B2",
    OpKind.CP_COMM: "#B07AA1", OpKind.EP_COMM: "#64B5CD",
    OpKind.WAIT_PP: "#DD8452", OpKind.WAIT_BUBBLE: "#C8C8C8", OpKind.WAIT_DP: "#C44E52",
    OpKind.OPTIMIZER: "#222222", OpKind.PP_SEND: "#937860",
    OpKind.DP_REDUCE_SCATTER: "#17BECF", OpKind.DP_ALL_GATHER: "#0B6E78",
    OpKind.DP_ALL_REDUCE: "#2CA02C", OpKind.EMBEDDING_ALL_REDUCE: "#E377C2",
}
OP_LABELS = {
    OpKind.WAIT_PP: "wait-pp (exposed PP)", OpKind.WAIT_DP: "wait-dp (exposed DP)",
    OpKind.WAIT_BUBBLE: "wait-bubble (bubble)", OpKind.PP_SEND: "pp-send (PP lane)",
}
# Lanes of one timeline row (row i spans y in [i - 0.45, i + 0.45]): (bottom offset, height).
LANES = {"compute": (-0.45, 0.5), "pp": (0.08, 0.16), "dp": (0.27, 0.16)}


HOUSE_RC = {"text.parse_math": False}
"""The project's settings over matplotlib's defaults. Names in titles, labels and legends are
the user's text: a `$` in a scenario or policy name prints as itself, not as mathtext (no figure
here uses math)."""


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (imported on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextlib.contextmanager
def house_style() -> Iterator[None]:
    """matplotlib's own defaults with `HOUSE_RC` over them, whatever the user's matplotlibrc
    ($MATPLOTLIBRC, ~/.config/matplotlib) or rcParams say; the caller's settings come back after."""
    pyplot()
    import matplotlib.style

    with matplotlib.style.context("default"), matplotlib.rc_context(HOUSE_RC):
        yield


def _styled(function: Callable[P, R]) -> Callable[P, R]:
    """`function` run under `house_style`: a figure is built and drawn with the same settings."""
    @functools.wraps(function)
    def styled(*args: P.args, **kwargs: P.kwargs) -> R:
        with house_style():
            return function(*args, **kwargs)
    return styled


def save_figure(fig: Figure, path: str | Path) -> None:
    """Write `figure_png(fig)` atomically."""
    write_atomic(path, figure_png(fig))


@_styled
def figure_png(fig: Figure) -> bytes:
    """`fig` as a PNG with no timestamp or software metadata; the figure is closed. Drawing is
    quiet: a user's name in a script the font lacks draws as boxes, and a label too long for
    constrained layout stays where it is, without matplotlib's UserWarnings."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        fig.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
    pyplot().close(fig)
    return buffer.getvalue()


def _fastest_first(results: Sequence[Result]) -> list[Result]:
    return sorted(results, key=lambda r: (r.iteration_time_s, r.policy))


def _barh(ax: Axes, names: list[str], values: list[float], colour: str, fmt: str) -> None:
    ax.barh(range(len(values)), values, color=colour)
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(len(names) - 0.5, -0.5)  # first on top (explicit: invert_yaxis toggles)
    for i, v in enumerate(values):
        ax.text(v, i, " " + fmt.format(v), va="center", fontsize=8)
    ax.set_xlim(0, max(values, default=1) * 1.18 or 1)
    ax.grid(axis="x", alpha=0.3)


@_styled
def iteration_time_figure(results: Sequence[Result], title: str = "",
                          references: Sequence[str] = ()) -> Figure:
    """Two horizontal bar panels, fastest policy on top: iteration time (s), TFLOP/s per GPU;
    the policies in `references` (bounds on a hypothetical network) are labelled so."""
    ordered = _fastest_first(results)
    names = [r.policy + (" (reference)" if r.policy in references else "") for r in ordered]
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(12, max(2.6, 1.4 + 0.42 * len(ordered))),
                                           sharey=True, layout="constrained")
    _barh(left, names, [r.iteration_time_s for r in ordered], "#4C72B0", "{:.3f} s")
    left.set_xlabel("iteration time (s), lower is better")
    left.set_title("Iteration time")
    _barh(right, names, [r.tflops_per_gpu for r in ordered], "#55A868", "{:.1f}")
    right.set_xlabel("TFLOP/s per GPU (Megatron-LM formula), higher is better")
    right.set_title("Throughput per GPU")
    fig.suptitle(title or "Iteration time and throughput per policy (fastest first)")
    return fig


@_styled
def breakdown_figure(results: Sequence[Result], title: str = "") -> Figure:
    """Stacked horizontal bars per policy of `Result.breakdown_s` (s), in BREAKDOWN_KEYS order."""
    ordered = _fastest_first(results)
    height = max(3.0, 1.8 + 0.42 * len(ordered))
    fig, ax = pyplot().subplots(figsize=(12, height), layout="constrained")
    y = list(range(len(ordered)))
    left = [0.0] * len(ordered)
    for key in BREAKDOWN_KEYS:
        widths = [r.breakdown_s[key] for r in ordered]
        ax.barh(y, widths, left=left, color=CATEGORY_COLOURS[key], label=CATEGORY_LABELS[key])
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for i, total in enumerate(left):
        ax.text(total, i, f" {total:.3f} s", va="center", fontsize=8)
    ax.set_yticks(y, [r.policy for r in ordered])
    ax.set_ylim(len(ordered) - 0.5, -0.5)
    ax.set_xlim(0, max(left, default=1) * 1.15 or 1)
    ax.set_xlabel("time per iteration (s), mean over (stage, replica) entities")
    ax.set_title(title or "Where the iteration goes, per policy (fastest first)")
    fig.legend(loc="outside lower center", ncol=4, frameon=False, fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return fig


@_styled
def memory_figure(results: Sequence[Result], title: str = "") -> Figure:
    """Grouped bars: peak memory per GPU (GiB) of each pipeline stage per policy, with each
    stage's GPU capacity as a dashed line over its group."""
    ordered = _fastest_first(results)
    stages = max((len(r.memory.per_stage_bytes) for r in ordered), default=1)
    fig, ax = pyplot().subplots(figsize=(12, 5.5), layout="constrained")
    colours = pyplot().get_cmap("tab10")
    width = 0.8 / max(1, len(ordered))
    for k, r in enumerate(ordered):
        xs = [s - 0.4 + width * (k + 0.5) for s in range(len(r.memory.per_stage_bytes))]
        ax.bar(xs, [b / GIB for b in r.memory.per_stage_bytes], width=width,
               color=colours(k % 10), label=r.policy + ("" if r.memory.fits else " (OOM)"))
    capacity = _stage_capacity_gib(ordered, stages)
    ax.hlines(capacity, [s - 0.45 for s in range(stages)], [s + 0.45 for s in range(stages)],
              colors="black", linestyles="dashed", label="GPU memory capacity")
    ax.set_xticks(range(stages), [str(s) for s in range(stages)])
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("peak memory per GPU (GiB)")
    ax.set_ylim(0, max(capacity + [r.memory.peak_gib for r in ordered]) * 1.1)
    ax.set_title(title or "Peak memory per GPU of each pipeline stage vs GPU capacity")
    fig.legend(loc="outside lower center", ncol=4, frameon=False, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


def _stage_capacity_gib(results: Sequence[Result], stages: int) -> list[float]:
    """Per stage, the smallest capacity any policy's placement gives it (GiB)."""
    out = []
    for s in range(stages):
        caps = [r.memory.capacity_bytes[s] for r in results if s < len(r.memory.capacity_bytes)]
        out.append(min(caps) / GIB)
    return out


def timeline_rows(entities: Sequence[Entity], max_rows: int = MAX_TIMELINE_ROWS
                  ) -> tuple[list[Entity], str]:
    """The entities a Gantt chart shows and a note saying which (`sample_entities`)."""
    return sample_entities(entities, max_rows)


@_styled
def timeline_figure(trace: Trace, policy: str, max_rows: int = MAX_TIMELINE_ROWS) -> Figure:
    """Gantt chart of one iteration: a row per entity with three lanes (compute ops, PP sends,
    DP collectives); one PolyCollection per op kind, so it stays fast for 100k ops."""
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    rows, note = timeline_rows(trace.entities, max_rows)
    boxes = timeline_boxes(trace, rows)
    fig, ax = pyplot().subplots(figsize=(14, 2.6 + 0.34 * len(rows)), layout="constrained")
    handles = []
    for kind, colour in OP_COLOURS.items():
        if kind in boxes:
            ax.add_collection(PolyCollection(boxes[kind], closed=False, facecolors=colour,
                                             edgecolors="none",
                                             linewidths=0, antialiaseds=False))
            handles.append(Patch(color=colour, label=OP_LABELS.get(kind, kind.value)))
    ax.set_xlim(0, max(trace.iteration_s, 1e-9))
    ax.set_ylim(len(rows) - 0.5, -0.55)
    ax.set_yticks(range(len(rows)), [f"{e.name} ({e.node})" for e in rows], fontsize=8)
    ax.set_xlabel("time since iteration start (s)")
    ax.set_ylabel("entity: stage.replica (node)")
    ax.set_title(f"{policy}: one iteration, {trace.iteration_s:.3f} s ({note})\n"
                 "each row: compute stream (tall), PP sends (middle), DP collectives (bottom); "
                 "white = idle", fontsize=10)
    fig.legend(handles=handles, loc="outside lower center", ncol=6, frameon=False, fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return fig


def timeline_boxes(trace: Trace, rows: Sequence[Entity]) -> dict[OpKind, Any]:
    """Per op kind, the rectangles of the ops of `rows` as an (n, 4, 2) array of (s, row y)."""
    import numpy as np

    row_of = {e.name: i for i, e in enumerate(rows)}
    spans: dict[OpKind, list[tuple[float, float, float, float]]] = {}
    for r in trace.records:
        i = row_of.get(r.entity)
        if i is None or r.stream not in LANES or r.end_s <= r.start_s:
            continue
        bottom, height = LANES[r.stream]
        spans.setdefault(r.kind, []).append((r.start_s, r.end_s, i + bottom, i + bottom + height))
    out = {}
    for kind, items in spans.items():
        a = np.asarray(items)
        xs = a[:, [0, 0, 1, 1]]
        ys = a[:, [2, 3, 3, 2]]
        out[kind] = np.stack([xs, ys], axis=-1)
    return out


@_styled
def validation_figure(doc: dict) -> Figure:
    """Predicted vs measured iteration time per policy (s); error bars span the measured
    iterations (min to max), and each pair is annotated with its error %."""
    cases = doc["cases"]
    fig, ax = pyplot().subplots(figsize=(10, 5.5), layout="constrained")
    xs = list(range(len(cases)))
    predicted = [c["predicted_s"] for c in cases]
    measured = [c["measured_s"] for c in cases]
    spreads = [c.get("measured_iterations_s") or [c["measured_s"]] for c in cases]
    low = [m - min(s) for m, s in zip(measured, spreads, strict=True)]
    high = [max(s) - m for m, s in zip(measured, spreads, strict=True)]
    ax.bar([x - 0.2 for x in xs], predicted, width=0.4, color="#4C72B0",
           label="predicted (simulator)")
    ax.bar([x + 0.2 for x in xs], measured, width=0.4, color="#DD8452", label="measured (median)",
           yerr=[[max(0.0, v) for v in low], [max(0.0, v) for v in high]], capsize=4,
           error_kw={"ecolor": "black", "label": "measured min..max"})
    top = max(predicted + [m + h for m, h in zip(measured, high, strict=True)], default=1)
    for x, c in zip(xs, cases, strict=True):
        ax.text(x, top * 1.04, f"{c['error_pct']:+.1f}%", ha="center", fontsize=9)
    ax.set_ylim(0, top * 1.15 or 1)
    ax.set_xticks(xs, [c["policy"] for c in cases], rotation=20, ha="right")
    ax.set_ylabel("iteration time (s)")
    agrees = "agrees" if doc.get("ranking_agrees") else "does NOT agree"
    verdict = "NO VERDICT: host unstable" if doc.get("host_unstable") else f"ranking {agrees}"
    ax.set_title(f"Predicted vs measured iteration time (error % above each pair; tolerance "
                 f"{doc.get('tolerance_pct', float('nan')):g}%; {verdict})", fontsize=10)
    fig.legend(loc="outside lower center", ncol=3, frameon=False, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


SWEEP_MARKERS = "osD^vPX*"
SWEEP_LINESTYLES = ("-", "--", "-.", ":")


@_styled
def sweep_figure(rows: Sequence[dict], fields: Sequence[str], metric: str, ylabel: str) -> Figure:
    """Lines of `metric` against the first swept field (in increasing order where it is
    numeric), one per policy, each with its own hollow marker and line style so policies with
    the same results all show (the legend names them); one subplot per combination of the
    other swept fields."""
    x_field, others = fields[0], list(fields[1:])
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[f] for f in others), []).append(row)
    n = len(groups)
    cols = min(3, n)
    nrows = -(-n // cols)
    fig, axes = pyplot().subplots(nrows, cols, figsize=(5.5 * cols + 1.5, 4.2 * nrows + 0.8),
                                  squeeze=False, sharey=True, layout="constrained")
    x_values = list(dict.fromkeys(row[x_field] for row in rows))
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in x_values)
    policies = list(dict.fromkeys(row["policy"] for row in rows))
    labels = _sweep_labels(rows, fields, metric, policies)
    colours = pyplot().get_cmap("tab10")
    for ax, (key, members) in zip(axes.flat, groups.items(), strict=False):
        for k, policy in enumerate(policies):
            pts = [r for r in members if r["policy"] == policy and r.get("status", "ok") == "ok"]
            xy = sorted((r[x_field] if numeric else x_values.index(r[x_field]), r[metric])
                        for r in pts)
            ax.plot([x for x, _ in xy], [y for _, y in xy], color=colours(k % 10),
                    marker=SWEEP_MARKERS[k % len(SWEEP_MARKERS)], markerfacecolor="none",
                    markersize=10 - 2 * (k % 4), linestyle=SWEEP_LINESTYLES[k % 4],
                    label=labels[policy])
        if not numeric:
            ax.set_xticks(range(len(x_values)), [str(v) for v in x_values])
        ax.set_xlabel(x_field)
        ax.set_ylabel(ylabel)
        ax.set_title(", ".join(f"{f}={v}" for f, v in zip(others, key, strict=True)) or
                     f"{ylabel} vs {x_field}", fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncol=min(len(names), 4), fontsize=8)
    fig.suptitle(f"Sweep: {ylabel} vs {x_field}")
    return fig


def _sweep_labels(rows: Sequence[dict], fields: Sequence[str], metric: str,
                  policies: list[str]) -> dict[str, str]:
    """Each policy's legend label: its name, with '(same as P)' where every point of it has
    the `metric` of the earlier policy P, so the lines lie on each other."""
    points: dict[str, list] = {p: [] for p in policies}
    for row in rows:
        if row.get("status", "ok") == "ok":
            points[row["policy"]].append((tuple(row[f] for f in fields), row[metric]))
    labels = {}
    for k, policy in enumerate(policies):
        same = next((p for p in policies[:k] if points[p] and points[p] == points[policy]), None)
        labels[policy] = policy if same is None else f"{policy} (same as {same})"
    return labels
