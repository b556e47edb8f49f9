"""The SMs NCCL's kernels hold while a data-parallel gradient reduction overlaps the backward:
the releasing backward's GEMMs run on sm_count - held SMs after its first bucket is released,
in the engine and the estimate alike; held by the node's NICs on the network the reducing
group's transport uses."""

from __future__ import annotations

import dataclasses

import pytest

from holmes_sim.cost.compute import KernelCompute
from holmes_sim.cost.gemm import Gemm, gemm_time_s
from holmes_sim.cost.ops import OpCosts, node_comm_sms, released_extra_s
from holmes_sim.cost.transformer import layer_kernels, nccl_comm_sms
from holmes_sim.estimate.analytic import estimate_iteration
from holmes_sim.estimate.op_table import full_op_table, op_table
from holmes_sim.estimate.walk import walk, walk_plain
from holmes_sim.plan import GroupKind, Transport, TransportKind
from holmes_sim.prepare import prepare_text
from holmes_sim.runner import plan_policy
from holmes_sim.sim.engine import simulate
from holmes_sim.sim.trace import OpKind


def _scenario(training: str = "", *, nodes: int = 2, tp: int = 1, pp: int = 1, layers: int = 4,
              batch: int = 64, nics: int = 8, schedule: str = "1f1b", virtual: int = 1,
              policy: str = "megatron", nic_list: str | None = None) -> str:
    nic_list = nic_list or (f"[{{type: ib, bandwidth_gbit_per_s: 400, count: {nics}, fabric: ib, "
                            "latency_us: 0}]")
    return f"""name: dp-sms
fabrics: [{{name: ib, type: ib}}, {{name: roce, type: roce}}]
clusters:
  - name: c
    nodes:
      - {{name: n, count: {nodes}, gpu: h100-sxm, gpus_per_node: 8, nics: {nic_list}}}
model: {{num_layers: {layers}, hidden_size: 4096, num_attention_heads: 32, seq_length: 2048,
        vocab_size: 51200, tie_embeddings: false}}
training: {{global_batch_size: {batch}, micro_batch_size: 1{training}}}
parallel: {{tensor: {tp}, pipeline: {pp}, schedule: {schedule}, virtual_stages: {virtual}}}
policies: [{policy}]
"""


OVERLAP = ", distributed_optimizer: true, overlap_grad_reduce: true, bucket_size_mb: 40"


def _run(text: str, policy: str = "megatron"):
    prepared = prepare_text(text)
    plan, cluster = plan_policy(prepared, policy)
    trace = simulate(plan, cluster, prepared.workload, prepared.compute)
    est = estimate_iteration(plan, cluster, prepared.workload, prepared.compute).iteration_s
    return prepared, plan, cluster, trace, est


def test_sms_held_follow_the_nics_as_nccl_689_gives_them():
    """2 SMs for one NIC, 16 for a DGX's 8, 2 per NIC between, never more than 16."""
    assert [nccl_comm_sms(n) for n in (1, 2, 4, 8, 16)] == [2, 4, 8, 16, 16]


def _hand_loss(gpu, w, tp: int, held: int) -> float:
    """A one-chunk stage's backward loss by hand: every backward GEMM of each layer and of the
    output layer at sm_count - held SMs minus at sm_count."""
    k = layer_kernels(w, tp)
    layer = [x for g in k.dense for x in g.backward()] + [x for g in k.attention for x in g.backward()]
    head = list(Gemm(w.micro_batch * w.seq, w.vocab // tp, w.hidden).backward())
    return sum(gemm_time_s(gpu, g, reserved_sms=held) - gemm_time_s(gpu, g)
               for g in layer * w.num_layers + head)


def test_the_releasing_backward_takes_the_closed_form_extra():
    """One stage, DP 16: the last backward releases its buckets and runs every share after
    the first beside their reductions, each GEMM on 132 - 16 SMs: it takes the other
    backwards' time plus (1 - f0) x the hand loss, f0 the share before the first bucket."""
    prepared, plan, cluster, trace, est = _run(_scenario(OVERLAP))
    node, w = cluster.nodes[0], prepared.workload
    dp = (plan.transport_of(GroupKind.DATA, 0),)
    assert plan.releases_gradients_in_backward and node_comm_sms(node, dp) == 16
    costs = OpCosts(cluster, w, prepared.compute, 1)
    f0 = costs.first_release_fraction(plan.layers_per_stage, 0, False, True,
                                      plan.bucket_numel(0, w.given_bucket_numel))
    loss = _hand_loss(node.gpu, w, 1, 16)
    assert 0 < f0 < 1 and loss > 0
    rows = [r for r in trace.records if r.entity == "s0.d0" and r.kind is OpKind.BACKWARD]
    per_mb = {}
    for r in rows:
        per_mb[r.microbatch] = per_mb.get(r.microbatch, 0.0) + r.end_s - r.start_s
    last = plan.num_microbatches - 1
    assert per_mb[last] - per_mb[0] == pytest.approx((1 - f0) * loss, rel=1e-9)
    assert released_extra_s(costs.held_sm_loss_s(node, dp, 4, True), f0) == \
        pytest.approx((1 - f0) * loss, rel=1e-12)
    assert est == pytest.approx(trace.iteration_s, rel=1e-9)


class _Unheld(KernelCompute):
    """The kernel model with no SMs lost beside collectives."""

    def held_sm_loss_s(self, gpu, workload, tp, held):
        return 0.0, 0.0


def _without_loss(prepared):
    return dataclasses.replace(prepared, compute=_Unheld())


@pytest.mark.parametrize("training, kw, policy", [
    (OVERLAP, {}, "megatron"),
    (OVERLAP + ", overlap_param_gather: true", {}, "megatron"),
    (", overlap_grad_reduce: true, bucket_size_mb: 40", dict(pp=2), "megatron"),
    (OVERLAP, dict(pp=2, nics=1), "megatron"),
    (OVERLAP, dict(tp=2, pp=2, nics=4), "megatron"),
    ("", dict(pp=2), "megatron-llama"),
])
def test_engine_and_estimate_agree_and_the_loss_only_slows(training, kw, policy):
    """Engine == estimate (1e-9) with the held SMs; priced at zero both are faster."""
    text = _scenario(training, policy=policy, **kw)
    prepared, plan, cluster, trace, est = _run(text, policy)
    assert est == pytest.approx(trace.iteration_s, rel=1e-9)
    assert plan.releases_gradients_in_backward
    free = _without_loss(prepared)
    base = simulate(plan, cluster, free.workload, free.compute).iteration_s
    assert base < trace.iteration_s
    assert estimate_iteration(plan, cluster, free.workload, free.compute).iteration_s == \
        pytest.approx(base, rel=1e-9)


@pytest.mark.parametrize("kw", [dict(pp=2, layers=8, schedule="interleaved", virtual=2),
                                dict(pp=4, layers=8)])
def test_where_contention_parts_them_the_held_sms_move_both_alike(kw):
    """Interleaved and four stages over two nodes: pipeline sends share NICs with the DP rings,
    so the engine and the estimate differ; the held SMs add the same seconds to both."""
    prepared, plan, cluster, trace, est = _run(_scenario(OVERLAP, **kw))
    free = _without_loss(prepared)
    engine = trace.iteration_s - simulate(plan, cluster, free.workload, free.compute).iteration_s
    estimate = est - estimate_iteration(plan, cluster, free.workload, free.compute).iteration_s
    assert engine > 0 and estimate == pytest.approx(engine, rel=1e-6)


def test_nothing_changes_without_an_overlapped_reduction():
    """No gradient released in the backward: the held SMs cost nothing."""
    for training in (", distributed_optimizer: true", ""):
        prepared, plan, cluster, trace, est = _run(_scenario(training))
        assert not plan.releases_gradients_in_backward
        free = _without_loss(prepared)
        assert simulate(plan, cluster, free.workload, free.compute).iteration_s == \
            trace.iteration_s
        assert estimate_iteration(plan, cluster, free.workload, free.compute).iteration_s == est


IB, ROCE = ("{type: ib, bandwidth_gbit_per_s: 200, count: 4, fabric: ib, latency_us: 0}",
            "{type: roce, bandwidth_gbit_per_s: 200, count: 8, fabric: roce, latency_us: 0}")
ETH = "{type: ethernet, bandwidth_gbit_per_s: 100, count: 2}"


def test_the_sms_follow_the_nics_of_the_network_the_group_reduces_over():
    """A node with 4 IB, 8 RoCE and 2 Ethernet NICs: RDMA on IB holds 8 SMs, on RoCE 16, TCP
    (over Ethernet) 4; a group within the node by its first RDMA fabric; with the experts'
    group beside the DP group the most of the two; none without a group."""
    node = prepare_text(_scenario(nodes=1, nic_list=f"[{IB}, {ROCE}, {ETH}]")).cluster.nodes[0]
    ib, roce = Transport(TransportKind.RDMA, "ib"), Transport(TransportKind.RDMA, "roce")
    tcp, local = Transport(TransportKind.TCP, "ethernet"), Transport(TransportKind.LOCAL)
    assert [node_comm_sms(node, (t,)) for t in (ib, roce, tcp, local)] == [8, 16, 4, 8]
    assert node_comm_sms(node, (tcp, roce)) == node_comm_sms(node, (roce, tcp)) == 16
    assert node_comm_sms(node, ()) == 0


def _unused_ib(moe: bool, ib_on_last: bool) -> str:
    """Four Ethernet-only nodes, TP 1 PP 2 (MoE: EP 4 with expert-data-parallel groups of 8),
    gradients reduced in the backward; the last node also on an IB fabric none of the others
    reaches (`ib_on_last`), so every DP group still runs over TCP."""
    last = f"[{IB}, {ETH}]" if ib_on_last else f"[{ETH}]"
    moe_fields = ", swiglu: true, num_experts: 8, moe_router_topk: 2, moe_ffn_hidden_size: " \
        "1024, moe_routing: even" if moe else ""
    return f"""name: unused-ib
fabrics: [{{name: ib, type: ib}}]
clusters:
  - name: lab
    nodes:
      - {{name: n, count: 3, gpu: a100-80gb, nics: [{ETH}]}}
      - {{name: x, count: 1, gpu: a100-80gb, nics: {last}}}
model: {{num_layers: 8, hidden_size: 2048, num_attention_heads: 16, seq_length: 2048,
        vocab_size: 32000{moe_fields}}}
training: {{global_batch_size: 64, micro_batch_size: 2{OVERLAP}}}
parallel: {{tensor: 1, pipeline: 2, schedule: 1f1b, expert: {4 if moe else 1}}}
policies: [megatron, holmes]
"""


@pytest.mark.parametrize("policy", ["holmes", "megatron"])
@pytest.mark.parametrize("moe", [False, True])
def test_nics_no_group_can_use_change_nothing(policy, moe):
    """IB NICs on one node, a fabric no other node shares: every DP (and expert-data-parallel)
    group reduces over TCP through the same 2 Ethernet NICs, NCCL holds the same 4 SMs, and
    the engine and the estimate give the iteration time without those NICs, bit for bit."""
    times = []
    for ib_on_last in (False, True):
        prepared, plan, cluster, trace, est = _run(_unused_ib(moe, ib_on_last), policy)
        assert plan.releases_gradients_in_backward
        kinds = (GroupKind.DATA, GroupKind.EXPERT_DATA) if moe else (GroupKind.DATA,)
        assert {g.transport.kind for g in plan.groups if g.kind in kinds} == {TransportKind.TCP}
        assert bool(plan.groups_of(GroupKind.EXPERT_DATA)) is moe
        times.append((trace.iteration_s, est))
    assert times[0] == times[1]


@pytest.mark.parametrize("policy, fabric, held", [("megatron", "ib", 8), ("holmes", "roce", 16)])
def test_each_policy_holds_the_sms_of_the_fabric_its_group_uses(policy, fabric, held):
    """Two nodes on IB (4 NICs, declared first) and RoCE (8 NICs): Megatron-LM's job-wide
    setting reduces over the first fabric, Holmes over the faster RoCE; the releasing
    backward's extra time is the closed form's with 2 SMs per NIC of that fabric."""
    prepared, plan, cluster, trace, est = _run(
        _scenario(OVERLAP, policy=policy, nic_list=f"[{IB}, {ROCE}]"), policy)
    node, w = cluster.nodes[0], prepared.workload
    dp = plan.transport_of(GroupKind.DATA, 0)
    assert dp == Transport(TransportKind.RDMA, fabric) and node_comm_sms(node, (dp,)) == held
    f0 = OpCosts(cluster, w, prepared.compute, 1).first_release_fraction(
        plan.layers_per_stage, 0, False, True, plan.bucket_numel(0, w.given_bucket_numel))
    per_mb = {}
    for r in trace.records:
        if r.entity == "s0.d0" and r.kind is OpKind.BACKWARD:
            per_mb[r.microbatch] = per_mb.get(r.microbatch, 0.0) + r.end_s - r.start_s
    assert per_mb[plan.num_microbatches - 1] - per_mb[0] == \
        pytest.approx((1 - f0) * _hand_loss(node.gpu, w, 1, held), rel=1e-9)
    assert est == pytest.approx(trace.iteration_s, rel=1e-9)


@pytest.mark.parametrize("kind, p, m, v", [("1f1b", 4, 64, 1), ("1f1b", 1, 8, 1),
                                           ("interleaved", 4, 32, 2), ("gpipe", 3, 6, 1)])
def test_released_tables_walk_as_the_plain_walk(kind, p, m, v):
    """The released kinds (each stage's last backward of each chunk) run at their own times;
    with the plain backward's times the walk is the plain table's; the jump agrees with the
    op-by-op walk."""
    plain, released = op_table(kind, p, m, v), op_table(kind, p, m, v, True)
    assert [len(k) for k in released.kinds] == [len(k) + v for k in plain.kinds]
    durs = [[1e-3 * (1 + j) * (2 if b else 1) for j, b in kinds] for kinds in released.kinds]
    sends = [1e-4] * len(plain.sends)
    start = [0.0] * p
    same = walk(released, durs, sends, start)
    assert same == pytest.approx(walk(plain, [d[:2 * v] for d in durs], sends, start), rel=1e-12)
    slower = [d[:2 * v] + [x + 5e-4 for x in d[2 * v:]] for d in durs]
    assert walk(released, slower, sends, start) == \
        pytest.approx(walk_plain(released, slower, sends, start), rel=1e-12)
    full = full_op_table(kind, p, m, v, True)
    assert sum(op[0] >= 2 * v for row in full.rows for op in row) == p * v
    assert max(walk(released, slower, sends, start)) > max(same)
