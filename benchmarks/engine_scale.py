"""How the simulation cost grows with the cluster: one simulated iteration of a GPT-175B-class
model (96 layers, hidden 12288) with 1F1B and 64 micro-batches on 64 to 4,096 GPUs, half on
InfiniBand and half on RoCE (nodes racked alternately), planned and simulated by the `holmes`
policy. Each size runs in a fresh process so its peak memory is its own.

    python benchmarks/engine_scale.py [--gpus 64 256 1024 4096] [--microbatches 64] [--json]

Prints one line per size, then the cost per (GPU x micro-batch) relative to the smallest size
(flat = linear scaling); with --json the last line is a JSON list of
{"gpus", "wall_s", "events", "peak_rss_mib", ...}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from pathlib import Path


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


def measure(gpus: int, microbatches: int, queue) -> None:
    """Child process: plan and simulate once, report wall time, events and peak RSS."""
    from holmes_sim.prepare import prepare
    from holmes_sim.runner import run_policy

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scale.yaml"
        path.write_text(scenario_yaml(gpus, microbatches))
        prepared = prepare(path)
    t0 = time.perf_counter()
    outcome = run_policy(prepared, "holmes")
    wall = time.perf_counter() - t0
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    queue.put({"gpus": gpus, "wall_s": round(wall, 3), "events": outcome.trace.events,
               "flows": outcome.trace.flows, "entities": len(outcome.trace.entities),
               "microbatches": prepared.num_microbatches, "peak_rss_mib": round(rss_mib, 1),
               "simulated_iteration_s": round(outcome.result.iteration_time_s, 3)})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument("--microbatches", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="print a JSON list as the last line")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for gpus in args.gpus:
        queue = ctx.Queue()
        proc = ctx.Process(target=measure, args=(gpus, args.microbatches, queue))
        proc.start()
        row = queue.get()
        proc.join()
        rows.append(row)
        print(f"{gpus:6d} GPUs: {row['wall_s']:7.2f} s wall, {row['events']:8d} events, "
              f"{row['flows']:7d} flows, {row['entities']:4d} entities, "
              f"peak RSS {row['peak_rss_mib']:7.1f} MiB", flush=True)
    base = rows[0]["wall_s"] / (rows[0]["gpus"] * rows[0]["microbatches"])
    for r in rows:
        per = r["wall_s"] / (r["gpus"] * r["microbatches"])
        print(f"{r['gpus']:6d} GPUs: cost per GPU x micro-batch = {per / base:5.2f} x the smallest")
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
