"""Calibration: what this host achieves, measured before any case runs and written as a profile
(the JSON `profile:` accepts). Each fabric's gloo throughput, latency and collective step cost
(link probes between two nodes' namespaces), the intra-node loopback link, and compute: per-piece
times of the backend's model, the framework time per op, and, under real compute, the shared
host's effective cores and spread."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from holmes_sim.backend.launch import how_it_ended
from holmes_sim.cost.compute import PROFILE_SCHEMA, Profile, ProfiledCompute
from holmes_sim.errors import TestbedError
from holmes_sim.plan import GpuRef, OptimizerMode, Plan
from holmes_sim.prepare import Prepared, apply_link_profile
from holmes_sim.schedule import ScheduleKind
from holmes_sim.spec.scenario import TestbedSpec
from holmes_sim.validation.host import REALTIME_PRIORITY
from holmes_sim.validation.testbed_plan import GLOO_TIMEOUT_S, model_config

_OVERHEAD_ITERATIONS = 12
"""Measured iterations of `measure_op_overhead`'s one-rank run."""


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


def emulated_durations(entry: dict) -> dict:
    """The compute durations an emulated rank waits, from a profile's compute entry."""
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
    piece times on this host (medians), times `emulated_scale`, scaled per GPU model
    (`speed_factors`), and the framework time per op of an emulated one-rank run, with the
    scheduler the pieces were timed under (`scheduler`). No `host` section: waiting ranks share
    no CPU."""
    config = model_config(prepared)
    # At the ranks' real-time priority: other processes on the host do not stretch the samples.
    solo = layer_times(prepared, config, spec, 1, realtime_priority=REALTIME_PRIORITY)
    # The median sample of each piece, as real compute takes it: the fastest samples would
    # understate each op by 20-40% and leave communication too large a share.
    base = _profile_entries(solo)
    overhead = measure_op_overhead(prepared, config, base, spec, tb, emulated=True)
    scale = emulated_scale(prepared, spec, base["layer_forward_s"])
    return {"schema": PROFILE_SCHEMA,
            "compute": {g: {**{k: v * f * scale for k, v in base.items()},
                            "op_overhead_s": overhead}
                        for g, f in speed_factors(prepared).items()},
            "scheduler": solo["scheduler"]}


def emulated_scale(prepared: Prepared, spec: TestbedSpec, layer_forward_s: float) -> float:
    """What the solo piece times are multiplied by before emulated ranks wait them: with
    `testbed.emulated_layer_forward_ms`, whatever brings the measured layer forward
    (`layer_forward_s`, seconds) to it, so the testbed keeps the compute-to-communication ratio
    its rates were chosen for on any host; without it, `host_share`."""
    if spec.emulated_layer_forward_ms is None:
        return host_share(prepared)
    return spec.emulated_layer_forward_ms * 1e-3 / layer_forward_s


def layer_times(prepared: Prepared, config, spec: TestbedSpec, concurrency: int,
                realtime_priority: int = 0) -> dict:
    """`measure_layer_times` with `testbed.calibration_repeats`, within `testbed.timeout_s`;
    a TestbedError naming both fields when the repeats do not fit."""
    from holmes_sim.backend.calibrate_compute import CalibrationTooSlow, measure_layer_times

    try:
        return measure_layer_times(config, prepared.workload.micro_batch, concurrency,
                                   spec.calibration_repeats, timeout_s=spec.timeout_s,
                                   realtime_priority=realtime_priority)
    except CalibrationTooSlow as exc:
        raise TestbedError(f"testbed.calibration_repeats: {exc}; "
                           f"{repeats_advice(spec, exc)}") from None


def repeats_advice(spec: TestbedSpec, exc) -> str:
    """What to change when compute calibration's repeats do not fit in testbed.timeout_s
    (`exc`: the CalibrationTooSlow)."""
    text = f"compute calibration must finish within testbed.timeout_s ({spec.timeout_s:g} s)"
    if exc.need_s is None:
        return (f"{text}; lower testbed.calibration_repeats (now {spec.calibration_repeats}, "
                f"default {TestbedSpec().calibration_repeats}) or raise testbed.timeout_s")
    give = 10 * math.ceil(1.5 * (spec.timeout_s - exc.left_s + exc.need_s) / 10)
    lower = (f"lower testbed.calibration_repeats to at most {exc.fits}" if exc.fits else
             "lower testbed.calibration_repeats")
    return f"{text}: {lower}, or raise testbed.timeout_s to at least {give} s"


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
    ranks / cores, at least 1 (4 ranks on 2 cores: 2). Without `testbed.emulated_layer_forward_ms`
    emulated ranks wait their solo times times this, the speed real-compute ranks get here. The
    solo times are measured without contention (SCHED_FIFO), so the product does not move with
    the load, but it does with the host's own speed."""
    return max(1.0, prepared.cluster.num_gpus / (os.cpu_count() or 1))


def calibrate_compute(prepared: Prepared, spec: TestbedSpec, tb=None) -> dict:
    """Profile entries for compute: per-piece solo times, framework overhead per op, and the
    shared host (effective cores, spread) measured with as many processes as ranks."""
    config = model_config(prepared)
    ranks = prepared.cluster.num_gpus
    solo = layer_times(prepared, config, spec, 1)
    busy = layer_times(prepared, config, spec, ranks)
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
                    bucket_numel=prepared.workload.given_bucket_numel,
                    emulated_compute=[emulated_durations(compute)] if emulated else [],
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
    # The shaped rate it ran against: every NIC of the fabric, and the uplinks, achieve the
    # measured fraction of their own (`prepare.apply_link_profile`).
    got["line_rate_bytes_per_s"] = min(
        nic.bandwidth_bytes_per_s for node, name in pairs
        for nic in prepared.cluster.node(node).nics if nic.name == name)
    return got


def _probe(tb, what: str, pairs: list[tuple[str, str]], spec: TestbedSpec,
           realtime_priority: int, extra: list[str] = ()) -> dict:
    """`calibrate_links`' figures between (node, interface) `pairs[0]` and `pairs[1]` (`extra`:
    more of its arguments)."""
    return _probe_at_once(tb, what, [pairs], spec, realtime_priority, extra)[0]


_PROBE_LIMIT_S = 120.0
"""Wall-clock limit of one link probe, seconds."""
_POLL_S = 0.05


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
                        "--timeout", f"{min(GLOO_TIMEOUT_S, spec.timeout_s):g}",
                        "--realtime-priority", str(realtime_priority), *extra],
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log))
        _wait_probes(procs, what, pairs, tmp)
        results = []
        for k in range(len(pairs)):
            sender, receiver = (json.loads(Path(f"{tmp / f'result{k}'}.{r}").read_text())
                                for r in (0, 1))
            # Both ends' CPU per byte: on a shared host, moving bytes competes with compute.
            sender["cpu_s_per_byte"] += receiver["cpu_s_per_byte"]
            results.append(sender)
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_probes(procs: list[subprocess.Popen], what: str, pairs: list, tmp: Path) -> None:
    """Wait for every probe process at once (process i: rank i % 2 of pair i // 2, its log
    probe{pair}-{rank}.log in `tmp`); a TestbedError as soon as one fails, naming the one that
    most likely caused it (`launch.culprit`) with its log, or when the limit passes."""
    from holmes_sim.backend.launch import culprit, read_tail, tail_text

    def name(i: int) -> str:
        return f"rank {i % 2}" + (f" on {pairs[i // 2][i % 2][0]}" if len(pairs) > 1 else "")

    def log_of(i: int) -> Path:
        return tmp / f"probe{i // 2}-{i % 2}.log"

    deadline = time.monotonic() + _PROBE_LIMIT_S
    while True:
        codes = {i: p.poll() for i, p in enumerate(procs)}
        failed = [i for i, c in codes.items() if c not in (None, 0)]
        running = [name(i) for i, c in codes.items() if c is None]
        still = f" ({', '.join(running)} still running)" if running else ""
        if failed:
            i = culprit(failed, codes, log_of)
            raise TestbedError(f"link probe on {what} failed: its {name(i)} "
                               f"{how_it_ended(codes[i])}{still}"
                               + tail_text(name(i), read_tail(log_of(i), 1500)))
        if not running:
            return
        if time.monotonic() > deadline:
            raise TestbedError(f"link probe on {what} timed out after {_PROBE_LIMIT_S:g} s"
                               f"{still}")
        time.sleep(_POLL_S)


def apply_profile(prepared: Prepared, raw: dict) -> Prepared:
    """The prepared scenario with measured compute and link numbers in place of the catalog's."""
    profile = Profile(ProfiledCompute(raw["compute"], "calibration"), raw["fabrics"], raw)
    return dataclasses.replace(prepared, compute=profile.compute, profile=profile,
                               cluster=apply_link_profile(prepared.cluster, profile))
