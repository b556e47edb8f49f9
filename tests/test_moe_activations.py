"""An MoE layer's activation memory under tensor parallelism: the rows its expert-TP group
all-gathers, and the shared expert's gate.

Megatron-Core's `MoEAlltoAllTokenDispatcher.dispatch_postprocess` all-gathers the dispatched rows
and their probabilities over the expert-TP group (`gather_from_sequence_parallel_region`,
megatron/core/transformer/moe/token_dispatcher.py), and `TEGroupedLinear` is built with tp_size
1 (`explicit_expert_comm`, megatron/core/extensions/transformer_engine.py): the grouped fc1
keeps etp times the GPU's M/t tokens' k rows as its input, and the weighted activation their
probabilities. fc1's output and fc2's input have those rows at 1/etp of the width."""

from __future__ import annotations

import dataclasses

import pytest

from holmes_sim.model.bucket_layout import chunk_params
from holmes_sim.model.workload import build_workload
from holmes_sim.spec.job import ModelSpec, TrainingSpec
from holmes_sim.spec.presets import preset_fields

_SP = TrainingSpec(global_batch_size=64, micro_batch_size=1, sequence_parallel=True,
                   recompute="selective", flash_attention=True)


def _mixtral(tp: int, ep: int, etp: int | None):
    spec = ModelSpec(**dict(preset_fields("mixtral-8x7b"), seq_length=4096))
    return build_workload(spec, _SP, tp, ep=ep, etp=etp)


def test_rows_gathered_over_expert_tp_count_etp_times():
    """Mixtral 8x7B at TP 8 with SP, s 4096, selective recomputation: one layer holds, per
    s b h element over t, the norms', QKV's and router's inputs 8, the fp32 router logits 4E/h,
    Q 2, K and V 4k/h = 1, the projection's input 2, the experts' activation and fc2 inputs
    2 k (f1_e + f_e)/h = 42, and the k permuted rows with their probabilities 2k (h + 1)/h
    times etp. Before, that last term was etp-blind: 123.7 MB at expert TP 8 and at 1."""
    s, h, t, k = 4096, 4096, 8, 2
    gathered = 2 * k * (h + 1) / h
    base = 8 + 4 * 8 / h + 2 + 1 + 2 + 2 * k * 3 * 14336 / h
    folded = _mixtral(t, 4, None)  # expert TP = TP = 8
    split = _mixtral(t, 8, 1)      # expert TP 1: the rows stay sequence-split
    assert folded.expert_tp(t) == 8 and split.expert_tp(t) == 1
    assert folded.activation_bytes_per_layer(t) == pytest.approx(
        s * h * (base + gathered * 8) / t, rel=1e-12)
    assert split.activation_bytes_per_layer(t) == pytest.approx(
        s * h * (base + gathered) / t, rel=1e-12)
    assert folded.activation_bytes_per_layer(t) / 1e6 == pytest.approx(182.5, abs=0.05)


@pytest.mark.parametrize("etp", [2, 4])
def test_only_the_gathered_term_grows_with_expert_tp(etp):
    """Between expert TP 1 and etp the layer grows by s b h / t x 2k (h + 1)/h x (etp - 1):
    fc1's output and fc2's input, etp times the rows at 1/etp of the width, do not change."""
    s, h, t = 4096, 4096, 8
    grown = _mixtral(t, 8 * 4 // etp, etp).activation_bytes_per_layer(t) - \
        _mixtral(t, 8, 1).activation_bytes_per_layer(t)
    assert grown == pytest.approx(s * h / t * 4 * (h + 1) / h * (etp - 1), rel=1e-9)


def test_without_tp_the_gathered_rows_are_the_gpus_own():
    """At TP 1 the expert-TP group is the GPU alone: the k rows count once, as before."""
    w = _mixtral(1, 1, None)
    no_moe = dataclasses.replace(w, moe=None)
    s, h = 4096, 4096
    moe_extra = 4 * 8 / h + 2 * 2 * (h + 1) / h + 2 * 2 * 3 * 14336 / h - 2 * 3 * 14336 / h
    assert w.activation_bytes_per_layer(1) - no_moe.activation_bytes_per_layer(1) == \
        pytest.approx(s * h * moe_extra, rel=1e-12)


def _qwen(gate: bool, tp: int = 1):
    spec = ModelSpec(**dict(preset_fields("qwen1.5-moe-a2.7b"), moe_shared_expert_gate=gate))
    return build_workload(spec, _SP, tp)


def test_qwen_moe_presets_gate_their_shared_expert():
    """Hugging Face Qwen2-MoE scales the shared expert by `sigmoid(shared_expert_gate(x))`,
    a 1 x h weight per MoE layer; Megatron-Core's `SharedExpertMLP.gate_weight` (1, h),
    replicated over TP (marked sequence_parallel, its gradient all-reduced like a norm's)."""
    for name in ("qwen1.5-moe-a2.7b", "qwen2-57b-a14b"):
        assert preset_fields(name)["moe_shared_expert_gate"] is True
    gated, plain = _qwen(True, 4), _qwen(False, 4)
    h, moe_layers = gated.hidden, gated.moe.moe_layers
    assert gated.total_params - plain.total_params == moe_layers * h
    assert gated.layer_kind_params(True)[2] - plain.layer_kind_params(True)[2] == h
    assert gated.layer_params - plain.layer_params == round(h * moe_layers / gated.num_layers)


def test_the_gate_is_in_the_gradient_buckets_once():
    """The bucket cut lists every parameter once: with the gate they add up to the model's."""
    w = _qwen(True)
    params = chunk_params(w, 1, 0, w.num_layers, True, True)
    assert sum(p[0] for p in params) == w.total_params
    assert sum(p[0] for p in params) - sum(p[0] for p in chunk_params(
        _qwen(False), 1, 0, w.num_layers, True, True)) == w.moe.moe_layers * w.hidden


def test_the_gate_keeps_the_shared_experts_output():
    """`SharedExpertMLP.forward` multiplies the shared expert's output by the gate's score,
    so both stay until the backward: 2 (h + 1)/h per s b h element of each MoE layer, over t
    with SP. Megatron-LM's `num_floating_point_operations` does not count the gate, nor
    does holmes-sim."""
    gated, plain = _qwen(True, 4), _qwen(False, 4)
    s, h = gated.seq, gated.hidden
    assert gated.activation_bytes_per_layer(4) - plain.activation_bytes_per_layer(4) == \
        pytest.approx(s * h * 2 * (h + 1) / h / 4, rel=1e-9)
    assert gated.model_flop_per_iteration() == plain.model_flop_per_iteration()
