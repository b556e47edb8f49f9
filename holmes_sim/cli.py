"""The `holmes-sim` command: a thin typer layer over the library.

Exit codes: 0 success, 1 a validation out of tolerance, 2 bad input (one message, no traceback).
Flags cover input/output and run control only; what changes the modelled system belongs in the
scenario file, so a result is reproducible from the YAML plus the seed.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from holmes_sim.bundled import bundled_scenario, resolve_scenario, scenario_names, testbed_file
from holmes_sim.errors import HolmesError, PlanError, TestbedError, printable
from holmes_sim.report.files import (check_outputs, closed_stdout, is_stdout, refused_notes,
                                     stale_note, stdout_write_error, terminate_unwinds)
from holmes_sim.validation.modes import unused_options

app = typer.Typer(add_completion=True, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
                  help="Plan, simulate and validate LLM training on GPU clusters with mixed NICs "
                       "(Holmes, arXiv 2312.03549).")


def _console(stderr: bool = False) -> Console:
    """$COLUMNS when positive, else the terminal's width, else 80: tables drop columns to fit
    (run --wide keeps all)."""
    console = Console(stderr=stderr)
    return console if console.width > 0 else Console(stderr=stderr, width=80)


out, err = _console(), _console(stderr=True)


def _fail(exc: HolmesError) -> typer.Exit:
    text = printable(str(exc), keep="\n\t" if isinstance(exc, TestbedError) else "")
    err.print(f"[bold red]error:[/bold red] {escape(text)}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


class _EmptyPath(typer.BadParameter):
    """An empty path value, which would name the current folder: one line, exit 2."""

    def show(self, file=None) -> None:
        _fail(_usage(self.message))


def _path(option: str, fix: str, kind: type = Path):
    """A parser for `option` refusing an empty value (an unset shell variable), before any work."""
    def parse(value: str | Path):
        if str(value) == "":
            raise _EmptyPath(f"{option} is empty (an unset shell variable?); {fix}")
        return kind(value)
    return parse


_FOLDER, _FILE = "name a folder, or '.' for the current one", "name a file, or '-' for standard output"
_SCENARIO = _path("SCENARIO", "name a scenario file or a bundled scenario", str)
_JSON, _REPORT, _HOSTS = (_path("--json", _FILE), _path("--report", _FOLDER),
                          _path("--hosts", "name the hosts file"))


def _memory_guarded(command):
    """Run `command` within the command's memory bound and its workers' (`spec.limits`;
    workers unbounded on Ray): past it, when a worker dies, or when standard output is closed or
    cannot be written, one message and exit 2."""
    @functools.wraps(command)
    def guarded(*args, **kwargs):
        from holmes_sim.spec.limits import memory_bounded

        try:
            if (closed := closed_stdout()) is not None:
                raise closed
            with memory_bounded(workers=kwargs.get("ray") is None):
                return command(*args, **kwargs)
        except HolmesError as exc:
            raise _fail(exc) from None
        except OSError as exc:
            if (failure := stdout_write_error(exc)) is None:
                raise
            raise _fail(failure) from None
    return guarded


def _version(value: bool) -> None:
    if value:
        from holmes_sim.version import tool_version

        out.print(f"holmes-sim {tool_version()}", highlight=False)
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """Options before the command (the help text is the Typer app's)."""


_HOSTS_HELP = ("With --plans/--export: the real host of each of the scenario's nodes, one a line "
               "in the scenario's node order (or 'HOST NODE' lines); each plan's launch folder "
               "lists them in its own node order.")


@app.command()
@terminate_unwinds()  # SIGTERM and SIGHUP clean up as Ctrl-C does, exit 128 + signal
@_memory_guarded
def run(
    scenario: Annotated[str, typer.Argument(
        parser=_SCENARIO, help="Scenario YAML (or the name of a bundled one).")],
    policy: Annotated[list[str] | None, typer.Option("--policy", "-p",
                      help="Only these policies (repeatable); default: the scenario's list.")] = None,
    json_path: Annotated[Path | None, typer.Option(
        "--json", parser=_JSON, help="Write results as JSON here ('-': standard output; the table "
                                     "then goes to standard error).")] = None,
    report: Annotated[Path | None, typer.Option(
        "--report", parser=_REPORT, help="Write figures, traces and report.md here.")] = None,
    seed: Annotated[int | None, typer.Option(min=0, max=2**63 - 1,
                                             help="Override the scenario's seed (0 or more).")] = None,
    plans: Annotated[Path | None, typer.Option(
        "--plans", parser=_path("--plans", _FOLDER), help="Write each policy's plan "
        "(plan_<policy>.json) and, per real policy, a launch folder: hostfile, launch.sh (torchrun "
        "per node), Megatron-LM and Holmes arguments, NCCL settings (docs/validation.md).")] = None,
    hosts: Annotated[Path | None, typer.Option("--hosts", parser=_HOSTS, help=_HOSTS_HELP)] = None,
    wide: Annotated[bool, typer.Option("--wide", help="Every column, however wide the terminal.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No table.")] = False,
    full_simulation: Annotated[bool, typer.Option(
        "--full-simulation", help="Simulate every data-parallel replica, not one per class of "
                                  "identical replicas (same results, slower).")] = False,
) -> None:
    """Simulate one training iteration for every policy and print a table, fastest first."""
    from holmes_sim.export.folders import plan_launches, read_cli_hosts, scenario_hosts
    from holmes_sim.metrics import memory_warning
    from holmes_sim.report.files import prepare_output
    from holmes_sim.report.owned import write_result_json
    from holmes_sim.runner import results_document, run_scenario, stamp

    try:
        host_names = read_cli_hosts(hosts, plans, "--plans")
        prepared = _prepare(scenario)
        check_outputs([(json_path, False, "--json"), (report, True, "--report"), (plans, True, "--plans")],
                      (prepared.source, hosts, prepared.profile_path))
        scenario_hosts(hosts, host_names, prepared.cluster)  # before the simulation
        if seed is not None:
            prepared = replace(prepared, scenario=replace(prepared.scenario, seed=seed))
        names = _check_policy_names(policy)
        _check_run_targets(plans, report, names or list(prepared.scenario.policies))
        outcomes = run_scenario(prepared, names, full_simulation)
        if plans is not None:
            _write_plans(prepare_output(plans, directory=True, option="--plans"), outcomes,
                         *plan_launches(prepared, outcomes, hosts, host_names))
        if report is not None:  # before --json, which may name the report's own results.json
            _write_report(report, prepared, outcomes)
        if json_path is not None:
            from holmes_sim.report.stragglers import with_stragglers

            write_result_json(json_path, stamp(with_stragglers(results_document(
                prepared, outcomes, prepared.scenario.seed), prepared, outcomes)))
    except HolmesError as exc:
        raise _fail(exc) from None
    if not quiet:
        _print_results(err if is_stdout(json_path) else out, prepared, outcomes, wide)
    _notes(memory_warning(prepared, [o.result for o in outcomes]))


def _check_run_targets(plans: Path | None, report: Path | None, policies: list[str]) -> None:
    """The files `run --plans` and `--report` will replace, checked before the simulation."""
    from holmes_sim.export.folders import check_plans_targets
    from holmes_sim.report.document import report_targets
    from holmes_sim.report.owned import check_owned

    check_plans_targets(plans, policies)
    if report is not None:
        check_owned(report, "--report", report_targets(policies))


def _write_plans(directory: Path, outcomes, launches: dict, refused: dict[str, str]) -> None:
    """`export.folders.write_plans`, with notes on the launch folders it left out (`refused`:
    why, by policy) and on what it found from before."""
    from holmes_sim.export.folders import write_plans

    _notes(stale_note("--plans", directory, write_plans(directory, outcomes, launches)),
           *refused_notes(refused))


def _write_report(directory: Path, prepared, outcomes) -> None:
    from rich.progress import Progress

    from holmes_sim.report.document import write_report
    from holmes_sim.report.files import prepare_output, stale_entries

    directory = prepare_output(directory, directory=True, option="--report")
    with Progress(console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task(f"writing {directory}", total=None)
        write_report(directory, prepared, outcomes,
                     progress=lambda done, n: bar.update(task, completed=done, total=n))
    written = {f"{kind}_{o.plan.policy}.{ext}" for o in outcomes
               for kind, ext in (("trace", "json"), ("timeline", "png"))}
    _notes(stale_note("--report", directory, stale_entries(directory, written,
                                                           ["trace_*.json", "timeline_*.png"])))


def _notes(*lines: str) -> None:
    """Print each non-empty line to standard error."""
    for line in filter(None, lines):
        err.print(line, highlight=False, markup=False, soft_wrap=True)


def _prepare(scenario: str):
    """`prepare` of the scenario, with a note for each fabric that joins clusters."""
    from holmes_sim.hardware.cluster import fabric_notes
    from holmes_sim.prepare import prepare

    prepared = prepare(resolve_scenario(scenario))
    _notes(*fabric_notes(prepared.cluster))
    return prepared


def _print_results(console: Console, prepared, outcomes, wide: bool) -> None:
    from holmes_sim.report.tables import layout_label, print_table, results_table

    title = f"{prepared.scenario.name}: {prepared.cluster.num_gpus} GPUs, " \
            f"{layout_label(prepared)}, {prepared.num_microbatches} micro-batches " \
            f"({prepared.scenario.parallel.schedule})"
    print_table(console, results_table(title, outcomes, console.width, wide), wide)
    if prepared.nominal_cluster is not None:
        from holmes_sim.report.stragglers import stragglers_text

        console.print(stragglers_text(prepared, outcomes), highlight=False, markup=False,
                      soft_wrap=True)


def _check_policy_names(names: list[str] | None) -> list[str] | None:
    from holmes_sim.policies import get_policy

    for n in names or []:
        get_policy(n, "--policy")
    return list(dict.fromkeys(names)) if names else None  # -p holmes -p holmes: one row


@app.command()
@_memory_guarded
def check(scenario: Annotated[str, typer.Argument(parser=_SCENARIO,
                                                  help="Scenario YAML to validate.")]) -> None:
    """Validate a scenario and build every policy's plan, without simulating."""
    from holmes_sim.cost.ops import OpCosts
    from holmes_sim.metrics import memory_fix, memory_report
    from holmes_sim.runner import naming_policy, plan_policy

    try:
        prepared = _prepare(scenario)
        too_big = []
        for name in prepared.scenario.policies:
            plan, cluster = plan_policy(prepared, name)
            with naming_policy(name, prepared.source):  # each group chooses its transport
                tuple(plan.groups)
            mem = memory_report(plan, cluster, prepared.workload,
                                OpCosts(cluster, prepared.workload, prepared.compute, plan.tp))
            fits = "fits" if mem.fits else "[red]does not fit[/red]"
            out.print(f"  {escape(name):30s} layers {'/'.join(map(str, plan.layers_per_stage))}, "
                      f"peak {mem.peak_gib:.1f} GiB per GPU ({fits})", highlight=False, soft_wrap=True)
            if not mem.fits:
                too_big.append(f"{name} {mem.shortfall()}")
        if too_big:
            raise PlanError(f"{prepared.source}: the model does not fit in GPU memory ("
                            f"{'; '.join(too_big)}); {memory_fix(prepared)}")
    except HolmesError as exc:
        raise _fail(exc) from None
    from holmes_sim.report.tables import layout_label

    out.print(f"[green]ok[/green]: {escape(prepared.source)}: {prepared.cluster.num_gpus} GPUs, "
              f"{layout_label(prepared, ' x ')}, {prepared.num_microbatches} micro-batches",
              highlight=False, soft_wrap=True)


@app.command()
@terminate_unwinds()
def validate(
    testbed: Annotated[Path | None, typer.Argument(
        parser=_path("TESTBED", "name a testbed file or a bundled testbed"),
        help="Testbed scenario (same schema, small, with a `testbed:` section) or a bundled "
             "testbed's name (default, two_clusters, unequal_speed, interleaved, ethernet, "
             "tensor_parallel, moe, moe_edp; default: default).", show_default=False)] = None,
    real: Annotated[bool, typer.Option("--real", help="Calibrate, predict, run for real, compare.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Build every group and stage on gloo, "
                                          "without training.")] = False,
    cleanup: Annotated[bool, typer.Option("--cleanup", help="Remove what killed runs recorded "
                                          "(namespaces, processes, temp folders); exit 2 if "
                                          "something stays.")] = False,
    published: Annotated[bool, typer.Option("--published", help="Check the simulator against the "
                         "published measurements in validation/published and the Holmes paper's "
                         "Figure 6 (no testbed needed).")] = False,
    policy: Annotated[list[str] | None, typer.Option("--policy", "-p", help="Only these policies.")] = None,
    iterations: Annotated[int | None, typer.Option(min=1, max=10_000,
                                                   help="Measured iterations per policy.")] = None,
    compute: Annotated[str | None, typer.Option(
        "--compute", help="emulated: ranks wait their calibrated compute durations, all "
        "communication real (robust on a busy host); real: ranks compute. Default: the "
        "testbed's testbed.compute (emulated).", show_default=False)] = None,
    json_path: Annotated[Path | None, typer.Option(
        "--json", parser=_JSON, help="Write the comparison as JSON ('-': standard output).")] = None,
    report: Annotated[Path | None, typer.Option(
        "--report", parser=_REPORT, help="Write figures and report.md here.")] = None,
    wide: Annotated[bool, typer.Option("--wide", help="Every column, however wide the terminal.")] = False,
) -> None:
    """Run plans for real with torch.distributed on an emulated testbed and compare with the
    simulator's predictions (exit 1 when a case leaves the tolerance)."""
    given = {"--real": real, "--dry-run": dry_run, "--cleanup": cleanup, "--policy": policy, "--iterations":
             iterations is not None, "--compute": compute, "--json": json_path, "--report": report,
             "--wide": wide, "a testbed": testbed}
    if published:  # simulation only: no torch, no testbed
        try:
            _refuse_unused("--published", given)
            from holmes_sim.spec.limits import memory_bounded

            with memory_bounded():
                _validate_published(json_path, wide)
        except HolmesError as exc:
            raise _fail(exc) from None
        return
    _require_torch()
    try:
        if cleanup or (dry_run and not real):
            _refuse_unused("--cleanup" if cleanup else "--dry-run", given)
        testbed, problem = testbed_file(testbed)
        if problem:
            raise _usage(problem)
        result = _validate_on_testbed(testbed, real=real, dry_run=dry_run, cleanup=cleanup,
                                      policy=policy, iterations=iterations, compute=compute,
                                      json_path=json_path, report=report)
    except HolmesError as exc:
        raise _fail(exc) from None
    except KeyboardInterrupt:  # testbed, ranks and temp folders are gone by now
        err.print("interrupted; testbed removed" if real else "interrupted", markup=False)
        raise typer.Exit(130) from None
    if result is not None:
        _print_verdict(result, json_path, wide)


def _refuse_unused(mode: str, given: dict[str, object]) -> None:
    """A usage error naming every option of `given` that was set but `mode` does not use."""
    if message := unused_options(mode, given):
        raise _usage(message)


def _require_torch() -> None:
    """Exit 2 naming the extra to install when torch is missing."""
    if importlib.util.find_spec("torch") is None:
        err.print("error: `holmes-sim validate` needs torch; install it with "
                  "pip install 'holmes-sim[validate]'", highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(2)


def _validate_on_testbed(testbed: Path, *, real: bool, dry_run: bool, cleanup: bool,
                         policy: list[str] | None, iterations: int | None, compute: str | None,
                         json_path: Path | None, report: Path | None):
    """`validate --cleanup`, `--dry-run` (both print their lines; None) or `--real` (the
    ValidationResult, written to `json_path` and `report` when given)."""
    from holmes_sim.validation import real_run

    if cleanup:
        for line in real_run.cleanup():
            out.print(line, highlight=False, markup=False)
        return None
    if real == dry_run:
        raise _usage("choose one of --real (measure and compare) or --dry-run (build only)")
    names = _check_policy_names(policy)
    if real:
        from holmes_sim.report.document import VALIDATION_FILES
        from holmes_sim.report.owned import check_owned

        check_outputs([(json_path, False, "--json"), (report, True, "--report")], (testbed,))
        if report is not None:
            check_owned(report, "--report", VALIDATION_FILES)
    if dry_run:
        for line in real_run.dry_run(testbed, names):
            out.print(line, highlight=False, markup=False)
        return None
    result = real_run.validate_real(testbed, names, iterations,
                                    progress=lambda m: err.print(m, highlight=False, markup=False),
                                    compute=compute)
    _write_validation(result, json_path, report)
    return result


def _write_validation(result, json_path: Path | None, report: Path | None) -> None:
    """The result as JSON at `json_path` and as a report in `report`, each when given."""
    from holmes_sim.report.owned import write_result_json
    from holmes_sim.runner import stamp

    if json_path is not None:
        write_result_json(json_path, stamp(result.to_json()))
    if report is not None:
        from holmes_sim.report.document import write_validation_report

        write_validation_report(report, result)


def _print_verdict(result, json_path: Path | None, wide: bool = False) -> None:
    """The comparison table; exit 3 when the host gave no verdict, 1 when a case is out of
    tolerance."""
    from holmes_sim.report.tables import print_table
    from holmes_sim.validation.comparison import comparison_table

    console = err if is_stdout(json_path) else out
    print_table(console, comparison_table(result, console.width, wide), wide)
    for note in result.provenance.get("notes", ()):
        err.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
    if result.host_unstable:  # before the verdict: on such a host it would not mean anything
        for w in result.host_warnings:
            err.print(f"error: {w}; no verdict", highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(3)
    if not result.within_tolerance:
        raise typer.Exit(1)


def _validate_published(json_path: Path | None, wide: bool = False) -> None:
    """`validate --published`: print both tables, exit 1 outside the tolerances."""
    from holmes_sim.report.tables import print_table
    from holmes_sim.validation.published import check, check_table, paper_table
    from holmes_sim.report.owned import write_result_json
    from holmes_sim.runner import stamp

    check_outputs([(json_path, False, "--json")])
    result = check(progress=lambda m: err.print(m, highlight=False, markup=False))
    if json_path is not None:
        write_result_json(json_path, stamp(result.to_json()))
    console = err if is_stdout(json_path) else out
    print_table(console, check_table(result, console.width, wide), wide)
    print_table(console, paper_table(result, console.width, wide), wide)
    if not result.within_tolerance:
        raise typer.Exit(1)


def _usage(message: str) -> HolmesError:
    from holmes_sim.errors import ScenarioError
    return ScenarioError(message)


@app.command()
def scenarios() -> None:
    """List the bundled scenarios, one line each."""
    for name in scenario_names():
        path = bundled_scenario(name)
        out.print(f"{name:22s} {_first_comment(path)}", highlight=False, markup=False, soft_wrap=True)


def _first_comment(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


@app.command()
@terminate_unwinds()
@_memory_guarded
def plan(
    scenario: Annotated[str, typer.Argument(parser=_SCENARIO, help="Scenario YAML (or the name of a "
                                            "bundled one); its `search:` block bounds the search.")],
    top: Annotated[int | None, typer.Option("--top", min=1, max=1000, help="Plans the discrete-event "
                                            "simulation confirms (default: search.top_k).")] = None,
    rows: Annotated[int, typer.Option("--rows", min=1, max=10000, help="Rows to print.")] = 10,
    json_path: Annotated[Path | None, typer.Option(
        "--json", parser=_JSON, help="Write the ranked search as JSON here ('-': standard output).")] = None,
    export: Annotated[Path | None, typer.Option(
        "--export", parser=_path("--export", _FOLDER), help="Write a launch folder (hostfile, "
        "torchrun per node, Megatron-LM and Holmes arguments, NCCL settings) for each confirmed "
        "plan here.")] = None,
    jobs: Annotated[int | None, typer.Option(
        "--jobs", "-j", min=1, help="Local worker processes for the analytic search (default: "
                                    "the CPU count).")] = None,
    ray: Annotated[str | None, typer.Option(
        "--ray", help="Run the analytic search as Ray tasks: 'auto' (a running cluster, else a "
                      "local one) or a cluster address. Same ranking as the local run.")] = None,
    max_candidates: Annotated[int, typer.Option(
        "--max-candidates", min=1, max=10**8, help="Refuse a search of more candidates (layout "
        "x policy x optimizer) than this, counted before the search starts.")] = 50_000,
    hosts: Annotated[Path | None, typer.Option("--hosts", parser=_HOSTS, help=_HOSTS_HELP)] = None,
    wide: Annotated[bool, typer.Option("--wide", help="Every column, however wide the terminal.")] = False,
) -> None:
    """Search parallel layouts, schedules, recompute and placements; rank them analytically,
    confirm the best by simulation, compare with the best Megatron-LM default layout."""
    from holmes_sim.export.folders import check_export_targets, read_cli_hosts, write_exports
    from holmes_sim.search import exports, planner, report as search_report
    from holmes_sim.report.files import prepare_output
    from holmes_sim.report.owned import write_result_json
    from holmes_sim.report.progress import WorkProgress
    from holmes_sim.report.tables import print_folded, print_table
    from holmes_sim.report.stragglers import variability_note
    from holmes_sim.runner import stamp

    try:
        host_names = read_cli_hosts(hosts, export, "--export")
        prepared = _prepare(scenario)
        check_outputs([(json_path, False, "--json"), (export, True, "--export")],
                      (prepared.source, hosts, prepared.profile_path))
        spec = prepared.scenario.search if top is None else replace(prepared.scenario.search, top_k=top)
        check_export_targets(export, spec, prepared, hosts, host_names)  # before the search
        with WorkProgress(err, "plan", "layouts") as bar:
            result = search_report.runnable(planner.search(
                prepared, spec, progress=bar.update, jobs=_capped_jobs(jobs), ray=ray,
                max_candidates=max_candidates, confirming=bar.stage("plan, simulating the best", "plans")))
        launches, refused = exports.launches(prepared, result, hosts, host_names) if export else ([], {})
        if json_path is not None:
            write_result_json(json_path, stamp(result.to_json()))
        if export is not None:
            directory = prepare_output(export, directory=True, option="--export")
            _notes(stale_note("--export", directory, write_exports(directory, launches)),
                   *refused_notes(refused))
    except HolmesError as exc:
        raise _fail(exc) from None
    console = err if is_stdout(json_path) else out
    print_table(console, search_report.plan_table(result, rows, console.width, wide), wide)
    print_folded(console, [search_report.why_the_winner_wins(result),
                           *search_report.infeasible_summary(result), variability_note(prepared)])


def _capped_jobs(jobs: int | None) -> int | None:
    """`--jobs`, at most the cores and the workers the memory holds at their bound (a note says
    so when it is lowered); None (the command's default) unless the memory allows fewer."""
    from holmes_sim.search.planner import usable_cores
    from holmes_sim.spec.limits import worker_cap

    cap, why = worker_cap(usable_cores())
    if jobs is not None and jobs > cap:
        err.print(f"note: --jobs {jobs} lowered to {cap}: {why}", highlight=False, markup=False)
        return cap
    return cap if jobs is None and cap < usable_cores() else jobs


@app.command()
@terminate_unwinds()
@_memory_guarded
def sweep(
    scenario: Annotated[str, typer.Argument(
        parser=_SCENARIO, help="Scenario YAML (or the name of a bundled one).")],
    sets: Annotated[list[str], typer.Option("--set", help="PATH=V1,V2,... a scenario field by "
                    "dotted path with [index], e.g. clusters[0].nodes[0].count=2,4 or "
                    "training.micro_batch_size=1,2,4 (repeatable: every combination runs).")],
    policy: Annotated[list[str] | None, typer.Option(
        "--policy", "-p", help="Only these policies (repeatable); default: the scenario's list.",
    )] = None,
    out_dir: Annotated[Path, typer.Option(
        "--out", parser=_path("--out", _FOLDER),
        help="Write sweep.csv, sweep.json and plots here.")] = Path("sweep-out"),
    jobs: Annotated[int | None, typer.Option(
        "--jobs", "-j", min=1, help="Worker processes (default: min(2, points)).")] = None,
    ray: Annotated[str | None, typer.Option(
        "--ray", help="Run the points as Ray tasks: 'auto' (a running cluster, else a local "
                      "one) or a cluster address. Same rows as the local run.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No table.")] = False,
    max_points: Annotated[int, typer.Option(
        "--max-points", min=1, max=10**7, help="Refuse a sweep of more points (combinations of "
        "distinct values) than this, counted before anything runs.")] = 500,
    wide: Annotated[bool, typer.Option("--wide", help="Every column, however wide the terminal.")] = False,
) -> None:
    """Run a scenario for every combination of field values and tabulate and plot the results."""
    from holmes_sim.report.progress import WorkProgress
    from holmes_sim.report.tables import print_table
    from holmes_sim.report.owned import check_owned
    from holmes_sim.runner import scenario_file
    from holmes_sim.search.sweep import SWEEP_FILES, run_sweep, sweep_table, write_sweep

    try:
        check_outputs([(out_dir, True, "--out")], (resolve_scenario(scenario),))
        check_owned(out_dir, "--out", SWEEP_FILES)
        with WorkProgress(err, "sweep", "points") as bar:
            result = run_sweep(resolve_scenario(scenario), sets, _check_policy_names(policy),
                               _capped_jobs(jobs), progress=bar.update, ray=ray,
                               max_points=max_points)
        _notes(*result.notes)
        write_sweep(out_dir, replace(result, scenario=scenario_file(result.scenario)))
    except HolmesError as exc:
        raise _fail(exc) from None
    if not quiet:
        print_table(out, sweep_table(result, out.width, wide), wide)
    skipped = sorted({r["point"] for r in result.rows if r["status"] == "infeasible"})
    if skipped:
        err.print(f"warning: {len(skipped)} point(s) infeasible and skipped (point "
                  f"{', '.join(map(str, skipped))}); the table and sweep.csv say why",
                  highlight=False, markup=False, soft_wrap=True)
    err.print(f"wrote {out_dir}/sweep.csv, sweep.json, sweep_iteration_time.png, sweep_tflops.png",
              highlight=False, markup=False)


def main() -> None:  # pragma: no cover - console entry
    app(prog_name="holmes-sim")
    sys.exit(0)
