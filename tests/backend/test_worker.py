"""Process groups, the per-rank worker and the launcher, on loopback with tiny models.

Losses of distributed runs must match a single-process run of the same model, data and optimizer
within a relative tolerance of 1e-5 (float32; the only differences are summation orders of the
gradient reductions).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from holmes_sim.backend.collectives import all_gather, ring_reduce_scatter
from holmes_sim.backend.groups import BuiltGroup, _direction, build_groups, gloo_group
from holmes_sim.backend.launch import dry_run, local_spawn, run_plan
from holmes_sim.backend.model import build_full_model
from holmes_sim.backend.reference import train_reference
from holmes_sim.backend.run_config import RunConfig
from holmes_sim.errors import TestbedError
from holmes_sim.plan import GroupKind, OptimizerMode, Plan
from holmes_sim.schedule import ScheduleKind
from tests.backend.threads import in_threads

LOSS_RTOL = 1e-5


def _build_all(plan: Plan, interface_of: Callable[[str], str],
               timeout_s: float = 20.0) -> dict[int, list[BuiltGroup]]:
    """Every rank's groups, built in one process (one thread per rank, a shared HashStore)."""
    store = dist.HashStore()
    return in_threads(range(plan.world_size),
                      lambda rank: build_groups(plan, rank, store, interface_of, timeout_s),
                      timeout_s + 10)


def test_private_gloo_spelling_still_works() -> None:
    # Fails loudly when a torch upgrade renames ProcessGroupGloo._Options, _devices, _timeout or
    # create_device: the one private call of the backend.
    pg, native = gloo_group(dist.HashStore(), "probe", 0, 1, "lo", 7.0)
    assert isinstance(pg, dist.ProcessGroupGloo) and pg.size() == 1
    assert len(native._devices) == 1
    assert native._timeout == timedelta(seconds=7.0)


def test_groups_hold_the_plans_ranks_and_interfaces(plan_factory) -> None:
    nic = {GroupKind.PIPELINE: "ib0", GroupKind.DATA: "eth1"}
    plan = plan_factory(pp=2, dp=2, nic_of=lambda rank, kind: nic[kind])
    # On the host only "lo" exists: map each plan NIC to it and record the mapping used.
    mapping = {"ib0": "lo", "eth1": "lo", "": "lo"}
    asked: list[str] = []
    built = _build_all(plan, lambda n: (asked.append(n), mapping[n])[1])
    assert set(asked) == {"ib0", "eth1", ""}
    for rank, groups in built.items():
        expected = [i for i, g in enumerate(plan.groups) if rank in g.ranks]
        assert [g.index for g in groups] == expected
        for g in groups:
            plan_group = plan.groups[g.index]
            assert g.group == plan_group
            assert g.pg.size() == len(plan_group.ranks) and g.pg.rank() == g.group_rank
            assert plan_group.ranks[g.group_rank] == rank
            assert g.options.nic == plan_group.nics[g.group_rank]
            assert g.options.interface == mapping[g.options.nic]
            assert len(g.options.native._devices) == 1
    # Each rank: its TP group, one DATA group, one PIPELINE pair.
    assert sorted(g.group.kind.value for g in built[0]) == ["dp", "pp", "tp"]
    assert built[0][2].group.ranks == (0, 2) and built[2][2].group_rank == 1


def test_group_on_a_missing_interface_fails_loudly(plan_factory) -> None:
    plan = plan_factory(pp=2, nic_of=lambda rank, kind: "hsnone0")
    with pytest.raises(TestbedError, match="hsnone0"):
        _build_all(plan, lambda n: n or "lo", timeout_s=5.0)


def test_interface_mapping_rules() -> None:
    cfg = RunConfig(interface_map={"ib0": "veth-ib0"})
    assert cfg.interface_of("ib0") == "veth-ib0"
    assert cfg.interface_of("eth1") == "eth1"  # testbed: interfaces are named like NICs
    assert cfg.interface_of("") == "lo"  # LOCAL group
    assert RunConfig(interface_map={"*": "lo"}).interface_of("ib0") == "lo"


def test_ring_reduce_scatter_sums_and_shards(plan_factory) -> None:
    plan = plan_factory(dp=3)
    built = _build_all(plan, lambda n: "lo")
    flats = {r: torch.arange(6, dtype=torch.float32) * (r + 1) for r in range(3)}
    shards: dict[int, torch.Tensor] = {}

    def one(rank: int) -> None:
        dp = next(g for g in built[rank] if g.group.kind is GroupKind.DATA)
        shards[rank] = ring_reduce_scatter(dp, flats[rank], tag=0).clone()

    threads = [threading.Thread(target=one, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    total = torch.arange(6, dtype=torch.float32) * 6
    for r in range(3):
        assert torch.equal(shards[r], total[2 * r:2 * r + 2])


def test_ring_all_gather_fills_every_shard(plan_factory) -> None:
    plan = plan_factory(dp=3)
    built = _build_all(plan, lambda n: "lo")
    flats = {r: torch.full((6,), -1.0) for r in range(3)}
    for r in range(3):
        flats[r][2 * r:2 * r + 2] = torch.tensor([10.0 * r, 10.0 * r + 1])

    def one(rank: int) -> None:
        dp = next(g for g in built[rank] if g.group.kind is GroupKind.DATA)
        all_gather(dp, flats[rank], tag=0)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    expected = torch.tensor([0.0, 1.0, 10.0, 11.0, 20.0, 21.0])
    for r in range(3):
        assert torch.equal(flats[r], expected)


def test_each_direction_has_its_own_connection(plan_factory) -> None:
    """Data from a lower to a higher group rank and back travel on different gloo
    connections, so a receive's rendezvous message never queues behind data going the other
    way (groups.py)."""
    plan = plan_factory(dp=2)
    built = _build_all(plan, lambda n: "lo")
    for rank in (0, 1):
        group = next(g for g in built[rank] if g.group.kind is GroupKind.DATA)
        assert group.pg_rev is not None and group.pg_rev is not group.pg
        assert _direction(group, 0, 1) is group.pg
        assert _direction(group, 1, 0) is group.pg_rev


CASES = {
    "pp2-1f1b": dict(pp=2),
    "pp2-gpipe": dict(pp=2, schedule=ScheduleKind.GPIPE),
    "pp2-interleaved": dict(pp=2, schedule=ScheduleKind.INTERLEAVED, num_chunks=2,
                            num_microbatches=4),
    "dp2-replicated": dict(dp=2),
    "pp2-dp2-distributed": dict(pp=2, dp=2, optimizer=OptimizerMode.DISTRIBUTED),
    "dp2-overlapped": dict(dp=2, optimizer=OptimizerMode.DISTRIBUTED_OVERLAPPED),
    "tp2-pp2-distributed": dict(tp=2, pp=2, optimizer=OptimizerMode.DISTRIBUTED),
}


@pytest.mark.parametrize("case", CASES)
def test_distributed_run_matches_single_process(case, plan_factory, run_config_factory,
                                                tiny_config) -> None:
    plan = plan_factory(**CASES[case])
    # Small buckets: several per rank, so the overlapped mode launches more than one.
    cfg = run_config_factory(bucket_numel=20_000)
    result = run_plan(plan, cfg, timeout_s=60)
    reference = train_reference(tiny_config, cfg.micro_batch_size, plan.num_microbatches,
                                plan.dp, cfg.iterations, cfg.lr, cfg.optimizer)
    assert len(result.losses) == cfg.iterations
    assert result.losses == pytest.approx(reference, rel=LOSS_RTOL)
    assert reference[0] != pytest.approx(reference[-1], rel=1e-4)  # training changed the model
    assert len(result.iteration_times_s) == cfg.iterations - cfg.warmup
    assert all(t > 0 for t in result.iteration_times_s)
    # Every rank executed exactly its schedule, in order, in every iteration.
    schedule = plan.schedule()
    for doc in result.ranks:
        expected = [("forward" if op.kind == "F" else "backward", op.microbatch, op.chunk)
                    for op in schedule.stage_ops[doc["pp_rank"]]]
        for it in range(cfg.iterations):
            done = [(o["kind"], o["microbatch"], o["chunk"]) for o in doc["ops"]
                    if o["iteration"] == it and o["kind"] in ("forward", "backward")]
            assert done == expected
    if plan.optimizer.overlapped:
        # Some bucket's reduce-scatter started before the rank's last backward finished.
        for doc in result.ranks:
            ops = [o for o in doc["ops"] if o["iteration"] == cfg.iterations - 1]
            last_backward_end = max(o["end"] for o in ops if o["kind"] == "backward")
            assert min(o["start"] for o in ops if "async" in o["detail"]) < last_backward_end
    kinds = set(result.op_times_s)
    assert {"forward", "backward", "optimizer", "dp-sync"} <= kinds
    assert ("recv" in kinds) == (plan.pp > 1)


def test_failing_rank_is_reported_and_every_rank_killed(plan_factory, run_config_factory,
                                                        tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    plan = plan_factory(pp=2)
    # Rank 1's world group binds to an interface that does not exist: it raises at start-up
    # while rank 0 waits for it in the rendezvous.
    cfg = run_config_factory(world_interfaces=["lo", "hsnone0"], timeout_s=60)
    procs: list[subprocess.Popen] = []

    def spawn(rank: int, argv: list[str]) -> subprocess.Popen:
        procs.append(local_spawn(rank, argv))
        return procs[-1]

    start = time.monotonic()
    with pytest.raises(TestbedError, match=r"rank 1 exited") as err:
        run_plan(plan, cfg, spawn=spawn, timeout_s=40)
    assert time.monotonic() - start < 40
    assert "hsnone0" in str(err.value)  # the failing rank's log tail
    assert len(procs) == 2 and all(p.poll() is not None for p in procs)
    assert not list(Path(tmp_path).glob("holmes-run-*"))  # temp files removed


def test_timeout_kills_every_rank(plan_factory, run_config_factory) -> None:
    plan = plan_factory(pp=2)
    procs: list[subprocess.Popen] = []

    def spawn(rank: int, argv: list[str]) -> subprocess.Popen:
        # Rank 1 never starts the worker: rank 0 waits for it until the run times out.
        argv = argv if rank == 0 else ["sleep", "60"]
        procs.append(local_spawn(rank, argv))
        return procs[-1]

    with pytest.raises(TestbedError, match=r"timed out .*\[0, 1\]"):
        run_plan(plan, run_config_factory(), spawn=spawn, timeout_s=3)
    assert all(p.poll() is not None for p in procs)


def test_dry_run_reports_every_group_and_stage(plan_factory, run_config_factory,
                                               tiny_config) -> None:
    plan = plan_factory(pp=2, dp=2, schedule=ScheduleKind.INTERLEAVED, num_chunks=2,
                        num_microbatches=2, layers=(1, 1, 1, 1))
    summaries = dry_run(plan, run_config_factory(), timeout_s=60)
    assert [s["rank"] for s in summaries] == [0, 1, 2, 3]
    seen_groups = {(g["index"], tuple(g["ranks"]), g["group_rank"]) for s in summaries
                   for g in s["groups"]}
    expected = {(i, g.ranks, k) for i, g in enumerate(plan.groups) for k in range(len(g.ranks))}
    assert seen_groups == expected
    assert all(g["interface"] == "lo" for s in summaries for g in s["groups"])
    # Interleaved p=2: both directions are separate PIPELINE groups.
    pipes = {tuple(g.ranks) for g in plan.groups_of(GroupKind.PIPELINE)}
    assert {(0, 2), (2, 0), (1, 3), (3, 1)} == pipes
    stages = {(s["dp_rank"], st["virtual"]): st for s in summaries for st in s["stages"]}
    assert sorted(stages) == [(d, v) for d in range(2) for v in range(4)]
    assert [stages[(0, v)]["first_layer"] for v in range(4)] == [0, 1, 2, 3]
    assert stages[(0, 0)]["embedding"] and stages[(1, 3)]["head"]
    assert not stages[(0, 1)]["embedding"] and not stages[(0, 1)]["head"]
    total = sum(stages[(0, v)]["parameters"] for v in range(4))
    assert total == sum(p.numel() for p in build_full_model(tiny_config).parameters())


def test_rank_logs_are_private(plan_factory, run_config_factory, tmp_path) -> None:
    out = tmp_path / "out"
    dry_run(plan_factory(), run_config_factory(output_dir=str(out)), timeout_s=60)
    assert out.stat().st_mode & 0o777 == 0o700
    assert (out / "rank_0.log").stat().st_mode & 0o777 == 0o600


EMULATED = {"layer_forward_s": 0.002, "layer_backward_s": 0.004, "embedding_forward_s": 0.0005,
            "embedding_backward_s": 0.001, "head_forward_s": 0.0015, "head_backward_s": 0.003,
            "optimizer_s_per_param": 1e-9}


@pytest.mark.parametrize("case", ["pp2-dp2-overlapped", "pp2-interleaved", "tp2-pp2",
                                  "tp2-pp2-split"])
def test_emulated_compute_waits_its_durations_and_still_communicates(case, plan_factory,
                                                                     run_config_factory) -> None:
    kw = {"pp2-dp2-overlapped": dict(pp=2, dp=2, optimizer=OptimizerMode.DISTRIBUTED_OVERLAPPED),
          "pp2-interleaved": dict(pp=2, schedule=ScheduleKind.INTERLEAVED, num_chunks=2,
                                  num_microbatches=4),
          "tp2-pp2": dict(tp=2, pp=2), "tp2-pp2-split": dict(tp=2, pp=2)}[case]
    plan = plan_factory(**kw)
    split = case.endswith("-split")  # each TP rank sends half a message, the receivers gather
    # Rank 1 emulates a GPU twice as slow: its waits double, nobody else's.
    slow = {k: 2 * v for k, v in EMULATED.items()}
    per_rank = [slow if r == 1 else EMULATED for r in range(plan.world_size)]
    cfg = run_config_factory(bucket_numel=20_000, emulated_compute=per_rank, realtime_priority=1,
                             pipeline_split=split)
    result = run_plan(plan, cfg, timeout_s=60)
    assert result.losses == ()  # nothing computed
    # Real-time scheduling where permitted (root), else said so; never silently.
    for doc in result.ranks:
        assert doc["scheduler"] == "fifo:1" if os.geteuid() == 0 else \
            doc["scheduler"].startswith("other (SCHED_FIFO refused")
    schedule = plan.schedule()
    for doc in result.ranks:
        d = per_rank[doc["rank"]]
        # Requested wait per iteration: every op's pieces, exactly (1/tp of each per TP rank).
        want, tp_calls = 0.0, 0
        for op in schedule.stage_ops[doc["pp_rank"]]:
            stage = doc["stages"][op.chunk]
            pieces = stage["num_layers"] * d["layer_backward_s" if op.kind == "B" else
                                             "layer_forward_s"]
            for piece, flag in (("embedding", "embedding"), ("head", "head")):
                if stage[flag]:
                    pieces += d[f"{piece}_{'backward' if op.kind == 'B' else 'forward'}_s"]
            want += pieces / plan.tp
            # TP: two all-reduces per layer and op; a received message split over the TP
            # group is all-gathered.
            received = split and (op.kind == "F" and doc["pp_rank"] > 0 or
                                  op.kind == "B" and doc["pp_rank"] < plan.pp - 1)
            tp_calls += (2 * stage["num_layers"] + received) if plan.tp > 1 else 0
        measured = cfg.iterations - cfg.warmup
        assert doc["emulation"]["requested_s"] == pytest.approx(measured * want, rel=1e-9)
        assert doc["tp_collectives"] == cfg.iterations * tp_calls
        # A wait never ends early: each compute op lasts at least its pieces' durations.
        assert doc["emulation"]["actual_s"] >= doc["emulation"]["requested_s"]
        for it in range(cfg.iterations):
            done = [(o["kind"], o["microbatch"], o["chunk"]) for o in doc["ops"]
                    if o["iteration"] == it and o["kind"] in ("forward", "backward")]
            assert done == [("forward" if op.kind == "F" else "backward", op.microbatch, op.chunk)
                            for op in schedule.stage_ops[doc["pp_rank"]]]
        if plan.optimizer.overlapped:
            # The gradient buckets still move, launched during the backward as in a real run.
            ops = [o for o in doc["ops"] if o["iteration"] == cfg.iterations - 1]
            last_backward_end = max(o["end"] for o in ops if o["kind"] == "backward")
            assert min(o["start"] for o in ops if "reduce-scatter" in o["detail"]) \
                < last_backward_end
            assert any("all-gather" in o["detail"] for o in doc["ops"])
    assert ("recv" in result.op_times_s) == (plan.pp > 1)


def test_emulated_compute_rejects_incomplete_durations(plan_factory, run_config_factory) -> None:
    plan = plan_factory(pp=2)
    partial = {k: v for k, v in EMULATED.items() if k != "head_backward_s"}
    cfg = run_config_factory(emulated_compute=[EMULATED, partial])
    with pytest.raises(TestbedError, match="head_backward_s"):
        run_plan(plan, cfg, timeout_s=60)
