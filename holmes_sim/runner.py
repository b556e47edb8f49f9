"""Evaluate policies on a prepared scenario: plan, simulate, summarise."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from holmes_sim.collector import quiet_collector
from holmes_sim.errors import FieldError, PlanError
from holmes_sim.hardware.cluster import Cluster
from holmes_sim.cost.ops import OpCosts
from holmes_sim.metrics import Result, summarize
from holmes_sim.plan import Plan
from holmes_sim.policies import get_policy
from holmes_sim.prepare import Prepared
from holmes_sim.sim.engine import EngineOptions, simulate
from holmes_sim.sim.trace import Trace
from holmes_sim.spec.load import located

BASELINE = "megatron"
# Version of the layout of the JSON documents (results, sweep, validation); raise it when a key is
# renamed or removed or its meaning changes.
SCHEMA_VERSION = 1
# Policies that change or restrict the hardware: bounds on a hypothetical network, not placements
# one could deploy on the scenario's cluster.
REFERENCES = ("all-ib", "all-ethernet")


@dataclass(frozen=True, slots=True)
class Outcome:
    """One policy's plan, the hardware it assumed, its simulated trace and its figures."""

    plan: Plan
    cluster: Cluster
    trace: Trace
    result: Result


def plan_policy(prepared: Prepared, name: str) -> tuple[Plan, Cluster]:
    """Ask policy `name` for its plan on the prepared scenario (with the collector quieted:
    planning builds many long-lived objects and few cycles). A PlanError names the policy."""
    policy = get_policy(name)
    with quiet_collector():
        cluster = policy.cluster_view(prepared.cluster)
        with naming_policy(name, prepared.source):
            return policy.plan(prepared.request(cluster)), cluster


@contextlib.contextmanager
def naming_policy(name: str, source: str = "") -> Iterator[None]:
    """Re-raise a PlanError that does not name policy `name` with its name in front, and the
    file and line of the field it blames in the scenario file `source`."""
    try:
        yield
    except PlanError as exc:
        if str(exc).startswith(name):
            raise
        message = str(exc) if exc.field is None else \
            _located(source, _file_stamp(source), exc.field, str(exc))
        raise PlanError(f"{name}: {message}", exc.field) from None


def _file_stamp(source: str) -> tuple[int, int] | None:
    """(modification time in ns, size) of the file `source`; None where it is none."""
    try:
        st = os.stat(source)
    except (OSError, ValueError):
        return None
    return st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=256)
def _located(source: str, stamp: tuple[int, int] | None, field: str, message: str) -> str:
    """`message` about `field` with its file and line (`spec.load.located`), once per error and
    version of the file (`stamp`): a search meets the same one in many layouts."""
    return str(located(source, FieldError(field, message)))


def run_policy(prepared: Prepared, name: str, seed: int | None = None,
               full_simulation: bool = False) -> Outcome:
    """Plan and simulate one policy (`seed` overrides the scenario's; `full_simulation`
    simulates every replica instead of one per class of identical replicas)."""
    plan, cluster = plan_policy(prepared, name)
    options = replace(engine_options(prepared, seed), full_simulation=full_simulation)
    # transports are chosen as the simulation meets each group
    with naming_policy(name, prepared.source):
        trace = simulate(plan, cluster, prepared.workload, prepared.compute, options)
    costs = OpCosts(cluster, prepared.workload, prepared.compute, plan.tp)
    return Outcome(plan, cluster, trace, summarize(plan, trace, cluster, prepared.workload, costs))


def engine_options(prepared: Prepared, seed: int | None = None) -> EngineOptions:
    """Engine switches from the scenario (collectives, seed) and the profile (shared host CPU
    and its measured compute spread)."""
    profile = prepared.profile
    return EngineOptions(
        step_by_step=prepared.scenario.engine.collectives == "step-by-step",
        shared_cpu_cores=profile.shared_cpu_cores if profile else None,
        compute_cv=profile.compute_cv if profile and profile.compute_cv > 0
        else prepared.scenario.engine.compute_cv,
        seed=prepared.scenario.seed if seed is None else seed)


def run_scenario(prepared: Prepared, policies: list[str] | None = None,
                 full_simulation: bool = False) -> list[Outcome]:
    """Every requested policy (default: the scenario's list): the plans that fit in GPU memory
    fastest first, then those that do not."""
    names = policies or list(prepared.scenario.policies)
    return ranked([run_policy(prepared, n, full_simulation=full_simulation) for n in names])


def ranked(outcomes: list[Outcome]) -> list[Outcome]:
    """Plans that fit in GPU memory fastest first, then those that do not (fastest first)."""
    return sorted(outcomes, key=lambda o: (not o.result.memory.fits, o.result.iteration_time_s,
                                           o.plan.policy))


def speedups(outcomes: list[Outcome]) -> dict[str, float]:
    """Speed-up over megatron of each policy whose plan fits in GPU memory (empty when megatron
    was not run or does not fit)."""
    base = next((o for o in outcomes if o.plan.policy == BASELINE), None)
    if base is None or not base.result.memory.fits:
        return {}
    return {o.plan.policy: base.result.iteration_time_s / o.result.iteration_time_s
            for o in outcomes if o.result.memory.fits}


def same_plans(outcomes: list[Outcome]) -> dict[str, str]:
    """Policy -> the first earlier policy (in `outcomes` order) that made the identical plan on the
    identical hardware, so their rows are equal by construction."""
    seen: list[tuple[Plan, Cluster, str]] = []
    same: dict[str, str] = {}
    for o in outcomes:
        plan = replace(o.plan, policy="", notes=())
        match = next((name for p, c, name in seen if p == plan and c == o.cluster), None)
        if match is None:
            seen.append((plan, o.cluster, o.plan.policy))
        else:
            same[o.plan.policy] = match
    return same


def scenario_file(source: str | os.PathLike) -> str:
    """The scenario file as a document names it: a bundled scenario by its name (as `run NAME`
    takes it), any other by the path as given; never the package's install path, so one run
    gives the same bytes from any checkout or install."""
    from holmes_sim.bundled import data_dir

    path = Path(source)
    try:
        bundled = path.suffix == ".yaml" and path.parent.resolve() == data_dir("scenarios").resolve()
    except (OSError, RuntimeError, ValueError):
        bundled = False
    return path.stem if bundled else str(source)


def results_document(prepared: Prepared, outcomes: list[Outcome], seed: int) -> dict:
    """The `--json` document; a policy's `speedup_over_megatron` is null where megatron was
    not run or either plan does not fit in GPU memory (`speedups`)."""
    ups = speedups(outcomes)
    s = prepared.scenario
    results = [{**o.result.to_json(), "speedup_over_megatron": ups.get(o.plan.policy)}
               for o in outcomes]
    return {
        "scenario": {"name": s.name, "file": scenario_file(prepared.source), "seed": seed,
                     "gpus": prepared.cluster.num_gpus, "tp": prepared.tp, "pp": prepared.pp,
                     "dp": prepared.dp, "cp": prepared.cp, "num_microbatches": prepared.num_microbatches,
                     "schedule": s.parallel.schedule, "model": s.model.name},
        "results": results,
    }


def stamp(document: dict) -> dict:
    """`document` with the JSON `schema_version` and the tool's name and version added (written
    with sorted keys, so they do not lead the file)."""
    from holmes_sim.version import tool_version

    return {"schema_version": SCHEMA_VERSION, "tool": {"name": "holmes-sim", "version": tool_version()},
            **document}
