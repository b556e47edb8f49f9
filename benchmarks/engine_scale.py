"""How the simulation cost grows with the cluster: one iteration of GPT-175B (96 layers, hidden
12288, TP 8, PP 16, 1F1B, 192 micro-batches per replica) on 1,024 to 131,072 A100s, racks of four
nodes alternately on InfiniBand and RoCE, planned and simulated by the `holmes` policy.

    python benchmarks/engine_scale.py [--gpus 1024 9216 131072] [--microbatches 192]
                                      [--full-simulation] [--straggler] [--asymmetric]
                                      [--acceptance] [--repeat N] [--json]

Per size, in fresh processes: the simulate call's CPU time (planning excluded), events and
events/s, the peak RSS of that process, and the wall time and peak RSS of a whole
`holmes-sim run SCENARIO -q` process. A bare SimPy timeout loop, measured in the simulating
process just before and just after the simulate call (the median of six loops), gives the
machine's events/s, so figures compare across machines as ratios. `--straggler` makes the
cluster's first node run at 0.85 of its speed (a GPU model with 0.85 of the A100's peak FLOP/s
and memory bandwidth), so that replica's class cannot be merged. `--asymmetric` runs another job
instead: GPT-7.5B (36 layers, hidden 4096), TP 1, PP 1, one micro-batch per replica, on three
clusters joined by 400 Gbit/s links: half the GPUs H100s on InfiniBand (8 a node), a quarter
A100s on RoCE (8 a node), a quarter A100s on Ethernet only (4 a node); its DP ring crosses the
three NIC kinds, so no two replicas are alike and the symmetric run is the full simulation.
`--acceptance` runs issue 25's cases: symmetric 1,024, 9,216 and 131,072 GPUs; full simulation
of 9,216, plain and with a straggler; and the asymmetric 9,216-GPU job (symmetric, no target),
each case run three times in rotation (`--repeat`); the medians of its runs are checked against
their targets. With --json the last line is a JSON list of
the rows.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Targets per case (gpus, full simulation, straggler, asymmetric): (figure, limit, "<=" or ">=").
# Issue 25: full simulation of 9,216 GPUs (plain and with a straggler) in <= 9.4 s and 400 MiB
# at >= 0.5x bare SimPy's events/s; 131,072 GPUs (symmetric) in <= 10 s and 1 GiB. Earlier
# issues: 1,024 GPUs simulated in <= 1 s of CPU, 16,384 GPUs run in <= 20 s.
_FULL_9216 = [("run_wall_s", 9.4, "<="), ("run_rss_mib", 400.0, "<="), ("x_bare", 0.5, ">=")]
TARGETS = {
    (1024, False, False, False): [("sim_cpu_s", 1.0, "<=")],
    (16384, False, False, False): [("run_wall_s", 20.0, "<=")],
    (131072, False, False, False): [("run_wall_s", 10.0, "<="), ("run_rss_mib", 1024.0, "<=")],
    (9216, True, False, False): _FULL_9216,
    (9216, True, True, False): _FULL_9216,
}
ACCEPTANCE = [(1024, False, False, False), (9216, False, False, False),
              (131072, False, False, False), (9216, True, False, False),
              (9216, True, True, False), (9216, False, False, True)]
STRAGGLER_SPEED = 0.85
_A100_80GB = {"peak_tflops": 312.0, "memory_bandwidth_gbyte_per_s": 2039.0}


def _rack(name: str, count: int, kind: str, gpu: str = "a100-80gb") -> str:
    model = "ib-hdr" if kind == "ib" else "roce-200g"
    return (f"      - {{name: {name}, count: {count}, gpu: {gpu}, nics: "
            f"[{{type: {kind}, model: {model}, count: 8, fabric: {kind}}}, "
            f"{{type: ethernet, model: eth-100g}}]}}")


def scenario_yaml(gpus: int, microbatches: int, straggler: bool = False) -> str:
    """A mixed-NIC cluster of `gpus` A100s (8 per node) training GPT-175B with TP 8; with
    `straggler`, its first node at STRAGGLER_SPEED of its speed."""
    nodes = gpus // 8
    pp = min(16, nodes)
    dp = nodes // pp
    half = max(1, nodes // 2)
    group = max(1, min(4, half))  # racks of up to 4 nodes, alternating IB and RoCE
    racks = []
    catalog = []
    for i in range(nodes // group):
        kind = "ib" if i % 2 == 0 else "roce"
        if i == 0 and straggler:  # rack 0 as its slow first node and the rest
            racks.append(_rack("r0s", 1, kind, gpu="a100-80gb-slow"))
            catalog = ["catalog:", "  gpus: {a100-80gb-slow: {" + ", ".join(
                [f"{k}: {v * STRAGGLER_SPEED:.4f}" for k, v in _A100_80GB.items()]
                + ["memory_gib: 80", "compute_efficiency: 0.738", "sm_count: 108",
                   "intra_node: nvlink3"]) + "}}"]
            if group > 1:
                racks.append(_rack("r0", group - 1, kind))
            continue
        racks.append(_rack(f"r{i}", group, kind))
    return "\n".join([
        "name: engine-scale", "fabrics: [{name: ib, type: ib}, {name: roce, type: roce}]",
        "clusters:", "  - name: dc", "    nodes:", *racks, *catalog,
        "model: {num_layers: 96, hidden_size: 12288, num_attention_heads: 96, seq_length: 2048}",
        f"training: {{global_batch_size: {microbatches * dp}, micro_batch_size: 1, recompute: full,"
        " sequence_parallel: true}",
        f"parallel: {{tensor: 8, pipeline: {pp}, schedule: 1f1b}}",
        "policies: [holmes]", ""])


def _asymmetric_cluster(name: str, nodes: int, gpu: str, per_node: int, kind: str) -> list[str]:
    nics = "{type: ethernet, model: eth-100g}"
    if kind != "ethernet":
        model = "ib-hdr" if kind == "ib" else "roce-200g"
        nics = f"{{type: {kind}, model: {model}, count: 8, fabric: {kind}}}, " + nics
    return [f"  - name: {name}", f"    nodes: [{{count: {nodes}, gpu: {gpu}, "
            f"gpus_per_node: {per_node}, nics: [{nics}]}}]"]


def asymmetric_yaml(gpus: int) -> str:
    """The `--asymmetric` job (see the module docstring) on `gpus` GPUs (a multiple of 32)."""
    if gpus % 32:
        raise SystemExit(f"--asymmetric needs a multiple of 32 GPUs, not {gpus}")
    links = [f"  - {{clusters: [{a}, {b}], bandwidth_gbit_per_s: 400, latency_us: 100}}"
             for a, b in (("ibc", "rocec"), ("ibc", "ethc"), ("rocec", "ethc"))]
    return "\n".join([
        "name: engine-scale-asymmetric",
        "fabrics: [{name: ib, type: ib}, {name: roce, type: roce}]", "clusters:",
        *_asymmetric_cluster("ibc", gpus // 16, "h100-sxm", 8, "ib"),
        *_asymmetric_cluster("rocec", gpus // 32, "a100-80gb", 8, "roce"),
        *_asymmetric_cluster("ethc", gpus // 16, "a100-80gb", 4, "ethernet"),
        "inter_cluster_links:", *links,
        "model: {num_layers: 36, hidden_size: 4096, num_attention_heads: 32, seq_length: 2048}",
        f"training: {{global_batch_size: {gpus}, micro_batch_size: 1}}",
        "parallel: {tensor: 1, pipeline: 1, schedule: 1f1b}", "policies: [holmes]", ""])


def bare_simpy_events_per_s(n: int = 300_000) -> float:
    """Events/s of a bare SimPy loop: one process yielding `n` timeouts (CPU time)."""
    import simpy

    env = simpy.Environment()

    def loop():
        for _ in range(n):
            yield env.timeout(1.0)

    env.process(loop())
    t0 = time.process_time()
    env.run()
    return n / (time.process_time() - t0)


def bare_simpy_samples(repeat: int = 3) -> list[float]:
    """Events/s (CPU time) of `repeat` bare SimPy loops of 200,000 events each."""
    return [bare_simpy_events_per_s(200_000) for _ in range(repeat)]


def measure_simulate(path: str, full: bool, queue) -> None:
    """Child process: plan, then time the simulate call alone (CPU seconds)."""
    from dataclasses import replace

    from holmes_sim.prepare import prepare
    from holmes_sim.runner import engine_options, plan_policy
    from holmes_sim.sim.engine import simulate

    prepared = prepare(Path(path))
    plan, cluster = plan_policy(prepared, "holmes")
    options = replace(engine_options(prepared), full_simulation=full)
    bare = bare_simpy_samples()
    t0 = time.process_time()
    trace = simulate(plan, cluster, prepared.workload, prepared.compute, options)
    cpu = time.process_time() - t0
    bare = sorted(bare + bare_simpy_samples())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    queue.put({"sim_cpu_s": cpu, "events": trace.events, "flows": trace.flows,
               "entities": len(trace.entities),
               "simulated_entities": len({e for _, _, e, _, _ in trace.ops()}),
               "sim_rss_mib": rss, "iteration_s": trace.iteration_s,
               "bare_simpy_events_per_s": (bare[2] + bare[3]) / 2,
               "bare_simpy_range": (bare[0], bare[-1])})


def measure_run(path: str, full: bool) -> dict:
    """Wall time and peak RSS of a whole `holmes-sim run PATH -q` process."""
    exe = Path(sys.executable).with_name("holmes-sim")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "from holmes_sim.cli import main; main()"]
    cmd += ["run", path, "-q", *(["--full-simulation"] if full else [])]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with status {status}")
    return {"run_wall_s": wall, "run_cpu_s": usage.ru_utime + usage.ru_stime,
            "run_rss_mib": usage.ru_maxrss / 1024}


def measure(gpus: int, microbatches: int, full: bool, straggler: bool = False,
            asymmetric: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"scale_{gpus}.yaml"
        path.write_text(asymmetric_yaml(gpus) if asymmetric else
                        scenario_yaml(gpus, microbatches, straggler))
        queue = mp.get_context("spawn").Queue()
        proc = mp.get_context("spawn").Process(target=measure_simulate, args=(str(path), full, queue))
        proc.start()
        row = {"gpus": gpus, "microbatches": 1 if asymmetric else microbatches,
               "full_simulation": full, "straggler": straggler, "asymmetric": asymmetric,
               **queue.get()}
        proc.join()
        row.update(measure_run(str(path), full))
    row["events_per_s"] = row["events"] / row["sim_cpu_s"]
    return row


def verdicts(row: dict) -> list[str]:
    """Each target of the row's case: 'figure value <= limit ok' (or MISSED)."""
    out = []
    case = (row["gpus"], row["full_simulation"], row["straggler"], row["asymmetric"])
    for key, limit, op in TARGETS.get(case, []):
        value = row[key]
        ok = value <= limit if op == "<=" else value >= limit
        out.append(f"{key} {value:.2f} {op} {limit:g} {'ok' if ok else 'MISSED'}")
    return out


def median_row(runs: list[dict]) -> dict:
    """One row of a case's runs: each numeric figure's median (the lower middle of an even
    count), everything else as the first run has it."""
    row = dict(runs[0])
    for key, value in row.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            row[key] = sorted(r[key] for r in runs)[(len(runs) - 1) // 2]
    row["runs"] = len(runs)
    return row


def describe(row: dict) -> str:
    """One line of a row's figures."""
    case = ("full" if row["full_simulation"] else "symmetric") + \
        (", straggler" if row["straggler"] else "") + (", asymmetric" if row["asymmetric"] else "")
    low, high = row["bare_simpy_range"]
    return (f"{row['gpus']:6d} GPUs ({case}): simulate {row['sim_cpu_s']:6.2f} s CPU, "
            f"{row['events']:8d} events, {row['events_per_s'] / 1e3:6.0f} k events/s "
            f"({row['x_bare']:.2f} x bare SimPy's {row['bare_simpy_events_per_s'] / 1e6:.2f} M, "
            f"its loops {low / 1e6:.2f}-{high / 1e6:.2f} M), "
            f"{row['simulated_entities']}/{row['entities']} entities simulated, iteration "
            f"{row['iteration_s']:.4f} s; holmes-sim run {row['run_wall_s']:6.2f} s wall, "
            f"{row['run_cpu_s']:6.2f} s CPU, peak RSS {row['run_rss_mib']:6.1f} MiB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1024, 4096, 9216, 16384, 131072])
    ap.add_argument("--microbatches", type=int, default=192)
    ap.add_argument("--full-simulation", action="store_true", help="simulate every replica")
    ap.add_argument("--straggler", action="store_true",
                    help=f"the first node at {STRAGGLER_SPEED} of its speed")
    ap.add_argument("--asymmetric", action="store_true",
                    help="the TP 1 job on three NIC kinds instead (see the module docstring)")
    ap.add_argument("--acceptance", action="store_true",
                    help="issue 25's cases and the asymmetric one (ignores --gpus, "
                         "--full-simulation, --straggler, --asymmetric)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="runs of every case, in rotation; each target is checked on the "
                         "medians (default 1, with --acceptance 3)")
    ap.add_argument("--json", action="store_true", help="print a JSON list as the last line")
    args = ap.parse_args()
    cases = ACCEPTANCE if args.acceptance else \
        [(g, args.full_simulation, args.straggler, args.asymmetric) for g in args.gpus]
    repeat = max(1, args.repeat or (3 if args.acceptance else 1))
    runs: dict[tuple, list[dict]] = {case: [] for case in cases}
    for r in range(repeat):  # in rotation, so a busy spell of the host hits every case
        for case in cases:
            row = measure(case[0], args.microbatches, *case[1:])
            row["x_bare"] = row["events_per_s"] / row["bare_simpy_events_per_s"]
            runs[case].append(row)
            print(("" if repeat == 1 else f"[run {r + 1}/{repeat}] ") + describe(row), flush=True)
    rows = [median_row(runs[case]) for case in cases]
    for row in rows:
        if repeat > 1:
            print(f"median of {repeat}: " + describe(row), flush=True)
        for verdict in verdicts(row):
            print(f"        target: {verdict}", flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
