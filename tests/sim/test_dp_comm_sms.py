"""The SMs NCCL's kernels hold while a data-parallel gradient reduction overlaps the backward:
the releasing backward's GEMMs run on sm_count - held SMs after its first bucket is released,
in the engine and the estimate alike."""

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
from holmes_sim.prepare import prepare_text
from holmes_sim.runner import plan_policy
from holmes_sim.sim.engine import simulate
from holmes_sim.sim.trace import OpKind


def _scenario(training: str = "", *, nodes: int = 2, tp: int = 1, pp: int = 1, layers: int = 4,
              batch: int = 64, nics: int = 8, schedule: str = "1f1b", virtual: int = 1,
              policy: str = "megatron") -> str:
    return f"""name: dp-sms
fabrics: [{{name: ib, type: ib}}]
clusters:
  - name: c
    nodes:
      - {{name: n, count: {nodes}, gpu: h100-sxm, gpus_per_node: 8, nics: [{{type: ib,
          bandwidth_gbit_per_s: 400, count: {nics}, fabric: ib, latency_us: 0}}]}}
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
    assert plan.releases_gradients_in_backward and node_comm_sms(node) == 16
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
    assert released_extra_s(costs.held_sm_loss_s(node, 4, True), f0) == \
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
