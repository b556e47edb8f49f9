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
        policies: policy names, at least one (default: the scenario's `policies:` list).
        seed: overrides the scenario's seed.
        full_simulation: True to simulate every data-parallel replica rather than one per class of
            identical replicas (the same results to 1e-9, slower).

    Raises:
        holmes_sim.errors.HolmesError: for a bad scenario or policy (the CLI's exit-2 message).
    """
    from holmes_sim.runner import run_scenario

    _check_seed(seed)
    _check_flag(full_simulation)
    names = None if policies is None else _check_policies(policies)
    prepared = _prepare(scenario)
    if seed is not None:
        prepared = replace(prepared, scenario=replace(prepared.scenario, seed=seed))
    outcomes = run_scenario(prepared, names, full_simulation)
    return _simulation(prepared, outcomes)


def _prepare(scenario: str | Path | Mapping[str, Any]) -> Prepared:
    from holmes_sim.bundled import resolve_scenario
    from holmes_sim.errors import ScenarioError
    from holmes_sim.prepare import prepare, prepare_text

    if isinstance(scenario, Mapping):
        from holmes_sim.spec.load import mapping_text

        return prepare_text(mapping_text(scenario, "<dict scenario>"), "<dict scenario>")
    if isinstance(scenario, str) and ("\n" in scenario or len(scenario) > 4096):
        raise ScenarioError("scenario: this looks like YAML text, not a file or a bundled name; "
                            "pass yaml.safe_load(text) (a dict) or write it to a file")
    if not isinstance(scenario, str | Path):
        raise ScenarioError(f"scenario: expected a file path, a bundled name or a dict, got "
                            f"{type(scenario).__name__}")
    return prepare(resolve_scenario(scenario))


def _check_seed(seed: object) -> None:
    from holmes_sim.errors import ScenarioError

    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        shown = repr(seed) if len(repr(seed)) <= 40 else f"a {type(seed).__name__}"
        raise ScenarioError(f"seed: expected a whole number from 0 to 2**63 - 1, got {shown}")


def _check_flag(full_simulation: object) -> None:
    from holmes_sim.errors import ScenarioError

    if not isinstance(full_simulation, bool):
        raise ScenarioError(f"full_simulation: expected True or False, got "
                            f"{full_simulation!r:.40} ({type(full_simulation).__name__})")


def _check_policies(names: object) -> list[str]:
    """`names` as a list without repeats; a ScenarioError for a string, an iterator, a non-name
    or an unknown policy."""
    from holmes_sim.errors import ScenarioError
    from holmes_sim.policies import get_policy

    if isinstance(names, str | bytes) or not isinstance(names, list | tuple):
        raise ScenarioError(f"policies: expected a list of policy names, got "
                            f"{type(names).__name__} (e.g. policies=['holmes'])")
    for name in names:
        if not isinstance(name, str):
            raise ScenarioError(f"policies: expected policy names, got {type(name).__name__}")
        get_policy(name, "policies")
    if not names:
        raise ScenarioError("policies: the list is empty; name at least one policy, or pass "
                            "None for the scenario's own")
    return list(dict.fromkeys(names))


def _simulation(prepared: Prepared, outcomes: list[Outcome]) -> Simulation:
    from holmes_sim.runner import REFERENCES, same_plans, speedups

    ups, same = speedups(outcomes), same_plans(outcomes)
    results = tuple(PolicyResult(o.result, ups.get(o.plan.policy), o.plan.policy in REFERENCES,
                                 same.get(o.plan.policy), outcome=o) for o in outcomes)
    return Simulation(prepared.scenario.name, prepared.cluster.num_gpus, prepared.tp, prepared.pp,
                      prepared.dp, prepared.num_microbatches, prepared.scenario.seed, results,
                      prepared)
