"""Calibrate, predict, run, compare: the real-run validator.

1. Build the emulated testbed of a testbed scenario (one network namespace per node, one shaped
   veth per NIC; `backend/testbed.py`, described by `testbed_plan.py`).
2. Calibrate this host (`calibration.py`): per-layer compute under the run's concurrency (as
   many processes as ranks) and each fabric's achieved gloo throughput and latency. The result
   is a profile, the same JSON `profile:` accepts.
3. Predict each policy's iteration time with the simulator on that profile.
4. Run each policy's very plan for real with torch.distributed (gloo), each group on the NIC the
   plan chose, and take the median iteration time after warm-up.
5. Compare (`comparison.py`): error per policy, and whether the policies rank the same; the
   host's load and stability decide whether there is a verdict at all (`host.py`).
Measurement (2) and prediction (3) are separate steps joined by the profile: nothing measured in
(4) feeds a prediction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from holmes_sim.errors import ScenarioError, TestbedError
from holmes_sim.plan import Plan
from holmes_sim.prepare import Prepared, prepare
from holmes_sim.runner import plan_policy, run_policy
from holmes_sim.spec.scenario import TestbedSpec
from holmes_sim.validation.calibration import (
    apply_profile,
    calibrate_compute,
    calibrate_intra_node,
    calibrate_links,
    emulated_durations,
    emulated_profile,
    measure_fabric,
    speed_factors,
)
from holmes_sim.validation.comparison import Case, ValidationResult
from holmes_sim.validation.host import (
    MAX_LOAD_PER_CORE,
    REALTIME_PRIORITY,
    host_warnings,
    implausible,
    realtime_note,
    realtime_scheduler,
    recent_load,
)
from holmes_sim.validation.testbed_plan import (
    GLOO_TIMEOUT_S as _GLOO_TIMEOUT_S,
    check_testbed,
    model_config,
    plan_summary,
    runnable_policies,
    testbed_nodes,
    testbed_uplinks,
    transport_lines,
)

Progress = Callable[[str], None]
_PREDICTION_SEEDS = 7


def validate_real(testbed_path: str | Path, policies: list[str] | None = None,
                  iterations: int | None = None, progress: Progress = lambda m: None,
                  rounds: int = 2, compute: str | None = None) -> ValidationResult:
    """Calibrate, predict, run and compare every policy of a testbed scenario (module docstring).

    `compute` ("emulated" or "real") overrides the testbed's `testbed.compute`. Emulated: the
    compute profile is measured once, the ranks wait its durations and every prediction uses
    them; real: the ranks compute and each case is calibrated just before it runs.

    Raises:
        ScenarioError: the file cannot run on a testbed (not fp32, tied embeddings, TP > 1
            or GPU models of different speed under real compute, ...).
        TestbedError: no root / ip / tc / namespaces, or a rank failed or hung.
    """
    from holmes_sim.backend.records import measurement_lock
    from holmes_sim.backend.testbed import Testbed

    prepared = prepare(testbed_path, check=check_testbed)
    spec = _run_spec(prepared, testbed_path, iterations, compute)
    names = runnable_policies(prepared, policies)
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
        load = {"load_before": os.getloadavg()[0], "runnable_before": recent_load(),
                "scheduler": {"probe": realtime_scheduler() if spec.compute == "emulated"
                              else "other"}}
        session = _Session(prepared, spec, config, tb, progress)
        links, warnings = _calibrate_links(session)
        runs, profiles = _run_rounds(session, names, links, rounds)
        cases = [_combine(name, runs[name]) for name in names]
    predictions = {name: [p for p, _, _, _ in runs[name]] for name in names}
    load["notes"] = memory_notes({name: [o for _, o, _, _ in runs[name]] for name in names})
    load["scheduler"].update(_schedulers(runs, profiles))
    return _result(session, testbed_path, cases, profiles, warnings, load, started, predictions)


def _schedulers(runs: dict[str, list], profiles: list[dict]) -> dict[str, list[str]]:
    """What the compute calibration (emulated: its `scheduler`) and the ranks of every run ran
    under (`worker.set_realtime`'s words), each distinct value once."""
    ranks = {d.get("scheduler", "unknown") for got in runs.values() for _, _, run, _ in got
             for d in run.ranks}
    calibration = {p["scheduler"] for p in profiles if "scheduler" in p}
    return {"compute_calibration": sorted(calibration), "ranks": sorted(ranks)}


def memory_notes(outcomes: dict[str, list]) -> list[str]:
    """A note when the simulator says a policy's plan does not fit the declared GPUs' memory
    (per policy, its outcomes of every round): the testbed's ranks run on CPU, so such a plan
    still runs and its time is still compared, but the declared cluster could not run it."""
    short = {}
    for name, got in outcomes.items():
        bad = [o.result.memory for o in got if not o.result.memory.fits]
        if bad:
            short[name] = max(bad, key=lambda m: m.excess_gib).shortfall()
    if not short:
        return []
    return ["the simulated plans do not fit the declared GPUs' memory ("
            + "; ".join(f"{name} {why}" for name, why in short.items())
            + "); the testbed's ranks run on CPU, so they ran and are compared, but the declared "
              "cluster could not run them; raise the GPUs' memory_gib or shrink the model"]


@dataclass(frozen=True, slots=True)
class _Session:
    """What every step of one validation run works with: the scenario, its testbed section with
    the command line's overrides, the backend's model, the built testbed, the progress sink."""

    prepared: Prepared
    spec: TestbedSpec
    config: object
    tb: object
    progress: Progress

    @property
    def emulated(self) -> bool:
        return self.spec.compute == "emulated"


def _run_spec(prepared: Prepared, testbed_path: str | Path, iterations: int | None,
              compute: str | None) -> TestbedSpec:
    """The scenario's testbed section with `iterations` and `compute` in place of its own, or a
    ScenarioError when the compute mode is unknown or cannot run the scenario."""
    spec = prepared.scenario.testbed or TestbedSpec()
    if iterations is not None:
        spec = dataclasses.replace(spec, iterations=iterations)
    if compute is not None:
        if compute not in ("emulated", "real"):
            raise ScenarioError(f"compute must be 'emulated' or 'real', got {compute!r}")
        spec = dataclasses.replace(spec, compute=compute)
    if spec.compute != "emulated" and prepared.workload.moe is not None:
        raise ScenarioError(f"{testbed_path}: model.num_experts: real compute calibrates a "
                            "whole MoE layer in one process, not a rank's E / ep experts between "
                            "its all-to-alls, and is not validated for MoE layers; MoE testbeds "
                            "use emulated compute; drop --compute real")
    if spec.compute != "emulated" and prepared.tp > 1:
        raise ScenarioError(f"{testbed_path}: parallel.tensor: real compute calibrates the "
                            "unsplit model, so it runs tensor: 1 only; drop --compute real (TP "
                            "testbeds use emulated compute)")
    factors = speed_factors(prepared)
    slower = {g: f for g, f in factors.items() if f != 1.0}
    if spec.compute != "emulated" and slower:
        fastest = min(factors, key=factors.get)
        raise ScenarioError(f"{testbed_path}: peak_tflops: the testbed's GPU models differ in "
                            "speed (" + ", ".join(f"{g} {f:g}x slower" for g, f in slower.items())
                            + f" than {fastest}); real compute runs every rank on this host's "
                            "CPU at one speed, so they would compute alike; drop --compute real "
                            "(emulated compute waits each model's calibrated durations scaled by "
                            "its peak_tflops) or give every node the same GPU model")
    return spec


def _calibrate_links(session: _Session) -> tuple[dict, list[str]]:
    """The profile's link sections (every fabric, and the intra-node link where a node holds
    several ranks), and the warnings of fabrics whose latency stayed implausible."""
    s = session
    s.progress("calibrating the links ...")
    # Emulated ranks wait instead of computing: the links are probed on an idle host share.
    busy = 0 if s.emulated else s.prepared.cluster.num_gpus - 2
    rt = REALTIME_PRIORITY if s.emulated else 0  # probes move bytes as the ranks will
    with step("link calibration", s.spec):
        fabrics = calibrate_links(s.prepared, s.tb, s.spec, busy, rt)
        warnings = _recheck_links(s.prepared, s.tb, s.spec, fabrics, s.progress, busy=busy, rt=rt)
        intra = calibrate_intra_node(s.prepared, s.tb, s.spec, busy, rt)
    return {"fabrics": fabrics, **intra}, warnings


def _predict_emulated(session: _Session, names: list[str], links: dict) -> dict[str, tuple]:
    """Emulated compute: per policy, the one profile every round uses (compute measured once,
    plus `links`) and the prediction on it, (profile, outcome, predicted s); {} otherwise."""
    s = session
    if not s.emulated:
        return {}
    s.progress("calibrating compute once (the ranks wait these durations) ...")
    with step("compute calibration", s.spec):
        common = {**emulated_profile(s.prepared, s.spec, s.tb), **links}
    return {name: (common, *predict(apply_profile(s.prepared, common), name)) for name in names}


def _calibrate_and_predict(session: _Session, name: str, links: dict, label: str) -> tuple:
    """Real compute: a compute calibration taken just before `name` runs (step `label`), and
    the prediction on it, (profile, outcome, predicted s)."""
    with step(f"{label}: compute calibration", session.spec):
        profile = {**calibrate_compute(session.prepared, session.spec, session.tb), **links}
    return (profile, *predict(apply_profile(session.prepared, profile), name))


def _run_rounds(session: _Session, names: list[str], links: dict,
                rounds: int) -> tuple[dict[str, list], list[dict]]:
    """Every policy run `rounds` times, a round running each once (A B C D, A B C D, ...): host
    drift over minutes hits every policy alike, and under real compute each policy is
    calibrated and predicted inside every round it runs in. Per policy its rounds'
    (predicted s, outcome, run, profile), and every profile in the order used."""
    s = session
    fixed = _predict_emulated(s, names, links)
    runs: dict[str, list] = {name: [] for name in names}
    profiles = []
    started = time.monotonic()
    for r, per_round in enumerate(round_iterations(s.spec.iterations, rounds)):
        round_spec = dataclasses.replace(s.spec, iterations=per_round)
        for k, name in enumerate(names):
            left = _time_left(started, r * len(names) + k, rounds * len(names))
            label = f"round {r + 1}/{rounds}, {name}{left}"
            if s.emulated:
                profile, outcome, predicted = fixed[name]
            else:
                s.progress(f"{label}: calibrating compute ...")
                profile, outcome, predicted = _calibrate_and_predict(s, name, links, label)
            profiles.append(profile)
            s.progress(f"{label}: predicted {predicted:.3f} s; running "
                       f"{s.spec.warmup} + {per_round} iterations for real ...")
            with step(label, s.spec, s.spec.warmup + per_round, predicted):
                run = _run_real(outcome.plan, s.prepared, s.config, round_spec, s.tb,
                                profile["compute"] if s.emulated else None)
            runs[name].append((predicted, outcome, run, profile))
    return runs, profiles


def round_iterations(iterations: int, rounds: int) -> list[int]:
    """The measured iterations of each of `rounds` rounds (at most `iterations`), summing to
    `iterations`: as even as they go, the first rounds taking the remainder (5 in 2: 3, 2)."""
    rounds = min(rounds, iterations)
    base, extra = divmod(iterations, rounds)
    return [base + (r < extra) for r in range(rounds)]


STARTUP_S = 10.0
"""Rank start-up allowed for in `step`'s advice (importing torch, joining the groups; 3-5 s
for 4 ranks on 2 cores)."""


@contextlib.contextmanager
def step(what: str, spec: TestbedSpec, iterations: int = 0, predicted_s: float | None = None):
    """Name the step `what` in a TestbedError raised inside; a run past testbed.timeout_s, or
    ranks that timed out waiting on a peer under a gloo timeout it cut below 60 s, also name
    testbed.timeout_s and what the step needs (`iterations` of `predicted_s` each, when known)."""
    from holmes_sim.backend.launch import RankFailed, RunTimedOut

    try:
        yield
    except RunTimedOut as exc:
        raise TestbedError(f"{what}: {timeout_advice(spec, iterations, predicted_s)}; "
                           f"{exc}") from None
    except RankFailed as exc:
        advice = ""
        if exc.peer_timeout and spec.timeout_s < _GLOO_TIMEOUT_S:
            advice = (f"gloo's operation timeout is testbed.timeout_s here ({spec.timeout_s:g} s; "
                      f"at most {_GLOO_TIMEOUT_S:g}): raise it if the peer was only slow; ")
        raise TestbedError(f"{what}: {advice}{exc}") from None
    except TestbedError as exc:
        raise TestbedError(f"{what}: {exc}") from None


def timeout_advice(spec: TestbedSpec, iterations: int = 0, predicted_s: float | None = None) -> str:
    """Why testbed.timeout_s was too short for a step and what to give it."""
    text = f"testbed.timeout_s ({spec.timeout_s:g} s) ran out"
    if predicted_s is None:
        return (f"{text}; it must cover rank start-up (about {STARTUP_S:g} s) plus every "
                f"iteration of the step; raise it (default {TestbedSpec().timeout_s:g})")
    need = STARTUP_S + iterations * predicted_s
    give = max(60, 10 * math.ceil(3 * need / 10))
    return (f"{text}; this step needs rank start-up (about {STARTUP_S:g} s) plus (warmup + "
            f"iterations) x predicted iteration time = {iterations} x {predicted_s:.3f} s, about "
            f"{need:.0f} s; give it at least {give} s")


def _time_left(started: float, done: int, total: int) -> str:
    """' (about 4.5 min left)' from the time the `done` of `total` runs took, '' before the first."""
    from holmes_sim.report.progress import duration, time_left

    left = time_left(time.monotonic() - started, done, total)
    return "" if left is None else f" (about {duration(left)} left)"


def _result(session: _Session, testbed_path: str | Path, cases: list[Case], profiles: list[dict],
            warnings: list[str], load: dict, started: float,
            predictions: dict[str, list[float]] | None = None) -> ValidationResult:
    """The run's result: its cases, the host's warnings (each also reported to `progress`) and
    the provenance, with the host's load before (`load`) and after the run."""
    spec = session.spec
    sched = load["scheduler"]
    schedulers = [sched["probe"], *sched.get("compute_calibration", ()), *sched.get("ranks", ())]
    warnings = warnings + host_warnings(load["runnable_before"], os.cpu_count() or 1, profiles,
                                        lags=[c.emulation_lag_pct for c in cases],
                                        max_load_per_core=MAX_LOAD_PER_CORE[spec.compute],
                                        predictions=predictions,
                                        max_prediction_spread_pct=spec.tolerance_pct)
    realtime = realtime_note(schedulers) if session.emulated else []
    load = {**load, "notes": [*load.get("notes", ()), *realtime]}
    for w in warnings:
        session.progress(f"warning: {w}")
    for n in realtime:
        session.progress(f"note: {n}")
    prov = {**provenance(testbed_path, time.time() - started), **load,
            "load_after": os.getloadavg()[0], "compute": spec.compute}
    return ValidationResult(tuple(cases), spec.tolerance_pct, profiles[0], prov,
                            tuple(warnings), spec.compute)


def _combine(name: str, rounds: list) -> Case:
    """One policy's case from its rounds: the median prediction, every measured iteration (their
    median and interval), the losses of the first round, the first round's profile, and the
    plans the rounds ran."""
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
    plans = []
    for _, o, _, _ in rounds:
        if (summary := plan_summary(o.plan)) not in plans:
            plans.append(summary)
    return Case(name, predicted, statistics.median(iterations), iterations, first.losses,
                outcome.result.breakdown_s, ops, profile, lag, tuple(plans))


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
                    timeout_s=min(_GLOO_TIMEOUT_S, spec.timeout_s),
                    bucket_numel=prepared.workload.given_bucket_numel,
                    pipeline_split=prepared.workload.pp_split_over_tp,
                    emulated_compute=[] if emulated is None else [
                        emulated_durations(emulated[prepared.cluster.node(g.node).gpu.name])
                        for g in plan.rank_to_gpu],
                    # Emulated ranks mostly wait: real-time priority makes them wake on time on
                    # a host whose cores other processes keep busy.
                    realtime_priority=0 if emulated is None else REALTIME_PRIORITY)

    def spawn(rank: int, argv: list[str]) -> subprocess.Popen:
        return tb.popen(plan.rank_to_gpu[rank].node, argv, stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    return run_plan(plan, cfg, spawn=spawn, timeout_s=spec.timeout_s, mkdtemp=tb.mkdtemp)


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


def dry_run(testbed_path: str | Path, policies: list[str] | None = None) -> list[str]:
    """Build every group and stage of every policy's plan on gloo (loopback), without training."""
    prepared = prepare(testbed_path, check=check_testbed)  # before torch loads: bad input is quick

    from holmes_sim.backend.launch import dry_run as backend_dry_run
    from holmes_sim.backend.run_config import RunConfig

    config = model_config(prepared)
    lines = []
    for name in runnable_policies(prepared, policies):
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
