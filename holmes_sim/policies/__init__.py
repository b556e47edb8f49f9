"""Scheduling policies by name. Each is a pure function from a `PlanRequest` to a `Plan`."""

from __future__ import annotations

from holmes_sim.errors import ScenarioError
from holmes_sim.plan import OptimizerMode
from holmes_sim.policies.base import DEEPSPEED_SCHEDULES, PlanRequest, Policy
from holmes_sim.policies.holmes import HolmesPolicy
from holmes_sim.policies.megatron import LLAMA_FIXED, LLAMA_RELEASED, MegatronPolicy
from holmes_sim.policies.references import AllEthernetReference, AllIbReference

POLICIES: dict[str, Policy] = {
    p.name: p for p in (
        MegatronPolicy(),
        MegatronPolicy(name="megatron-llama", llama_release=LLAMA_FIXED,
                       description="Megatron-LLaMA since 2023-10: Megatron-LM placement, overlapped "
                                   "distributed optimizer reducing every micro-batch"),
        MegatronPolicy(name="megatron-llama-2023-08", llama_release=LLAMA_RELEASED,
                       description="Megatron-LLaMA as released 2023-08 (and in the Holmes "
                                   "repository): under PP each gradient bucket reduced once per run"),
        MegatronPolicy(name="megatron-deepspeed", optimizer=OptimizerMode.ZERO1,
                       schedules=DEEPSPEED_SCHEDULES,
                       description="Megatron-DeepSpeed: Megatron-LM placement, ZeRO-1 data parallel"),
        HolmesPolicy(),
        HolmesPolicy(name="holmes-no-nic-aware-order", nic_aware_order=False,
                     description="Holmes without NIC-aware rank order (listing order)"),
        HolmesPolicy(name="holmes-no-nic-selection", nic_selection=False,
                     description="Holmes without per-group NIC selection (job-wide transport)"),
        HolmesPolicy(name="holmes-no-adaptive-partition", adaptive_partition=False,
                     description="Holmes with equal layers per stage"),
        HolmesPolicy(name="holmes-no-overlap", overlapped_optimizer=False,
                     description="Holmes with a distributed optimizer that does not overlap"),
        AllIbReference(),
        AllEthernetReference(),
    )
}


def get_policy(name: str, path: str = "policies") -> Policy:
    """The policy registered as `name`.

    Raises:
        ScenarioError: listing the registered names.
    """
    if name not in POLICIES:
        raise ScenarioError(f"{path}: unknown policy '{name}' (known: {', '.join(POLICIES)})")
    return POLICIES[name]


def searched_schedules(listed: tuple[str, ...] | None, name: str) -> tuple[str, ...]:
    """The pipeline schedules `holmes-sim plan` searches for the policy `name`: `listed` (the
    scenario's `search.schedule`) where given, else its framework's own (`Policy.schedules`;
    GPipe, which no Megatron-based framework runs, only when listed)."""
    return listed if listed is not None else get_policy(name, "search.policies").schedules


__all__ = ["POLICIES", "Policy", "PlanRequest", "get_policy", "searched_schedules"]
