"""How the simulation cost grows with the cluster: one iteration of GPT-175B (96 layers, hidden
12288, TP 8, PP 16, 1F1B, 192 micro-batches per replica) on 1,024 to 16,384 A100s, racks of four
nodes alternately on InfiniBand and RoCE, planned and simulated by the `holmes` policy.

    python benchmarks/engine_scale.py [--gpus 1024 4096 9216 16384] [--microbatches 192]
                                      [--full-simulation] [--json]

Per size, in fresh processes: the simulate call's CPU time (planning excluded), events and
events/s, the peak RSS of that process, and the wall time and peak RSS of a whole
`holmes-sim run SCENARIO -q` process. A bare SimPy timeout loop measured in the same run gives
the machine's events/s, so figures compare across machines as ratios. With --json the last line
is a JSON list of the rows.
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

TARGETS = {1024: ("sim_cpu_s", 1.0), 9216: ("run_wall_s", 9.4), 16384: ("run_wall_s", 20.0)}
RSS_TARGET = (9216, 400.0)  # MiB, whole run process


def scenario_yaml(gpus: int, microbatches: int) -> str:
    """A mixed-NIC cluster of `gpus` A100s (8 per node) training GPT-175B with TP 8."""
    nodes = gpus // 8
    pp = min(16, nodes)
    dp = nodes // pp
    half = max(1, nodes // 2)
    group = max(1, min(4, half))  # racks of up to 4 nodes, alternating IB and RoCE
    racks = []
    for i in range(nodes // group):
        kind = "ib" if i % 2 == 0 else "roce"
        model = "ib-hdr" if kind == "ib" else "roce-200g"
        racks.append(f"      - {{name: r{i}, count: {group}, gpu: a100-80gb, nics: "
                     f"[{{type: {kind}, model: {model}, count: 8, fabric: {kind}}}, "
                     f"{{type: ethernet, model: eth-100g}}]}}")
    return "\n".join([
        "name: engine-scale", "fabrics: [{name: ib, type: ib}, {name: roce, type: roce}]",
        "clusters:", "  - name: dc", "    nodes:", *racks,
        "model: {num_layers: 96, hidden_size: 12288, num_attention_heads: 96, seq_length: 2048}",
        f"training: {{global_batch_size: {microbatches * dp}, micro_batch_size: 1, recompute: full,"
        " sequence_parallel: true}",
        f"parallel: {{tensor: 8, pipeline: {pp}, schedule: 1f1b}}",
        "policies: [holmes]", ""])


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


def measure_simulate(path: str, full: bool, queue) -> None:
    """Child process: plan, then time the simulate call alone (CPU seconds)."""
    from dataclasses import replace

    from holmes_sim.prepare import prepare
    from holmes_sim.runner import engine_options, plan_policy
    from holmes_sim.sim.engine import simulate

    prepared = prepare(Path(path))
    plan, cluster = plan_policy(prepared, "holmes")
    options = replace(engine_options(prepared), full_simulation=full)
    t0 = time.process_time()
    trace = simulate(plan, cluster, prepared.workload, prepared.compute, options)
    cpu = time.process_time() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    queue.put({"sim_cpu_s": cpu, "events": trace.events, "flows": trace.flows,
               "entities": len(trace.entities), "simulated_entities": len({r.entity for r in trace.compact}),
               "sim_rss_mib": rss, "iteration_s": trace.iteration_s})


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


def measure(gpus: int, microbatches: int, full: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"scale_{gpus}.yaml"
        path.write_text(scenario_yaml(gpus, microbatches))
        queue = mp.get_context("spawn").Queue()
        proc = mp.get_context("spawn").Process(target=measure_simulate, args=(str(path), full, queue))
        proc.start()
        row = {"gpus": gpus, "microbatches": microbatches, **queue.get()}
        proc.join()
        row.update(measure_run(str(path), full))
    row["events_per_s"] = row["events"] / row["sim_cpu_s"]
    return row


def verdicts(row: dict) -> list[str]:
    out = []
    if row["gpus"] in TARGETS:
        key, limit = TARGETS[row["gpus"]]
        out.append(f"{key} {row[key]:.2f} <= {limit} {'ok' if row[key] <= limit else 'MISSED'}")
    if row["gpus"] == RSS_TARGET[0]:
        ok = row["run_rss_mib"] <= RSS_TARGET[1]
        out.append(f"run RSS {row['run_rss_mib']:.0f} <= {RSS_TARGET[1]:.0f} MiB {'ok' if ok else 'MISSED'}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1024, 4096, 9216, 16384])
    ap.add_argument("--microbatches", type=int, default=192)
    ap.add_argument("--full-simulation", action="store_true", help="simulate every replica")
    ap.add_argument("--json", action="store_true", help="print a JSON list as the last line")
    args = ap.parse_args()
    bare = bare_simpy_events_per_s()
    print(f"bare SimPy: {bare / 1e6:.2f} M events/s (CPU)", flush=True)
    rows = []
    for gpus in args.gpus:
        row = measure(gpus, args.microbatches, args.full_simulation)
        row["bare_simpy_events_per_s"] = bare
        rows.append(row)
        print(f"{gpus:6d} GPUs: simulate {row['sim_cpu_s']:6.2f} s CPU, {row['events']:8d} events, "
              f"{row['events_per_s'] / 1e3:6.0f} k events/s ({row['events_per_s'] / bare:.2f} x bare), "
              f"{row['simulated_entities']}/{row['entities']} entities simulated; holmes-sim run "
              f"{row['run_wall_s']:6.2f} s wall, peak RSS {row['run_rss_mib']:6.1f} MiB  "
              + "; ".join(verdicts(row)), flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
