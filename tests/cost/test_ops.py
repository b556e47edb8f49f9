"""An op's duration: `OpCosts.chunk_compute_s` as its parts add up, and the shared `ChunkTimes`
(the estimate's and the partition search's) equal to what the engine prices, bit for bit."""

from __future__ import annotations

import dataclasses

import pytest

from holmes_sim.bundled import bundled_scenario
from holmes_sim.cost.ops import ChunkTimes, OpCosts
from holmes_sim.prepare import prepare


def _workloads(w):
    """The scenario's workload and variants that change how a chunk is priced."""
    return [w, dataclasses.replace(w, defer_embedding_wgrad=True),
            dataclasses.replace(w, async_tp_allreduce=True, recompute="full"),
            dataclasses.replace(w, tp_comm_overlap=True, sequence_parallel=True)]


@pytest.mark.parametrize("name", ["straggler", "large_175b_1024"])
def test_chunk_times_equal_the_engines_compute_plus_tp_and_the_hand_sum(name):
    p = prepare(bundled_scenario(name))
    slow = min(p.cluster.nodes, key=lambda n: n.speed)
    nodes = [p.cluster.nodes[0], slow]
    assert name != "straggler" or slow.speed < 1.0  # a node whose kernels run slower
    for w in _workloads(p.workload):
        for tp in (1, 8):
            costs = OpCosts(p.cluster, w, p.compute, tp)
            times = ChunkTimes(costs)
            c = p.compute
            for node in nodes:
                g, speed = node.gpu, node.speed
                for layers in (1, 3, 7):
                    for first, last, backward in ((True, False, False), (False, True, True),
                                                  (True, True, True), (False, False, False)):
                        hand = c.op_overhead_s(g) + layers * c.layer_s(g, w, tp, backward) / speed
                        if first:
                            hand += c.embedding_s(g, w, tp, backward) / speed
                        if last:
                            hand += c.head_s(g, w, tp, backward) / speed
                            if backward:
                                hand -= costs.deferred_wgrad_s(node)
                        compute = costs.chunk_compute_s(node, layers, first, last, backward)
                        tp_s = costs.tp_comm_s(node, layers, backward)
                        assert compute == hand
                        assert tp_s == layers * costs.tp_comm_s(node, 1, backward)
                        # TP 1 has none; under TP a GEMM long enough may hide it all
                        assert tp_s >= 0 and (tp > 1 or tp_s == 0)
                        if w is p.workload and tp > 1:
                            assert tp_s > 0  # plain all-reduces: nothing hides them
                        assert times.op_s(node, layers, first, last, backward) == compute + tp_s


@pytest.mark.parametrize("norm, norm_params", [("rmsnorm", 1024), ("layernorm", 2 * 1024)])
def test_one_tied_stage_holds_each_parameter_once(norm, norm_params):
    """PP 1 with tied embeddings: the head adds only the final norm (h for RMSNorm, which has no
    bias, 2h for LayerNorm), so the stage holds the model's parameters, counted by hand: 4 layers
    of 12 h^2 (no biases) and two norms, the V h embedding, the final norm."""
    from holmes_sim.model.workload import build_workload
    from holmes_sim.spec.job import ModelSpec, TrainingSpec
    h = 1024
    spec = ModelSpec(num_layers=4, hidden_size=h, num_attention_heads=16, seq_length=1024,
                     normalization=norm, tie_embeddings=True, position_embedding="rope",
                     bias=False)
    w = build_workload(spec, TrainingSpec(global_batch_size=8, micro_batch_size=1))
    p = prepare(bundled_scenario("straggler"))
    costs = OpCosts(p.cluster, w, p.compute, 1)
    by_hand = 4 * (12 * h * h + 2 * norm_params) + w.vocab * h + norm_params
    assert costs.stage_params((4,), 1, 0) == by_hand == w.total_params


def test_tp_collectives_through_nccl_are_its_picks_and_userbuffers_stay_rings():
    """large_175b_1024's TP 8 on a DGX H100 node (NVLink 4 with SHARP): without sequence
    parallelism a layer pass's two all-reduces run on NVLS (NCCL's pick, 1.5 times faster than
    the ring at 50 MB); with it, the all-gather and reduce-scatter pairs are NCCL's picks too;
    under `tp_comm_overlap` the layer's own four go through Transformer Engine's userbuffers,
    which stay TE's ring over the link."""
    from holmes_sim.cost.collectives import ring_collective_time_s
    from holmes_sim.cost.nccl_algorithms import choose, collective_time_s

    p = prepare(bundled_scenario("large_175b_1024"))
    node, link = p.cluster.nodes[0], p.cluster.nodes[0].intra_link
    plain = dataclasses.replace(p.workload, sequence_parallel=False, tp_comm_overlap=False,
                                async_tp_allreduce=False, recompute="none")
    costs = OpCosts(p.cluster, plain, p.compute, 8)
    topology, size = costs.tp_topology(node), plain.tp_allreduce_bytes()
    picked = choose(topology, "all-reduce", size)
    ring = ring_collective_time_s("all-reduce", 8, size, link.bandwidth_bytes_per_s *
                                  link.efficiency, link.step_latency_s)
    assert picked.algorithm == "nvls" and picked.time_s < ring / 1.4
    assert costs.tp_comm_s(node, 1, False) == pytest.approx(2 * picked.time_s, rel=1e-12)
    sp = dataclasses.replace(plain, sequence_parallel=True)
    pair = sum(collective_time_s(topology, k, size) for k in ("all-gather", "reduce-scatter"))
    assert OpCosts(p.cluster, sp, p.compute, 8).tp_comm_s(node, 1, True) == \
        pytest.approx(2 * pair, rel=1e-12)
    overlap = dataclasses.replace(sp, tp_comm_overlap=True)
    half = tuple(ring_collective_time_s(k, 8, size, link.bandwidth_bytes_per_s * link.efficiency,
                                        link.step_latency_s) for k in ("all-gather", "reduce-scatter"))
    over = OpCosts(p.cluster, overlap, p.compute, 8)
    assert over.tp_comm_s(node, 1, False) == pytest.approx(
        over.userbuffer_exposed_s(node, False, half), rel=1e-12)


def test_an_ops_cp_exposure_is_priced_once_per_gpu_model_rate_and_latency(monkeypatch):
    """`OpCosts.cp_exposed_s` keeps `context_parallel.op_exposed_s`'s seconds: the estimate
    asks again at every op of every candidate, with the same few rates."""
    from holmes_sim.cost import ops

    p = prepare(bundled_scenario("llama3_70b_h100"))
    w = dataclasses.replace(p.workload, cp=2)
    costs = OpCosts(p.cluster, w, p.compute, 8)
    calls = []
    real = ops.op_exposed_s
    monkeypatch.setattr(ops, "op_exposed_s", lambda *a: calls.append(a) or real(*a))
    nodes = p.cluster.nodes
    first = [costs.cp_exposed_s(n, 4, b, 2e10, 1e-5) for n in nodes for b in (False, True)]
    assert len(calls) == 2  # one GPU model, both directions
    again = [costs.cp_exposed_s(n, 4, b, 2e10, 1e-5) for n in nodes for b in (False, True)]
    assert again == first == [real(n.gpu, w, 8, 4, b, 2e10 / 8, 1e-5)
                              for n in nodes for b in (False, True)]
    costs.cp_exposed_s(nodes[0], 4, False, 1e10, 1e-5)
    assert len(calls) == 3
