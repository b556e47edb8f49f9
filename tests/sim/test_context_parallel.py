"""Context parallelism end to end: the rank order Megatron-Core builds, each policy's CP groups,
the engine's CP ring against its closed form on an idle fabric, and the estimate against the
engine."""

from __future__ import annotations

import pytest

from holmes_sim.cost.context_parallel import kv_chunk_bytes
from holmes_sim.cost.transformer import attention_core_s, layer_kernels
from holmes_sim.errors import PlanError
from holmes_sim.estimate.analytic import estimate_iteration
from holmes_sim.plan import GroupKind, TransportKind, megatron_cp_rank
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy, run_policy
from holmes_sim.sim.trace import OpKind

NIC = "{{type: ib, bandwidth_gbit_per_s: {gbit}, count: 1, fabric: ib, latency_us: 5}}"


def cp_scenario(*, nodes: int = 4, gpus: int = 8, tp: int = 8, pp: int = 1, cp: int = 4,
                comm: str = "p2p", gbit: float = 200, seq: int = 8192, layers: int = 4,
                global_batch: int = 2, groups: str | None = None, policies: str = "[megatron]",
                extra_training: str = "") -> str:
    """YAML of one IB cluster (or the node `groups` given) running CP `cp`."""
    nic = NIC.format(gbit=gbit)
    groups = groups or (f"      - {{name: n, count: {nodes}, gpu: h100-sxm, gpus_per_node: {gpus}, "
                        f"nics: [{nic}, {{type: ethernet, bandwidth_gbit_per_s: 100}}]}}")
    return f"""name: cp
fabrics:
  - {{name: ib, type: ib}}
  - {{name: roce, type: roce}}
clusters:
  - name: c
    nodes:
{groups}
model: {{num_layers: {layers}, hidden_size: 4096, num_attention_heads: 32, num_query_groups: 8,
        seq_length: {seq}, vocab_size: 32000, tie_embeddings: false}}
training: {{global_batch_size: {global_batch}, micro_batch_size: 1, flash_attention: true{extra_training}}}
parallel: {{tensor: {tp}, pipeline: {pp}, context: {cp}, cp_comm_type: {comm}}}
policies: {policies}
"""


def test_rank_order_is_megatrons_tp_cp_dp_pp(write_scenario):
    """16 GPUs, TP 2 CP 2 DP 2 PP 2: Megatron-Core's RankGenerator with order "tp-cp-ep-dp-pp"
    makes these groups (written out from the rule: TP fastest, then CP, then DP, then PP)."""
    prepared = prepare(write_scenario(cp_scenario(nodes=2, tp=2, pp=2, cp=2, global_batch=4)))
    assert (prepared.tp, prepared.pp, prepared.dp, prepared.cp) == (2, 2, 2, 2)
    plan, _ = plan_policy(prepared, "megatron")

    def ranks(kind):
        return sorted(g.ranks for g in plan.groups_of(kind))

    assert ranks(GroupKind.TENSOR) == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11),
                                       (12, 13), (14, 15)]
    assert ranks(GroupKind.CONTEXT) == [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11),
                                        (12, 14), (13, 15)]
    # gradients are reduced over the data-parallel-with-context group (DP x CP)
    assert ranks(GroupKind.DATA) == [(0, 2, 4, 6), (1, 3, 5, 7), (8, 10, 12, 14),
                                     (9, 11, 13, 15)]
    assert ranks(GroupKind.PIPELINE) == [(r, r + 8) for r in range(8)]
    # (pp, dp, cp, tp) = (1, 1, 0, 1) is rank 8 + 4 + 0 + 1
    assert megatron_cp_rank(1, 1, 0, 1, dp=2, cp=2, tp=2) == 13
    assert plan.data_parallel == 2 and plan.cp_peers(3) == (2, 3)


@pytest.mark.parametrize("tp,pp,cp,nodes", [(2, 2, 2, 2), (4, 2, 2, 4), (2, 1, 4, 4)])
def test_rank_order_is_megatron_cores_rank_generator(write_scenario, tp, pp, cp, nodes):
    """The same groups from Megatron-Core's own `RankGenerator` (the test extra installs it)."""
    state = pytest.importorskip("megatron.core.parallel_state")
    prepared = prepare(write_scenario(cp_scenario(nodes=nodes, tp=tp, pp=pp, cp=cp,
                                                  global_batch=16)))
    plan, _ = plan_policy(prepared, "megatron")
    gen = state.RankGenerator(tp=tp, ep=1, dp=prepared.dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    for kind, name in ((GroupKind.TENSOR, "tp"), (GroupKind.CONTEXT, "cp"),
                       (GroupKind.DATA, "dp-cp")):
        assert sorted(g.ranks for g in plan.groups_of(kind)) == \
            sorted(tuple(r) for r in gen.get_ranks(name)), name


def test_holmes_keeps_cp_rings_on_one_rdma_fabric(write_scenario):
    """Nodes listed IB, RoCE, IB, RoCE with TP 8 and CP 2: Megatron's listing order pairs an IB
    node with a RoCE node (no shared RDMA fabric: TCP); Holmes' NIC-aware order pairs like
    nodes, so every CP ring runs on one RDMA fabric."""
    def group(name, fabric):
        nic = f"{{type: {fabric}, bandwidth_gbit_per_s: 200, count: 1, fabric: {fabric}}}"
        return (f"      - {{name: {name}, count: 1, gpu: h100-sxm, gpus_per_node: 8, "
                f"nics: [{nic}, {{type: ethernet, bandwidth_gbit_per_s: 100}}]}}")
    groups = "\n".join(group(n, f) for n, f in (("a", "ib"), ("b", "roce"), ("c", "ib"),
                                                ("d", "roce")))
    prepared = prepare(write_scenario(cp_scenario(cp=2, groups=groups,
                                                  policies="[megatron, holmes]")))
    megatron, _ = plan_policy(prepared, "megatron")
    holmes, _ = plan_policy(prepared, "holmes")
    assert {g.transport.kind for g in megatron.groups_of(GroupKind.CONTEXT)} == {TransportKind.TCP}
    assert {str(g.transport) for g in holmes.groups_of(GroupKind.CONTEXT)} == {"rdma:ib",
                                                                               "rdma:roce"}


def test_holmes_notes_a_cp_ring_it_cannot_keep_on_rdma(write_scenario):
    """Three IB nodes and one RoCE node, TP 8, CP 2: one CP group must pair IB with RoCE; it runs
    on TCP and the plan says so."""
    def group(name, fabric, count):
        nic = f"{{type: {fabric}, bandwidth_gbit_per_s: 200, count: 1, fabric: {fabric}}}"
        return (f"      - {{name: {name}, count: {count}, gpu: h100-sxm, gpus_per_node: 8, "
                f"nics: [{nic}, {{type: ethernet, bandwidth_gbit_per_s: 100}}]}}")
    groups = group("a", "ib", 3) + "\n" + group("b", "roce", 1)
    prepared = prepare(write_scenario(cp_scenario(cp=2, groups=groups, policies="[holmes]")))
    plan, _ = plan_policy(prepared, "holmes")
    kinds = sorted(str(g.transport) for g in plan.groups_of(GroupKind.CONTEXT))
    assert kinds == ["rdma:ib"] * 8 + ["tcp:ethernet"] * 8
    assert any("8 CP group(s) span NIC classes (from rank 16)" in n for n in plan.notes)


def _ring_oracle_s(prepared, gbit: float) -> float:
    """Exposed CP time of one entity's iteration from Transformer Engine's step structure, by
    hand: per layer and micro-batch, the forward's cp - 1 steps send a K/V chunk (T1) beside one
    step of compute C; the backward's first and last steps send K/V, then dK/dV (T1), its cp - 2
    middle steps both (T2), each waited for within its step. T = latency + the TP group's bytes
    / the NIC's rate; C = 1/cp of the attention."""
    w, cp, tp = prepared.workload, prepared.cp, prepared.tp
    nic = prepared.cluster.nodes[0].nics[0]
    assert nic.effective_bandwidth_bytes_per_s <= gbit / 8 * 1e9
    rate, lat = nic.effective_bandwidth_bytes_per_s, nic.latency_s
    gpu = prepared.cluster.nodes[0].gpu
    t1 = lat + kv_chunk_bytes(w, tp) * tp / rate
    t2 = lat + 2 * kv_chunk_bytes(w, tp) * tp / rate
    fwd, bwd = (attention_core_s(gpu, layer_kernels(w, tp), w.dtype_bytes, b) / cp
                for b in (False, True))
    if w.seq == 65536:  # the regime where the backward's step structure matters
        assert t1 < bwd < t2
    per_layer = (cp - 1) * max(0.0, t1 - fwd)
    per_layer += 2 * max(0.0, t1 - bwd) + (cp - 2) * max(0.0, t2 - bwd)
    return per_layer * w.num_layers * prepared.num_microbatches


@pytest.mark.parametrize("gbit,seq", [(50, 8192), (400, 8192), (400, 65536)])
def test_cp_ring_on_an_idle_fabric_equals_its_closed_form(write_scenario, gbit, seq):
    """TP 8 fills each node and CP 4 rings the four nodes over one IB NIC each: every ring step
    has its own NIC in each direction, so the engine's CP waits equal the closed form. At
    65,536 tokens a backward step's compute outlasts a one-chunk transfer but not a two-chunk
    one, where a ring sending K/V and dK/dV in every step would wait 3 (T2 - C), not 2 (T2 - C)."""
    prepared = prepare(write_scenario(cp_scenario(gbit=gbit, seq=seq)))
    out = run_policy(prepared, "megatron")
    waits = sum(r.duration_s for r in out.trace.records
                if r.kind is OpKind.CP_COMM and r.entity == "s0.d0")
    expect = _ring_oracle_s(prepared, gbit)
    assert expect > 0
    assert waits == pytest.approx(expect, rel=0.01, abs=1e-9)
    assert out.result.breakdown_s["cp_comm"] == pytest.approx(expect, rel=0.01, abs=1e-9)


@pytest.mark.parametrize("comm,tp,cp", [("p2p", 8, 4), ("p2p", 4, 4), ("p2p", 2, 4),
                                        ("a2a", 2, 4), ("allgather", 8, 4)])
def test_estimate_equals_the_engine_without_contention(write_scenario, comm, tp, cp):
    """One stage, gradients reduced after the backward: nothing shares a link with the CP
    rings, across nodes (TP 8), half on NVLink and half across (TP 4) or on NVLink (TP 2)."""
    prepared = prepare(write_scenario(cp_scenario(tp=tp, cp=cp, comm=comm, gbit=100,
                                                  layers=8, global_batch=8)))
    out = run_policy(prepared, "megatron")
    est = estimate_iteration(out.plan, out.cluster, prepared.workload, prepared.compute)
    assert est.iteration_s == pytest.approx(out.result.iteration_time_s, rel=1e-3)
    assert (out.result.breakdown_s["cp_comm"] > 0) == (tp > 2 or comm != "p2p")  # a2a: exposed


@pytest.mark.parametrize("comm,tp,cp", [("p2p", 8, 2), ("allgather", 8, 2), ("a2a", 2, 2)])
def test_estimate_is_optimistic_by_the_contention_it_does_not_see(write_scenario, comm, tp, cp):
    """Two stages: pipeline sends, and under holmes the overlapped optimizer's DP traffic, share
    NICs with the CP rings while they run; the engine sees it, the estimate does not (at most
    6% here, with each TP rank sending whole pipeline messages; docs/cost_models.md)."""
    prepared = prepare(write_scenario(cp_scenario(tp=tp, pp=2, cp=cp, comm=comm, gbit=100,
                                                  layers=8, global_batch=8,
                                                  policies="[megatron, holmes]")))
    for policy in ("megatron", "holmes"):
        out = run_policy(prepared, policy)
        est = estimate_iteration(out.plan, out.cluster, prepared.workload, prepared.compute)
        assert 0.94 * out.result.iteration_time_s < est.iteration_s \
            <= out.result.iteration_time_s * (1 + 1e-9), policy


def test_cp_splits_compute_and_activations(write_scenario):
    """CP 2 on the same GPUs instead of DP 2: each rank computes half the tokens of twice the
    micro-batches, and holds half the activations per micro-batch."""
    base = prepare(write_scenario(cp_scenario(tp=8, cp=1, global_batch=8, gbit=1e6)))
    cp = prepare(write_scenario(cp_scenario(tp=8, cp=2, global_batch=8, gbit=1e6)))
    assert (base.dp, cp.dp, cp.num_microbatches) == (4, 2, 2 * base.num_microbatches)
    b, c = run_policy(base, "megatron").result, run_policy(cp, "megatron").result
    assert c.breakdown_s["compute"] == pytest.approx(b.breakdown_s["compute"], rel=0.05)
    assert c.memory.per_stage_bytes[0] < b.memory.per_stage_bytes[0]


@pytest.mark.parametrize("policy", ["megatron-llama", "megatron-llama-2023-08",
                                    "megatron-deepspeed"])
def test_frameworks_without_cp_refuse_it(write_scenario, policy):
    """Refused when the policy runs, at the context degree's line; a scenario that lists it
    still runs the other policies (`--policy`)."""
    text = cp_scenario(cp=2, global_batch=4, policies=f"[megatron, {policy}]")
    prepared = prepare(write_scenario(text))
    line = next(i for i, row in enumerate(text.splitlines(), 1) if row.startswith("parallel:"))
    with pytest.raises(PlanError, match=rf"^{policy}: .*:{line}: parallel.context: this "
                                        "framework has no context parallelism"):
        plan_policy(prepared, policy)
    assert run_policy(prepared, "megatron").result.iteration_time_s > 0
