"""The backend's mixture-of-experts layer: balanced routing, the expert-parallel split against
the whole model, the pairwise all-to-all on gloo, an emulated run of the bundled MoE
testbed's plans on loopback whose all-to-all bytes must equal the simulator's, and the
expert-data-parallel groups (dp > ep) the routed experts' gradients are reduced over."""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading

import pytest
import torch
import torch.distributed as dist

from holmes_sim.backend.collectives import pairwise_all_to_all
from holmes_sim.backend.groups import PointToPoint, gloo_connections
from holmes_sim.backend.model import GPTConfig, build_full_model, build_stage, synthetic_batch
from holmes_sim.backend.moe import ExpertParallel, expert_of_copies
from holmes_sim.cost.expert_parallel import peer_bytes
from holmes_sim.plan import GroupKind
from tests.backend.threads import in_threads
from tests.conftest import REPO

MOE = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32, seed=3,
                num_experts=4, moe_topk=2, moe_ffn=24)
MOE_TESTBED = REPO / "holmes_sim" / "data" / "testbeds" / "moe.yaml"


def test_routing_gives_every_expert_the_same_rows() -> None:
    chosen = expert_of_copies(tokens=24, topk=2, experts=4)
    assert chosen.shape == (24, 2)
    assert torch.bincount(chosen.reshape(-1), minlength=4).tolist() == [12] * 4
    assert all(len(set(row.tolist())) == 2 for row in chosen)  # k distinct experts per token


def test_expert_parallel_split_trains_as_the_whole_model() -> None:
    batches = [synthetic_batch(MOE, 0, 0, 2, d, 2) for d in range(2)]
    full = build_full_model(MOE)
    ref_losses, ref_grads = [], []
    for tokens, targets in batches:
        full.zero_grad()
        loss = full(tokens, targets)
        loss.backward()
        ref_losses.append(loss.item())
        ref_grads.append({n: p.grad.clone() for n, p in full.named_parameters()})
    # An in-process all-to-all between two threads: chunk j to rank j.
    box, barrier = {}, threading.Barrier(2)

    def exchange(rank):
        def all_to_all(x):
            box[rank] = x.clone()
            barrier.wait()
            out = torch.stack([box[j][rank] for j in range(2)])
            barrier.wait()
            return out
        return all_to_all

    def rank_body(rank):
        stage = build_stage(MOE, 0, MOE.n_layer, True, True,
                            ep=ExpertParallel(2, rank, exchange(rank)))
        loss = stage(*batches[rank])
        loss.backward()
        return loss.item(), stage

    got = in_threads(range(2), rank_body, 60)
    for rank, (loss, stage) in got.items():
        assert loss == pytest.approx(ref_losses[rank], rel=1e-6)
        for layer, block in enumerate(stage.blocks):
            assert len(block.mlp.experts) == 2
            name = f"blocks.{layer}.mlp.router.weight"
            torch.testing.assert_close(block.mlp.router.weight.grad, ref_grads[rank][name])
            # Rank r holds experts 2r, 2r + 1; they saw both ranks' tokens.
            for local, expert in enumerate(block.mlp.experts):
                e = 2 * rank + local
                name = f"blocks.{layer}.mlp.experts.{e}.c_fc.weight"
                torch.testing.assert_close(expert.c_fc.weight, full.get_parameter(name))
                torch.testing.assert_close(expert.c_fc.weight.grad,
                                           ref_grads[0][name] + ref_grads[1][name])


def test_pairwise_all_to_all_on_gloo_swaps_every_chunk() -> None:
    store, p = dist.HashStore(), 3

    def body(rank):
        pg, pg_rev, _ = gloo_connections(store, "a2a", rank, p, "lo", 20.0)
        group = PointToPoint(pg, pg_rev, rank, p)
        chunks = torch.stack([torch.full((4,), 10.0 * rank + j) for j in range(p)])
        return pairwise_all_to_all(group, chunks, 100)

    got = in_threads(range(p), body, 60)
    for rank, out in got.items():
        assert out[:, 0].tolist() == [10.0 * j + rank for j in range(p)]


def test_moe_testbed_plans_send_the_simulators_all_to_all_bytes() -> None:
    # Megatron's and Holmes' plans of the bundled MoE testbed, emulated on loopback: each rank
    # sends, per iteration, exactly the bytes the simulator puts on its EP group.
    from holmes_sim.backend.launch import run_plan
    from holmes_sim.backend.run_config import RunConfig
    from holmes_sim.prepare import prepare
    from holmes_sim.runner import plan_policy
    from holmes_sim.validation.testbed_plan import check_testbed, model_config

    prepared = prepare(MOE_TESTBED, check=check_testbed)
    w = prepared.workload
    durations = {"layer_forward_s": 2e-3, "layer_backward_s": 4e-3, "embedding_forward_s": 1e-4,
                 "embedding_backward_s": 1e-4, "head_forward_s": 1e-3, "head_backward_s": 2e-3,
                 "optimizer_s_per_param": 1e-9}
    for name in ("megatron", "holmes"):
        plan, _ = plan_policy(prepared, name)
        cfg = RunConfig(model=model_config(prepared), micro_batch_size=w.micro_batch,
                        iterations=2, warmup=1, interface_map={"*": "lo"},
                        world_interfaces=["lo"] * plan.world_size,
                        bucket_numel=int(w.bucket_bytes // 4),
                        emulated_compute=[durations] * plan.world_size)
        result = run_plan(plan, cfg, timeout_s=120)
        schedule = plan.schedule()
        for doc in result.ranks:
            group = plan.group_containing(GroupKind.EXPERT, doc["rank"])
            ep = len(group.ranks)
            layers = plan.stage_layers(doc["pp_rank"])
            per_iteration = sum((ep - 1) * peer_bytes(w, plan.tp, ep, layers[op.chunk])
                                for op in schedule.stage_ops[doc["pp_rank"]])
            assert per_iteration > 0
            assert doc["ep_all_to_all"]["bytes_sent"] == cfg.iterations * per_iteration, name
            assert doc["ep_all_to_all"]["calls"] == cfg.iterations * sum(
                2 * layers[op.chunk] for op in schedule.stage_ops[doc["pp_rank"]])


def test_worker_computes_the_first_losses_of_the_whole_model_under_expert_parallelism() -> None:
    # Holmes' plan of the MoE testbed (PP 2 x DP 2 x EP 2) on loopback with real compute and a
    # smaller MoE GPT: before any update every replica's micro-batch losses are the whole
    # model's on the same data, so the gloo all-to-alls moved every token to its expert and back.
    import statistics

    from holmes_sim.backend.launch import run_plan
    from holmes_sim.backend.run_config import RunConfig
    from holmes_sim.prepare import prepare
    from holmes_sim.runner import plan_policy
    from holmes_sim.validation.testbed_plan import check_testbed

    prepared = prepare(MOE_TESTBED, check=check_testbed)
    plan, _ = plan_policy(prepared, "holmes")
    config = GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=8, vocab_size=32, seed=5,
                       num_experts=4, moe_topk=2, moe_ffn=24)
    cfg = RunConfig(model=config, micro_batch_size=2, iterations=1, warmup=0,
                    interface_map={"*": "lo"}, world_interfaces=["lo"] * plan.world_size)
    result = run_plan(plan, cfg, timeout_s=120)
    full = build_full_model(config)
    with torch.no_grad():
        want = statistics.fmean(full(*synthetic_batch(config, 0, mb, 2, d, plan.dp)).item()
                                for d in range(plan.dp) for mb in range(plan.num_microbatches))
    assert result.losses[0] == pytest.approx(want, rel=1e-5)
    for doc in result.ranks:
        assert doc["ep_all_to_all"]["calls"] == 2 * 2 * 2 * plan.num_microbatches  # F+B, 2 layers


def test_real_compute_refuses_moe_testbeds() -> None:
    from typer.testing import CliRunner

    from holmes_sim.cli import app

    result = CliRunner().invoke(app, ["validate", "moe", "--real", "--compute", "real"])
    assert result.exit_code == 2 and "model.num_experts" in result.output \
        and "emulated compute" in result.output


@pytest.mark.parametrize("field, value", [("moe_shared_expert_intermediate_size: 64", "shared"),
                                          ("moe_expert_capacity_factor: 1.0", "dropless"),
                                          ("moe_layer_freq: 2", "every layer")])
def test_moe_layers_the_backend_cannot_run_are_refused(tmp_path, field, value) -> None:
    from holmes_sim.errors import ScenarioError
    from holmes_sim.prepare import prepare
    from holmes_sim.validation.testbed_plan import check_testbed

    text = MOE_TESTBED.read_text().replace("  moe_router_topk: 2\n",
                                           f"  moe_router_topk: 2\n  {field}\n")
    path = tmp_path / "moe.yaml"
    path.write_text(text)
    with pytest.raises(ScenarioError, match=value):
        prepare(path, check=check_testbed)


def _dp4_ep2_testbed(tmp_path):
    """The bundled MoE testbed with PP 1: DP 4 over EP 2, so two expert-data-parallel groups."""
    path = tmp_path / "moe.yaml"
    path.write_text(MOE_TESTBED.read_text().replace("  pipeline: 2\n", "  pipeline: 1\n"))
    return path


def test_expert_data_parallel_groups_are_the_plans_and_carry_the_expert_gradients(tmp_path):
    """PP 1 makes DP 4 over EP 2: a real run accepts it, every rank is in exactly the plan's
    EXPERT_DATA group (the replicas holding its experts: one per EP group) on the plan's NIC, and
    reduces the routed experts' gradients there, the dense ones over the DATA group."""
    from holmes_sim.backend.launch import run_plan
    from holmes_sim.backend.run_config import RunConfig
    from holmes_sim.prepare import prepare
    from holmes_sim.runner import plan_policy
    from holmes_sim.validation.testbed_plan import check_testbed

    prepared = prepare(_dp4_ep2_testbed(tmp_path), check=check_testbed)
    assert prepared.dp == 4 and prepared.workload.ep == 2
    config = GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=8, vocab_size=32, seed=5,
                       num_experts=4, moe_topk=2, moe_ffn=24)
    nics = {}
    for name in ("megatron", "holmes-no-nic-aware-order"):
        plan, _ = plan_policy(prepared, name)
        cfg = RunConfig(model=config, micro_batch_size=2, iterations=1, warmup=0,
                        interface_map={"*": "lo"}, world_interfaces=["lo"] * plan.world_size,
                        bucket_numel=200)
        result = run_plan(plan, cfg, timeout_s=120)
        for doc in result.ranks:
            rank = doc["rank"]
            want = plan.group_containing(GroupKind.EXPERT_DATA, rank)
            [got] = [g for g in doc["groups"] if g["kind"] == GroupKind.EXPERT_DATA.value]
            assert tuple(got["ranks"]) == want.ranks and got["size"] == 2
            assert got["nic"] == want.nics[want.ranks.index(rank)]
            ep_rank = plan.group_containing(GroupKind.EXPERT, rank).ranks.index(rank)
            assert [plan.group_containing(GroupKind.EXPERT, r).ranks.index(r)
                    for r in want.ranks] == [ep_rank] * 2  # the same experts
            assert len({plan.group_containing(GroupKind.EXPERT, r).ranks
                        for r in want.ranks}) == 2  # one member of each EP group
            details = [o["detail"] for o in doc["ops"] if o["kind"] == "dp-sync"]
            assert any(d.startswith("expert ") for d in details)
            assert any(not d.startswith("expert ") for d in details)
            nics[name, rank] = got["nic"]
    # Megatron's order puts the expert-DP groups on Ethernet, the other on one RDMA fabric each.
    assert {nics["megatron", r] for r in range(4)} == {"eth0"}
    assert {nics["holmes-no-nic-aware-order", r] for r in range(4)} == {"ib0", "roce0"}


# Emulated compute of the root testbed runs (seconds; per parameter for the optimizer).
EMULATED_DURATIONS = {"layer_forward_s": 4e-3, "layer_backward_s": 8e-3,
                      "embedding_forward_s": 2e-4, "embedding_backward_s": 2e-4,
                      "head_forward_s": 1e-3, "head_backward_s": 2e-3,
                      "optimizer_s_per_param": 1e-9}
CAN_BUILD = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


def _run_on_testbed(path, names: tuple[str, ...]):
    """Each of `names`' plans run for real on the testbed `path` describes, one measured
    iteration with `EMULATED_DURATIONS`: (the prepared testbed, each NIC's fabric, name ->
    (plan, run)). Every run ends before this returns, so the testbed is gone whatever the
    caller's assertions do."""
    from holmes_sim.backend.testbed import Testbed
    from holmes_sim.prepare import prepare
    from holmes_sim.runner import plan_policy
    from holmes_sim.validation.real_run import _run_real
    from holmes_sim.validation.testbed_plan import (
        check_testbed,
        model_config,
        testbed_nodes,
        testbed_uplinks,
    )

    prepared = prepare(path, check=check_testbed)
    spec = dataclasses.replace(prepared.scenario.testbed, iterations=1, warmup=1)
    fabric_of = {nic.name: nic.fabric for node in prepared.cluster.nodes for nic in node.nics}
    runs = {}
    with Testbed(testbed_nodes(prepared), uplinks=testbed_uplinks(prepared)) as tb:
        for name in names:
            plan, _ = plan_policy(prepared, name)
            runs[name] = plan, _run_real(plan, prepared, model_config(prepared), spec, tb,
                                         {"cpu-rank": EMULATED_DURATIONS})
    return prepared, fabric_of, runs


@pytest.mark.root
@pytest.mark.skipif(not CAN_BUILD, reason="needs root with `ip` and `tc`")
def test_moe_testbed_all_to_alls_cross_fabrics_under_megatron_only() -> None:
    # Both placements on the emulated testbed (one measured iteration each): every rank sends
    # the simulator's all-to-all bytes; Holmes' EP groups stay on one RDMA fabric, Megatron's
    # pair an IB with a RoCE node and run on TCP over the 100 Mbit/s Ethernet, where an
    # all-to-all's bytes take their line rate's time.
    from holmes_sim.plan import TransportKind

    prepared, fabric_of, runs = _run_on_testbed(MOE_TESTBED, ("megatron", "holmes"))
    w = prepared.workload
    a2a_s, ethernet_s = {}, {}
    eth_rate = 0.1e9 / 8
    for name, (plan, run) in runs.items():
        schedule = plan.schedule()
        for group in plan.groups_of(GroupKind.EXPERT):
            fabrics = {fabric_of[nic] for nic in group.nics}
            if name == "holmes":
                assert group.transport.kind is TransportKind.RDMA and len(fabrics) == 1
                assert fabrics <= {"ib", "roce"}
            else:
                assert group.transport.kind is TransportKind.TCP and fabrics == {"ethernet"}
                nodes = {plan.rank_to_gpu[r].node.split("-")[0] for r in group.ranks}
                assert nodes == {"ib", "roce"}  # one IB and one RoCE node
        busiest_bytes = 0
        for doc in run.ranks:
            [ep_doc] = [g for g in doc["groups"] if g["kind"] == GroupKind.EXPERT.value]
            # Its gloo connections are bound to the NIC the plan chose.
            assert ep_doc["interface"] == ep_doc["nic"]
            assert fabric_of[ep_doc["nic"]] in (("ethernet",) if name == "megatron" else
                                                ("ib", "roce"))
            layers = plan.stage_layers(doc["pp_rank"])
            per_iteration = sum(peer_bytes(w, 1, 2, layers[op.chunk])
                                for op in schedule.stage_ops[doc["pp_rank"]])
            assert doc["ep_all_to_all"]["bytes_sent"] == 2 * per_iteration
            busiest_bytes = max(busiest_bytes, per_iteration)
        a2a_s[name] = max(d["ep_all_to_all"]["seconds"] for d in run.ranks) / 2
        ethernet_s[name] = busiest_bytes / eth_rate
    assert 0.9 < a2a_s["megatron"] / ethernet_s["megatron"] < 1.3, (a2a_s, ethernet_s)
    # Holmes' measured seconds include waiting for peers still computing; half the Ethernet
    # line-rate time of its bytes is a bound they could not meet had they crossed it.
    assert a2a_s["holmes"] < 0.5 * ethernet_s["holmes"], (a2a_s, ethernet_s)


@pytest.mark.root
@pytest.mark.skipif(not CAN_BUILD, reason="needs root with `ip` and `tc`")
def test_moe_edp_testbed_reduces_expert_gradients_on_the_plans_nics() -> None:
    # moe_edp (DP 4, EP 2) on the emulated testbed, one measured iteration per plan: every
    # rank's expert-data-parallel group is bound to the NIC the plan chose, and its expert
    # buckets cross that NIC at its rate: on one 2 Gbit/s RDMA fabric under
    # holmes-no-nic-aware-order, on the 100 Mbit/s Ethernet (beside the DP ring) under holmes.
    _, fabric_of, runs = _run_on_testbed(MOE_TESTBED.with_name("moe_edp.yaml"),
                                         ("holmes", "holmes-no-nic-aware-order"))
    reduce_s = {}
    for name, (plan, run) in runs.items():
        for doc in run.ranks:
            [edp] = [g for g in doc["groups"] if g["kind"] == GroupKind.EXPERT_DATA.value]
            want = plan.group_containing(GroupKind.EXPERT_DATA, doc["rank"])
            assert tuple(edp["ranks"]) == want.ranks
            assert edp["interface"] == edp["nic"] == want.nics[want.ranks.index(doc["rank"])]
            assert fabric_of[edp["nic"]] in (("ethernet",) if name == "holmes" else
                                             ("ib", "roce"))
        reduce_s[name] = [o["end"] - o["start"] for doc in run.ranks for o in doc["ops"]
                          if o["detail"].startswith("expert reduce-scatter bucket")]
    # A 0.53 MB bucket sends 0.26 MB: 22 ms at the Ethernet's rate (measured 20-52 ms, the
    # DP ring sharing the NIC), 1.1 ms on RDMA (fastest measured 0.84 ms). Each time includes
    # waiting for peers still computing, which a slow or busy host stretches (RDMA median
    # 9.8 ms in one run), so the fastest bucket of each, whose rank waited for no peer,
    # times the link.
    eth, rdma = reduce_s["holmes"], reduce_s["holmes-no-nic-aware-order"]
    assert min(eth) > 0.015, reduce_s
    assert min(rdma) < min(eth) / 5, reduce_s
