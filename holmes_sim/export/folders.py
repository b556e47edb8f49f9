"""The launch folders the CLI writes: `run --plans` (a plan JSON per policy and a launch folder
per real policy) and `plan --export` (a launch folder per confirmed plan), with the hosts of
`--hosts` (the scenario's nodes in its order, each plan's folder listing them in its own node
order). Every folder is built, and the host list checked against the scenario, before the first
file is written, so a refused `--hosts` leaves nothing behind; a file in the way that holmes-sim
did not write (`report.owned`) is refused before the first write too, and all folders are
written as one change (`staged.write_together`)."""

from __future__ import annotations

from pathlib import Path

from holmes_sim.errors import PlanError
from holmes_sim.export.hosts import HostLine, read_host_names, read_hosts
from holmes_sim.export.launch import (LAUNCH_FILE_NAMES, REFERENCE_POLICIES, LaunchFiles,
                                      launch_files)
from holmes_sim.export.refusals import (model_launch_refusal, plan_launch_refusal,
                                        policy_launch_refusal)
from holmes_sim.report.staged import write_together
from holmes_sim.report.files import check_folder, check_writable, stale_entries
from holmes_sim.report.owned import check_owned, owned_folder


def read_cli_hosts(path: Path | None, target: Path | None, needs: str
                   ) -> list[HostLine] | None:
    """The lines of `--hosts`, read and checked before any work (None without it).

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


def scenario_hosts(path: Path | None, lines: list[HostLine] | None, cluster
                   ) -> dict[str, str] | None:
    """The host of each of the scenario's nodes (`cluster`, the scenario's, not a policy's
    view) by node name, from `--hosts` (`lines`, as read from `path`), or None without it;
    every plan's launch folder lists these hosts in its own node order (`launch_files`)."""
    if path is None:
        return None
    return read_hosts(path, [n.name for n in cluster.nodes], lines)


def plan_launches(prepared, outcomes, hosts: Path | None, lines: list[HostLine] | None
                  ) -> tuple[dict[str, LaunchFiles], dict[str, str]]:
    """The launch folder of every real (non-reference) policy's plan that Megatron-LM would
    start, and why each other policy has none (`launch_refusals`), both by policy."""
    refused = launch_refusals(prepared, outcomes)
    by_node = scenario_hosts(hosts, lines, prepared.cluster)
    launches = {o.plan.policy: launch_files(o.plan, o.cluster, prepared.workload,
                                            prepared.scenario.training.precision, hosts=by_node)
                for o in outcomes if o.plan.policy not in refused}
    return launches, refused


def launch_refusals(prepared, outcomes) -> dict[str, str]:
    """Why each policy without a launch folder has none, by policy: a reference on a
    hypothetical network, or a plan the export writes no launch for
    (`launch.plan_launch_refusal`)."""
    refused = {}
    for o in outcomes:
        why = (REFERENCE_NOTE if o.plan.policy in REFERENCE_POLICIES else
               plan_launch_refusal(o.plan, prepared.workload))
        if why is not None:
            refused[o.plan.policy] = why
    return refused


REFERENCE_NOTE = "a reference on a hypothetical network, not a placement for this cluster"


def plans_targets(policies) -> list[str]:
    """Every file `run --plans` may write for `policies`, relative to its folder (references get
    a plan file and no launch folder)."""
    return [name for p in policies
            for name in (f"plan_{p}.json", *(f"{p}/{f}" for f in LAUNCH_FILE_NAMES
                                             if p not in REFERENCE_POLICIES))]


def check_plans_targets(directory: Path | None, policies) -> None:
    """The files `run --plans` may write under an existing `directory` (None: no --plans),
    checked before the simulation."""
    if directory is not None:
        for policy in policies:
            check_launch_folder(directory / policy, "--plans")
        check_owned(directory, "--plans", plans_targets(policies))


def write_plans(directory: Path, outcomes, launches: dict[str, LaunchFiles]) -> list[str]:
    """plan_<policy>.json per policy and the launch folder of each in `launches`; returns the
    entries of an earlier run this one did not write."""
    policies = [o.plan.policy for o in outcomes]
    for policy in policies:  # every target checked before the first file is written
        check_folder(directory / policy, "--plans")
    files = {f"plan_{o.plan.policy}.json": o.plan.to_json() + "\n" for o in outcomes}
    for policy, launch in launches.items():
        files |= {f"{policy}/{name}": text for name, text in launch.files.items()}
    with owned_folder(directory, "--plans", plans_targets(policies)) as folder:
        write_together(directory, files, folder, "--plans", LAUNCH_FILE_NAMES)
    written = {f"plan_{p}.json" for p in policies} | set(launches)  # a refused folder is stale
    return stale_entries(directory, written, ["plan_*.json", "*/launch.sh"])


def export_targets(names) -> list[str]:
    """Every file `plan --export` may write into the launch folders `names`."""
    return [f"{name}/{f}" for name in names for f in LAUNCH_FILE_NAMES]


def check_export_targets(export: Path | None, spec, prepared, hosts: Path | None = None,
                         host_names: list[HostLine] | None = None) -> None:
    """That Megatron-LM can build the model, that `hosts` names one host a node (every plan
    uses every node), and every launch folder `plan --export` could write under an existing
    `export` (None: no export), checked before the search."""
    if export is None:
        return
    why = model_launch_refusal(prepared.workload)
    if why is not None:
        raise PlanError(f"--export: no launch files: {why}")
    if all(policy in REFERENCE_POLICIES for policy in spec.policies):
        raise PlanError(f"--export: search.policies lists only {', '.join(spec.policies)}, "
                        "references on a hypothetical network with no launch files; add holmes "
                        "or megatron to search.policies, or drop --export")
    real = [p for p in dict.fromkeys(spec.policies) if p not in REFERENCE_POLICIES]
    if all(policy_launch_refusal(p) for p in real):
        raise PlanError("--export: no policy of search.policies gets launch files: " + "; ".join(
            f"{p}: {policy_launch_refusal(p)}" for p in real) + "; add holmes or megatron to "
            "search.policies, or drop --export")
    if hosts is not None:
        scenario_hosts(hosts, host_names, prepared.cluster)
    if export.is_dir():
        names = [f"{rank}-{policy}" for rank in range(1, spec.top_k + 2)  # top K and baseline
                 for policy in dict.fromkeys(spec.policies)]
        for name in names:
            check_launch_folder(export / name, "--export")
        check_owned(export, "--export", export_targets(names))


def write_exports(directory: Path, launches: list[tuple[str, LaunchFiles]]) -> list[str]:
    """Each (folder name, launch folder) of `plan --export` under `directory`; returns the
    entries of an earlier run this one did not write. Without launches (every confirmed plan
    refused, its note says why) nothing is written and no folder made."""
    if not launches:
        return stale_entries(directory, set(), ["*/launch.sh"]) if directory.is_dir() else []
    for name, _ in launches:  # every target checked before the first is written
        check_folder(directory / name, "--export")
    files = {f"{name}/{f}": text for name, launch in launches for f, text in launch.files.items()}
    with owned_folder(directory, "--export",
                      export_targets(name for name, _ in launches)) as folder:
        write_together(directory, files, folder, "--export", LAUNCH_FILE_NAMES)
    return stale_entries(directory, {name for name, _ in launches}, ["*/launch.sh"])


def check_launch_folder(path: Path, option: str) -> None:
    """OutputError unless `path` is absent or a real folder this process can create and replace
    files in (`report.files.check_folder`, `check_writable`: an immutable or append-only folder
    is refused too)."""
    check_folder(path, option)
    if path.is_dir():
        check_writable(path, option)
