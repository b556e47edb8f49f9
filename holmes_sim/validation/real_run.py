"""Calibrate, predict, run, compare: the real-run validator.

1. Build the emulated testbed of a testbed scenario (one network namespace per node, one shaped
   veth per NIC; `backend/testbed.py`).
2. Calibrate this host: per-layer compute under the run's concurrency (as many processes as
   ranks) and each fabric's achieved gloo throughput and latency. The result is a profile, the
   same JSON `profile:` accepts.
3. Predict each policy's iteration time with the simulator on that profile.
4. Run each policy's very plan for real with torch.distributed (gloo), each group on the NIC the
   plan chose, and take the median iteration time after warm-up.
5. Compare: error per policy, and whether the policies rank the same.
Measurement (2) and prediction (3) are separate steps joined by the profile: nothing measured in
(4) feeds a prediction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from holmes_sim.hardware.cluster import ETHERNET
from holmes_sim.cost.compute import PROFILE_SCHEMA, Profile, ProfiledCompute
from holmes_sim.errors import FieldError, ScenarioError, TestbedError
from holmes_sim.plan import GpuRef, OptimizerMode, Plan
from holmes_sim.policies import get_policy
from holmes_sim.prepare import Prepared, apply_link_profile, prepare
from holmes_sim.runner import plan_policy, run_policy
from holmes_sim.schedule import ScheduleKind
from holmes_sim.spec.scenario import TestbedSpec

Progress = Callable[[str], None]
_OVERHEAD_ITERATIONS = 12
_PREDICTION_SEEDS = 7


@dataclass(frozen=True, slots=True)
class Case:
    """One policy: predicted and measured iteration time (s) and the error in %."""

    policy: str
    predicted_s: float
    measured_s: float
    measured_iterations_s: tuple[float, ...]
    losses: tuple[float, ...]
    predicted_breakdown_s: dict = dataclasses.field(default_factory=dict)
    """The simulator's time breakdown (mean over entities) of this policy."""
    measured_ops_s: dict = dataclasses.field(default_factory=dict)
    """Measured seconds per op kind per rank per iteration (forward, backward, recv, ...)."""
    profile: dict = dataclasses.field(default_factory=dict)
    """The calibration the prediction used (taken just before this case's run)."""
    emulation_lag_pct: float = 0.0
    """Emulated compute: how much longer the ranks' compute waits took than requested, in % of
    the requested (the host's wake-up lag; 0 under real compute)."""

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def measured_ci_s(self) -> tuple[float, float]:
        """Distribution-free ~95% confidence interval of the measured median (order statistics;
        the whole range when there are too few iterations for one)."""
        return median_ci(self.measured_iterations_s)

    @property
    def noise_pct(self) -> float:
        """Half-width of the measured median's interval, in % of the median."""
        lo, hi = self.measured_ci_s
        return 100.0 * (hi - lo) / 2 / self.measured_s if self.measured_s > 0 else 0.0


def median_ci(samples: tuple[float, ...] | list[float], z: float = 1.96) -> tuple[float, float]:
    """~95% interval of the median: the order statistics n/2 -+ z sqrt(n)/2 (binomial, normal
    approximation); (min, max) below 6 samples, where that rank interval covers everything."""
    xs = sorted(samples)
    n = len(xs)
    if n == 0:
        return (0.0, 0.0)
    half = z * math.sqrt(n) / 2
    lo, hi = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half) - 1)
    return (xs[lo], xs[hi]) if n >= 6 else (xs[0], xs[-1])


# SCHED_FIFO priority of emulated ranks (RunConfig.realtime_priority): the lowest real-time one.
REALTIME_PRIORITY = 1
# Largest load per core before a run that still measures (see host_warnings).
MAX_LOAD_PER_CORE = {"real": 1.0, "emulated": 2.5}
LOAD_WINDOW_S = 5.0
"""How long `recent_load` samples the run queue before a run, seconds."""


def _procs_running() -> int:
    """Tasks running or runnable on the host now (`procs_running` of /proc/stat)."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("procs_running"):
                return int(line.split()[1])
    return 0


def recent_load(window_s: float = LOAD_WINDOW_S, interval_s: float = 0.05,
                read=_procs_running) -> float:
    """Other tasks running or waiting for a core, averaged over the last `window_s` seconds
    (sampled every `interval_s`; this sampler itself not counted): the load of the host's other
    tenants now. The 1-minute load average also remembers the validator's own previous run for
    minutes (one `tensor_parallel` run, 8 ranks, left it at 5.5 on 2 cores), so runs in a row
    were refused for their own load."""
    count = max(1, round(window_s / interval_s))
    total = 0
    for k in range(count):
        if k:
            time.sleep(interval_s)
        total += max(0, read() - 1)
    return total / count


def host_warnings(load_before: float, cpu_count: int, calibrations: list[dict],
                  max_calibration_ratio: float = 1.5, lags: list[float] = (),
                  max_lag_pct: float = 5.0, max_load_per_core: float = 1.0) -> list[str]:
    """Why this host's measurements cannot be trusted, or nothing.

    Overloaded: a load (`recent_load`: tasks running or waiting, averaged over a few seconds)
    above `max_load_per_core` x the core count before the run starts (taken then because the
    validator's own ranks load the host during it; the thresholds were set on the 1-minute load
    average, the same count averaged longer). Real
    compute: 1 per core, the ranks need the cores. Emulated compute: 2.5 per core; measured on
    2 cores: load 2.7, 4.3 and 5.6 before the run (1, 3 and 6 busy loops besides other users)
    all gave errors within 6% and waits within 1% of requested, but at 5.6 the Ethernet
    latency probe read 2.9 ms (others 0.03-0.05 ms), which the link check flags. Lag: runs
    whose waits overran by up to 4.5% stayed within 6.3% error; one at 6.1% reached 10.6%.
    Unstable: the per-case compute calibrations of one run differ by more than
    `max_calibration_ratio`. Emulated compute (`lags`, per case): the ranks' compute waits
    took more than `max_lag_pct` % longer than requested, a time no prediction contains."""
    out = []
    if load_before > max_load_per_core * cpu_count:
        out.append(f"host overloaded before the run: {load_before:.1f} tasks running or "
                   f"waiting on {cpu_count} cores (more than {max_load_per_core:g} per core)")
    layer = [c["compute"][next(iter(c["compute"]))]["layer_forward_s"] for c in calibrations
             if c.get("compute")]
    if len(layer) > 1 and min(layer) > 0 and max(layer) / min(layer) > max_calibration_ratio:
        out.append(f"host unstable: layer-forward calibrations ranged {1e3 * min(layer):.1f}-"
                   f"{1e3 * max(layer):.1f} ms within one run (more than "
                   f"{max_calibration_ratio:g}x)")
    worst = max(lags, default=0.0)
    if worst > max_lag_pct:
        out.append(f"host too busy for emulated compute: the ranks' waits overran by "
                   f"{worst:.1f}% (more than {max_lag_pct:g}%)")
    return out


def implausible(values: dict[str, float], factor: float = 30.0) -> list[str]:
    """Keys whose value exceeds `factor` times the median of the other values (e.g. one link
    probe's latency of 4 ms next to others' 0.03 ms: a descheduled probe, not the link)."""
    if len(values) < 2:
        return []
    bad = []
    for k, v in values.items():
        rest = [x for j, x in values.items() if j != k]
        if v > factor * max(statistics.median(rest), 1e-9):
            bad.append(k)
    return bad


@dataclass(frozen=True, slots=True)
class ValidationResult:
    """All cases of one validation run, with the profile and where it ran."""

    cases: tuple[Case, ...]
    tolerance_pct: float
    profile: dict
    provenance: dict
    host_warnings: tuple[str, ...] = ()
    """Why the host cannot be trusted (overloaded, unstable calibration); empty: it can."""
    compute: str = "real"
    """How the ranks computed: "emulated" (calibrated waits) or "real"."""

    @property
    def host_unstable(self) -> bool:
        return bool(self.host_warnings)

    @property
    def ranking_agrees(self) -> bool:
        return ranking_agrees(self.cases)

    @property
    def within_tolerance(self) -> bool:
        return all(abs(c.error_pct) <= self.tolerance_pct for c in self.cases)

    def to_json(self) -> dict:
        return {
            "cases": [{"policy": c.policy, "predicted_s": c.predicted_s, "measured_s": c.measured_s,
                       "error_pct": c.error_pct,
                       "measured_iterations_s": list(c.measured_iterations_s),
                       "measured_ci_s": list(c.measured_ci_s), "noise_pct": c.noise_pct,
                       "losses": list(c.losses),
                       "predicted_breakdown_s": c.predicted_breakdown_s,
                       "measured_ops_s": c.measured_ops_s,
                       "emulation_lag_pct": c.emulation_lag_pct,
                       "profile_compute": c.profile.get("compute", {}),
                       "profile_host": c.profile.get("host", {})} for c in self.cases],
            "ranking_agrees": self.ranking_agrees,
            "mechanism_effects": mechanism_effects(self.cases),
            "host_unstable": self.host_unstable,
            "host_warnings": list(self.host_warnings),
            "compute": self.compute,
            "within_tolerance": self.within_tolerance,
            "tolerance_pct": self.tolerance_pct,
            "mean_abs_error_pct": statistics.fmean(abs(c.error_pct) for c in self.cases),
            "max_abs_error_pct": max(abs(c.error_pct) for c in self.cases),
            "profile": self.profile,
            "provenance": self.provenance,
        }


# Each ablation and the Holmes mechanism it switches off (holmes_sim/policies/__init__.py).
MECHANISMS = {"holmes-no-nic-aware-order": "NIC-aware grouping",
              "holmes-no-nic-selection": "per-group NIC selection",
              "holmes-no-adaptive-partition": "adaptive partition",
              "holmes-no-overlap": "overlapped optimizer",
              "megatron": "all four (Megatron-LM's defaults)"}


def mechanism_effects(cases: tuple[Case, ...] | list[Case], tie_pct: float = 3.0) -> list[dict]:
    """Per ablation run next to holmes: how much slower it is without the mechanism, measured
    and predicted, in % of holmes' time, and whether the measured effect exceeds the noise
    band (`ranking_agrees`' band: `tie_pct` or both cases' measured noise)."""
    by = {c.policy: c for c in cases}
    base = by.get("holmes")
    if base is None:
        return []
    out = []
    for name, mechanism in MECHANISMS.items():
        c = by.get(name)
        if c is None:
            continue
        band = max(tie_pct, base.noise_pct, c.noise_pct)
        measured = 100.0 * (c.measured_s / base.measured_s - 1)
        out.append({"policy": name, "mechanism": mechanism, "measured_pct": measured,
                    "predicted_pct": 100.0 * (c.predicted_s / base.predicted_s - 1),
                    "band_pct": band, "beyond_noise": abs(measured) > band})
    return out


def ranking_agrees(cases: tuple[Case, ...] | list[Case], tie_pct: float = 3.0) -> bool:
    """Every pair the prediction orders (by more than its band) is measured in the same order,
    unless the two measured times are within that band of each other. A pair's band is
    `tie_pct` % or the larger of the two cases' measured noise (`Case.noise_pct`), whichever
    is wider: the prediction claims no order the measurement cannot resolve."""
    for a in cases:
        for b in cases:
            band = 1 + max(tie_pct, a.noise_pct, b.noise_pct) / 100
            if a.predicted_s * band < b.predicted_s and a.measured_s > b.measured_s * band:
                return False
    return True


# ---- the real run ------------------------------------------------------------------------------
def validate_real(testbed_path: str | Path, policies: list[str] | None = None,
                  iterations: int | None = None, progress: Progress = lambda m: None,
                  rounds: int = 2, compute: str | None = None) -> ValidationResult:
    """Calibrate, predict, run and compare every policy of a testbed scenario (module docstring).

    `compute` ("emulated" or "real") overrides the testbed's `testbed.compute`. Emulated: the
    compute profile is measured once, the ranks wait its durations and every prediction uses
    them; real: the ranks compute and each case is calibrated just before it runs.

    Raises:
        ScenarioError: the file cannot run on a testbed (not fp32, tied embeddings, TP > 1
            under real compute, ...).
        TestbedError: no root / ip / tc / namespaces, or a rank failed or hung.
    """
    from holmes_sim.backend.records import measurement_lock
    from holmes_sim.backend.testbed import Testbed

    prepared = prepare(testbed_path, check=check_testbed)
    spec = prepared.scenario.testbed or TestbedSpec()
    if iterations is not None:
        spec = dataclasses.replace(spec, iterations=iterations)
    if compute is not None:
        if compute not in ("emulated", "real"):
            raise ScenarioError(f"compute must be 'emulated' or 'real', got {compute!r}")
        spec = dataclasses.replace(spec, compute=compute)
    emulated = spec.compute == "emulated"
    if not emulated and prepared.tp > 1:
        raise ScenarioError(f"{testbed_path}: parallel.tensor: real compute calibrates the "
                            "unsplit model, so it runs tensor: 1 only; drop --compute real (TP "
                            "testbeds use emulated compute)")
    names = _runnable_policies(prepared, policies)
    config = model_config(prepared)
    if rounds < 1:
        raise ScenarioError(f"rounds must be >= 1, got {rounds}")
    rounds = min(rounds, spec.iterations)  # at least one measured iteration per round
    started = time.time()
    # The lock first, so a second run refuses at once; the testbed runs its preflight inside it.
    # The host's load is read once both have passed (a refusal does not wait for it), before
    # any rank or probe runs.
    with measurement_lock(f"validate --real {testbed_path}"), Testbed(
            testbed_nodes(prepared), uplinks=testbed_uplinks(prepared)) as tb:
        load_before, runnable_before = os.getloadavg()[0], recent_load()
        progress("calibrating the links ...")
        # Emulated ranks wait instead of computing: the links are probed on an idle host share.
        busy = 0 if emulated else prepared.cluster.num_gpus - 2
        rt = REALTIME_PRIORITY if emulated else 0  # probes move bytes as the ranks will
        fabrics = calibrate_links(prepared, tb, spec, busy, rt)
        warnings = _recheck_links(prepared, tb, spec, fabrics, progress, busy=busy, rt=rt)
        links = {"fabrics": fabrics, **calibrate_intra_node(prepared, tb, spec, busy, rt)}
        fixed: dict[str, tuple] = {}
        if emulated:
            progress("calibrating compute once (the ranks wait these durations) ...")
            common = {**emulated_profile(prepared, spec, tb), **links}
            fixed = {name: (common, *predict(apply_profile(prepared, common), name))
                     for name in names}
        # Rounds (A B C D, A B C D, ...): host drift over minutes hits every policy alike, and
        # each policy is calibrated and predicted inside every round it runs in.
        per_round = -(-spec.iterations // rounds)
        round_spec = dataclasses.replace(spec, iterations=per_round)
        runs: dict[str, list] = {name: [] for name in names}
        profiles = []
        for r in range(rounds):
            for name in names:
                if emulated:
                    profile, outcome, predicted = fixed[name]
                else:
                    progress(f"round {r + 1}/{rounds}, {name}: calibrating compute ...")
                    profile = {**calibrate_compute(prepared, spec, tb), **links}
                    outcome, predicted = predict(apply_profile(prepared, profile), name)
                profiles.append(profile)
                progress(f"round {r + 1}/{rounds}, {name}: predicted {predicted:.3f} s; running "
                         f"{spec.warmup} + {per_round} iterations for real ...")
                run = _run_real(outcome.plan, prepared, config, round_spec, tb,
                                profile["compute"] if emulated else None)
                runs[name].append((predicted, outcome, run, profile))
        cases = [_combine(name, runs[name]) for name in names]
    warnings += host_warnings(runnable_before, os.cpu_count() or 1, profiles,
                              lags=[c.emulation_lag_pct for c in cases],
                              max_load_per_core=MAX_LOAD_PER_CORE[spec.compute])
    for w in warnings:
        progress(f"warning: {w}")
    prov = {**provenance(testbed_path, time.time() - started), "load_before": load_before,
            "runnable_before": runnable_before,
            "load_after": os.getloadavg()[0], "compute": spec.compute}
    return ValidationResult(tuple(cases), spec.tolerance_pct, profiles[0], prov,
                            tuple(warnings), spec.compute)


def _combine(name: str, rounds: list) -> Case:
    """One policy's case from its rounds: the median prediction, every measured iteration (their
    median and interval), the losses of the first round, the first round's profile."""
    predicted = statistics.median(p for p, _, _, _ in rounds)
    iterations = tuple(t for _, _, run, _ in rounds for t in run.iteration_times_s)
    _, outcome, first, profile = rounds[0]
    ops: dict[str, float] = {}
    for _, _, run, _ in rounds:
        for k, v in run.op_times_s.items():
            ops[k] = ops.get(k, 0.0) + v / len(rounds)
    emulation = [d["emulation"] for _, _, run, _ in rounds for d in run.ranks if "emulation" in d]
    requested = sum(e["requested_s"] for e in emulation)
    lag = 100.0 * (sum(e["actual_s"] for e in emulation) - requested) / requested \
        if requested > 0 else 0.0
    return Case(name, predicted, statistics.median(iterations), iterations, first.losses,
                outcome.result.breakdown_s, ops, profile, lag)


def _recheck_links(prepared: Prepared, tb, spec: TestbedSpec, fabrics: dict,
                   progress: Progress, tries: int = 2, busy: int = 0,
                   rt: int = 0) -> list[str]:
    """Re-probe fabrics whose latency is implausible next to the others' (in place); what is
    still implausible after `tries` becomes a host warning."""
    for _ in range(tries):
        bad = implausible({f: d["latency_s"] for f, d in fabrics.items()})
        if not bad:
            return []
        for f in bad:
            progress(f"{f}: latency {1e3 * fabrics[f]['latency_s']:.2f} ms is implausible next "
                     f"to the other fabrics'; probing again ...")
            fabrics[f] = measure_fabric(prepared, tb, f, spec, busy, rt)
    return [f"host unstable: fabric {f} latency {1e3 * fabrics[f]['latency_s']:.2f} ms stayed "
            f"implausible after {tries} re-probes"
            for f in implausible({f: d["latency_s"] for f, d in fabrics.items()})]


def predict(prepared: Prepared, name: str) -> tuple:
    """Simulated iteration time of `name`: the median over `_PREDICTION_SEEDS` seeds when the
    profile measured a compute spread (the real run reports a median of noisy iterations too)."""
    seeds = range(prepared.scenario.seed, prepared.scenario.seed +
                  (_PREDICTION_SEEDS if prepared.profile and prepared.profile.compute_cv > 0 else 1))
    outcomes = [run_policy(prepared, name, seed) for seed in seeds]
    times = sorted(o.result.iteration_time_s for o in outcomes)
    median = statistics.median(times)
    return min(outcomes, key=lambda o: abs(o.result.iteration_time_s - median)), median


def _runnable_policies(prepared: Prepared, policies: list[str] | None) -> list[str]:
    names = policies or list(prepared.scenario.policies)
    for name in names:
        policy = get_policy(name)
        if policy.cluster_view(prepared.cluster) is not prepared.cluster:
            raise ScenarioError(f"policy '{name}' assumes other hardware than the testbed has "
                                "(a reference); it can be simulated but not run; remove it from "
                                "--policy or the testbed's policies")
    return names


def model_config(prepared: Prepared):
    """The backend GPT of the scenario's model, or a ScenarioError naming what cannot run."""
    from holmes_sim.backend.model import GPTConfig

    check_backend(prepared)
    s, w = prepared.scenario, prepared.workload
    return GPTConfig(n_layer=w.num_layers, n_head=w.heads, n_embd=w.hidden, block_size=w.seq,
                     vocab_size=w.vocab, seed=1234 + s.seed)


def check_backend(prepared: Prepared) -> None:
    """A FieldError naming what the real-run backend cannot run (no torch import)."""
    s, w = prepared.scenario, prepared.workload
    if s.training.precision != "fp32" or w.grad_bytes != 4:
        raise FieldError("training.precision", "the CPU backend trains in fp32; set precision: fp32 "
                                               "and grad_reduce_in_fp32: true so predicted message "
                                               "sizes match")
    if w.tie_embeddings:
        raise FieldError("model.tie_embeddings", "the backend's GPT has an untied head; set "
                                                 "tie_embeddings: false")


def testbed_nodes(prepared: Prepared):
    """One emulated node per scenario node, one shaped NIC per scenario NIC (line rate). With
    two clusters, each cluster's Ethernet NICs plug into a segment of its own (the uplink joins
    them, `testbed_uplinks`)."""
    from holmes_sim.backend.topology import TestbedNic, TestbedNode

    split = bool(prepared.cluster.uplinks)
    return [TestbedNode(n.name, tuple(TestbedNic(
        nic.name, nic.fabric, nic.bandwidth_bytes_per_s * 8,
        n.cluster if split and nic.fabric == ETHERNET else "") for nic in n.nics))
            for n in prepared.cluster.nodes]


def testbed_uplinks(prepared: Prepared):
    """The scenario's inter-cluster link as a shaped uplink between the clusters' Ethernet
    segments (check_testbed allows at most one)."""
    from holmes_sim.backend.topology import TestbedUplink

    return [TestbedUplink(ETHERNET, u.clusters, u.bandwidth_bytes_per_s * 8)
            for u in prepared.cluster.uplinks]


def check_testbed(prepared: Prepared) -> None:
    """Everything the testbed would refuse, as a FieldError naming the scenario field, before
    anything is built: names and interface names the kernel takes, rates tc can shape, at most
    254 nodes, two nodes on every fabric (link calibration measures between two)."""
    from holmes_sim.backend import topology as tbmod

    check_backend(prepared)
    nodes = prepared.cluster.nodes
    links = prepared.scenario.inter_cluster_links
    if len(links) > 1:
        raise FieldError("inter_cluster_links", f"{len(links)} inter-cluster links; the testbed "
                         "joins at most two clusters (one uplink: more would loop the bridges)")
    for i, link in enumerate(links):
        if link.latency_us != 0:
            raise FieldError(f"inter_cluster_links[{i}].latency_us", "the testbed cannot add "
                             "latency (its shapers set rates only; no netem); set latency_us: 0")
        if not 0 < link.bandwidth_gbit_per_s * 1e9 <= tbmod.MAX_RATE_BIT_PER_S:
            raise FieldError(f"inter_cluster_links[{i}].bandwidth_gbit_per_s",
                             "cannot be shaped on the testbed")
    if len(nodes) > tbmod.MAX_NODES:
        raise FieldError("clusters", f"{len(nodes)} nodes; the testbed emulates at most "
                                     f"{tbmod.MAX_NODES} (one address each in a /24)")
    fabrics = list(dict.fromkeys(nic.fabric for n in nodes for nic in n.nics))
    if len(fabrics) > tbmod.MAX_FABRICS:
        raise FieldError("fabrics", f"{len(fabrics)} fabrics; the testbed has at most "
                                    f"{tbmod.MAX_FABRICS}")
    on_fabric: dict[str, list[tuple[str, str]]] = {}
    for i, (node, name_path, nic_paths) in enumerate(zip(nodes, *_node_paths(prepared), strict=True)):
        problem = tbmod.name_problem(node.name)
        if problem is not None:
            raise FieldError(name_path, f"node name '{node.name}' ({len(node.name)} characters) "
                                        f"cannot name a testbed node: it {problem}")
        if len(nic_paths) != len(node.nics):  # NICs split by `gpus`: name the group's list
            nic_paths = [name_path.rsplit(".", 1)[0] + ".nics"] * len(node.nics)
        for nic, nic_path in zip(node.nics, nic_paths, strict=True):
            _check_testbed_nic(i, fabrics.index(nic.fabric), nic, nic_path)
            on_fabric.setdefault(nic.fabric, []).append((node.name, nic_path))
    for fabric, members in on_fabric.items():
        if len(members) < 2:
            raise FieldError(f"{members[0][1]}.fabric" if fabric != "ethernet" else members[0][1],
                             f"fabric '{fabric}' reaches only node '{members[0][0]}'; link "
                             "calibration measures between two nodes, so give it a second one")


def _check_testbed_nic(i: int, j: int, nic, path: str) -> None:
    from holmes_sim.backend import topology as tbmod

    longest = max((nic.name, tbmod.peer_name(i, j), tbmod.bridge_name(j)), key=len)
    if len(longest) > tbmod.IFNAME_MAX or tbmod.name_problem(nic.name) is not None:
        raise FieldError(path, f"interface name '{longest}' is longer than Linux allows "
                               f"({tbmod.IFNAME_MAX} characters)")
    rate = nic.bandwidth_bytes_per_s * 8
    if not 0 < rate <= tbmod.MAX_RATE_BIT_PER_S:
        raise FieldError(f"{path}.bandwidth_gbit_per_s", f"{rate / 1e9:g} Gbit/s cannot be "
                         f"shaped on the testbed (at most {tbmod.MAX_RATE_BIT_PER_S / 1e9:g})")


def _node_paths(prepared: Prepared) -> tuple[list[str], list[list[str]]]:
    """For each node of the cluster, in order: the field that names it, and its NICs' fields."""
    names, nics = [], []
    for ci, c in enumerate(prepared.scenario.clusters):
        for gi, g in enumerate(c.nodes):
            group = f"clusters[{ci}].nodes[{gi}]"
            per_nic = [f"{group}.nics[{k}]" for k, spec in enumerate(g.nics) for _ in range(spec.count)]
            for _ in range(g.count):
                names.append(f"{group}.name" if g.name is not None else f"clusters[{ci}].name")
                nics.append(per_nic)
    return names, nics


def _run_real(plan: Plan, prepared: Prepared, config, spec: TestbedSpec, tb,
              emulated: dict | None = None):
    """One policy's plan for real; `emulated`: GPU model -> compute durations the ranks wait
    (the profile's compute section), None: real compute."""
    from holmes_sim.backend.launch import run_plan
    from holmes_sim.backend.run_config import RunConfig

    eth = [next(n.name for n in prepared.cluster.node(g.node).nics if n.type == "ethernet")
           for g in plan.rank_to_gpu]
    cfg = RunConfig(model=config, micro_batch_size=prepared.workload.micro_batch,
                    iterations=spec.warmup + spec.iterations, warmup=spec.warmup,
                    lr=spec.learning_rate, optimizer=spec.optimizer, world_interfaces=eth,
                    timeout_s=min(60.0, spec.timeout_s),
                    bucket_numel=max(1, int(prepared.workload.bucket_bytes // 4)),
                    emulated_compute=[] if emulated is None else [
                        _durations(emulated[prepared.cluster.node(g.node).gpu.name])
                        for g in plan.rank_to_gpu],
                    # Emulated ranks mostly wait: real-time priority makes them wake on time on
                    # a host whose cores other processes keep busy.
                    realtime_priority=0 if emulated is None else REALTIME_PRIORITY)

    def spawn(rank: int, argv: list[str]) -> subprocess.Popen:
        return tb.popen(plan.rank_to_gpu[rank].node, argv, stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    return run_plan(plan, cfg, spawn=spawn, timeout_s=spec.timeout_s, mkdtemp=tb.mkdtemp)


# ---- calibration -------------------------------------------------------------------------------
def calibrate_links(prepared: Prepared, tb, spec: TestbedSpec, busy: int | None = None,
                    realtime_priority: int = 0) -> dict:
    """Every fabric's achieved gloo throughput, latency and collective step cost (`busy`
    processes computing meanwhile; default: one per rank not in the probe)."""
    return {f: measure_fabric(prepared, tb, f, spec, busy, realtime_priority)
            for f in sorted(_fabrics(prepared))}


def calibrate_intra_node(prepared: Prepared, tb, spec: TestbedSpec, busy: int | None = None,
                         realtime_priority: int = 0) -> dict:
    """{"intra_node": the link between two ranks of one node} when a node holds several ranks
    (they talk over its loopback, which the simulator then prices instead of the catalog's
    intra-node link); {} otherwise."""
    nodes = [n.name for n in prepared.cluster.nodes if n.num_gpus > 1]
    if not nodes:
        return {}
    # Every such node's pair at once: loopback is the host's CPU, which the ranks of all
    # nodes share while they run (one pair alone measured 10-20% faster than four at once).
    with _busy_processes(tb, prepared.cluster.num_gpus - 2 * len(nodes) if busy is None else busy):
        fits = _probe_at_once(tb, "intra-node", [[(n, "lo"), (n, "lo")] for n in nodes], spec,
                              realtime_priority,
                              ["--all-reduce", str(int(prepared.workload.tp_allreduce_bytes()))])
    return {"intra_node": {key: statistics.median(f[key] for f in fits) for key in fits[0]}}


def _durations(entry: dict) -> dict:
    from holmes_sim.backend.emulation import EMULATED_KEYS

    return {k: entry[k] for k in EMULATED_KEYS}


def speed_factors(prepared: Prepared) -> dict[str, float]:
    """Per GPU model of the testbed, how much longer its compute takes than the fastest
    model's: the ratio of peak_tflops (emulated compute scales the calibration by it)."""
    gpus = {n.gpu.name: n.gpu for n in prepared.cluster.nodes}
    fastest = max(g.peak_flop_per_s for g in gpus.values())
    return {name: fastest / g.peak_flop_per_s for name, g in sorted(gpus.items())}


def emulated_profile(prepared: Prepared, spec: TestbedSpec, tb=None) -> dict:
    """The compute profile emulated ranks wait and the simulator predicts with: one rank's solo
    piece times on this host (medians), times `host_share`, scaled per GPU model
    (`speed_factors`), and the framework time per op of an emulated one-rank run. No `host`
    section: waiting ranks share no CPU."""
    from holmes_sim.backend.calibrate_compute import measure_layer_times

    config = model_config(prepared)
    # At the ranks' real-time priority: other processes on the host do not stretch the samples.
    solo = measure_layer_times(config, prepared.workload.micro_batch, concurrency=1,
                               repeats=spec.calibration_repeats,
                               realtime_priority=REALTIME_PRIORITY)
    # The median sample of each piece, as real compute takes it. (The fastest samples were
    # tried, with the NICs' 128 KiB buckets of the time: 20-40% shorter, so communication
    # weighed more and the testbed's Ethernet, which the simulator over-predicted by ~10%
    # (bursts, docs/validation.md), dominated the default testbed's error: mean 8.4%, max 13%.)
    base = _profile_entries(solo)
    overhead = measure_op_overhead(prepared, config, base, spec, tb, emulated=True)
    share = host_share(prepared)
    return {"schema": PROFILE_SCHEMA,
            "compute": {g: {**{k: v * f * share for k, v in base.items()},
                            "op_overhead_s": overhead}
                        for g, f in speed_factors(prepared).items()}}


def _profile_entries(solo: dict) -> dict[str, float]:
    """A profile's compute entries (seconds per micro-batch; per parameter for the optimizer)
    from `measure_layer_times`' median samples."""
    return {"layer_forward_s": solo["block_forward_s"],
            "layer_backward_s": solo["block_backward_s"],
            "embedding_forward_s": solo["embedding_forward_s"],
            "embedding_backward_s": solo["embedding_backward_s"],
            "head_forward_s": solo["head_forward_s"],
            "head_backward_s": solo["head_backward_s"],
            "optimizer_s_per_param": solo["optimizer_per_param_s"]}


def host_share(prepared: Prepared) -> float:
    """How much longer than alone a rank computes when every rank computes on this host's cores:
    ranks / cores, at least 1 (4 ranks on 2 cores: 2). Emulated ranks wait their solo times
    times this, so they run at the speed real-compute ranks get here and the testbed keeps the
    compute-to-communication ratio its rates were chosen for; the solo times themselves are
    measured without contention (SCHED_FIFO), so the product does not move with the load."""
    return max(1.0, prepared.cluster.num_gpus / (os.cpu_count() or 1))


def calibrate_compute(prepared: Prepared, spec: TestbedSpec, tb=None) -> dict:
    """Profile entries for compute: per-piece solo times, framework overhead per op, and the
    shared host (effective cores, spread) measured with as many processes as ranks."""
    from holmes_sim.backend.calibrate_compute import measure_layer_times

    config = model_config(prepared)
    ranks = prepared.cluster.num_gpus
    solo = measure_layer_times(config, prepared.workload.micro_batch, concurrency=1,
                               repeats=spec.calibration_repeats)
    busy = measure_layer_times(config, prepared.workload.micro_batch, concurrency=ranks,
                               repeats=spec.calibration_repeats)
    # The ranks are processes sharing this host's cores: the simulator runs compute on a shared
    # CPU of `effective_cores` (see EngineOptions), each op costing its solo time in core-seconds.
    # Effective cores: how much work `ranks` busy processes get done at once, relative to one.
    work = ("block_forward", "block_backward")
    effective = ranks * sum(solo[f"{k}_s"] for k in work) / sum(busy[f"{k}_mean_s"] for k in work)
    effective = min(float(min(ranks, os.cpu_count() or ranks)), max(1.0, effective))
    spread = busy["block_cv"]
    compute = _profile_entries(solo)
    compute["op_overhead_s"] = measure_op_overhead(prepared, config, compute, spec, tb)
    gpus = {n.gpu.name for n in prepared.cluster.nodes}
    return {"schema": PROFILE_SCHEMA,
            "compute": {g: dict(compute) for g in sorted(gpus)},
            "host": {"effective_cores": effective, "compute_cv": spread,
                     "cpu_count": os.cpu_count(), "ranks": ranks}}


def measure_op_overhead(prepared: Prepared, config, compute: dict, spec: TestbedSpec,
                        tb=None, emulated: bool = False) -> float:
    """Framework time per forward or backward op (Python, data, buffers) beyond the pieces'
    compute, in seconds: a one-rank run of the same model through the real worker (`emulated`:
    waiting `compute`'s durations), minus the calibrated pieces, divided by its ops. A
    calibration run of its own, not a measured case."""
    from holmes_sim.backend.launch import run_plan
    from holmes_sim.backend.run_config import RunConfig

    m, layers = prepared.num_microbatches, prepared.workload.num_layers
    plan = Plan("calibration", 1, 1, 1, (GpuRef("calibration", 0),), (layers,),
                ScheduleKind.ONE_F_ONE_B, m, 1, OptimizerMode.REPLICATED, ())
    cfg = RunConfig(model=config, micro_batch_size=prepared.workload.micro_batch,
                    iterations=_OVERHEAD_ITERATIONS + 2, warmup=2, interface_map={"*": "lo"},
                    world_interfaces=["lo"], lr=spec.learning_rate, optimizer=spec.optimizer,
                    bucket_numel=max(1, int(prepared.workload.bucket_bytes // 4)),
                    emulated_compute=[_durations(compute)] if emulated else [],
                    realtime_priority=REALTIME_PRIORITY if emulated else 0)
    # The fastest iteration: noise on a shared host only ever adds time.
    mkdtemp = tb.mkdtemp if tb is not None else None
    measured = min(run_plan(plan, cfg, timeout_s=spec.timeout_s, mkdtemp=mkdtemp).iteration_times_s)
    pieces = m * (compute["embedding_forward_s"] + compute["embedding_backward_s"]
                  + layers * (compute["layer_forward_s"] + compute["layer_backward_s"])
                  + compute["head_forward_s"] + compute["head_backward_s"])
    params = prepared.workload.total_params
    pieces += params * compute["optimizer_s_per_param"]
    return max(0.0, (measured - pieces) / (2 * m))


def _fabrics(prepared: Prepared) -> set[str]:
    return {nic.fabric for n in prepared.cluster.nodes for nic in n.nics}


def measure_fabric(prepared: Prepared, tb, fabric: str, spec: TestbedSpec,
                   busy: int | None = None, realtime_priority: int = 0) -> dict:
    """gloo throughput and latency between the first two nodes on `fabric`, while the other
    ranks' share of the host is busy computing (`busy` processes; default: one per other rank),
    as it is during a real-compute run: on a shared host a message waits for its receiver to be
    scheduled, which costs milliseconds, not microseconds. `realtime_priority`: the probe's
    SCHED_FIFO priority (emulated compute: the ranks' own, as their messages will move)."""
    with _busy_processes(tb, prepared.cluster.num_gpus - 2 if busy is None else busy):
        return _probe_fabric(prepared, tb, fabric, spec, realtime_priority)


@contextlib.contextmanager
def _busy_processes(tb, count: int):
    """`count` single-threaded processes doing matrix products until the block ends; the
    testbed records them and they die with this process, whatever kills it."""
    code = ("import torch; torch.set_num_threads(1); a = torch.randn(256, 256)\n"
            "while True: a = (a @ a).tanh_()")
    procs = [tb.start_process([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for _ in range(max(0, count))]
    try:
        time.sleep(1.0 if procs else 0.0)  # let them import torch and start
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _probe_fabric(prepared: Prepared, tb, fabric: str, spec: TestbedSpec,
                  realtime_priority: int = 0) -> dict:
    pairs = [(n.name, nic.name) for n in prepared.cluster.nodes for nic in n.nics
             if nic.fabric == fabric][:2]
    if len(pairs) < 2:
        raise TestbedError(f"fabric '{fabric}' has fewer than two nodes; nothing to measure")
    got = _probe(tb, f"fabric '{fabric}'", pairs, spec, realtime_priority)
    # The shaped rate it ran against: the measured fraction of it applies to uplinks too.
    got["line_rate_bytes_per_s"] = min(
        nic.bandwidth_bytes_per_s for node, name in pairs
        for nic in prepared.cluster.node(node).nics if nic.name == name)
    return got


def _probe(tb, what: str, pairs: list[tuple[str, str]], spec: TestbedSpec,
           realtime_priority: int, extra: list[str] = ()) -> dict:
    """`calibrate_links`' figures between (node, interface) `pairs[0]` and `pairs[1]` (`extra`:
    more of its arguments)."""
    return _probe_at_once(tb, what, [pairs], spec, realtime_priority, extra)[0]


def _probe_at_once(tb, what: str, pairs: list[list[tuple[str, str]]], spec: TestbedSpec,
                   realtime_priority: int, extra: list[str] = ()) -> list[dict]:
    """`_probe` on every pair of `pairs` at the same time (links that share the host's CPU, as
    the ranks use them together)."""
    tmp = tb.mkdtemp("holmes-probe-")
    procs: list[subprocess.Popen] = []
    try:
        for k, pair in enumerate(pairs):
            for r, (node, nic) in enumerate(pair):
                log_path = tmp / f"probe{k}-{r}.log"
                with open(os.open(log_path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as log:
                    procs.append(tb.popen(node, [
                        sys.executable, "-m", "holmes_sim.backend.calibrate_links",
                        "--rank", str(r), "--store", str(tmp / f"store{k}"), "--interface", nic,
                        "--bytes", str(spec.link_probe_bytes), "--out", str(tmp / f"result{k}"),
                        "--realtime-priority", str(realtime_priority), *extra],
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log))
        deadline = time.monotonic() + 120
        for i, p in enumerate(procs):
            code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                log = (tmp / f"probe{i // 2}-{i % 2}.log").read_text(errors="replace")[-1500:]
                raise TestbedError(f"link probe on {what} failed (rank {i % 2}, code "
                                   f"{code}):\n{log}")
        results = []
        for k in range(len(pairs)):
            sender, receiver = (json.loads(Path(f"{tmp / f'result{k}'}.{r}").read_text())
                                for r in (0, 1))
            # Both ends' CPU per byte: on a shared host, moving bytes competes with compute.
            sender["cpu_s_per_byte"] += receiver["cpu_s_per_byte"]
            results.append(sender)
        return results
    except subprocess.TimeoutExpired:
        raise TestbedError(f"link probe on {what} timed out after 120 s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def apply_profile(prepared: Prepared, raw: dict) -> Prepared:
    """The prepared scenario with measured compute and link numbers in place of the catalog's."""
    profile = Profile(ProfiledCompute(raw["compute"], "calibration"), raw["fabrics"], raw)
    return dataclasses.replace(prepared, compute=profile.compute, profile=profile,
                               cluster=apply_link_profile(prepared.cluster, profile))


def provenance(testbed_path: str | Path, wall_s: float) -> dict:
    """Where, when and how the measurement was taken."""
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"host": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "commit": commit or "unknown", "command": " ".join(["holmes-sim", *sys.argv[1:]]),
            "testbed": str(testbed_path), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "wall_s": round(wall_s, 1)}


# ---- dry run, cleanup, table -------------------------------------------------------------------
def dry_run(testbed_path: str | Path, policies: list[str] | None = None) -> list[str]:
    """Build every group and stage of every policy's plan on gloo (loopback), without training."""
    prepared = prepare(testbed_path, check=check_testbed)  # before torch loads: bad input is quick

    from holmes_sim.backend.launch import dry_run as backend_dry_run
    from holmes_sim.backend.run_config import RunConfig

    config = model_config(prepared)
    lines = []
    for name in _runnable_policies(prepared, policies):
        plan, _ = plan_policy(prepared, name)
        cfg = RunConfig(model=config, micro_batch_size=prepared.workload.micro_batch,
                        interface_map={"*": "lo"}, world_interfaces=["lo"] * plan.world_size)
        docs = backend_dry_run(plan, cfg)
        lines.append(f"{name}: {plan.world_size} ranks, layers {list(plan.layers_per_stage)}")
        for rank, doc in enumerate(docs):
            groups = ", ".join(f"{g['kind']}{tuple(g['ranks'])}@{g['nic'] or 'local'}"
                               for g in doc["groups"])
            stages = ", ".join(f"layers {s['first_layer']}..{s['first_layer'] + s['num_layers'] - 1}"
                               for s in doc["stages"])
            lines.append(f"  rank {rank} on {plan.rank_to_gpu[rank].node}: {stages}; {groups}")
        lines.extend(transport_lines(plan))
    return lines


def transport_lines(plan: Plan) -> list[str]:
    """Each plan group's transport settings: the gloo interface per member on the testbed, and
    the NCCL variables a real cluster run sets while creating it (plan NIC names; a site maps
    them to devices with RunConfig.nic_devices)."""
    from holmes_sim.backend.nccl import nccl_settings

    lines = []
    for i, g in enumerate(plan.groups):
        nccl = nccl_settings(g, {})
        shown = " ".join(f"{k}={v}" for k, v in sorted(nccl.items())) or "none (NVLink/PCIe)"
        members = ", ".join(f"{r}:{n or 'lo'}" for r, n in zip(g.ranks, g.nics, strict=True))
        lines.append(f"  group {i} {g.kind.value}{tuple(g.ranks)} {g.transport}: "
                     f"gloo {members}; NCCL {shown}")
    return lines


def cleanup() -> list[str]:
    """Undo what killed runs recorded; the lines to print (removed, and found but not ours).

    Raises:
        TestbedError: something could not be removed, or not root.
    """
    from holmes_sim.backend.records import cleanup_leftovers

    report = cleanup_leftovers()
    lines = [f"removed {len(report.removed)} leftover(s): {', '.join(report.removed) or 'none'}"]
    if report.foreign:
        lines.append(f"left alone (named like ours, but no run of ours recorded them): "
                     f"{', '.join(report.foreign)}")
    if report.failed:
        raise TestbedError(f"could not remove {', '.join(report.failed)} ("
                           f"{'; '.join(lines)}); they stay recorded for the next --cleanup")
    return lines


def comparison_table(result: ValidationResult) -> Table:
    """Predicted against measured (median, ~95% interval), per policy, with mean/max error and
    the ranking verdict, or why there is none (host warnings)."""
    doc = result.to_json()
    verdict = (f"ranking {'agrees' if result.ranking_agrees else 'DISAGREES'}"
               if not result.host_unstable else "NO VERDICT: " + "; ".join(result.host_warnings))
    table = Table(title=f"validation (tolerance {result.tolerance_pct:.0f}%): mean |error| "
                        f"{doc['mean_abs_error_pct']:.1f}%, max {doc['max_abs_error_pct']:.1f}%, "
                        f"{verdict}",
                  title_justify="left")
    for col in ("policy", "predicted s", "measured s", "95% interval", "error %", "iterations",
                "verdict"):
        table.add_column(col, justify="left" if col in ("policy", "verdict") else "right")
    for c in sorted(result.cases, key=lambda c: c.measured_s):
        ok = abs(c.error_pct) <= result.tolerance_pct
        lo, hi = c.measured_ci_s
        table.add_row(c.policy, f"{c.predicted_s:.3f}", f"{c.measured_s:.3f}",
                      f"{lo:.3f}-{hi:.3f}", f"{c.error_pct:+.1f}",
                      str(len(c.measured_iterations_s)),
                      "ok" if ok else "[red]out of tolerance[/red]")
    return table
