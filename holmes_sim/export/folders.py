"""The launch folders the CLI writes: `run --plans` (a plan JSON per policy and a launch folder
per real policy) and `plan --export` (a launch folder per confirmed plan), with the host names of
`--hosts`. Every folder is built, and every host list checked against its plan, before the first
file is written, so a refused `--hosts` leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

from holmes_sim.errors import PlanError
from holmes_sim.export.launch import (REFERENCE_POLICIES, LaunchFiles, launch_files, node_order,
                                      read_host_names, read_hosts)
from holmes_sim.report.files import (check_file, check_folder, output_lock, stale_entries,
                                     write_atomic)


def read_cli_hosts(path: Path | None, target: Path | None, needs: str) -> list[str] | None:
    """The names of `--hosts`, read and checked before any work (None without it).

    Raises:
        PlanError: without the output (`needs`, e.g. --plans) they name the hosts of, or as
            `read_host_names`.
    """
    if path is None:
        return None
    if target is None:
        raise PlanError(f"--hosts names the hosts of launch folders: give {needs} too, or drop "
                        "--hosts")
    return read_host_names(path)


def plan_hosts(path: Path | None, names: list[str] | None, plan, cluster) -> list[str] | None:
    """The host names of `--hosts` for the plan's nodes, or None without it."""
    return None if path is None else read_hosts(path, len(node_order(plan, cluster)), names)


def plan_launches(prepared, outcomes, hosts: Path | None,
                  names: list[str] | None) -> dict[str, LaunchFiles]:
    """The launch folder of every real (non-reference) policy's plan, by policy."""
    return {o.plan.policy: launch_files(o.plan, o.cluster, prepared.workload,
                                        prepared.scenario.training.precision,
                                        hosts=plan_hosts(hosts, names, o.plan, o.cluster))
            for o in outcomes if o.plan.policy not in REFERENCE_POLICIES}


def write_plans(directory: Path, outcomes,
                launches: dict[str, LaunchFiles]) -> tuple[list[str], list[str]]:
    """plan_<policy>.json per policy and the launch folder of each in `launches`; returns the
    entries of an earlier run this one did not write and the policies without a folder."""
    for o in outcomes:  # every target checked before the first file is written
        check_file(directory / f"plan_{o.plan.policy}.json")
        check_folder(directory / o.plan.policy, "--plans")
    skipped = []
    with output_lock(directory, "--plans"):
        for o in outcomes:
            write_atomic(directory / f"plan_{o.plan.policy}.json", o.plan.to_json() + "\n")
            if o.plan.policy not in launches:
                skipped.append(o.plan.policy)
                continue
            launches[o.plan.policy].write(directory / o.plan.policy)
    written = {n for o in outcomes for n in (f"plan_{o.plan.policy}.json", o.plan.policy)}
    return stale_entries(directory, written, ["plan_*.json", "*/launch.sh"]), skipped


def check_export_targets(export: Path | None, spec) -> None:
    """Every launch folder `plan --export` could write under an existing `export` (None: no
    export), checked before the search."""
    if export is not None and export.is_dir():
        for rank in range(1, spec.top_k + 2):  # the top K and the baseline
            for policy in dict.fromkeys(spec.policies):
                check_folder(export / f"{rank}-{policy}", "--export")


def write_exports(directory: Path, launches: list[tuple[str, LaunchFiles]]) -> list[str]:
    """Each (folder name, launch folder) of `plan --export` under `directory`; returns the
    entries of an earlier run this one did not write."""
    for name, _ in launches:  # every target checked before the first is written
        check_folder(directory / name, "--export")
    with output_lock(directory, "--export"):
        for name, files in launches:
            files.write(directory / name)
    return stale_entries(directory, {name for name, _ in launches}, ["*/launch.sh"])
