"""Tables and sentences for `holmes-sim plan`: the ranked candidates, why the winner wins, and
what did not fit. User text is never markup (rich Text)."""

from __future__ import annotations

from collections import Counter

from rich.table import Table
from rich.text import Text

from holmes_sim.search.planner import Candidate, PlanSearch


def layout_label(c: Candidate) -> str:
    lay = c.layout
    sched = f"interleaved x{lay.virtual_stages}" if lay.schedule == "interleaved" else lay.schedule
    sp = " SP" if lay.sequence_parallel else ""
    return f"TP{lay.tp} PP{lay.pp} DP{lay.dp} mb{lay.micro_batch_size} {sched} rc:{lay.recompute}{sp}"


def plan_table(result: PlanSearch, rows: int) -> Table:
    """The best `rows` candidates, then the baseline if it is not among them."""
    table = Table(title=Text(f"{result.scenario}: {result.evaluated:,} plans in "
                             f"{result.elapsed_s:.1f} s, best first"), title_justify="left")
    for col in ("#", "policy", "layout", "optimizer", "iter s", "TFLOP/s", "GiB", "speed-up"):
        table.add_column(col, justify="left" if col in ("policy", "layout", "optimizer") else "right")
    shown = list(result.candidates[:rows])
    for i, c in enumerate(shown, 1):
        table.add_row(*_row(str(i), c, result))
    if result.baseline is not None and result.baseline not in shown:
        table.add_row(*_row("base", result.baseline, result))
    table.caption = Text("iteration times of simulated rows (*) come from the discrete-event "
                         "simulation, the others from the analytic estimate; speed-up over the "
                         "best Megatron-LM default layout (base)")
    return table


def _row(rank: str, c: Candidate, result: PlanSearch) -> list[Text]:
    up = result.speedup(c)
    return [Text(rank), Text(c.policy), Text(layout_label(c)), Text(c.optimizer),
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
    b, a = dict(best.breakdown_s), dict(base.breakdown_s)
    deltas = sorted(((a[k] - b.get(k, 0.0), k) for k in a), reverse=True)
    parts = [f"{k} {a[k]:.2f} s -> {b.get(k, 0.0):.2f} s" for d, k in deltas[:3] if d > 0]
    return (f"The best plan ({best.policy}, {layout_label(best)}) beats the best Megatron-LM default "
            f"({layout_label(base)}) by {result.speedup(best):.2f}x; it saves most on: "
            + "; ".join(parts) + ".")


def infeasible_summary(result: PlanSearch, examples: int = 3) -> list[str]:
    """How many plans did not fit or could not be built, by kind, with a few examples."""
    if not result.infeasible:
        return []
    kinds = Counter("memory" if c.reason.startswith("needs") else "plan" for c in result.infeasible)
    lines = [f"{result.infeasible.__len__():,} plans left out: {kinds['memory']:,} do not fit in GPU "
             f"memory, {kinds['plan']:,} could not be built"]
    for c in result.infeasible[:examples]:
        lines.append(f"  {c.policy}, {layout_label(c)}: {c.reason}")
    return lines
