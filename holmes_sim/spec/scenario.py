"""The whole scenario: hardware + job + the policies to compare + seed + engine options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from holmes_sim.spec.hardware import (CatalogSpec, ClusterSpec, FabricSpec, InterClusterLinkSpec,
                                      VariabilitySpec)
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


MIN_LINK_PROBE_BYTES = 2**20
"""The smallest `testbed.link_probe_bytes`: below 1 MiB the probe times a link's latency and its
shaper's 1 ms burst, not its rate (4 bytes read 75 kB/s on a 2 Gbit/s link)."""


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
    """Size of the message that measures each fabric's throughput, bytes (at least
    MIN_LINK_PROBE_BYTES)."""
    optimizer: Literal["adam", "sgd"] = "adam"
    learning_rate: float = 0.001
    compute: Literal["emulated", "real"] = "emulated"
    """emulated: each rank waits its calibrated compute durations (measured once per run on
    this host, scaled by 1 / the GPU model's peak_tflops relative to the fastest model of the
    testbed) while all communication is real, so the prediction, which uses the same
    durations, tests the network and schedule model, and a busy host changes little. real:
    the ranks compute (end-to-end training; the prediction models the shared host CPU)."""
    emulated_layer_forward_ms: float | None = None
    """Emulated compute only: how long one layer's forward waits, milliseconds; every other
    piece keeps its measured ratio to it. Fixes the testbed's compute-to-communication ratio
    whatever this host's speed (omit: the host's measured speed, `host_share`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchSpec:
    """The space `holmes-sim plan` searches; each list bounds one knob (omit: every valid value)."""

    tensor: tuple[int, ...] | None = None
    """TP degrees (default: every divisor of the GPUs per node up to 8 that divides the heads)."""
    pipeline: tuple[int, ...] | None = None
    """PP degrees (default: every degree that divides the GPUs and fits the layers, up to 64)."""
    context: tuple[int, ...] | None = None
    """Context-parallel degrees (default: the scenario's `parallel.context` alone); list more
    (1, 2, 4, 8) to search CP."""
    expert: tuple[int, ...] | None = None
    """Expert-parallel degrees (default: the scenario's `parallel.expert` alone); list more
    (1, 2, 4, 8) to search EP."""
    expert_tensor: tuple[int, ...] | None = None
    """The experts' TP degrees of an MoE model (default: 1 and each layout's TP degree); each
    must divide the layout's TP degree and pass `parallel.expert_tensor`'s checks, else skipped."""
    micro_batch_size: tuple[int, ...] | None = None
    """Micro-batch sizes (default: 1, 2, 4, 8, 16 that divide the batch)."""
    schedule: tuple[Literal["gpipe", "1f1b", "interleaved"], ...] | None = None
    """Pipeline schedules, for every policy (default: each policy's framework's own,
    `Policy.schedules`: 1F1B and interleaved, 1F1B alone for megatron-deepspeed; GPipe only when
    listed, and no launch runs it)."""
    virtual_stages: tuple[int, ...] = (2, 3, 4, 5, 6, 7, 8, 9)
    """Model chunks per stage tried for the interleaved schedule."""
    recompute: tuple[Literal["none", "selective", "full"], ...] = ("none", "selective", "full")
    sequence_parallel: tuple[bool, ...] = (False, True)
    """Tried only with TP > 1."""
    policies: tuple[str, ...] = ("holmes", "megatron")
    """Placements to evaluate per layout; megatron is the baseline."""
    optimizer: tuple[Literal["replicated", "distributed", "distributed-overlap",
                             "distributed-overlap-gather"], ...] = (
        "replicated", "distributed", "distributed-overlap")
    """Optimizer settings tried for policies that take the scenario's (megatron): all-reduce,
    Megatron's distributed optimizer, it with --overlap-grad-reduce, or with that and
    --overlap-param-gather (listed on request). Other policies fix theirs."""
    top_k: int = 5
    """Candidates the discrete-event simulation confirms."""


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
    search: SearchSpec = field(default_factory=SearchSpec)
    """What `holmes-sim plan` searches."""
    profile: str | None = None
    """Path (relative to the scenario file) of a measured profile JSON that replaces catalog
    compute and link numbers (written by `holmes-sim validate`)."""
    variability: VariabilitySpec = field(default_factory=VariabilitySpec)
    """Stragglers, a seeded per-GPU speed spread, degraded NICs and uplinks
    (`hardware.variability`)."""
