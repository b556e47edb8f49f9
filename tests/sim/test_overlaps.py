"""Megatron-Core's overlaps and uneven split, each against a hand calculation on a small case, in
the engine and the analytic estimate alike; the loader's refusals; the exported flags."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from holmes_sim.cost.collectives import ring_collective_time_s
from holmes_sim.cost.nccl_algorithms import collective_time_s
from holmes_sim.cost.ops import OpCosts
from holmes_sim.cost.attention import causal_block_fraction
from holmes_sim.cost.transformer import attention_core_s, layer_kernels
from holmes_sim.hardware.catalog import GPUS
from holmes_sim.errors import FieldError, ScenarioError
from holmes_sim.estimate.analytic import estimate_iteration
from holmes_sim.estimate.netview import netview
from holmes_sim.export.launch import launch_files
from holmes_sim.model.pipeline_split import PipelineSplit, megatron_layers_per_stage
from holmes_sim.plan import OptimizerMode
from holmes_sim.prepare import prepare_text
from holmes_sim.runner import plan_policy
from holmes_sim.sim.engine import simulate
from tests.export.test_launch_targets import UPSTREAM, parse


def _scenario(training: str = "", *, nodes: int = 2, gpus: int = 1, tp: int = 1, pp: int = 2,
              layers: int = 4, schedule: str = "1f1b", virtual: int = 1, batch: int = 8,
              gbit: float = 200, vocab: int = 51200, seq: int = 1024) -> str:
    return f"""name: overlaps
fabrics: [{{name: ib, type: ib}}]
clusters:
  - name: c
    nodes:
      - {{name: n, count: {nodes}, gpu: a100-80gb, gpus_per_node: {gpus}, nics: [{{type: ib,
          bandwidth_gbit_per_s: {gbit}, count: 1, fabric: ib, latency_us: 0}}]}}
model: {{num_layers: {layers}, hidden_size: 1024, num_attention_heads: 16, seq_length: {seq},
        vocab_size: {vocab}, tie_embeddings: false}}
training: {{global_batch_size: {batch}, micro_batch_size: 1{training}}}
parallel: {{tensor: {tp}, pipeline: {pp}, schedule: {schedule}, virtual_stages: {virtual}}}
policies: [megatron, holmes]
"""


@dataclasses.dataclass(frozen=True)
class StepCompute:
    """1 ms forward and 2 ms backward per layer; the output layer's backward 1 ms, of which its
    weight-gradient GEMM 0.5 ms; nothing else."""

    def layer_s(self, gpu, workload, tp, backward):
        return 2e-3 if backward else 1e-3

    def embedding_s(self, gpu, workload, tp, backward):
        return 0.0

    def head_s(self, gpu, workload, tp, backward):
        return 1e-3 if backward else 0.0

    def head_wgrad_s(self, gpu, workload, tp):
        return 0.5e-3

    def optimizer_s(self, gpu, params_per_gpu):
        return 0.0

    def gradient_buffer_s(self, gpu, workload, params_per_gpu):
        return 0.0

    def op_overhead_s(self, gpu):
        return 0.0


def _times(prepared) -> tuple[float, float]:
    """(estimate, engine) iteration seconds of the megatron plan."""
    plan, cluster = plan_policy(prepared, "megatron")
    return (estimate_iteration(plan, cluster, prepared.workload, prepared.compute).iteration_s,
            simulate(plan, cluster, prepared.workload, prepared.compute).iteration_s)


def test_overlap_param_gather_exposes_only_what_the_forward_cannot_hide():
    """DP 2 x TP 8, one stage: without the flag the bucket all-gathers (r_i s each) run after the
    step (sum r_i exposed); with it they run back to back ahead of the first forward (F s) in
    forward order, the reverse of the buckets' release order, and bucket i's share of the
    forward, from 1 - p_i (p_i its ready point in the backward, `OpCosts.gradient_buckets`),
    waits for its own gather: exposed max over i of (end of gather i - F (1 - p_i)), at least
    the first gather (`gather_delay_s`); the engine and the estimate both save the rest."""
    base = ", distributed_optimizer: true, overlap_grad_reduce: true, bucket_size_mb: 10"
    for gbit, hidden_by_forward in ((200, False), (3200, True)):
        kw = dict(gpus=8, tp=8, pp=1, layers=8, batch=16, gbit=gbit)
        off = prepare_text(_scenario(base, **kw))
        on = prepare_text(_scenario(base + ", overlap_param_gather: true", **kw))
        plan, cluster = plan_policy(on, "megatron")
        assert plan.optimizer is OptimizerMode.DISTRIBUTED_OVERLAPPED and plan.overlap_grad_reduce
        assert plan_policy(off, "megatron")[0].optimizer is OptimizerMode.DISTRIBUTED
        costs = OpCosts(cluster, on.workload, on.compute, 8)
        buckets, expert = costs.gradient_buckets((8,), 0, True, plan.bucket_numel(
            0, on.workload.given_bucket_numel))
        n, rate, latency = netview(cluster, plan.rank_to_gpu, plan.groups, 8, 1, 2, 1).dp_ring(0)
        gathers = [(ring_collective_time_s("all-gather", n, param, rate, latency), point)
                   for _, param, point in reversed(buckets)]  # forward order
        node = cluster.nodes[0]  # the forward's compute and its exposed TP collectives
        forward = costs.chunk_compute_s(node, 8, True, True, False) + costs.tp_comm_s(node, 8, False)
        ends = [sum(r for r, _ in gathers[:i + 1]) for i in range(len(gathers))]
        exposed = max([ends[0]] + [end - forward * (1 - point)
                                   for end, (_, point) in zip(ends[1:], gathers[1:])])
        # slow network: the gathers set the pace; fast: the forward hides most of them
        assert not expert and len(buckets) >= 4 and (exposed < ends[-1] / 2) == hidden_by_forward
        for before, after in zip(_times(off), _times(on), strict=True):
            assert before - after == pytest.approx(ends[-1] - exposed, rel=1e-6)


def test_tp_comm_overlap_leaves_what_each_gemm_cannot_hide():
    """TP 8 with SP, one stage, m = 8: each layer pass's two all-gathers and two reduce-scatters
    cost max(0, c - W (t-1)/t) beside a pipelined GEMM, max(0, c - W) beside a bulk one (c: TE's
    userbuffer ring over the link); the iteration drops by m L (exposed before - after) for
    forward plus backward, where the exposed ones without the overlap are NCCL's picks."""
    sp = ", sequence_parallel: true"
    off = prepare_text(_scenario(sp, nodes=1, gpus=8, tp=8, pp=1, layers=8))
    on = prepare_text(_scenario(sp + ", tp_comm_overlap: true", nodes=1, gpus=8, tp=8, pp=1,
                                layers=8))
    node = on.cluster.nodes[0]
    link = node.intra_link
    rate = link.bandwidth_bytes_per_s * link.efficiency
    ag, rs = (ring_collective_time_s(kind, 8, on.workload.tp_allreduce_bytes(), rate,
                                     link.step_latency_s) for kind in ("all-gather", "reduce-scatter"))
    costs = OpCosts(on.cluster, on.workload, on.compute, 8)
    saved = 0.0
    for backward, shares in ((False, (7 / 8,) * 4), (True, (7 / 8, 1, 7 / 8, 1))):
        windows = on.compute.tp_userbuffer_windows_s(node.gpu, on.workload, 8, backward)
        hand = sum(max(0.0, c - w * f) for c, w, f in zip((ag, rs, ag, rs), windows, shares,
                                                           strict=True))
        assert costs.tp_comm_s(node, 1, backward) == pytest.approx(hand, rel=1e-12)
        plain = OpCosts(off.cluster, off.workload, off.compute, 8)
        exposed = plain.tp_comm_s(node, 1, backward)
        nccl = sum(collective_time_s(plain.tp_topology(node), kind, off.workload.tp_allreduce_bytes())
                   for kind in ("all-gather", "reduce-scatter"))
        assert exposed == pytest.approx(2 * nccl, rel=1e-9) and hand < exposed
        saved += exposed - hand
    for before, after in zip(_times(off), _times(on), strict=True):
        assert before - after == pytest.approx(8 * 8 * saved, rel=1e-9)


def test_the_2022_async_all_reduce_stays_its_own_switch():
    """`async_tensor_model_parallel_allreduce` hides the backward's all-reduces behind the
    weight-gradient GEMMs only; `tp_comm_overlap` (every collective) hides more."""
    sp = ", sequence_parallel: true"
    kw = dict(nodes=1, gpus=8, tp=8, pp=1, layers=8)
    none, old, new = (_times(prepare_text(_scenario(sp + extra, **kw)))[1] for extra in
                      ("", ", async_tensor_model_parallel_allreduce: true",
                       ", tp_comm_overlap: true"))
    assert new < old < none


@pytest.mark.parametrize("m", [2, 4, 8])
def test_overlap_p2p_comm_leaves_only_the_fill_and_drain_transfers(m):
    """Interleaved, p = 2, v = 2, 1 + 2 ms per chunk, transfers of c < 1 ms: posting each
    receive two ops ahead hides every steady-state transfer; left are the 2 (p v - 1) of the
    forward fill and the backward drain: (v m + p - 1)(f + b) + 6c. Engine = estimate."""
    # (Posting after the previous op of the same kind hides a transfer only where forwards
    # and backwards alternate; the fill's forwards and the drain's backwards follow each other.)
    text = _scenario(", overlap_p2p_comm: true", layers=4, schedule="interleaved", virtual=2,
                     batch=m, gbit=32)
    on = dataclasses.replace(prepare_text(text), compute=StepCompute())
    off = dataclasses.replace(prepare_text(text.replace(", overlap_p2p_comm: true", "")),
                              compute=StepCompute())
    plan, cluster = plan_policy(on, "megatron")
    latency, rate = netview(cluster, plan.rank_to_gpu, plan.groups, 1, 2, 1, 2).p2p(0, 1, 0)
    c = latency + on.workload.pp_message_bytes(1) / rate
    assert c < 1e-3
    # The last virtual stage's backward carries the head (1 ms more): 3 + 1 per micro-batch.
    free = (2 * m + 1) * 3e-3 + m * 1e-3
    estimate_on, engine_on = _times(on)
    assert engine_on == pytest.approx(estimate_on, rel=1e-9)
    assert engine_on == pytest.approx(free + 6 * c, rel=1e-9)
    estimate_off, engine_off = _times(off)
    assert engine_off == pytest.approx(estimate_off, rel=1e-9) and engine_off > engine_on


def test_defer_embedding_wgrad_compute_moves_the_head_wgrad_into_the_flush():
    """p = 2, m = 4, one layer per stage, free communication: the last stage (1 + 3 ms per
    micro-batch) paces 1F1B, 19 ms; deferring its 0.5 ms weight-gradient GEMMs makes it 1 + 2.5
    ms and runs 4 x 0.5 ms after its last backward, while stage 0 does its last (2 ms): 17 ms."""
    off, on = (dataclasses.replace(prepare_text(_scenario(extra, layers=2, batch=4, gbit=1e9)),
                                   compute=StepCompute())
               for extra in ("", ", defer_embedding_wgrad_compute: true"))
    assert _times(off) == pytest.approx((19e-3, 19e-3), rel=1e-6)
    assert _times(on) == pytest.approx((17e-3, 17e-3), rel=1e-6)


def test_causal_flash_attention_computes_the_tiles_on_and_below_the_diagonal():
    """s = 2,048: 16 x 16 tiles of 128, 136 computed: 17/32 of 4 b s^2 h / t."""
    assert causal_block_fraction(2048) == 17 / 32
    assert causal_block_fraction(100) == 1.0  # one tile, on the diagonal
    p = prepare_text(_scenario(", flash_attention: true", seq=2048))
    w = p.workload
    kernels = layer_kernels(w, 1)
    assert kernels.flash_flop == pytest.approx(4 * 2048**2 * 1024)
    a100 = GPUS["a100-80gb"]  # no measured attention rates: the tile model prices it
    assert attention_core_s(a100, kernels, 2, False) == pytest.approx(
        4 * 2048**2 * 1024 * 17 / 32 / (a100.peak_flop_per_s * a100.attention_efficiency))
    # Megatron's reported model FLOPs stay as its formula counts them.
    unfused = prepare_text(_scenario("", seq=2048)).workload
    assert w.model_flop_per_iteration() == unfused.model_flop_per_iteration()


@pytest.mark.parametrize("layers,pp,v,split,expected", [
    (30, 4, 1, PipelineSplit(account_for_embedding=True, account_for_loss=True), (7, 8, 8, 7)),
    (30, 4, 2, PipelineSplit(account_for_embedding=True, account_for_loss=True),
     (3, 4, 4, 4, 4, 4, 4, 3)),
    (30, 4, 1, PipelineSplit(first_layers=6, last_layers=6), (6, 9, 9, 6)),
    (10, 4, 1, PipelineSplit(last_layers=1), (3, 3, 3, 1)),
    (31, 4, 1, PipelineSplit(account_for_embedding=True), (7, 8, 8, 8)),
])
def test_megatron_split_builds_the_layers_megatron_core_builds(layers, pp, v, split, expected):
    assert megatron_layers_per_stage(layers, pp, v, split) == expected
    assert sum(expected) == layers


@pytest.mark.parametrize("layers,pp,v,split,field", [
    (30, 4, 1, PipelineSplit(first_layers=5, last_layers=6), "decoder_first_pipeline_num_layers"),
    (30, 4, 1, PipelineSplit(account_for_embedding=True), "account_for_embedding"),
    (30, 4, 1, PipelineSplit(first_layers=6, account_for_loss=True),
     "decoder_first_pipeline_num_layers"),
    (30, 4, 4, PipelineSplit(first_layers=6, last_layers=6), "virtual_stages"),
])
def test_megatron_split_refuses_counts_that_do_not_add_up(layers, pp, v, split, field):
    with pytest.raises(FieldError, match=field):
        megatron_layers_per_stage(layers, pp, v, split)


def test_the_megatron_policy_splits_as_given_and_the_estimate_follows():
    """PP 4, 10 layers, a 256k vocabulary: the last stage holding one layer beside the output
    layer makes the iteration faster than the equal 3-3-2-2 split."""
    kw = dict(nodes=4, gpus=8, tp=8, pp=4, layers=10, batch=16, vocab=256000)
    even = prepare_text(_scenario("", **kw))
    uneven = prepare_text(_scenario(", decoder_last_pipeline_num_layers: 1", **kw))
    assert plan_policy(even, "megatron")[0].layers_per_stage == (3, 3, 2, 2)
    assert plan_policy(uneven, "megatron")[0].layers_per_stage == (3, 3, 3, 1)
    (_, sim_even), (est_uneven, sim_uneven) = _times(even), _times(uneven)
    assert sim_uneven == pytest.approx(est_uneven, rel=1e-9) and sim_uneven < sim_even


@pytest.mark.parametrize("training,kw,field", [
    (", overlap_param_gather: true, overlap_grad_reduce: true, distributed_optimizer: false", {},
     "training.overlap_param_gather"),
    (", overlap_param_gather: true", {}, "training.overlap_param_gather"),
    (", tp_comm_overlap: true", dict(nodes=1, gpus=8, tp=8, pp=1), "training.tp_comm_overlap"),
    (", tp_comm_overlap: true, sequence_parallel: true", {}, "training.tp_comm_overlap"),
    (", tp_comm_overlap: true, sequence_parallel: true, async_tensor_model_parallel_allreduce: "
     "true", dict(nodes=1, gpus=8, tp=8, pp=1), "async_tensor_model_parallel_allreduce"),
    (", overlap_p2p_comm: true", {}, "training.overlap_p2p_comm"),
    (", defer_embedding_wgrad_compute: true", dict(pp=1), "defer_embedding_wgrad_compute"),
    (", decoder_first_pipeline_num_layers: 4", {}, "decoder_first_pipeline_num_layers"),
    (", account_for_loss_in_pipeline_split: true", {}, "account_for_embedding_in_pipeline_split"),
    (", decoder_last_pipeline_num_layers: 0", {}, "decoder_last_pipeline_num_layers"),
])
def test_invalid_overlap_and_split_combinations_are_refused(training, kw, field):
    with pytest.raises(ScenarioError, match=field):
        prepare_text(_scenario(training, **kw))


def test_the_exporter_writes_the_flags_megatron_lm_parses():
    text = _scenario(", sequence_parallel: true, tp_comm_overlap: true, distributed_optimizer: "
                     "true, overlap_grad_reduce: true, overlap_param_gather: true, "
                     "defer_embedding_wgrad_compute: true, account_for_embedding_in_pipeline_split:"
                     " true, account_for_loss_in_pipeline_split: true", nodes=3, gpus=8, tp=8,
                     pp=3, layers=10, schedule="interleaved", virtual=2, batch=18)
    p = prepare_text(text)  # pipeline 3: Megatron-LM interleaves at 2 only with p2p overlap
    plan, cluster = plan_policy(p, "megatron")
    assert plan.layers_per_stage == (1, 2, 2, 2, 2, 1)
    args = shlex.split(launch_files(plan, cluster, p.workload, "bf16").files["megatron_args.txt"])
    parsed = parse(args, UPSTREAM)
    for flag in ("--tp-comm-overlap", "--overlap-param-gather", "--overlap-grad-reduce",
                 "--defer-embedding-wgrad-compute", "--no-overlap-p2p-communication",
                 "--account-for-embedding-in-pipeline-split",
                 "--account-for-loss-in-pipeline-split"):
        assert flag in parsed, flag
    assert parsed["--num-virtual-stages-per-pipeline-rank"] == ["2"]
    assert "--pipeline-model-parallel-layout" not in parsed
    p = prepare_text(_scenario(", decoder_first_pipeline_num_layers: 2, "
                               "defer_embedding_wgrad_compute: true", nodes=4, gpus=8, tp=8, pp=4,
                               layers=11, batch=16))
    fork = launch_files(*plan_policy(p, "holmes"), p.workload, "bf16").files["holmes_args.txt"]
    assert fork.startswith("# not expressible") and "defer" in fork
    plan, cluster = plan_policy(p, "megatron")
    parsed = parse(shlex.split(launch_files(plan, cluster, p.workload, "bf16").files[
        "megatron_args.txt"]), UPSTREAM)
    assert plan.layers_per_stage == (2, 3, 3, 3)
    assert parsed["--decoder-first-pipeline-num-layers"] == ["2"]
    assert "--no-overlap-p2p-communication" not in parsed  # 1F1B: nothing to turn off


def test_the_planner_tries_the_param_gather_and_keeps_overlaps_where_the_layout_allows():
    from holmes_sim.search.planner import Layout, evaluate, prepared_for

    text = _scenario(", sequence_parallel: true, tp_comm_overlap: true, overlap_p2p_comm: true, "
                     "distributed_optimizer: true, overlap_grad_reduce: true, bucket_size_mb: 10",
                     nodes=2, gpus=8, tp=8, pp=1, layers=8, batch=16)
    text = text.replace("schedule: 1f1b", "schedule: interleaved").replace("pipeline: 1", "pipeline: 2")
    prepared = prepare_text(text.replace("virtual_stages: 1", "virtual_stages: 2"))
    layout = Layout(8, 1, 2, 1, "1f1b", 1, "none", False, "distributed-overlap")
    plain, gather = (evaluate(prepared, dataclasses.replace(layout, optimizer=o), "megatron")
                     for o in ("distributed-overlap", "distributed-overlap-gather"))
    assert (plain.optimizer, gather.optimizer) == ("distributed", "distributed-overlapped")
    assert gather.predicted_iteration_s < plain.predicted_iteration_s
    # Without SP or the interleaved schedule the candidate drops the overlaps it cannot run.
    w = prepared_for(prepared, layout).workload
    assert not (w.tp_comm_overlap or w.overlap_p2p_comm)
    w = prepared_for(prepared, dataclasses.replace(layout, sequence_parallel=True, pp=2, dp=1,
                                                   schedule="interleaved", virtual_stages=2)).workload
    assert w.tp_comm_overlap and w.overlap_p2p_comm
