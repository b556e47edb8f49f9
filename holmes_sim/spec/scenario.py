"""The whole scenario: hardware + job + the policies to compare + seed + engine options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from holmes_sim.spec.hardware import CatalogSpec, ClusterSpec, FabricSpec, InterClusterLinkSpec
from holmes_sim.spec.job import ModelSpec, ParallelSpec, TrainingSpec

DEFAULT_POLICIES = (
    "megatron", "holmes", "holmes-no-nic-aware-order", "holmes-no-nic-selection",
    "holmes-no-adaptive-partition", "holmes-no-overlap", "all-ib", "all-ethernet",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSpec:
    """Simulation options."""

    collectives: Literal["steady-state", "step-by-step"] = "steady-state"
    """Ring collectives as p concurrent flows (fast) or 2(p-1) rounds of flows (detailed)."""
    compute_cv: float = 0.0
    """Run-to-run spread of compute op times (coefficient of variation; 0: deterministic). Each
    op's time gets a mean-1 log-normal factor drawn from the seed; a measured profile's
    `host.compute_cv` takes precedence."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TestbedSpec:
    """How `holmes-sim validate --real` runs this scenario on the emulated testbed."""

    __test__ = False  # not a pytest test class

    iterations: int = 8
    """Measured iterations per policy (after warm-up)."""
    warmup: int = 2
    """Iterations run first and left out of the timing."""
    tolerance_pct: float = 10.0
    """Largest |predicted - measured| / measured, in %, a case may show."""
    timeout_s: float = 240.0
    """Wall-clock limit of one policy's real run, seconds."""
    calibration_repeats: int = 30
    """Timed repetitions per piece when measuring compute."""
    link_probe_bytes: int = 4000000
    """Size of the message that measures each fabric's throughput, bytes."""
    optimizer: Literal["adam", "sgd"] = "adam"
    learning_rate: float = 0.001


@dataclass(frozen=True, kw_only=True, slots=True)
class Scenario:
    """A described cluster and job, and what to compare on it."""

    name: str = "scenario"
    description: str = ""
    seed: int = 0
    clusters: tuple[ClusterSpec, ...]
    fabrics: tuple[FabricSpec, ...] = ()
    inter_cluster_links: tuple[InterClusterLinkSpec, ...] = ()
    model: ModelSpec
    training: TrainingSpec
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    policies: tuple[str, ...] = DEFAULT_POLICIES
    catalog: CatalogSpec = field(default_factory=CatalogSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    testbed: TestbedSpec | None = None
    """Present in validation testbed files (`validation/testbeds/`)."""
    profile: str | None = None
    """Path (relative to the scenario file) of a measured profile JSON that replaces catalog
    compute and link numbers (written by `holmes-sim validate`)."""
