"""Tables and sentences for `holmes-sim plan`: the ranked candidates, why the winner wins, and
what did not fit. User text is never markup (rich Text)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from rich import box
from rich.table import Table
from rich.text import Text

from holmes_sim.errors import PlanError
from holmes_sim.report.tables import fit_table
from holmes_sim.search.planner import Candidate, PlanSearch


def layout_label(c: Candidate) -> str:
    lay = c.layout
    sched = f"interleaved x{lay.virtual_stages}" if lay.schedule == "interleaved" else lay.schedule
    sp = " SP" if lay.sequence_parallel else ""
    cp = f" CP{lay.cp}" if lay.cp > 1 else ""
    ep = f" EP{lay.ep}" if lay.ep > 1 else ""
    ep += f" ETP{lay.etp}" if lay.etp is not None and lay.etp != lay.tp else ""
    return f"TP{lay.tp}{cp} PP{lay.pp} DP{lay.dp}{ep} mb{lay.micro_batch_size} {sched} " \
        f"rc:{lay.recompute}{sp}"


PLAN_COLUMNS = ("#", "policy", "layout / optimizer", "iter s", "TFLOP/s", "GiB", "speed-up")
PLAN_DROP_ORDER = ("TFLOP/s", "GiB")
"""The columns a narrow console loses first; the plan's identity (#, policy, layout and
optimizer, one line each) stays whole."""
MATERIAL_SAVING = 0.01
"""A breakdown term enters "saves most on" only when it saves at least this share of the
baseline's iteration."""


def plan_table(result: PlanSearch, rows: int, width: int = 80, wide: bool = False) -> Table:
    """The best `rows` candidates, then the baseline if it is not among them, narrowed to
    `width` columns unless `wide`."""
    base = result.baseline
    same = (lambda c: base is not None and c.policy == base.policy
            and (c.layout, c.optimizer) == (base.layout, base.optimizer))
    # the baseline's estimated copy, when shown, is shown as the baseline simulated
    shown = [base if same(c) else c for c in result.candidates[:rows]]
    numbered = [(str(i), c) for i, c in enumerate(shown, 1)]
    if base is not None and base not in shown:
        numbered.append(("base", base))
    return fit_table(lambda headers: _plan_table(result, numbered, headers), PLAN_COLUMNS,
                     PLAN_DROP_ORDER, width, wide)


def _plan_table(result: PlanSearch, numbered: list[tuple[str, Candidate]],
                headers: Sequence[str]) -> Table:
    table = Table(title=Text(f"{result.scenario}: {result.evaluated:,} plans in "
                             f"{result.elapsed_s:.1f} s; simulated (*) first, then by estimate"),
                  title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                  caption_justify="left")
    keep = [i for i, col in enumerate(PLAN_COLUMNS) if col in headers]
    for i in keep:
        col = PLAN_COLUMNS[i]
        table.add_column(col, justify="left" if col in PLAN_COLUMNS[1:3] else "right",
                         no_wrap=col in ("#", "policy"), overflow="fold")
    for rank, c in numbered:
        cells = _row(rank, c, result)
        table.add_row(*(cells[i] for i in keep))
    versus = ("speed-up over the best Megatron-LM default layout (base)" if result.baseline
              else "no speed-up: the search has no megatron plan to compare with")
    table.caption = Text("iteration times of simulated rows (*) come from the discrete-event "
                         f"simulation, the others from the analytic estimate; {versus}")
    return table


def optimizer_label(c: Candidate) -> str:
    """The optimizer and whether gradient reduction overlaps the backward pass."""
    return c.optimizer + (" +overlap" if c.overlap_grad_reduce else "")


def _row(rank: str, c: Candidate, result: PlanSearch) -> list[Text]:
    up = result.speedup(c)
    return [Text(rank), Text(c.policy), Text(f"{layout_label(c)}\n{optimizer_label(c)}"),
            Text(f"{c.predicted_iteration_s:.3f}" + ("*" if c.simulated else "")),
            Text(f"{c.tflops_per_gpu:.1f}"), Text(f"{c.peak_memory_gib:.1f}"),
            Text("-" if up is None else f"{up:.2f}x")]


def why_the_winner_wins(result: PlanSearch) -> str:
    """One sentence: the largest differences between the winner's and the baseline's breakdown."""
    if not result.candidates or result.baseline is None:
        return ""
    best, base = result.candidates[0], result.baseline
    if not (best.breakdown_s and base.breakdown_s):
        return ""
    if best == base:
        return (f"The best plan ({best.policy}, {layout_label(best)}) is the best Megatron-LM "
                "default: no plan searched is faster.")
    if best.predicted_iteration_s == base.predicted_iteration_s:
        return (f"The best plan ({best.policy}, {layout_label(best)}) ties with the best "
                f"Megatron-LM default ({layout_label(base)}): no plan searched is faster.")
    if best.predicted_iteration_s > base.predicted_iteration_s:
        return (f"The best Megatron-LM default ({layout_label(base)}) simulates faster than the "
                "plans the estimate ranked first; confirm more of them with --top.")
    b, a = dict(best.breakdown_s), dict(base.breakdown_s)
    deltas = sorted(((a[k] - b.get(k, 0.0), k) for k in a), reverse=True)
    material = MATERIAL_SAVING * base.predicted_iteration_s
    parts = [f"{k} {_seconds(a[k], b.get(k, 0.0))}" for d, k in deltas[:3] if d >= material]
    saves = f"; it saves most on: {'; '.join(parts)}" if parts else ""
    return (f"The best plan ({best.policy}, {layout_label(best)}) beats the best Megatron-LM default "
            f"({layout_label(base)}) by {result.speedup(best):.2f}x{saves}.")


def _seconds(before: float, after: float) -> str:
    """'B s -> A s' with the fewest decimals (2 to 4) that tell the two apart."""
    digits = next((d for d in (2, 3) if f"{before:.{d}f}" != f"{after:.{d}f}"), 4)
    return f"{before:.{digits}f} s -> {after:.{digits}f} s"


def infeasible_summary(result: PlanSearch, examples: int = 3) -> list[str]:
    """How many plans did not fit or could not be built, by kind, with a few examples: one plan
    per distinct build failure (at most `examples` - 1 of them), then the plans nearest to
    fitting, one per layout and optimizer."""
    if not result.infeasible:
        return []
    memory = [c for c in result.infeasible if c.excess_gib > 0]
    lines = [f"{len(result.infeasible):,} plans left out: {len(memory):,} do not fit in GPU "
             f"memory, {len(result.infeasible) - len(memory):,} could not be built"]
    failures: dict[tuple[str, str], Candidate] = {}
    for c in result.infeasible:
        if c.excess_gib <= 0:
            failures.setdefault((c.policy, _failure_rule(c.reason)), c)
    shown = list(failures.values())[:examples - 1 if memory else examples]
    nearest: dict[tuple[str, str, str], Candidate] = {}
    for c in sorted(memory, key=lambda c: c.excess_gib):
        nearest.setdefault((c.policy, layout_label(c), c.optimizer), c)  # overlap or not
    shown += list(nearest.values())[:examples - len(shown)]
    for c in shown:
        optimizer = f", {optimizer_label(c)}" if c.optimizer else ""
        reason = c.reason.removeprefix(f"{c.policy}: ")
        lines.append(f"  {c.policy}, {layout_label(c)}{optimizer}: {reason}")
    return lines


def _failure_rule(reason: str) -> str:
    """A build failure's message with its lists of named things and its numbers taken out: the
    same fault met by many layouts (a different node list each) is one rule."""
    token = r"[\w.\[\]-]*\d[\w.\[\]-]*"  # a name with a number: node ib-a-0, clusters[0].nodes[1]
    lists = re.sub(rf"{token}(, {token})*( and \d+ more)?", "N", reason)
    return re.sub(r"\d+", "N", lists)


def runnable(result: PlanSearch) -> PlanSearch:
    """`result`, unless no plan of the search fits in memory and can be built: then PlanError,
    with `infeasible_summary`'s counts and examples."""
    if not result.candidates:
        raise PlanError("no plan of the search can run: " + "; ".join(
            line.strip() for line in infeasible_summary(result)))
    return result
