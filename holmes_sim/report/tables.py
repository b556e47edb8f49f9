"""Rich tables for the terminal.

The results table keeps every number whole: when the console is narrower than all columns, the
least important columns go (`wide=True` keeps them all), and a table still too wide prints wider
than the console rather than cut a cell. Every cell is plain text, never rich markup, so a policy
or scenario name prints literally.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from holmes_sim.runner import REFERENCES, Outcome, same_plans, speedups

REFERENCE_MARK = " *"
# (header, justify, cell) in display order; DROP_ORDER names the columns a narrow console loses.
Cell = Callable[[Outcome, dict[str, float]], str]
COLUMNS: tuple[tuple[str, str, Cell], ...] = (
    ("policy", "left", lambda o, ups: _policy(o)),
    ("iter s", "right", lambda o, ups: f"{o.result.iteration_time_s:.3f}"),
    ("TFLOP/s/GPU", "right", lambda o, ups: f"{o.result.tflops_per_gpu:.1f}"),
    ("samples/s", "right", lambda o, ups: f"{o.result.samples_per_s:.1f}"),
    ("MFU", "right", lambda o, ups: f"{o.result.mfu:.1%}"),
    ("bubble", "right", lambda o, ups: f"{o.result.bubble_fraction:.1%}"),
    ("DP exposed s", "right", lambda o, ups: f"{o.result.breakdown_s['dp_exposed']:.3f}"),
    ("PP exposed s", "right", lambda o, ups: f"{o.result.breakdown_s['pp_exposed']:.3f}"),
    ("layers/stage", "left", lambda o, ups: _layers(o.result.layers_per_stage, False)),
    ("mem GiB", "right", lambda o, ups: f"{o.result.memory.peak_gib:.1f}"
                                        + ("" if o.result.memory.fits else " OOM")),
    ("speed-up", "right", lambda o, ups: _speedup(o, ups)),
)
DROP_ORDER = ("layers/stage", "DP exposed s", "PP exposed s", "samples/s", "bubble", "MFU")


def results_table(title: str, outcomes: list[Outcome], width: int = 80, wide: bool = False) -> Table:
    """One row per policy (fitting plans fastest first, then those that do not fit), with the
    speed-up over megatron, narrowed to `width` columns unless `wide`; footnotes explain marks."""
    return fit_table(lambda headers: _table(title, outcomes, list(headers), wide),
                     [c[0] for c in COLUMNS], DROP_ORDER, width, wide)


def fit_table(build: Callable[[Sequence[str]], Table], headers: Sequence[str],
              drop_order: Sequence[str], width: int, wide: bool) -> Table:
    """`build(shown headers)` with the columns of `drop_order` left out, in that order, until the
    table fits `width` characters (all kept when `wide`); a caption line names what was left out
    and that `--wide` shows it. The key column is never in `drop_order`, so it stays whole."""
    shown = list(headers)
    table = build(shown)
    for name in () if wide else drop_order:
        if table_width(table) <= width:
            break
        shown.remove(name)
        table = build(shown)
    hidden = [h for h in headers if h not in shown]
    if hidden:
        add_caption(table, f"not shown at {width} columns: {', '.join(hidden)} (--wide shows them)")
    return table


def add_caption(table: Table, line: str) -> None:
    """Append `line` (plain text, left-justified) to the table's caption."""
    old = table.caption
    text = Text(line) if old is None else Text.assemble(
        old if isinstance(old, Text) else Text(str(old)), "\n", line)
    table.caption = text
    table.caption_justify = "left"


def layout_label(prepared, joint: str = " ") -> str:
    """`TP 8 PP 2 CP 2 DP 4 EP 4` for a prepared scenario, the degrees joined by `joint`: CP
    where above 1, EP where above 1 and the experts' TP where it differs from TP (`ETP n`)."""
    par = prepared.scenario.parallel
    parts = [f"TP {prepared.tp}", f"PP {prepared.pp}"]
    parts += [f"CP {prepared.cp}"] if prepared.cp > 1 else []
    parts.append(f"DP {prepared.dp}")
    if par.expert > 1:
        parts.append(f"EP {par.expert}")
        if par.expert_tensor not in (None, prepared.tp):
            parts.append(f"ETP {par.expert_tensor}")
    return joint.join(parts)


def print_table(console: Console, table: Table, wide: bool = False) -> None:
    """Print `table`; rich folds the columns that may wrap to fit the console. On a console
    narrower than the table can shrink to (every no-wrap column whole, each folding column at its
    longest word), or under `wide` narrower than the whole table, it prints at that width so no
    cell is cut (a pipe then gets long lines, never a broken character)."""
    need = table_width(table) if wide else Measurement.get(console, console.options.update_width(
        10_000), table).minimum
    if need > console.width:
        console = Console(file=console.file, width=need, no_color=console.no_color,
                          force_terminal=console.is_terminal)
    console.print(table, crop=False)


def print_folded(console: Console, lines: Sequence[str | None]) -> None:
    """Print each non-empty line folded at spaces to the console's width, continuation lines
    indented two spaces past the line's own indent."""
    for line in filter(None, lines):
        indent = " " * (len(line) - len(line.lstrip()) + 2)
        console.print(textwrap.fill(line, console.width, subsequent_indent=indent,
                                    break_long_words=False, break_on_hyphens=False),
                      highlight=False, markup=False, soft_wrap=True)


def footnotes(outcomes: list[Outcome]) -> list[str]:
    """The lines under the table: what the marks mean and which rows are equal by construction."""
    names = {o.plan.policy for o in outcomes}
    notes = []
    if names & set(REFERENCES):
        notes.append("* reference on a hypothetical network (all-ib: every node on one InfiniBand "
                     "fabric; all-ethernet: TCP only): a bound, not a placement for this cluster")
    for policy, same in same_plans(outcomes).items():
        notes.append(f"{policy}: same plan as {same}, so the same figures")
    if any(not o.result.memory.fits for o in outcomes):
        notes.append("OOM: the plan does not fit in GPU memory; ranked after the plans that fit, "
                     "no speed-up")
    return notes


def _table(title: str, outcomes: list[Outcome], headers: list[str], wide: bool) -> Table:
    ups = speedups(outcomes)
    columns = [c for c in COLUMNS if c[0] in headers]
    if wide:  # the whole layer list
        columns = [(h, j, (lambda o, ups: _layers(o.result.layers_per_stage, True))
                    if h == "layers/stage" else cell) for h, j, cell in columns]
    rows = [[cell(o, ups) for _, _, cell in columns] for o in outcomes]
    table = Table(title=Text(title), title_justify="left", caption_justify="left")
    widths = column_widths(rows, [header for header, _, _ in columns])
    for (header, justify, _), width in zip(columns, widths, strict=True):
        # no cell wraps, and none is narrower than its widest cell: rich never cuts one
        table.add_column(header, justify=justify, no_wrap=True, min_width=width)
    for row in rows:
        table.add_row(*map(Text, row))
    notes = footnotes(outcomes)
    if notes:
        table.caption = Text("\n".join(notes))
    return table


def column_widths(rows: Sequence[Sequence[str]], headers: Sequence[str]) -> list[int]:
    """The characters each column of `headers` needs to show its widest cell and its header's
    longest line whole (a header of '' counts for nothing, a column with no text at all gets
    1): the `min_width` at which rich never cuts a cell of it. `rows` may hold more cells
    than there are headers (a column that may wrap)."""
    return [max([*(len(row[k]) for row in rows), *map(len, header.splitlines())], default=1)
            for k, header in enumerate(headers)]


def table_width(table: Table) -> int:
    """The columns `table` needs to print without cutting a cell."""
    console = Console(width=10_000)
    return Measurement.get(console, console.options, table).maximum


def _policy(o: Outcome) -> str:
    return o.plan.policy + (REFERENCE_MARK if o.plan.policy in REFERENCES else "")


def _speedup(o: Outcome, ups: dict[str, float]) -> str:
    if not o.result.memory.fits:
        return "no fit"
    return f"{ups[o.plan.policy]:.2f}x" if o.plan.policy in ups else "-"


def _layers(layers: tuple[int, ...], whole: bool) -> str:
    text = "/".join(map(str, layers))
    return text if whole or len(text) <= 24 else text[:21] + "..."
