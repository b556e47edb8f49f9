"""One rank of a real run: `python -m holmes_sim.backend.worker --config RUN.json --rank R`.

It builds the rank's groups and stages, runs its iterations (`rank.Rank`) and writes one JSON
result file: what it built, per-op timestamps (time.perf_counter() seconds) and losses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from holmes_sim.backend.emulation import emulated_durations
from holmes_sim.backend.groups import BuiltGroup, build_groups, expert_group, init_world
from holmes_sim.backend.model import Stage, TensorParallel
from holmes_sim.backend.moe import ExpertParallel
from holmes_sim.backend.rank import Rank, build_stages
from holmes_sim.backend.run_config import MUTATIONS, RunConfig
from holmes_sim.errors import TestbedError
from holmes_sim.plan import Plan


def set_realtime(priority: int) -> str:
    """SCHED_FIFO at `priority` for this process and the threads it starts later (0: leave the
    scheduler alone); what it runs under, for the result."""
    if priority <= 0:
        return "other"
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except (OSError, AttributeError) as e:
        return f"other (SCHED_FIFO refused: {e})"
    return f"fifo:{priority}"


def _no_comm(_tensor: torch.Tensor) -> torch.Tensor:
    raise TestbedError("a dry run builds TP stages without communicating")


def summary(rank: int, plan: Plan, groups: list[BuiltGroup], stages: list[Stage]) -> dict:
    """What a rank built: its groups (ranks, nic, interface) and stages (layers, parameters)."""
    pp_rank, dp_rank, tp_rank = plan.coords(rank)
    return {
        "rank": rank, "pp_rank": pp_rank, "dp_rank": dp_rank, "tp_rank": tp_rank,
        "groups": [{"index": g.index, "kind": g.group.kind.value, "ranks": list(g.group.ranks),
                    "group_rank": g.group_rank, "size": g.pg.size(), "nic": g.options.nic,
                    "interface": g.options.interface} for g in groups],
        "stages": [{"chunk": c, "virtual": c * plan.pp + pp_rank, "first_layer": s.first_layer,
                    "num_layers": s.num_layers, "embedding": s.has_embedding, "head": s.has_head,
                    "parameters": sum(p.numel() for p in s.parameters())}
                   for c, s in enumerate(stages)],
    }


def open_store(cfg: RunConfig, rank: int, world_size: int) -> dist.Store:
    spec = cfg.store
    if spec.get("kind") == "file":
        return dist.FileStore(spec["path"], world_size)
    if spec.get("kind") == "tcp":
        from datetime import timedelta
        return dist.TCPStore(spec["host"], int(spec["port"]), world_size, is_master=rank == 0,
                             timeout=timedelta(seconds=cfg.timeout_s))
    raise TestbedError(f"run config store must be kind 'file' or 'tcp', got {spec!r}")


def run_rank(plan: Plan, cfg: RunConfig, rank: int) -> dict:
    """Build everything for `rank`, train (unless dry run) and return the result document."""
    torch.set_num_threads(cfg.torch_threads)
    if cfg.mutation and cfg.mutation not in MUTATIONS:
        raise TestbedError(f"unknown mutation {cfg.mutation!r}; known: {', '.join(MUTATIONS)}")
    emulated_durations(cfg, rank)  # a bad entry fails here, before any peer waits for it
    scheduler = set_realtime(cfg.realtime_priority)
    if cfg.backend == "nccl":
        groups = _init_nccl(plan, cfg, rank)
    else:
        if cfg.world_interfaces:
            os.environ["GLOO_SOCKET_IFNAME"] = cfg.world_interfaces[rank]
        store = open_store(cfg, rank, plan.world_size)
        init_world(store, rank, plan.world_size, cfg.timeout_s)
        groups = build_groups(plan, rank, store, cfg.interface_of, cfg.timeout_s)
    if cfg.dry_run:
        pp_rank, _, tp_rank = plan.coords(rank)
        tp = None if plan.tp == 1 else TensorParallel(plan.tp, tp_rank, _no_comm, _no_comm)
        ep_group = expert_group(groups)
        ep = None if ep_group is None else ExpertParallel(ep_group.size, ep_group.group_rank,
                                                          _no_comm)
        result = summary(rank, plan, groups, build_stages(plan, cfg.model, pp_rank, tp, ep))
        dist.barrier(group=BARRIER_GROUP)  # SYNC-6
        return result
    worker = Rank(plan, cfg, rank, groups, DEVICE, BARRIER_GROUP)
    for it in range(cfg.iterations):
        worker.run_iteration(it)
    worker.finish()
    dist.barrier(group=BARRIER_GROUP)  # SYNC-6: no rank leaves while a peer may still talk to it
    result = summary(rank, plan, groups, worker.stages)
    result.update({
        "iterations": [{"index": o["iteration"], "start": o["start"], "end": o["end"]}
                       for o in worker.rec.ops if o["kind"] == "iteration"],
        "ops": [o for o in worker.rec.ops if o["kind"] != "iteration"],
        "losses": worker.losses,
    })
    if worker.emulator is not None:
        result["emulation"] = dict(worker.emulator.emulation)
    result["tp_collectives"] = worker.tp_comm.collectives
    if worker.ep_comm is not None:  # every iteration's all-to-alls, warm-up included
        result["ep_all_to_all"] = {"calls": worker.ep_comm.collectives,
                                   "bytes_sent": worker.ep_comm.bytes_sent,
                                   "seconds": worker.ep_comm.comm_s}
    result["scheduler"] = scheduler
    if cfg.dump_params:
        result["params"] = {n: t.reshape(-1).tolist() for s in worker.stages
                            for n, t in worker.full_params(s).items()}
    return result


# The device every tensor of this rank lives on: the CPU, or the rank's GPU under NCCL.
DEVICE = torch.device("cpu")
# The group SYNC-1 / SYNC-6 barriers run on: None (the gloo world) on the testbed, a separate
# gloo group under NCCL (no barrier ever builds a world NCCL communicator).
BARRIER_GROUP = None


def _init_nccl(plan: Plan, cfg: RunConfig, rank: int) -> list:
    """torchrun rendezvous (env://), one GPU per rank, every plan group created eagerly.

    The world group gets no `device_id`: torch then creates no world NCCL communicator (it is
    never used), so each plan group's communicator is built by itself under its own settings
    rather than split from the world's. Barriers use a gloo group (see nccl.py)."""
    global DEVICE, BARRIER_GROUP
    import socket
    from datetime import timedelta

    from holmes_sim.backend.groups import build_nccl_groups
    from holmes_sim.backend.nccl import check_placement

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    check_placement(plan, rank, socket.gethostname(), local_rank, cfg.node_hosts)
    DEVICE = torch.device("cuda", local_rank)
    torch.cuda.set_device(DEVICE)
    if cfg.bootstrap_ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = cfg.bootstrap_ifname
    timeout = timedelta(seconds=cfg.timeout_s)
    dist.init_process_group("nccl", rank=rank, world_size=plan.world_size, timeout=timeout)
    BARRIER_GROUP = dist.new_group(backend="gloo", timeout=timeout)
    return build_nccl_groups(plan, rank, cfg.nic_devices, DEVICE, cfg.timeout_s,
                             roce_fabrics=cfg.roce_fabrics, gid_index=cfg.roce_gid_index,
                             bootstrap_ifname=cfg.bootstrap_ifname)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="run config JSON (with plan_path)")
    parser.add_argument("--rank", type=int, default=None,
                        help="this rank (default: $RANK, as torchrun sets it)")
    args = parser.parse_args(argv)
    if args.rank is None:
        args.rank = int(os.environ["RANK"])
    # The overlapped optimizer's communication runs in a Python thread; with the default 5 ms
    # GIL switch interval every hand-over between it and the compute thread can stall a bucket
    # for milliseconds (GPU code overlaps through CUDA streams instead).
    sys.setswitchinterval(2e-4)
    doc = json.loads(Path(args.config).read_text())
    out_dir = Path(doc["run"]["output_dir"])
    # Everything this rank prints, C++ aborts included, goes to its log for launch to report.
    log = os.open(out_dir / f"rank_{args.rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 2)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    try:
        plan = Plan.from_json(Path(doc["plan_path"]).read_text())
        cfg = RunConfig.from_json(json.dumps(doc["run"]))
        result = run_rank(plan, cfg, args.rank)
        tmp = out_dir / f"rank_{args.rank}.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.rename(out_dir / f"rank_{args.rank}.json")
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's destructors can abort once peers have gone.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
