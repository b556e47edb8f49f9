"""Cost formulas against numbers computed by hand from the cited equations."""

from __future__ import annotations

import pytest

from holmes_sim.spec.job import ModelSpec, TrainingSpec
from holmes_sim.model.workload import build_workload


def _gpt(**training) -> object:
    model = ModelSpec(num_layers=36, hidden_size=4096, num_attention_heads=32, seq_length=2048,
                      vocab_size=51200)
    return build_workload(model, TrainingSpec(global_batch_size=1024, micro_batch_size=4, **training))


def test_layer_params_is_12h2_plus_13h():
    w = _gpt()
    assert w.layer_params == 12 * 4096**2 + 13 * 4096 == 201_379_840


def test_total_params_of_the_7_5b_model():
    # 36 layers x 201,379,840 + 51,200 x 4,096 word + 2,048 x 4,096 position + 2 x 4,096 final LN
    assert _gpt().total_params == 36 * 201_379_840 + 51200 * 4096 + 2048 * 4096 + 8192
    assert 7.4e9 < _gpt().total_params < 7.6e9


def test_forward_flop_per_layer():
    # 24 b s h^2 + 4 b s^2 h with b=4, s=2048, h=4096
    assert _gpt().layer_forward_flop == 24 * 4 * 2048 * 4096**2 + 4 * 4 * 2048**2 * 4096
    assert _gpt().logits_forward_flop == 2 * 4 * 2048 * 4096 * 51200


def test_backward_factor():
    assert _gpt().backward_factor == 2.0
    assert _gpt(recompute="full").backward_factor == 3.0


def test_messages():
    w = _gpt()
    whole = 4 * 2048 * 4096 * 2  # b s h bf16
    assert w.pp_message_bytes(tp=1) == whole
    assert w.pp_message_bytes(tp=8) == whole  # Megatron-Core: every TP rank sends it whole
    assert _gpt(sequence_parallel=True).pp_message_bytes(tp=8) == whole / 8  # s/t tokens
    assert _gpt(scatter_gather_tensors_in_pipeline=True).pp_message_bytes(tp=8) == whole / 8
    assert w.grad_bytes_of(1000) == 4000  # fp32 gradient reduction by default
    assert _gpt(grad_reduce_in_fp32=False).grad_bytes_of(1000) == 2000


@pytest.mark.parametrize("precision, fp32_grads, whole, sharded", [
    ("bf16", True, 18, 6 + 12 / 8), ("fp16", False, 20, 4 + 16 / 8), ("fp32", True, 16, 8 + 8 / 8),
    ("bf16", False, 20, 4 + 16 / 8)])
def test_state_bytes_follow_megatrons_distributed_optimizer_table(precision, fp32_grads, whole,
                                                                  sharded):
    """Bytes per parameter at the optimizer step, Megatron-LM's
    docs/user-guide/features/dist_optimizer.md: bf16 weights with fp32 gradients 18 / 6 + 12/d,
    fp16 20 / 4 + 16/d, fp32 16 / 8 + 8/d (d = 8); 16-bit gradients' fp32 copy (4, or 4/d) is
    made only for the step, so it is not held beside the activations."""
    w = _gpt(precision=precision, grad_reduce_in_fp32=fp32_grads)
    for shard, total in ((False, whole), (True, sharded)):
        held, step = w.state_bytes_per_param(8, shard), w.step_bytes_per_param(8, shard)
        assert held + step == total
        assert step == (0 if fp32_grads else 4 / (8 if shard else 1))


def test_activation_memory_korthikanti():
    w = _gpt()
    sbh = 2048 * 4 * 4096
    assert w.activation_bytes_per_layer(1) == pytest.approx(sbh * (34 + 5 * 32 * 2048 / 4096))
    assert w.activation_bytes_per_layer(4) == pytest.approx(sbh * (10 + 24 / 4 + 5 * 32 * 2048 / (4096 * 4)))
    assert _gpt(sequence_parallel=True).activation_bytes_per_layer(4) == \
        pytest.approx(sbh * (34 + 5 * 32 * 2048 / 4096) / 4)
    assert _gpt(recompute="full").activation_bytes_per_layer(1) == 2 * sbh


def test_fp32_activations_double_the_values_not_the_dropout_masks():
    """[K22]'s 34 sbh + 5as/h holds 2 bytes of hidden-dropout masks and 1 of attention-dropout
    mask among 2-byte values: in fp32 the values double (64 + 2 masks; 8 + 1 as/h)."""
    w = _gpt(precision="fp32")
    sbh = 2048 * 4 * 4096
    assert w.activation_bytes_per_layer(1) == pytest.approx(sbh * (66 + 9 * 32 * 2048 / 4096))
    assert _gpt(precision="fp32", recompute="full").activation_bytes_per_layer(1) == 4 * sbh


def test_megatron_tflops_formula():
    w = _gpt(recompute="full")
    B, s, L, h, V = 1024, 2048, 36, 4096, 51200
    flop = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    assert w.megatron_tflops_per_gpu(10.0, 64) == pytest.approx(flop / 10.0 / 64 / 1e12)
    assert _gpt().model_flop_per_iteration() == pytest.approx(flop * 72 / 96)
