"""The host the validator measures on: its load before a run, the checks that say whether its
measurements can be trusted, and the scheduling priority emulated ranks take on it."""

from __future__ import annotations

import statistics
import time


# SCHED_FIFO priority of emulated ranks (RunConfig.realtime_priority): the lowest real-time one.
REALTIME_PRIORITY = 1
# Largest load per core before a run that still measures (see host_warnings).
MAX_LOAD_PER_CORE = {"real": 1.0, "emulated": 2.5}
LOAD_WINDOW_S = 5.0
"""How long `recent_load` samples the run queue before a run, seconds."""


RANKS_PER_CORE = 8
"""Most testbed ranks (processes) per CPU core: each waits on the network most of the time."""
RANK_MEMORY_BYTES = 400 * 2**20
"""Memory one rank process takes besides its model's (torch and gloo; a tiny model's rank
peaked at 270-310 MiB resident); `testbed_plan.rank_memory_bytes` adds the model's."""


def max_ranks() -> int:
    """The most ranks this host runs at once: RANKS_PER_CORE per usable core (at least 16), and
    no more than the available memory holds at RANK_MEMORY_BYTES each (the model's own memory
    is `testbed_plan._check_memory`'s)."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    by_memory = available_memory() // RANK_MEMORY_BYTES
    return max(1, min(max(16, RANKS_PER_CORE * cores), by_memory or 1 << 30))


def available_memory() -> int:
    """MemAvailable of /proc/meminfo in bytes (0 when it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


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


_REALTIME_PROBE = """
import os, sys
try:
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(int(sys.argv[1])))
except (OSError, AttributeError) as e:
    print(f"other (SCHED_FIFO refused: {e})")
else:
    print(f"fifo:{sys.argv[1]}")
"""


def realtime_scheduler(priority: int = REALTIME_PRIORITY) -> str:
    """What a process of this host runs under when it asks for SCHED_FIFO at `priority`, in
    `worker.set_realtime`'s words ("fifo:1", or "other (SCHED_FIFO refused: ...)" without
    CAP_SYS_NICE or a real-time budget), probed in a child process so this one's scheduling is
    untouched."""
    import subprocess
    import sys

    try:
        out = subprocess.run([sys.executable, "-c", _REALTIME_PROBE, str(priority)],
                             capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return f"other (SCHED_FIFO not probed: {e})"
    return out.stdout.strip() or f"other (SCHED_FIFO not probed: {out.stderr.strip()[-200:]})"


def realtime_note(schedulers: list[str]) -> list[str]:
    """A note when an emulated run's processes (`schedulers`, `realtime_scheduler`'s words for
    the probe, the compute calibration and every rank) did not all get SCHED_FIFO: other work on
    the host can then delay their waits and messages (measured on 2 cores with one busy loop:
    waits overran by up to 6% and probed latencies read 2 ms instead of 0.03). A note, not a
    warning: that harm is what the lag check (`host_warnings`) and the link probes' plausibility
    check measure, and on a quiet host it does not occur."""
    refused = sorted({s for s in schedulers if not s.startswith("fifo:")})
    if not refused:
        return []
    return [f"ranks not real-time: emulated compute runs its ranks, calibration and probes under "
            f"SCHED_FIFO, but this host gave {'; '.join(refused)}; the lag and link checks still "
            "judge the run, but on a busy host other processes may delay waits and messages; "
            "for real-time ranks run as root with CAP_SYS_NICE (a container: --cap-add "
            "SYS_NICE) and a real-time budget (kernel.sched_rt_runtime_us > 0, and the cgroup's "
            "cpu.rt_runtime_us under RT group scheduling)"]


def host_warnings(load_before: float, cpu_count: int, calibrations: list[dict],
                  max_calibration_ratio: float = 1.5, lags: list[float] = (),
                  max_lag_pct: float = 5.0, max_load_per_core: float = 1.0,
                  predictions: dict[str, list[float]] | None = None,
                  max_prediction_spread_pct: float = 15.0) -> list[str]:
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
    took more than `max_lag_pct` % longer than requested, a time no prediction contains.
    Real compute (`predictions`: per policy, its prediction in each round, each from a compute
    calibration taken just before): a policy's predictions differ by more than
    `max_prediction_spread_pct` % (the validation's tolerance): the host's compute speed moved
    more than the error a verdict would judge."""
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
    out += prediction_spread(predictions or {}, max_prediction_spread_pct)
    worst = max(lags, default=0.0)
    if worst > max_lag_pct:
        out.append(f"host too busy for emulated compute: the ranks' waits overran by "
                   f"{worst:.1f}% (more than {max_lag_pct:g}%)")
    return out


def prediction_spread(predictions: dict[str, list[float]], max_spread_pct: float) -> list[str]:
    """A warning per policy whose per-round predictions (s) differ by more than
    `max_spread_pct` % (largest over smallest)."""
    out = []
    for policy, values in predictions.items():
        lo, hi = min(values, default=0.0), max(values, default=0.0)
        if lo > 0 and 100.0 * (hi / lo - 1.0) > max_spread_pct:
            out.append(f"host unstable for real compute: {policy}'s prediction moved "
                       f"{lo:.3f}-{hi:.3f} s between rounds ({100.0 * (hi / lo - 1.0):.0f}%, more "
                       f"than the {max_spread_pct:g}% tolerance); use --compute emulated or a "
                       "quieter host")
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
