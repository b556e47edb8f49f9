"""Expert tensor parallelism (`parallel.expert_tensor`, Megatron-Core's MoE parallel folding): the
loader's checks, Megatron-Core's expert rank order, the per-GPU all-to-all bytes and expert GEMM
shapes, the engine against the estimate, the planner's search and the exported flag."""

from __future__ import annotations

import shlex

import pytest

from holmes_sim.cost.expert_parallel import group_peer_bytes, local_exposed_s, token_bytes
from holmes_sim.cost.moe import moe_mlp_kernels, tp_comm_factor
from holmes_sim.errors import ScenarioError
from holmes_sim.estimate.analytic import estimate_iteration
from holmes_sim.export.launch import launch_files
from holmes_sim.plan import GroupKind, TransportKind
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy, run_policy
from tests.export.test_launch_targets import UPSTREAM, parse
from tests.sim.test_expert_parallel import ep_scenario, node


def etp_scenario(*, etp: int | None, **fields) -> str:
    """`ep_scenario` (8 experts, top-2, h 2048, f_e 4096, SwiGLU) with `expert_tensor: etp`."""
    text = ep_scenario(**fields)
    ep = fields.get("ep", 8)
    return text if etp is None else text.replace(f"expert: {ep}}}",
                                                 f"expert: {ep}, expert_tensor: {etp}}}")


@pytest.mark.parametrize("fields,words", [
    (dict(moe=False, tp=2, ep=1, etp=1), ["parallel.expert_tensor", "needs an MoE model"]),
    (dict(tp=2, ep=4, etp=4), ["parallel.expert_tensor", "must divide tensor=2"]),
    (dict(tp=2, ep=1, etp=1), ["parallel.expert_tensor", "multiple of tensor=2",
                               "expert to a multiple of 2"]),
    (dict(tp=8, ep=8, etp=8, groups=node()), ["parallel.expert_tensor",
                                              "tensor x context x data = 8"]),
    (dict(tp=2, ep=4, etp=1, experts=6), ["parallel.expert", "model.num_experts=6"]),
])
def test_bad_expert_tensor_degrees_name_the_field_and_fix(write_scenario, fields, words):
    fields.setdefault("groups", node(count=2))
    with pytest.raises(ScenarioError) as info:
        prepare(write_scenario(etp_scenario(**fields)))
    assert all(w in str(info.value) for w in words), str(info.value)


def test_expert_tensor_must_divide_the_expert_width(write_scenario):
    text = etp_scenario(groups=node(), tp=2, ep=4, etp=2).replace("moe_ffn_hidden_size: 4096",
                                                                   "moe_ffn_hidden_size: 4095")
    with pytest.raises(ScenarioError, match="expert_tensor=2 must divide the experts' FFN width"):
        prepare(write_scenario(text))


def test_expert_ranks_follow_megatron_cores_expert_order(write_scenario):
    """16 GPUs, TP 2, PP 2, EP 4, expert TP 1: a stage has 8 ranks (DP 4 of TP 2). Megatron-Core's
    expert `RankGenerator` (tp=etp 1, ep 4, dp=edp 8 / 4 = 2, order "tp-ep-dp-pp"; expert-TP
    rank fastest) numbers stage-local rank r = etp_rank + 1 x (ep_rank + 4 x edp_rank): EP groups
    are r = 0..3 and 4..7 (two TP groups each), expert-DP groups r and r + 4. The attention's TP,
    DP and PP groups do not change."""
    prepared = prepare(write_scenario(etp_scenario(groups=node(count=2), tp=2, pp=2, ep=4,
                                                   etp=1, global_batch=16)))
    plan, _ = plan_policy(prepared, "megatron")

    def ranks(kind):
        return sorted(g.ranks for g in plan.groups_of(kind))

    assert ranks(GroupKind.EXPERT) == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11),
                                       (12, 13, 14, 15)]
    assert ranks(GroupKind.EXPERT_DATA) == [(0, 4), (1, 5), (2, 6), (3, 7), (8, 12), (9, 13),
                                            (10, 14), (11, 15)]
    assert ranks(GroupKind.TENSOR)[:2] == [(0, 1), (2, 3)]
    assert ranks(GroupKind.DATA)[:2] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert prepared.workload.ep_replicas == 2  # an EP group spans 2 TP groups
    # the same groups from Megatron-Core's own generator (the test extra installs it)
    state = pytest.importorskip("megatron.core.parallel_state")
    gen = state.RankGenerator(tp=1, ep=4, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    assert ranks(GroupKind.EXPERT) == sorted(tuple(r) for r in gen.get_ranks("ep"))
    assert ranks(GroupKind.EXPERT_DATA) == sorted(tuple(r) for r in gen.get_ranks("dp"))


@pytest.mark.parametrize("tp,ep,etp,nodes", [(4, 4, 2, 2), (2, 8, 2, 2), (8, 8, 1, 2)])
def test_expert_groups_equal_megatron_cores_generator(write_scenario, tp, ep, etp, nodes):
    state = pytest.importorskip("megatron.core.parallel_state")
    prepared = prepare(write_scenario(etp_scenario(groups=node(count=nodes), tp=tp, ep=ep,
                                                   etp=etp, global_batch=16)))
    plan, _ = plan_policy(prepared, "holmes")
    edp = 8 * nodes // (ep * etp)
    gen = state.RankGenerator(tp=etp, ep=ep, dp=edp, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    for kind, name in ((GroupKind.EXPERT, "ep"), (GroupKind.EXPERT_DATA, "dp")):
        expect = sorted(tuple(r) for r in gen.get_ranks(name)) if edp > 1 or name == "ep" else []
        assert sorted(g.ranks for g in plan.groups_of(kind)) == expect, name


def test_bytes_and_gemm_shapes_with_expert_tp_below_tp(write_scenario):
    """One node, TP 2, EP 4, 8 experts (2 a GPU), top-2, M = 4096 tokens a micro-batch, h 2048,
    f_e 4096, SwiGLU, bf16. Every GPU dispatches its own M/2 tokens' 2 copies, B = 2048 x 2 x
    2048 x 2 bytes, whatever etp. Expert TP 2 (= TP): EP group = TP rank i of 4 replicas, a GPU's
    2 experts take 2 x 4096 rows (the TP pair's tokens) at half width; expert TP 1: EP group = 2
    TP groups, 1 peer inside the GPU's own TP group and 2 in the other, its 2 experts take 2 x
    2048 rows at full width: the same FLOPs. Dispatched rows are all-gathered over TP only at
    etp = 2."""
    folded = prepare(write_scenario(etp_scenario(groups=node(), tp=2, ep=4, etp=1))).workload
    split = prepare(write_scenario(etp_scenario(groups=node(), tp=2, ep=4, etp=None))).workload
    assert (folded.tp_per_etp, folded.ep_replicas, folded.expert_tp(2)) == (2, 2, 1)
    assert (split.tp_per_etp, split.ep_replicas, split.expert_tp(2)) == (1, 4, 2)
    b = 2048 * 2 * 2048 * 2
    assert token_bytes(folded, 2) == token_bytes(split, 2) == b
    # one layer's forward: 2 all-to-alls; per other TP group: 2 GPUs x q peers x B/ep each
    assert group_peer_bytes(folded, 2, 1) == 2 * (2 * 2 * b / 4)
    assert group_peer_bytes(split, 2, 1) == 2 * (2 * 1 * b / 4)
    assert local_exposed_s(split, 2, 1, 1e11, 1e-6) == 0.0
    assert local_exposed_s(folded, 2, 1, 1e11, 1e-6) == pytest.approx(2 * (1e-6 + b / 4 / 1e11))
    fc1_f, fc2_f = moe_mlp_kernels(folded, 2).linear
    fc1_s, fc2_s = moe_mlp_kernels(split, 2).linear
    assert (fc1_f.m, fc1_f.n, fc1_f.k, fc1_f.batch) == (2048, 2 * 4096, 2048, 2)
    assert (fc2_f.m, fc2_f.n, fc2_f.k, fc2_f.batch) == (2048, 2048, 4096, 2)
    assert (fc1_s.m, fc1_s.n, fc1_s.k, fc1_s.batch) == (4096, 4096, 2048, 2)
    assert (fc2_s.m, fc2_s.n, fc2_s.k, fc2_s.batch) == (4096, 2048, 2048, 2)
    assert fc1_f.m * fc1_f.n == fc1_s.m * fc1_s.n
    assert tp_comm_factor(split, 2) == 1.5 and tp_comm_factor(folded, 2) == 0.5
    # a GPU holds 1/(ep etp) of the routed experts: per layer 8 x 3 h f_e, over 4 and over 8
    expert = 8 * 3 * 2048 * 4096
    assert (folded.layer_params - split.layer_params) / 2 == expert / 4 - expert / 8
    assert folded.expert_layer_params / 2 == expert / 4


def test_engine_and_estimate_agree_and_nvlink_carries_the_folded_all_to_alls(write_scenario):
    """Two nodes, TP 2, EP 8: with expert TP 2 an EP group is TP rank i of 8 replicas, two
    nodes (InfiniBand); with expert TP 1 it is one node's 8 GPUs (NVLink), and the all-to-alls
    get cheaper. The estimate follows the engine within the 0.7% its dense and expert gradient
    rings sharing one NIC allow (docs/cost_models.md, "Expert parallelism"): expert TP 1 doubles
    a GPU's expert weights and gives them an expert-DP group of 2 across the nodes, which expert
    TP 2 (expert-DP 1) does not reduce at all."""
    out = {}
    for etp in (None, 1):
        prepared = prepare(write_scenario(etp_scenario(groups=node(count=2), tp=2, ep=8, etp=etp,
                                                       global_batch=8)))
        run = run_policy(prepared, "megatron")
        est = estimate_iteration(run.plan, run.cluster, prepared.workload, prepared.compute)
        assert est.iteration_s == pytest.approx(run.result.iteration_time_s, rel=7e-3)
        kinds = {g.transport.kind for g in run.plan.groups_of(GroupKind.EXPERT)}
        out[etp] = run.result.breakdown_s["ep_comm"], kinds
    assert out[None][1] == {TransportKind.RDMA} and out[1][1] == {TransportKind.LOCAL}
    assert 0 < out[1][0] < out[None][0] / 4


def test_full_recompute_redoes_the_folded_all_to_alls_too(write_scenario):
    """Expert TP 1 at TP 2: the sends inside the TP group (NVLink, `local_exposed_s`) and those
    to the other TP groups are both redone by the recomputed forward, so under full
    recomputation the engine's ep_comm is 1.5x that without, and the estimate follows."""
    comm = {}
    for recompute in ("none", "full"):
        prepared = prepare(write_scenario(etp_scenario(groups=node(count=2), tp=2, ep=8, etp=1,
                                                       global_batch=8, recompute=recompute)))
        run = run_policy(prepared, "megatron")
        est = estimate_iteration(run.plan, run.cluster, prepared.workload, prepared.compute)
        assert est.iteration_s == pytest.approx(run.result.iteration_time_s, rel=7e-3)
        comm[recompute] = run.result.breakdown_s["ep_comm"]
    assert comm["none"] > 0 and comm["full"] == pytest.approx(1.5 * comm["none"], rel=1e-9)


def test_plan_searches_expert_tp_and_exports_it(write_scenario):
    """`plan` tries expert TP 1 and TP for an MoE model, reports the chosen degree, and the
    export carries `--expert-tensor-parallel-size` as Megatron-LM's argument table reads it;
    Megatron-Core's `RankGenerator` takes the parsed value."""
    from holmes_sim.search import planner
    from holmes_sim.search.report import layout_label

    text = etp_scenario(groups=node(count=2), tp=2, ep=8, etp=None, global_batch=16) + (
        "search: {tensor: [2], pipeline: [1], expert: [8], micro_batch_size: [1], "
        "schedule: [1f1b], recompute: [none], sequence_parallel: [true], "
        "optimizer: [distributed], top_k: 2}\n")
    prepared = prepare(write_scenario(text))
    found = list(planner.layouts(prepared, prepared.scenario.search))
    assert sorted(lay.etp for lay in found) == [1, 2]
    result = planner.search(prepared, jobs=1)
    best = result.candidates[0]
    assert best.to_json()["etp"] == best.layout.etp
    folded = next(c for c in result.candidates if c.layout.etp == 1)
    assert "EP8 ETP1" in layout_label(folded)
    for layout, want in ((folded.layout, "1"), (next(lay for lay in found if lay.etp == 2), "2")):
        p = planner.prepared_for(prepared, layout)
        run = run_policy(p, "megatron")
        args = launch_files(run.plan, run.cluster, p.workload, "bf16").files["megatron_args.txt"]
        parsed = parse(shlex.split(args), UPSTREAM)
        assert parsed["--expert-tensor-parallel-size"] == [want]
        assert parsed["--expert-model-parallel-size"] == ["8"]
    state = pytest.importorskip("megatron.core.parallel_state")
    gen = state.RankGenerator(tp=int(want), ep=8, dp=16 // (8 * int(want)), pp=1, cp=1,
                              order="tp-cp-ep-dp-pp")
    assert sorted(g.ranks for g in run.plan.groups_of(GroupKind.EXPERT)) == \
        sorted(tuple(r) for r in gen.get_ranks("ep"))


def test_holmes_keeps_expert_tp_groups_of_ep_on_one_rdma_fabric(write_scenario):
    """Nodes IB, RoCE, IB, RoCE (8 GPUs each), TP 8, EP 4, expert TP 4: an EP group is 16
    consecutive ranks (ETP fastest), two nodes. Megatron's listing order puts an IB and a RoCE
    node in each (TCP over Ethernet); Holmes' NIC-aware order two nodes of one fabric (RDMA),
    8 micro-batches making the all-to-alls cost more than the expert-DP reductions."""
    from tests.sim.test_expert_parallel import _mixed_nodes

    prepared = prepare(write_scenario(etp_scenario(
        groups=_mixed_nodes(("ib", "roce", "ib", "roce")), tp=8, ep=4, etp=4, global_batch=32,
        policies="[megatron, holmes]")))
    megatron, _ = plan_policy(prepared, "megatron")
    holmes, _ = plan_policy(prepared, "holmes")
    assert sorted(g.ranks for g in megatron.groups_of(GroupKind.EXPERT))[:2] == [
        (0, 4, 8, 12), (1, 5, 9, 13)]
    assert {g.transport.kind for g in megatron.groups_of(GroupKind.EXPERT)} == {TransportKind.TCP}
    assert {str(g.transport) for g in holmes.groups_of(GroupKind.EXPERT)} == {"rdma:ib",
                                                                              "rdma:roce"}
    assert not any("EP group" in n for n in holmes.notes)


def test_expert_state_is_sharded_over_the_new_expert_data_parallel_group(write_scenario):
    """One node, TP 2, DP 4, EP 4, 4 MoE layers, distributed optimizer, bf16 with fp32
    gradients. Expert TP 2: a GPU holds 1/8 of the routed experts, expert-DP 1 (18 bytes a
    parameter); expert TP 1: 1/4, expert-DP 2 (6 + 12/2 = 12 bytes): 4 layers x X (12/4 - 18/8)
    = 3 X bytes more, X one layer's routed experts (8 x 3 h f_e). Expert TP 2 keeps the k = 2
    dispatched rows and probabilities of both its GPUs' tokens, expert TP 1 of its own
    (`Workload._moe_activation_terms`): s b h / t x 2k (h + 1)/h less a layer of the one
    micro-batch in flight. The rest of the memory is the same."""
    from holmes_sim.cost.ops import OpCosts
    from holmes_sim.metrics import memory_report

    peak = {}
    for etp in (None, 1):
        prepared = prepare(write_scenario(etp_scenario(groups=node(), tp=2, ep=4, etp=etp)))
        plan, cluster = plan_policy(prepared, "megatron")
        costs = OpCosts(cluster, prepared.workload, prepared.compute, plan.tp)
        peak[etp] = memory_report(plan, cluster, prepared.workload, costs).per_stage_bytes[0]
    rows = 4096 * 2048 / 2 * 2 * 2 * 2049 / 2048
    assert peak[1] - peak[None] == pytest.approx(3 * 8 * 3 * 2048 * 4096 - 4 * rows, rel=1e-6)
