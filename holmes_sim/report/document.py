"""The `--report DIR` output of `run` and `validate --real`: figures, Chrome traces, results.json
and a Markdown report whose findings are computed from the data."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from holmes_sim.metrics import BREAKDOWN_KEYS, Result, memory_fix
from holmes_sim.plan import GroupKind
from holmes_sim.prepare import Prepared
from holmes_sim.report import plots
from holmes_sim.report.files import deferred_interrupt, json_text, prepare_output
from holmes_sim.report.owned import owned_folder
from holmes_sim.report.perfetto import chrome_trace_text
from holmes_sim.report.staged import write_together
from holmes_sim.report.stragglers import stragglers_markdown, with_stragglers
from holmes_sim.report.tables import footnotes
from holmes_sim.runner import (BASELINE, REFERENCES, Outcome, ranked, results_document,
                               scenario_file, speedups, stamp)

TIE_REL = 1e-6
COST_NAMES = {
    "tp_comm": "tensor-parallel communication",
    "cp_comm": "exposed context-parallel (CP) communication",
    "ep_comm": "expert-parallel (EP) all-to-all communication",
    "pp_exposed": "exposed pipeline (PP) communication",
    "dp_exposed": "exposed data-parallel (DP) communication", "optimizer": "the optimizer step",
    "bubble": "pipeline bubble and idle time",
}
COST_GROUPS = {"tp_comm": GroupKind.TENSOR, "cp_comm": GroupKind.CONTEXT,
               "ep_comm": GroupKind.EXPERT, "pp_exposed": GroupKind.PIPELINE,
               "dp_exposed": GroupKind.DATA}


class ValidationResult(Protocol):
    """What `write_validation_report` needs: the `validate --real` JSON document."""

    def to_json(self) -> dict: ...


REPORT_FIGURES = ("iteration_time.png", "breakdown.png", "memory.png")
"""The figures of every `--report` of `run`, beside a timeline and a trace per policy."""
VALIDATION_FILES = ("predicted_vs_measured.png", "validation.md")
"""The files of a `validate --real --report`."""


def report_targets(policies) -> list[str]:
    """Every file `write_report` writes for `policies`, relative to its folder."""
    per_policy = [f"{kind}_{p}.{ext}" for p in policies
                  for kind, ext in (("timeline", "png"), ("trace", "json"))]
    return [*REPORT_FIGURES, *per_policy, "results.json", "report.md"]


def write_report(directory: Path, prepared: Prepared, outcomes: list[Outcome],
                 progress: Callable[[int, int], None] | None = None) -> None:
    """Write figures, a Chrome trace per policy, results.json and report.md into `directory`
    (created if new, not its parents; files in the way that holmes-sim did not write are
    refused, `report.owned`) as one change (`write_files`); `progress(done, total)` after each
    file."""
    directory = prepare_output(directory, directory=True, option="--report")
    write_files(directory, _report_steps(prepared, outcomes), progress)


Step = tuple[str, Callable[[], str | bytes]]
"""A file of a report: its name in the folder and the function that makes its bytes."""


def write_files(directory: Path, steps: list[Step],
                progress: Callable[[int, int], None] | None = None) -> None:
    """Make every file of `steps`, then replace the folder's earlier ones with them together
    (`staged.write_together`): a failure, or a Ctrl-C, while they are made or swapped in leaves
    the earlier files as they were (and removes a folder this run created). Ctrl-C is held
    back for the whole step and raised after the file being made: it is never lost, even where
    it lands in matplotlib's cleanup."""
    total = len(steps) + 1
    with deferred_interrupt() as interrupted, \
            owned_folder(directory, "--report", [name for name, _ in steps]) as folder:
        files = {}
        for done, (name, make) in enumerate(steps, 1):
            files[name] = make()
            interrupted()
            _tick(progress, done, total)
        write_together(directory, files, folder, "--report")
        interrupted()
        _tick(progress, total, total)


def _report_steps(prepared: Prepared, outcomes: list[Outcome]) -> list[Step]:
    """Every file of a `--report`, in making order."""
    results = [o.result for o in outcomes]
    name = prepared.scenario.name
    figures = {
        "iteration_time.png": lambda: plots.iteration_time_figure(
            results, f"{name}: iteration time and throughput per policy (fastest first)",
            references=REFERENCES),
        "breakdown.png": lambda: plots.breakdown_figure(
            results, f"{name}: where the iteration goes, per policy (fastest first)"),
        "memory.png": lambda: plots.memory_figure(
            results, f"{name}: peak memory per GPU of each pipeline stage vs GPU capacity"),
    }
    steps: list[Step] = [(f, lambda f=f: plots.figure_png(figures[f]())) for f in REPORT_FIGURES]
    steps += [(f"timeline_{o.plan.policy}.png",
               lambda o=o: plots.figure_png(plots.timeline_figure(o.trace, o.plan.policy)))
              for o in outcomes]
    steps += [(f"trace_{o.plan.policy}.json", lambda o=o: chrome_trace_text(o.trace))
              for o in outcomes]
    steps.append(("results.json", lambda: json_text(stamp(with_stragglers(
        results_document(prepared, outcomes, prepared.scenario.seed), prepared, outcomes)))))
    steps.append(("report.md", lambda: report_markdown(prepared, outcomes)))
    return steps


def _tick(progress: Callable[[int, int], None] | None, done: int, total: int) -> None:
    if progress is not None:
        progress(done, total)


def report_markdown(prepared: Prepared, outcomes: list[Outcome]) -> str:
    """report.md: set-up, findings, results table, figures and traces."""
    s = prepared.scenario
    policies = [o.plan.policy for o in outcomes]
    lines = [
        f"# {s.name}: one simulated training iteration per policy", "",
        f"{s.description or s.name}. Model {s.model.name}, {prepared.cluster.num_gpus} GPUs, "
        f"TP {prepared.tp} x PP {prepared.pp} x "
        f"{f'CP {prepared.cp} x ' if prepared.cp > 1 else ''}DP {prepared.dp}, "
        f"{prepared.num_microbatches} micro-batches ({s.parallel.schedule} schedule), "
        f"seed {s.seed}. Source: `{scenario_file(prepared.source)}`.", "",
        "## Findings", "", findings(outcomes, memory_fix(prepared)), "",
        "## Results (fastest first)", "", results_markdown_table(outcomes), "",
        "## Which nodes hold which pipeline stage", "", stage_nodes_markdown(outcomes), "",
        "## Links each group kind uses", "",
        "Per policy, the transport of every process group of each kind and how many groups use "
        "it (`local` is NVLink inside a node).", "", transports_markdown(outcomes), "",
        *_stragglers_section(prepared, outcomes),
        "## Figures", "",
        "Iteration time and throughput per policy:", "", "![iteration time](iteration_time.png)",
        "", "Time breakdown (mean over entities; sums to the iteration time):", "",
        "![breakdown](breakdown.png)", "",
        "Peak memory per GPU of each pipeline stage against the GPU capacity:", "",
        "![memory](memory.png)", "",
        "### Timelines", "",
        "One row per (stage, replica) entity: the tall lane is the compute stream (forward, "
        "backward, TP comm, waits), the thin lanes PP sends and DP collectives. Grey and white "
        "gaps are bubbles; orange and red are exposed PP and DP communication.", "",
    ]
    for p in policies:
        lines += [f"![timeline {p}](timeline_{p}.png)", ""]
    lines += ["## Files", "",
              "- `results.json`: the `run --json` document (every figure above, per policy).",
              "- `trace_<policy>.json`: Chrome trace of the iteration; open it in "
              "https://ui.perfetto.dev or chrome://tracing.", ""]
    return "\n".join(lines)


def _stragglers_section(prepared: Prepared, outcomes: list[Outcome]) -> list[str]:
    """'Slow hardware' lines when the scenario has variability (`report.stragglers`)."""
    if prepared.nominal_cluster is None:
        return []
    return ["## Slow hardware (scenario variability)", "",
            "What each straggler costs each plan: the plan's analytic iteration time less the "
            "same plan's without that straggler.", "", stragglers_markdown(prepared, outcomes), ""]


def stage_nodes_markdown(outcomes: list[Outcome]) -> str:
    """A table: per policy, the nodes of every pipeline stage (stage 0 first)."""
    lines = ["| policy | " + " | ".join(f"stage {k}" for k in range(outcomes[0].plan.pp)) + " |",
             "|---|" + "---|" * outcomes[0].plan.pp] if outcomes else []
    for o in outcomes:
        plan = o.plan
        cells = []
        for k in range(plan.pp):
            nodes = dict.fromkeys(g.node for d in range(plan.dp) for g in plan.entity_gpus(k, d))
            names = list(nodes)
            more = f" and {len(names) - 8} more" if len(names) > 8 else ""
            cells.append(", ".join(names[:8]) + more)
        lines.append(f"| {o.plan.policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def transports_markdown(outcomes: list[Outcome]) -> str:
    """A table: per policy, the transports of each group kind any policy has."""
    kinds = [k.value for k in GroupKind if any(k in o.result.transports for o in outcomes)]
    if not kinds:
        return ""
    lines = ["| policy | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for o in outcomes:
        cells = [o.result.transports.get(k, "-") for k in kinds]
        lines.append(f"| {o.result.policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def results_markdown_table(outcomes: list[Outcome]) -> str:
    """A Markdown table with one row per policy, in the given order."""
    ups = speedups(outcomes)
    head = ["policy", "iter s", "TFLOP/s/GPU", "samples/s", "MFU", "bubble", "DP exposed s",
            "PP exposed s", "layers/stage", "peak GiB", "fits", "speed-up vs megatron"]
    rows = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * 7 +
                                                          ["---", "---:", "---", "---:"]) + "|"]
    for o in outcomes:
        r = o.result
        up = f"{ups[r.policy]:.2f}x" if r.policy in ups else "-"
        cells = [r.policy + (" \\*" if r.policy in REFERENCES else ""),
                 f"{r.iteration_time_s:.3f}", f"{r.tflops_per_gpu:.1f}",
                 f"{r.samples_per_s:.1f}", f"{r.mfu:.1%}", f"{r.bubble_fraction:.1%}",
                 f"{r.breakdown_s['dp_exposed']:.3f}", f"{r.breakdown_s['pp_exposed']:.3f}",
                 "/".join(map(str, r.layers_per_stage)), f"{r.memory.peak_gib:.1f}",
                 "yes" if r.memory.fits else "NO (OOM)", up]
        rows.append("| " + " | ".join(cells) + " |")
    notes = [n.replace("*", "\\*", 1) for n in footnotes(outcomes)]
    return "\n".join(rows + ([""] + [f"{n}  " for n in notes] if notes else []))


def largest_cost(result: Result) -> tuple[str, float]:
    """The biggest non-compute breakdown category of `result` and its seconds."""
    others = [k for k in BREAKDOWN_KEYS if k != "compute"]
    key = max(others, key=lambda k: (result.breakdown_s[k], -others.index(k)))
    return key, result.breakdown_s[key]


def findings(outcomes: list[Outcome], fix: str = "") -> str:
    """One paragraph: who wins, by how much over megatron, and the largest cost it still pays;
    only plans that fit in GPU memory are compared. When none fits, it ends with `fix`, what to
    change (`metrics.memory_fix`)."""
    if not outcomes:
        return "No policy was run."
    ordered = [o.result for o in ranked(outcomes)]  # plans that fit first
    fitting = [r for r in ordered if r.memory.fits]
    oom = [r.policy for r in ordered if not r.memory.fits]
    if not fitting:
        return _none_fit_sentence(ordered, fix)
    winner = fitting[0]
    base = next((r for r in ordered if r.policy == BASELINE), None)
    parts = [_win_sentence(winner, fitting, base)]
    real = next((r for r in fitting if r.policy not in REFERENCES), None)
    if winner.policy in REFERENCES and real is not None:
        parts.append(f"{winner.policy} is a reference that changes the network, so it is a "
                     f"bound rather than a placement; the fastest policy on the scenario's own "
                     f"hardware is {_win_sentence(real, fitting, base, lead=False)}")
    parts.append(_saving_sentence(winner, base))
    parts.append(_cost_sentence(winner))
    if real is not None and real is not winner:
        parts.append(_cost_sentence(real))
    if oom:
        parts.append(f"Not fitting in GPU memory: {', '.join(oom)}.")
    return " ".join(p for p in parts if p)


def _none_fit_sentence(ordered: list[Result], fix: str) -> str:
    """What a run says when no plan fits in GPU memory: the nearest and the fix."""
    nearest = min(ordered, key=lambda r: (r.memory.excess_gib, r.policy))
    return (f"No policy's plan fits in GPU memory (the nearest, {nearest.policy}, "
            f"{nearest.memory.shortfall()}), so no plan is compared and there is no speed-up "
            f"to report{': ' + fix if fix else ''}. Not fitting in GPU memory: "
            f"{', '.join(r.policy for r in ordered)}.")


def _win_sentence(r: Result, fitting: list[Result], base: Result | None,
                  lead: bool = True) -> str:
    """`r`'s time, its ties among the plans that fit, and its speed-up over megatron."""
    ties = [o.policy for o in fitting if o is not r and
            abs(o.iteration_time_s - r.iteration_time_s) <= TIE_REL * r.iteration_time_s]
    tie = f" (tied with {', '.join(ties)})" if ties else ""
    text = (f"{r.policy}{tie} at {r.iteration_time_s:.3f} s per iteration "
            f"({r.tflops_per_gpu:.1f} TFLOP/s per GPU)")
    if base is None:
        gain = "; megatron was not run, so there is no speed-up to report."
    elif not base.memory.fits:
        gain = "; megatron's plan does not fit in GPU memory, so there is no speed-up to report."
    elif r is base:
        gain = ", i.e. megatron itself is fastest."
    else:
        up = base.iteration_time_s / r.iteration_time_s
        gain = (f", {up:.2f}x faster than megatron ({base.iteration_time_s:.3f} s, "
                f"{100 * (1 - r.iteration_time_s / base.iteration_time_s):.1f}% less time).")
    return ("The fastest policy is " if lead else "") + text + gain


def _saving_sentence(r: Result, base: Result | None) -> str:
    """Which breakdown category saves `r` the most time against megatron (when both fit), and
    on which links."""
    if base is None or base is r or not base.memory.fits or not r.memory.fits or \
            base.iteration_time_s <= r.iteration_time_s:
        return ""
    key = max(BREAKDOWN_KEYS, key=lambda k: base.breakdown_s[k] - r.breakdown_s[k])
    saved = base.breakdown_s[key] - r.breakdown_s[key]
    group = COST_GROUPS.get(key)
    links = (f" ({base.transports[group]} under megatron, {r.transports[group]} under "
             f"{r.policy})" if group in base.transports and group in r.transports else "")
    name = COST_NAMES.get(key, key)
    return (f"Most of the saving is {name} ({key}): {base.breakdown_s[key]:.3f} s against "
            f"{r.breakdown_s[key]:.3f} s, {saved:.3f} s less{links}.")


def _cost_sentence(r: Result) -> str:
    key, seconds = largest_cost(r)
    share = 100 * seconds / r.iteration_time_s if r.iteration_time_s > 0 else 0.0
    return (f"The largest cost {r.policy} still pays beyond compute is "
            f"{COST_NAMES[key]} ({key}): {seconds:.3f} s, {share:.1f}% of its iteration.")


def write_validation_report(directory: Path, result: ValidationResult) -> None:
    """Write predicted_vs_measured.png and validation.md for a `validate --real` result, as
    one change (`write_files`)."""
    directory = prepare_output(directory, directory=True, option="--report")
    doc = result.to_json()
    write_files(directory, [
        ("predicted_vs_measured.png", lambda: plots.figure_png(plots.validation_figure(doc))),
        ("validation.md", lambda: validation_markdown(doc))])


def validation_markdown(doc: dict) -> str:
    """validation.md: summary, table of cases, the figure, profile and provenance."""
    cases = doc["cases"]
    tol = doc.get("tolerance_pct", float("nan"))
    lines = ["# Simulator vs real run", "", validation_findings(doc), "",
             *_validation_notes(doc),
             "| policy | predicted s | measured s (median) | measured min..max s | error % | "
             "within tolerance |", "|---|---:|---:|---:|---:|---|"]
    for c in cases:
        its = c.get("measured_iterations_s") or [c["measured_s"]]
        ok = "yes" if abs(c["error_pct"]) <= tol else "NO"
        if doc.get("host_unstable"):
            ok = "no verdict"
        lines.append(f"| {c['policy']} | {c['predicted_s']:.4f} | {c['measured_s']:.4f} | "
                     f"{min(its):.4f}..{max(its):.4f} | {c['error_pct']:+.1f} | {ok} |")
    effects = doc.get("mechanism_effects") or []
    if effects:
        lines += ["", "Each mechanism's effect: how much slower the policy without it is than "
                      "holmes, measured and predicted (band: the measured noise or 3%).", "",
                  "| without | mechanism | measured | predicted | beyond noise (band) |",
                  "|---|---|---:|---:|---|"]
        for e in effects:
            lines.append(f"| {e['policy']} | {e['mechanism']} | {e['measured_pct']:+.1f}% | "
                         f"{e['predicted_pct']:+.1f}% | {'yes' if e['beyond_noise'] else 'no'} "
                         f"({e['band_pct']:.1f}%) |")
    lines += ["", "![predicted vs measured](predicted_vs_measured.png)", "",
              *_plan_lines(cases),
              "## Measured profile", "", _json_block(doc.get("profile", {})), "",
              "## Provenance", "", _json_block(doc.get("provenance", {})), ""]
    return "\n".join(lines)


def _plan_lines(cases: list[dict]) -> list[str]:
    """'## Plans': what each case ran, as the simulator planned it on the measured profile
    (placement, layers per stage, each group's transport and NICs); [] for a document without
    plans."""
    if not any(c.get("plans") for c in cases):
        return []
    lines = ["## Plans", "", "Planned on the measured profile (`--dry-run` shows the plans on "
             "the catalog's rates, which may differ).", ""]
    for c in cases:
        for k, plan in enumerate(c.get("plans") or ()):
            groups = ", ".join(f"{g['kind']}({', '.join(map(str, g['ranks']))}) "
                               f"{g['transport']} {'/'.join(n or 'local' for n in g['nics'])}"
                               for g in plan["groups"])
            which = f" (plan {k + 1} of {len(c['plans'])})" if len(c["plans"]) > 1 else ""
            lines.append(f"- **{c['policy']}**{which}: {plan['schedule']}, layers per stage "
                         f"{'/'.join(map(str, plan['layers_per_stage']))}; ranks "
                         f"{', '.join(f'{r}: {g}' for r, g in enumerate(plan['ranks']))}; "
                         f"groups {groups}")
    return [*lines, ""]


def _validation_notes(doc: dict) -> list[str]:
    """The host warnings and the run's notes (`provenance.notes`) as a list, with a blank line
    after; none: []."""
    items = [*(f"- Host: {w}; no verdict." for w in doc.get("host_warnings") or ()),
             *(f"- Note: {n}." for n in (doc.get("provenance") or {}).get("notes") or ())]
    return [*items, ""] if items else []


def validation_findings(doc: dict) -> str:
    """One paragraph: worst error, tolerance, and whether the ranking agrees; on a host that
    could not give a verdict (`host_unstable`, exit 3), why, and no verdict."""
    cases = doc["cases"]
    if not cases:
        return "No case was measured."
    if doc.get("host_unstable"):
        return (f"**No verdict** (`validate --real` exited 3): the host was too loaded or "
                f"unstable (see below). On such a host the measured times do not say whether "
                f"the simulator is within the "
                f"{doc.get('tolerance_pct', float('nan')):g}% tolerance or ranks the policies "
                f"right; they are listed below for the record only. Rerun on a quiet host for "
                f"a verdict.")
    tol = doc.get("tolerance_pct", float("nan"))
    worst = max(cases, key=lambda c: abs(c["error_pct"]))
    inside = sum(1 for c in cases if abs(c["error_pct"]) <= tol)
    ranking = "agrees" if doc.get("ranking_agrees") else "does not agree"
    return (f"{inside} of {len(cases)} policies are within the {tol:g}% tolerance; the largest "
            f"error is {worst['error_pct']:+.1f}% ({worst['policy']}: predicted "
            f"{worst['predicted_s']:.4f} s, measured {worst['measured_s']:.4f} s). The ranking of "
            f"policies by predicted time {ranking} with the measured ranking.")


def _json_block(value: Any) -> str:
    return "```json\n" + json.dumps(value, indent=2, sort_keys=True, default=str) + "\n```"
