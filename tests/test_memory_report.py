"""The memory report's peak per stage against the bytes counted by hand: model state per
Megatron-LM's distributed-optimizer guide, the activations of Korthikanti et al. 2022, the output
layer and loss on the last stage (Megatron-LM `theoretical_memory_usage.py`), and the optimizer
step's fp32 gradient copy, which is made only after the activations are freed."""

from __future__ import annotations

import dataclasses

import pytest

from holmes_sim.cost.ops import OpCosts, stage_param_counts
from holmes_sim.metrics import memory_report
from holmes_sim.model.workload import build_workload
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from holmes_sim.schedule import peaks_in_flight
from holmes_sim.spec.job import ModelSpec, TrainingSpec
from holmes_sim.spec.presets import preset_fields
from tests.conftest import small_scenario


def _report(write_scenario, *, seq: int, pp: int, precision: str, fp32_grads: bool,
            position: str = "learned"):
    """(workload, per-stage parameters of the whole TP group, per-stage peak bytes) of the
    megatron plan of an 8-layer TP 8 model without the distributed optimizer."""
    text = small_scenario(tp=8, pp=pp, seq=seq, global_batch=16).replace(
        "micro_batch_size: 1}", f"micro_batch_size: 1, precision: {precision}, "
        f"grad_reduce_in_fp32: {str(fp32_grads).lower()}, distributed_optimizer: false}}"
    ).replace("tie_embeddings:", f"position_embedding: {position}, tie_embeddings:")
    prepared = prepare(write_scenario(text))
    plan, cluster = plan_policy(prepared, "megatron")
    costs = OpCosts(cluster, prepared.workload, prepared.compute, plan.tp)
    params = [p for p, _, _ in stage_param_counts(costs, plan.layers_per_stage, plan.pp)]
    return prepared.workload, params, memory_report(plan, cluster, prepared.workload,
                                                    costs).per_stage_bytes


def _held(params: float, layers: int, *, seq: int = 0, last: bool = False) -> float:
    """Parameters a GPU of TP 8 holds: 1/8 of all but those every TP rank holds whole: each
    layer's two LayerNorms (2 x 2h, h = 1,024), on the first stage the learned position table
    (`seq` x h), on the last the final LayerNorm (2h)."""
    whole = layers * 2 * 2 * 1024 + seq * 1024 + (2 * 1024 if last else 0)
    return (params - whole) / 8 + whole


def test_last_stage_holds_one_micro_batchs_output_layer_and_loss(write_scenario):
    """PP 2, 1F1B, bf16 with fp32 gradients (18 bytes a parameter): stage 0 holds 2 in-flight
    micro-batches of its 4 layers; stage 1 one micro-batch of its 4 layers and of the output
    layer and loss, 4 s b (h + V) / t bytes."""
    w, params, peaks = _report(write_scenario, seq=1024, pp=2, precision="bf16", fp32_grads=True)
    layer = w.activation_bytes_per_layer(8)
    output = 4 * 1024 * (1024 + w.vocab) / 8
    assert w.vocab == 51200
    assert peaks[0] == pytest.approx(_held(params[0], 4, seq=1024) * 18 + 2 * 4 * layer,
                                     rel=1e-12)
    assert peaks[1] == pytest.approx(_held(params[1], 4, last=True) * 18 + 4 * layer + output,
                                     rel=1e-12)


def test_every_tp_rank_holds_the_position_table_and_final_norm_whole(write_scenario):
    """Megatron-Core's learned position table is a `torch.nn.Embedding` and its final norm no
    parallel layer: each of the 8 TP ranks holds all s h = 2,048 x 1,024 and 2h of them, 18
    bytes each (bf16, fp32 gradients), against a RoPE model without the table."""
    runs = {p: _report(write_scenario, seq=2048, pp=2, precision="bf16", fp32_grads=True,
                       position=p) for p in ("learned", "rope")}
    (w, params, learned), (_, rope_params, rope) = runs["learned"], runs["rope"]
    assert params[0] - rope_params[0] == 2048 * 1024
    assert learned[0] - rope[0] == pytest.approx(2048 * 1024 * 18, rel=1e-12)
    assert learned[1] == rope[1]
    last = _held(params[1], 4, last=True) * 18 + 4 * w.activation_bytes_per_layer(8) + \
        w.output_activation_bytes(8)
    assert learned[1] == pytest.approx(last, rel=1e-12)


@pytest.mark.parametrize("seq", [16, 2048])
def test_optimizer_steps_fp32_gradient_copy_only_after_the_activations(write_scenario, seq):
    """fp16 with fp16 gradients holds 16 bytes a parameter through the iteration; the step adds
    its fp32 gradient copy (4) once the activations are freed, so the peak is the state plus
    the larger of the two: the copy at 16 tokens, the activations at 2,048."""
    w, params, peaks = _report(write_scenario, seq=seq, pp=1, precision="fp16", fp32_grads=False)
    acts = 8 * w.activation_bytes_per_layer(8) + 4 * seq * (1024 + w.vocab) / 8
    held = _held(params[0], 8, seq=seq, last=True)
    copy = held * 4
    assert (copy > acts) == (seq == 16)
    assert peaks[0] == pytest.approx(held * 16 + max(acts, copy), rel=1e-12)


def test_deepseek_v3_ranks_hold_the_duplicated_projections_and_router_whole():
    """DeepSeek-V3 (h 7,168, q_lora_rank 1,536, kv_lora_rank 512, rope dim 64, 256 experts in
    58 of 61 layers): every TP rank holds each layer's two RMSNorms, the query and key/value
    down projections (Megatron-Core `parallel_mode='duplicated'`), the latent norms and the
    router whole."""
    spec = ModelSpec(**preset_fields("deepseek-v3"))
    w = build_workload(spec, TrainingSpec(global_batch_size=64, micro_batch_size=1), 8)
    h = 7168
    expected = 2 * h + h * 1536 + h * (512 + 64) + (1536 + 512) + round(58 * h * 256 / 61)
    assert w.layer_replicated_params == expected
    assert dataclasses.replace(w, mla=None, moe=None).layer_replicated_params == 2 * h


_DEEPSEEK_LITE = """name: d1
fabrics: [{name: ib, type: ib}]
clusters:
  - name: c
    nodes:
      - {count: 16, gpu: h100-sxm, gpus_per_node: 8, nics: [{type: ib, model: ib-ndr, count: 8, fabric: ib}]}
model: {preset: deepseek-v2-lite}
training: {global_batch_size: 64, micro_batch_size: 1, flash_attention: true,
           sequence_parallel: true, distributed_optimizer: true}
parallel: {tensor: 8, pipeline: 4, schedule: interleaved, virtual_stages: 2, expert: 2}
policies: [megatron]
"""


def _deepseek_lite_state_by_hand() -> list[float]:
    """Model state per GPU of each pipeline rank (bytes), counted layer by layer from the
    DeepSeek-V2-Lite card: layer 0 dense, 26 MoE layers of 64 routed experts (f_e 1,408), 2
    shared (f_s 2,816) and a router; the latent attention's down projection, latent norm and the
    two RMSNorms held whole on each TP rank; 27 layers in 8 virtual stages of 4, 4, 4, 3, 3, 3,
    3, 3; bf16 with fp32 gradients, distributed optimizer: 6 + 12/4 bytes, the experts'
    6 + 12/2 (expert-data-parallel 2: DP 4 x TP 8 over EP 2 x expert TP 8)."""
    h, heads, kv_rank, qk, rope, v, vocab = 2048, 16, 512, 128, 64, 128, 102400
    attention = h * heads * (qk + rope) + kv_rank * (h + heads * (qk + v) + 1) + h * rope + \
        heads * v * h
    whole_attention = h * (kv_rank + rope) + kv_rank
    chunks, start = [], 0
    for n in (4, 4, 4, 3, 3, 3, 3, 3):
        chunks.append(range(start, start + n))
        start += n
    states = []
    for rank in range(4):
        split = whole = routed = 0
        for layer in [*chunks[rank], *chunks[rank + 4]]:
            split += attention - whole_attention
            whole += whole_attention + 2 * h
            if layer == 0:
                split += 3 * h * 10944
            else:
                split, whole, routed = split + 3 * h * 2816, whole + h * 64, routed + 64 * 3 * h * 1408
        split += h * vocab if rank in (0, 3) else 0  # embedding, untied output layer
        whole += h if rank == 3 else 0  # the final RMSNorm
        states.append((split / 8 + whole) * (6 + 12 / 4) + routed / 16 * (6 + 12 / 2))
    return states


def test_a_stage_is_charged_for_the_moe_layers_it_holds(write_scenario):
    """DeepSeek-V2-Lite's first layer is dense: rank 0 holds it and 6 MoE layers, rank 1 seven
    MoE layers. Each rank's state equals the layer-by-layer count (the mean over the layer
    pattern charged rank 0 4% too much and rank 1 3% too little)."""
    prepared = prepare(write_scenario(_DEEPSEEK_LITE))
    plan, cluster = plan_policy(prepared, "megatron")
    w = prepared.workload
    costs = OpCosts(cluster, w, prepared.compute, plan.tp)
    report = memory_report(plan, cluster, w, costs)
    acts = [report.per_stage_bytes[s] - by_hand for s, by_hand in
            enumerate(_deepseek_lite_state_by_hand())]
    peaks = peaks_in_flight(plan.schedule_kind, 4, plan.num_microbatches, 2)
    expected = [peaks[s] * max(plan.layers_per_stage[s::4]) * w.activation_bytes_per_layer(8)
                for s in range(4)]
    expected[3] += w.output_activation_bytes(8)
    assert plan.layers_per_stage == (4, 4, 4, 3, 3, 3, 3, 3)
    assert acts == pytest.approx(expected, rel=1e-4)
