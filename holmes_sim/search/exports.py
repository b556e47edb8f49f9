"""The launch folders of `plan --export`: one per confirmed (simulated) real plan, named
<rank>-<policy>, each built before anything is written (`export.folders`), and why a confirmed
plan gets none (`export.refusals.plan_launch_refusal`: GPipe, Megatron-LLaMA,
Megatron-DeepSpeed)."""

from __future__ import annotations

from pathlib import Path

from holmes_sim.export.folders import scenario_hosts
from holmes_sim.export.hosts import HostLine
from holmes_sim.export.launch import REFERENCE_POLICIES, LaunchFiles, launch_files
from holmes_sim.export.refusals import plan_launch_refusal
from holmes_sim.prepare import Prepared
from holmes_sim.runner import plan_policy
from holmes_sim.search.planner import PlanSearch, prepared_for


def launches(prepared: Prepared, result: PlanSearch, hosts: Path | None,
             lines: list[HostLine] | None) -> tuple[list[tuple[str, LaunchFiles]], dict[str, str]]:
    """(folder name, launch folder) of every confirmed real plan that gets one, and why each
    other gets none, by folder name; `hosts` and `lines` as `export.folders.scenario_hosts`."""
    confirmed = [c for c in result.candidates if c.simulated and c.policy not in REFERENCE_POLICIES]
    by_node = scenario_hosts(hosts, lines, prepared.cluster)
    folders: list[tuple[str, LaunchFiles]] = []
    refused: dict[str, str] = {}
    for rank, c in enumerate(confirmed, 1):
        p = prepared_for(prepared, c.layout)
        plan, cluster = plan_policy(p, c.policy)
        if (why := plan_launch_refusal(plan, p.workload)) is not None:
            refused[f"{rank}-{c.policy}"] = why
            continue
        folders.append((f"{rank}-{c.policy}", launch_files(
            plan, cluster, p.workload, p.scenario.training.precision, hosts=by_node)))
    return folders, refused
