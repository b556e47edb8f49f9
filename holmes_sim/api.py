"""The Python API: `simulate` a scenario (a file, a bundled name or the YAML mapping as a dict)
and get typed results.

    import holmes_sim

    sim = holmes_sim.simulate("mixed_ib_roce", policies=["megatron", "holmes"])
    print(sim.best.policy, sim.result("holmes").speedup_over_megatron)

Heavy modules (simpy, numpy) load on the first call, not on import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from holmes_sim.metrics import Result
    from holmes_sim.prepare import Prepared
    from holmes_sim.runner import Outcome


@dataclass(frozen=True, slots=True)
class PolicyResult:
    """One policy's simulated iteration: its `metrics.Result` and how it compares.

    Every field of `result` also reads as an attribute of its own (`policy`,
    `iteration_time_s`, `tflops_per_gpu`, `samples_per_s`, `tokens_per_s`, `mfu`,
    `bubble_fraction`, `breakdown_s`, `stage_busy_s`, `layers_per_stage`, `memory`,
    `transports`, `notes`), and its memory report as `peak_memory_gib` and `fits_memory`.
    `speedup_over_megatron` is None when megatron was not run or a plan does not fit in GPU
    memory; `reference` marks policies on a hypothetical network (all-ib, all-ethernet);
    `same_plan_as` names an earlier policy that made the identical plan. `outcome` holds the
    plan, the hardware view and the full trace."""

    result: Result
    speedup_over_megatron: float | None
    reference: bool
    same_plan_as: str | None
    outcome: Outcome = field(repr=False, compare=False)

    @property
    def peak_memory_gib(self) -> float:
        """The largest per-GPU peak memory over the stages (GiB)."""
        return self.result.memory.peak_gib

    @property
    def fits_memory(self) -> bool:
        """Whether every stage's peak fits in its GPUs' memory."""
        return self.result.memory.fits

    def __getattr__(self, name: str) -> Any:
        """A field of `result` as an attribute of its own (called only for names the class
        does not have; `metrics` loads on the first simulate call, not on import)."""
        if not name.startswith("_"):
            result = object.__getattribute__(self, "result")
            if name in result.__dataclass_fields__:
                return getattr(result, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        return sorted({*object.__dir__(self), *self.result.__dataclass_fields__})


@dataclass(frozen=True, slots=True)
class Simulation:
    """Every requested policy on one scenario: plans that fit fastest first, then the others."""

    scenario: str
    gpus: int
    tp: int
    pp: int
    dp: int
    num_microbatches: int
    seed: int
    results: tuple[PolicyResult, ...]
    prepared: Prepared = field(repr=False, compare=False)

    @property
    def best(self) -> PolicyResult:
        """The fastest policy whose plan fits, on the scenario's own hardware (no reference)."""
        real = [r for r in self.results if r.fits_memory and not r.reference]
        return (real or list(self.results))[0]

    def result(self, policy: str) -> PolicyResult:
        """The result of `policy` (KeyError when it was not run)."""
        for r in self.results:
            if r.policy == policy:
                return r
        raise KeyError(policy)

    def to_json(self) -> dict:
        """The same document as `holmes-sim run --json`."""
        from holmes_sim.runner import results_document, stamp

        outcomes = [r.outcome for r in self.results]
        return stamp(results_document(self.prepared, outcomes, self.seed))


def simulate(scenario: str | Path | Mapping[str, Any], policies: Sequence[str] | None = None,
             seed: int | None = None, full_simulation: bool = False) -> Simulation:
    """Simulate one training iteration of every policy.

    Args:
        scenario: a scenario file, the name of a bundled scenario (`holmes-sim scenarios`), or
            the scenario as a mapping (what the YAML file holds).
        policies: policy names (default: the scenario's `policies:` list).
        seed: overrides the scenario's seed.
        full_simulation: simulate every data-parallel replica rather than one per class of
            identical replicas (the same results to 1e-9, slower).

    Raises:
        holmes_sim.errors.HolmesError: for a bad scenario or policy (the CLI's exit-2 message).
    """
    from holmes_sim.runner import run_scenario

    prepared = _prepare(scenario)
    if seed is not None:
        prepared = replace(prepared, scenario=replace(prepared.scenario, seed=seed))
    if policies is not None:
        _check_policies(policies)
    outcomes = run_scenario(prepared, list(policies) if policies else None, full_simulation)
    return _simulation(prepared, outcomes)


def _prepare(scenario: str | Path | Mapping[str, Any]) -> Prepared:
    from holmes_sim.bundled import resolve_scenario
    from holmes_sim.prepare import prepare, prepare_text

    if isinstance(scenario, Mapping):
        import yaml

        return prepare_text(yaml.safe_dump(dict(scenario), sort_keys=False), "<dict scenario>")
    return prepare(resolve_scenario(scenario))


def _check_policies(names: Sequence[str]) -> None:
    from holmes_sim.policies import get_policy

    for name in names:
        get_policy(name, "policies")


def _simulation(prepared: Prepared, outcomes: list[Outcome]) -> Simulation:
    from holmes_sim.runner import REFERENCES, same_plans, speedups

    ups, same = speedups(outcomes), same_plans(outcomes)
    results = tuple(PolicyResult(o.result, ups.get(o.plan.policy), o.plan.policy in REFERENCES,
                                 same.get(o.plan.policy), outcome=o) for o in outcomes)
    return Simulation(prepared.scenario.name, prepared.cluster.num_gpus, prepared.tp, prepared.pp,
                      prepared.dp, prepared.num_microbatches, prepared.scenario.seed, results,
                      prepared)
