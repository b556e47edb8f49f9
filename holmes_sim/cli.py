"""The `holmes-sim` command: a thin typer layer over the library.

Exit codes: 0 success, 1 a validation out of tolerance, 2 bad input (one message, no traceback).
Flags cover input/output and run control only; what changes the modelled system belongs in the
scenario file, so a result is reproducible from the YAML plus the seed.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from holmes_sim.errors import HolmesError, PlanError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan, simulate and validate LLM training on GPU clusters with mixed NICs "
                       "(Holmes, arXiv 2312.03549).")
# Wide enough for the results table when the output is a file or a pipe (rich assumes 80).
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "scenarios"


def _fail(exc: HolmesError) -> typer.Exit:
    err.print(f"[bold red]error:[/bold red] {escape(str(exc))}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


def resolve_scenario(name: str) -> Path:
    """A path as given, or the name of a bundled scenario (with or without .yaml)."""
    path = Path(name)
    if path.exists() or (path.suffix in (".yaml", ".yml") and path.parent != Path(".")):
        return path
    for candidate in (SCENARIO_DIR / name, SCENARIO_DIR / f"{name}.yaml"):
        if candidate.exists():
            return candidate
    return path


@app.command()
def run(
    scenario: Annotated[str, typer.Argument(help="Scenario YAML (or the name of a bundled one).")],
    policy: Annotated[list[str] | None, typer.Option("--policy", "-p",
                      help="Only these policies (repeatable); default: the scenario's list.")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results as JSON here.")] = None,
    report: Annotated[Path | None, typer.Option(
        "--report", help="Write figures, traces and report.md here.")] = None,
    seed: Annotated[int | None, typer.Option(min=0, max=2**63 - 1,
                                             help="Override the scenario's seed (0 or more).")] = None,
    plans: Annotated[Path | None, typer.Option(
        "--plans", help="Write each policy's plan as plan_<policy>.json here (to run it on a "
                        "real cluster, docs/validation.md).")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No table.")] = False,
) -> None:
    """Simulate one training iteration for every policy and print a table, fastest first."""
    from holmes_sim.prepare import prepare
    from holmes_sim.report.files import write_json
    from holmes_sim.report.tables import results_table
    from holmes_sim.runner import results_document, run_scenario

    try:
        prepared = prepare(resolve_scenario(scenario))
        if seed is not None:
            prepared = replace(prepared, scenario=replace(prepared.scenario, seed=seed))
        outcomes = run_scenario(prepared, _check_policy_names(policy))
        document = results_document(prepared, outcomes, prepared.scenario.seed)
        if json_path is not None:
            write_json(json_path, document)
        if plans is not None:
            from holmes_sim.report.files import write_atomic

            for o in outcomes:
                write_atomic(plans / f"plan_{o.plan.policy}.json", o.plan.to_json() + "\n")
        if report is not None:
            from holmes_sim.report.document import write_report

            write_report(report, prepared, outcomes)
    except HolmesError as exc:
        raise _fail(exc) from None
    if not quiet:
        title = f"{escape(prepared.scenario.name)}: {prepared.cluster.num_gpus} GPUs, TP {prepared.tp} " \
                f"PP {prepared.pp} DP {prepared.dp}, {prepared.num_microbatches} micro-batches " \
                f"({prepared.scenario.parallel.schedule})"
        out.print(results_table(title, outcomes))
        _warn_memory(outcomes)


def _check_policy_names(names: list[str] | None) -> list[str] | None:
    from holmes_sim.policies import get_policy

    for n in names or []:
        get_policy(n, "--policy")
    return names or None


def _warn_memory(outcomes) -> None:
    bad = [o.result.policy for o in outcomes if not o.result.memory.fits]
    if bad:
        err.print(f"[yellow]warning:[/yellow] {escape(', '.join(bad))} do not fit in GPU memory; lower "
                  "training.micro_batch_size, set training.recompute: full, or raise "
                  "parallel.tensor / parallel.pipeline", highlight=False)


@app.command()
def check(scenario: Annotated[str, typer.Argument(help="Scenario YAML to validate.")]) -> None:
    """Validate a scenario and build every policy's plan, without simulating."""
    from holmes_sim.metrics import memory_report
    from holmes_sim.opcost import OpCosts
    from holmes_sim.prepare import prepare
    from holmes_sim.runner import plan_policy

    try:
        prepared = prepare(resolve_scenario(scenario))
        too_big = []
        for name in prepared.scenario.policies:
            plan, cluster = plan_policy(prepared, name)
            mem = memory_report(plan, cluster, prepared.workload,
                                OpCosts(cluster, prepared.workload, prepared.compute, plan.tp))
            fits = "fits" if mem.fits else "[red]does not fit[/red]"
            out.print(f"  {escape(f'{name:30s}')} layers {'/'.join(map(str, plan.layers_per_stage))}, "
                      f"peak {mem.peak_gib:.1f} GiB per GPU ({fits})", highlight=False)
            if not mem.fits:
                too_big.append(f"{name} needs {mem.peak_gib:.1f} GiB, GPUs have "
                               f"{min(mem.capacity_bytes) / 2**30:.0f}")
        if too_big:
            raise PlanError(f"{prepared.source}: the model does not fit in GPU memory ("
                            f"{'; '.join(too_big)}); lower training.micro_batch_size, set "
                            "training.recompute: full, or raise parallel.tensor / parallel.pipeline")
    except HolmesError as exc:
        raise _fail(exc) from None
    out.print(f"[green]ok[/green]: {escape(str(prepared.source))}: {prepared.cluster.num_gpus} GPUs, "
              f"TP {prepared.tp} x PP {prepared.pp} x DP {prepared.dp}, "
              f"{prepared.num_microbatches} micro-batches", highlight=False)


DEFAULT_TESTBED = Path(__file__).resolve().parent.parent / "validation" / "testbeds" / "default.yaml"


@app.command()
def validate(
    testbed: Annotated[Path, typer.Argument(help="Testbed scenario (same schema, small, with a "
                                            "`testbed:` section).")] = DEFAULT_TESTBED,
    real: Annotated[bool, typer.Option("--real", help="Calibrate, predict, run for real, compare.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Build every group and stage on gloo, "
                                          "without training.")] = False,
    cleanup: Annotated[bool, typer.Option("--cleanup", help="Remove what killed runs recorded "
                                          "(namespaces, processes, temp folders); exit 2 if "
                                          "something stays.")] = False,
    policy: Annotated[list[str] | None, typer.Option("--policy", "-p", help="Only these policies.")] = None,
    iterations: Annotated[int | None, typer.Option(help="Measured iterations per policy.")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the comparison as JSON.")] = None,
    report: Annotated[Path | None, typer.Option("--report", help="Write figures and report.md here.")] = None,
) -> None:
    """Run plans for real with torch.distributed on an emulated testbed and compare with the
    simulator's predictions (exit 1 when a case leaves the tolerance)."""
    from holmes_sim import validate as v
    from holmes_sim.report.files import write_json

    try:
        if cleanup:
            for line in v.cleanup():
                out.print(line, highlight=False, markup=False)
            return
        if real == dry_run:
            raise _usage("choose one of --real (measure and compare) or --dry-run (build only)")
        names = _check_policy_names(policy)
        if dry_run:
            for line in v.dry_run(testbed, names):
                out.print(line, highlight=False, markup=False)
            return
        result = v.validate_real(testbed, names, iterations,
                                 progress=lambda m: err.print(m, highlight=False, markup=False))
        if json_path is not None:
            write_json(json_path, result.to_json())
        if report is not None:
            from holmes_sim.report.document import write_validation_report

            write_validation_report(report, result)
    except HolmesError as exc:
        raise _fail(exc) from None
    out.print(v.comparison_table(result))
    if not result.within_tolerance:
        raise typer.Exit(1)


def _usage(message: str) -> HolmesError:
    from holmes_sim.errors import ScenarioError

    return ScenarioError(message)


@app.command()
def scenarios() -> None:
    """List the bundled scenarios, one line each."""
    for path in sorted(SCENARIO_DIR.glob("*.yaml")):
        out.print(f"{path.stem:22s} {_first_comment(path)}", highlight=False, markup=False)


def _first_comment(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


@app.command()
def sweep(
    scenario: Annotated[str, typer.Argument(help="Scenario YAML (or the name of a bundled one).")],
    sets: Annotated[list[str], typer.Option("--set", help="PATH=V1,V2,... a scenario field by "
                    "dotted path with \\[index], e.g. inter_cluster_links[0].bandwidth_gbit_per_s="
                    "50,100,200 (repeatable: every combination runs).")],
    policy: Annotated[list[str] | None, typer.Option(
        "--policy", "-p", help="Only these policies (repeatable); default: the scenario's list.",
    )] = None,
    out_dir: Annotated[Path, typer.Option(
        "--out", help="Write sweep.csv, sweep.json and plots here.")] = Path("sweep-out"),
    jobs: Annotated[int | None, typer.Option(
        "--jobs", "-j", min=1, help="Worker processes (default: min(2, points)).")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No table.")] = False,
) -> None:
    """Run a scenario for every combination of field values and tabulate and plot the results."""
    from rich.progress import Progress

    from holmes_sim.sweep import run_sweep, sweep_table, write_sweep

    try:
        with Progress(console=err, transient=True) as bar:
            task = bar.add_task("sweep", total=None)
            result = run_sweep(resolve_scenario(scenario), sets, _check_policy_names(policy), jobs,
                               progress=lambda done, n: bar.update(task, completed=done, total=n))
        write_sweep(out_dir, result)
    except HolmesError as exc:
        raise _fail(exc) from None
    if not quiet:
        out.print(sweep_table(result))
    err.print(f"wrote {out_dir}/sweep.csv, sweep.json, sweep_iteration_time.png, sweep_tflops.png",
              highlight=False, markup=False)


def main() -> None:  # pragma: no cover - console entry
    app(prog_name="holmes-sim")
    sys.exit(0)
