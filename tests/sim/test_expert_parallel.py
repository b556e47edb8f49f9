"""Expert parallelism end to end: the loader's checks, each policy's EP groups, the engine's
all-to-alls against their closed form on an idle fabric (NVLink, one NIC per rail, and a group
that must leave RDMA), and the estimate against the engine."""

from __future__ import annotations

import pytest

from holmes_sim.cost.expert_parallel import op_exposed_s, token_bytes
from holmes_sim.errors import PlanError, ScenarioError
from holmes_sim.estimate.analytic import estimate_iteration
from holmes_sim.plan import GroupKind, TransportKind
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy, run_policy
from holmes_sim.sim.trace import OpKind

NODE = ("      - {{name: {name}, count: {count}, gpu: h100-sxm, gpus_per_node: 8, nics: "
        "[{{type: {fabric}, bandwidth_gbit_per_s: {gbit}, count: {nics}, fabric: {fabric}, "
        "latency_us: 5}}, {{type: ethernet, bandwidth_gbit_per_s: 100}}]}}")


def node(name="n", count=1, fabric="ib", gbit=200, nics=8) -> str:
    return NODE.format(name=name, count=count, fabric=fabric, gbit=gbit, nics=nics)


def ep_scenario(*, groups: str, tp: int = 1, pp: int = 1, ep: int = 8, experts: int = 8,
                layers: int = 4, global_batch: int = 8, policies: str = "[megatron]",
                moe: bool = True, routing: str = "even", recompute: str = "none") -> str:
    """An MoE scenario routed `even` by default (every expert its share), so the closed forms
    of the tests below hold exactly."""
    moe_fields = (f", num_experts: {experts}, moe_router_topk: 2, moe_ffn_hidden_size: 4096, "
                  f"moe_routing: {routing}" if moe else "")
    return f"""name: ep
fabrics:
  - {{name: ib, type: ib}}
  - {{name: roce, type: roce}}
clusters:
  - name: c
    nodes:
{groups}
model: {{num_layers: {layers}, hidden_size: 2048, num_attention_heads: 16, seq_length: 4096,
        vocab_size: 32000, tie_embeddings: false, swiglu: true, bias: false{moe_fields}}}
training: {{global_batch_size: {global_batch}, micro_batch_size: 1, flash_attention: true,
           sequence_parallel: {str(tp > 1).lower()}, recompute: {recompute}}}
parallel: {{tensor: {tp}, pipeline: {pp}, expert: {ep}}}
policies: {policies}
"""


@pytest.mark.parametrize("fields,words", [
    (dict(moe=False), ["parallel.expert", "model.num_experts"]),
    (dict(ep=4, experts=6), ["parallel.expert", "divide model.num_experts=6"]),
    (dict(ep=8, experts=16, tp=2), ["parallel.expert", "data x context = 4"]),
])
def test_bad_expert_degrees_name_the_field_and_fix(write_scenario, fields, words):
    with pytest.raises(ScenarioError) as info:
        prepare(write_scenario(ep_scenario(groups=node(), **fields)))
    assert all(w in str(info.value) for w in words), str(info.value)


def test_ep_groups_are_runs_of_consecutive_replicas(write_scenario):
    """16 GPUs, TP 2 PP 2 DP 4 EP 2: Megatron-Core's expert ranks "tp-ep-dp-pp" (TP fastest,
    then EP over the data-parallel replicas); DP gradients still over all replicas."""
    prepared = prepare(write_scenario(ep_scenario(groups=node(count=2), tp=2, pp=2, ep=2)))
    plan, _ = plan_policy(prepared, "megatron")
    assert sorted(g.ranks for g in plan.groups_of(GroupKind.EXPERT)) == [
        (0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)]
    assert sorted(g.ranks for g in plan.groups_of(GroupKind.DATA))[0] == (0, 2, 4, 6)
    # Expert-data-parallel: replicas r, r + ep of each stage and TP rank (the same experts).
    assert sorted(g.ranks for g in plan.groups_of(GroupKind.EXPERT_DATA)) == [
        (0, 4), (1, 5), (2, 6), (3, 7), (8, 12), (9, 13), (10, 14), (11, 15)]


def test_policies_without_megatron_core_refuse_ep(write_scenario):
    prepared = prepare(write_scenario(ep_scenario(groups=node(), ep=2,
                                                  policies="[megatron-deepspeed]")))
    with pytest.raises(PlanError, match="model: this framework has no Megatron-Core mixture-of-"
                                        "experts layers.*use policy megatron or holmes"):
        plan_policy(prepared, "megatron-deepspeed")


def _mixed_nodes(order: tuple[str, ...]) -> str:
    return "\n".join(node(name=f"n{i}", fabric=f, nics=1) for i, f in enumerate(order))


def test_holmes_keeps_ep_groups_on_one_rdma_fabric_and_notes_the_rest(write_scenario):
    """Nodes IB, RoCE, IB, RoCE, TP 8, EP 2: Megatron's listing order pairs IB with RoCE (TCP);
    Holmes' NIC-aware order pairs like nodes (8 micro-batches: the all-to-alls cost more than
    the expert-DP reductions that then cross, `tests/test_nic_order.py`). With three IB nodes
    and one RoCE node one group must cross, which the plan notes."""
    prepared = prepare(write_scenario(ep_scenario(
        groups=_mixed_nodes(("ib", "roce", "ib", "roce")), tp=8, ep=2, global_batch=32,
        policies="[megatron, holmes]")))
    megatron, _ = plan_policy(prepared, "megatron")
    holmes, _ = plan_policy(prepared, "holmes")
    assert {g.transport.kind for g in megatron.groups_of(GroupKind.EXPERT)} == {TransportKind.TCP}
    assert {str(g.transport) for g in holmes.groups_of(GroupKind.EXPERT)} == {"rdma:ib",
                                                                              "rdma:roce"}
    odd = prepare(write_scenario(ep_scenario(groups=_mixed_nodes(("ib", "ib", "ib", "roce")),
                                             tp=8, ep=4, policies="[holmes]", global_batch=8)))
    plan, _ = plan_policy(odd, "holmes")
    assert any("EP group(s) span NIC classes" in n for n in plan.notes), plan.notes


def _engine_and_oracle(prepared, rate_per_gpu: float, latency: float, exchanges: int = 2):
    """The engine's `ep-comm` seconds on s0.d0 and the closed form of `exchanges` exchanges
    (dispatch and combine of every layer) per micro-batch: a forward's and a backward's."""
    out = run_policy(prepared, "megatron")
    waits = sum(r.duration_s for r in out.trace.records
                if r.kind is OpKind.EP_COMM and r.entity == "s0.d0")
    w, tp = prepared.workload, prepared.tp
    per_pass = op_exposed_s(w, tp, w.ep, w.num_layers, rate_per_gpu, latency)
    return out, waits, exchanges * per_pass * prepared.num_microbatches


def test_alltoall_over_nvlink_equals_its_closed_form(write_scenario):
    """EP 8 inside one node: each GPU's 7 sends share its NVLink port."""
    prepared = prepare(write_scenario(ep_scenario(groups=node(), ep=8)))
    link = prepared.cluster.nodes[0].intra_link
    out, waits, expect = _engine_and_oracle(prepared, link.bandwidth_bytes_per_s * link.efficiency,
                                            link.latency_s)
    assert expect > 0 and waits == pytest.approx(expect, rel=0.02)
    assert out.result.breakdown_s["ep_comm"] == pytest.approx(expect, rel=0.02)


@pytest.mark.parametrize("gbit", [50, 400])
def test_alltoall_across_nodes_per_rail_equals_its_closed_form(write_scenario, gbit):
    """TP 8 fills each of 4 nodes and EP 4 spans them: GPU i sends to GPU i of the other nodes
    over its own rail NIC, whose capacity its 3 sends share."""
    prepared = prepare(write_scenario(ep_scenario(groups=node(count=4, gbit=gbit), tp=8, ep=4,
                                                  global_batch=4)))
    nic = prepared.cluster.nodes[0].nics[0]
    _, waits, expect = _engine_and_oracle(prepared, nic.effective_bandwidth_bytes_per_s,
                                          nic.latency_s)
    assert expect > 0 and waits == pytest.approx(expect, rel=0.02)


@pytest.mark.parametrize("recompute,exchanges", [("none", 2), ("selective", 2), ("full", 3)])
def test_full_recompute_redoes_the_forward_alltoalls_in_the_backward(write_scenario, recompute,
                                                                      exchanges):
    """Megatron-Core's full recomputation re-runs each whole layer in the backward
    (megatron/core/recompute.py `checkpointed_forward`), the MoE layer's dispatch and combine
    included: a backward has 4 all-to-alls per MoE layer, not 2, so ep_comm is 1.5x that
    without recomputation. Selective recomputation's default modules (core_attn) redo none.
    Engine and estimate agree (one stage, nothing else on the rails)."""
    prepared = prepare(write_scenario(ep_scenario(groups=node(count=4), tp=8, ep=4,
                                                  global_batch=4, recompute=recompute)))
    nic = prepared.cluster.nodes[0].nics[0]
    out, waits, expect = _engine_and_oracle(prepared, nic.effective_bandwidth_bytes_per_s,
                                            nic.latency_s, exchanges)
    assert expect > 0 and waits == pytest.approx(expect, rel=0.02)
    assert out.result.breakdown_s["ep_comm"] == pytest.approx(expect, rel=0.02)
    est = estimate_iteration(out.plan, out.cluster, prepared.workload, prepared.compute)
    assert est.iteration_s == pytest.approx(out.result.iteration_time_s, rel=1e-3)


def test_alltoall_across_nic_classes_runs_at_the_shared_ethernet_nic(write_scenario):
    """An IB node and a RoCE node share no RDMA fabric: EP 2 with TP 8 runs over each node's one
    Ethernet NIC, which the node's 8 GPUs share (the group's slowest path)."""
    prepared = prepare(write_scenario(ep_scenario(groups=_mixed_nodes(("ib", "roce")), tp=8,
                                                  ep=2, global_batch=2)))
    eth = prepared.cluster.nodes[0].nics[-1]
    assert eth.kind == "ethernet" if hasattr(eth, "kind") else True
    _, waits, expect = _engine_and_oracle(prepared, eth.effective_bandwidth_bytes_per_s / 8,
                                          eth.latency_s)
    assert expect > 0 and waits == pytest.approx(expect, rel=0.02)


@pytest.mark.parametrize("tp,ep,count", [(1, 8, 1), (8, 4, 4), (2, 4, 1)])
def test_estimate_equals_the_engine_without_contention(write_scenario, tp, ep, count):
    """One stage, gradients reduced after the backward: nothing shares a link with the
    all-to-alls, so the estimate's contended rates equal the engine's flows."""
    prepared = prepare(write_scenario(ep_scenario(groups=node(count=count), tp=tp, ep=ep,
                                                  global_batch=8)))
    out = run_policy(prepared, "megatron")
    est = estimate_iteration(out.plan, out.cluster, prepared.workload, prepared.compute)
    assert out.result.breakdown_s["ep_comm"] > 0
    assert est.iteration_s == pytest.approx(out.result.iteration_time_s, rel=1e-3)


def test_expert_weights_and_rows_divide_by_ep(write_scenario):
    """A GPU holds E/ep experts (memory, main-gradient adds) and with a balanced router
    processes the same M k rows; its all-to-all bytes are its M/t tokens' k copies."""
    one = prepare(write_scenario(ep_scenario(groups=node(), ep=1)))
    eight = prepare(write_scenario(ep_scenario(groups=node(), ep=8)))
    w1, w8 = one.workload, eight.workload
    expert = 3 * 2048 * 4096  # SwiGLU fc1 (2 f h) and fc2 (f h), no bias
    assert w1.layer_params - w8.layer_params == 7 * expert
    assert w8.moe.rank_rows(4096, 8) == w1.moe.routed_rows(4096) == 4096 * 2
    assert token_bytes(w8, 1) == 4096 * 2 * 2048 * 2


def test_plan_searches_ep_and_exports_it(write_scenario):
    """`search.expert` lists EP degrees; those that do not divide a layout's replicas are
    skipped there (one that fits no layout is refused: tests/search/test_search_causes.py);
    the best plan's export carries `--expert-model-parallel-size` as Megatron-LM's argument
    table reads it."""
    import shlex

    from holmes_sim.export.launch import launch_files
    from holmes_sim.search import planner
    from tests.export.test_launch_targets import UPSTREAM, parse

    text = ep_scenario(groups=node(count=2), ep=1, global_batch=16) + (
        "search: {tensor: [1, 2], pipeline: [1, 2], expert: [1, 2, 8], "
        "micro_batch_size: [1], schedule: [1f1b], recompute: [none], "
        "sequence_parallel: [true], optimizer: [distributed], top_k: 2}\n")
    prepared = prepare(write_scenario(text))
    found = list(planner.layouts(prepared, prepared.scenario.search))
    got = {(lay.tp, lay.pp, lay.ep) for lay in found if lay.etp == lay.tp}
    # 16 GPUs, 8 experts: EP 8 at expert TP = TP not TP 2 x PP 2's 4 replicas
    assert got == {(tp, pp, ep) for tp in (1, 2) for pp in (1, 2) for ep in (1, 2, 8)
                   if 16 // (tp * pp) % ep == 0}
    assert (2, 2, 8) not in got and (2, 1, 8) in got
    # expert TP 1 at TP 2 folds EP 8 into a stage's 8 ranks; EP 1 cannot take it
    folded = {(lay.tp, lay.pp, lay.ep) for lay in found if lay.etp != lay.tp}
    assert folded == {(2, 1, 2), (2, 1, 8), (2, 2, 2), (2, 2, 8)}
    p = planner.prepared_for(prepared, planner.Layout(2, 1, 8, 1, "1f1b", 1, "none", True, ep=8))
    assert p.workload.ep == 8 and p.scenario.parallel.expert == 8
    out = run_policy(p, "megatron")
    args = launch_files(out.plan, out.cluster, p.workload, "bf16").files["megatron_args.txt"]
    assert parse(shlex.split(args), UPSTREAM)["--expert-model-parallel-size"] == ["8"]


def test_bundled_moe_scenario_holmes_keeps_the_all_to_alls_on_rdma():
    """scenarios/moe_mixed_nics.yaml: Megatron's listing order mixes IB and RoCE nodes in every
    EP group (TCP over Ethernet); Holmes' keeps each on one RDMA fabric, and the breakdown's
    ep_comm carries most of the difference. The Holmes fork cannot express the MoE flags."""
    from holmes_sim.export.launch import launch_files
    from tests.conftest import SCENARIOS

    prepared = prepare(SCENARIOS / "moe_mixed_nics.yaml")
    assert prepared.workload.ep == 4
    runs = {p: run_policy(prepared, p) for p in ("megatron", "holmes")}
    ep = {p: {g.transport.kind for g in o.plan.groups_of(GroupKind.EXPERT)}
          for p, o in runs.items()}
    assert ep == {"megatron": {TransportKind.TCP}, "holmes": {TransportKind.RDMA}}
    mega, holmes = (runs[p].result for p in ("megatron", "holmes"))
    assert holmes.iteration_time_s < mega.iteration_time_s
    saved = mega.breakdown_s["ep_comm"] - holmes.breakdown_s["ep_comm"]
    assert saved > 0.5 * (mega.iteration_time_s - holmes.iteration_time_s)
    files = launch_files(runs["holmes"].plan, runs["holmes"].cluster, prepared.workload,
                         "bf16").files
    assert "--expert-model-parallel-size 4" in files["megatron_args.txt"]
    assert files["holmes_args.txt"].startswith("# not expressible") and \
        "--moe-ffn-hidden-size" in files["holmes_args.txt"]


def _reduce_scatters(out, entity: str = "s0.d0"):
    return [r for r in out.trace.records
            if r.kind is OpKind.DP_REDUCE_SCATTER and r.entity == entity]


def test_with_dp_equal_to_ep_only_dense_gradients_are_reduced(write_scenario):
    """DP 8 = EP 8 on one node: each replica holds its own experts (expert-data-parallel groups
    of one, `expert_parallel_buffers` of Megatron-Core's DDP), so the reduce-scatter moves
    7/8 of the dense gradients only: the EP 1 model's parameters less its 8 routed experts
    per layer; no expert-data-parallel group exists, and the experts' optimizer state is not
    sharded: the distributed optimizer saves 16 - (4 + 12/8) bytes of each dense parameter
    only."""
    text = ep_scenario(groups=node(), ep=8)
    one = prepare(write_scenario(ep_scenario(groups=node(), ep=1)))
    eight = prepare(write_scenario(text))
    replicated = prepare(write_scenario(text.replace("flash_attention: true,", "flash_attention: "
                                                     "true, distributed_optimizer: false,")))
    out = run_policy(eight, "megatron")
    assert not out.plan.groups_of(GroupKind.EXPERT_DATA)
    w = eight.workload
    routed = 4 * 8 * 3 * 2048 * 4096  # 4 MoE layers of 8 SwiGLU experts, no bias
    assert 4 * w.expert_layer_params == routed // 8
    dense = one.workload.total_params - routed
    moved = sum(r.bytes for r in _reduce_scatters(out))
    assert moved == pytest.approx(7 / 8 * w.grad_bytes_of(dense), rel=1e-12)
    saved = run_policy(replicated, "megatron").result.memory.per_stage_bytes[0] - \
        out.result.memory.per_stage_bytes[0]
    assert saved == pytest.approx(dense * (16 - 4 - 12 / 8), rel=1e-9)


def test_with_dp_twice_ep_expert_gradients_go_over_a_ring_of_two(write_scenario):
    """TP 8 on each of 4 nodes (one NIC per rail), DP 4, EP 2: dense gradients are
    reduce-scattered over the 4 replicas, the routed experts' over replicas {0, 2} and {1, 3}.
    Both streams start after the backward and leave every GPU by its rail NIC, which stays
    busy until both end: the reduce-scatters take (3/4 D + 1/2 X) / (8 r) (D dense and X
    expert gradient bytes of the TP group, r a NIC's rate), to 2%, where one ring of 4 for all
    would move 3/4 (D + X). The estimate adds the two streams' times likewise (2%)."""
    prepared = prepare(write_scenario(ep_scenario(groups=node(count=4), tp=8, ep=2,
                                                  global_batch=4)))
    out = run_policy(prepared, "megatron")
    w = prepared.workload
    groups = out.plan.groups_of(GroupKind.EXPERT_DATA)
    assert len(groups) == 2 * 8 and {len(g.ranks) for g in groups} == {2}
    routed = 4 * 8 * 3 * 2048 * 4096  # 4 MoE layers of 8 SwiGLU experts, no bias
    expert = w.grad_bytes_of(routed // 2)  # a GPU's TP group holds 4 of the 8
    dense = w.grad_bytes_of(w.total_params - routed)
    assert 2 * expert > dense > 0
    records = _reduce_scatters(out)
    assert sum(r.bytes for r in records) == pytest.approx(3 / 4 * dense + 1 / 2 * expert,
                                                          rel=1e-12)
    nic = prepared.cluster.nodes[0].nics[0]
    span = max(r.end_s for r in records) - min(r.start_s for r in records)
    expect = (3 / 4 * dense + 1 / 2 * expert) / (8 * nic.effective_bandwidth_bytes_per_s)
    assert span == pytest.approx(expect, rel=0.02)
    assert span < 0.9 * 3 / 4 * (dense + expert) / (8 * nic.effective_bandwidth_bytes_per_s)
    est = estimate_iteration(out.plan, out.cluster, w, prepared.compute)
    assert est.iteration_s == pytest.approx(out.result.iteration_time_s, rel=0.02)


@pytest.mark.parametrize("flags", ["", "overlap_grad_reduce: true,",
                                   "overlap_grad_reduce: true, overlap_param_gather: true,"])
def test_estimate_follows_the_engine_with_two_gradient_streams(write_scenario, flags):
    """DP 4, EP 2: the dense and the expert buckets run on their own streams through the same
    rail NICs, reduced after the backward, during it, or gathered before the next forward; the
    estimate shares the link between the two streams (`shared_link_ends`) and stays within 1%
    of the engine."""
    text = ep_scenario(groups=node(count=4), tp=8, ep=2, global_batch=8)
    prepared = prepare(write_scenario(text.replace("flash_attention: true,",
                                                   f"flash_attention: true, {flags}")))
    out = run_policy(prepared, "megatron")
    est = estimate_iteration(out.plan, out.cluster, prepared.workload, prepared.compute)
    assert est.iteration_s == pytest.approx(out.result.iteration_time_s, rel=0.01)


def test_two_streams_share_one_link_equally():
    """Processor sharing of two streams: alone a stream runs at the link's rate, together each
    at half; a job waits for its release and for its stream's previous job."""
    from holmes_sim.estimate.bucket_streams import shared_link_ends

    assert shared_link_ends(([(0.0, 1.0), (0.0, 1.0)], [(0.0, 3.0)])) == [[2.0, 4.0], [5.0]]
    assert shared_link_ends(([(0.0, 1.0)], [(5.0, 1.0)])) == [[1.0], [6.0]]
    assert shared_link_ends(([(0.0, 2.0)], [(1.0, 1.0)])) == [[3.0], [3.0]]
