"""Llama-class architectures: GQA, SwiGLU, RMSNorm, no biases, RoPE, untied embeddings, vocabulary
padding and the named presets, against Megatron-LM's formulas and the models' published sizes."""

from __future__ import annotations

import dataclasses

import pytest

from holmes_sim.cost.transformer import layer_kernels
from holmes_sim.errors import FieldError, ScenarioError
from holmes_sim.export.model_args import architecture_args
from holmes_sim.model.workload import build_workload, padded_vocab
from holmes_sim.spec.job import ModelSpec, TrainingSpec
from holmes_sim.spec.load import load_scenario_text
from holmes_sim.spec.presets import PRESETS, preset_fields
from tests.megatron_flops import megatron_transformer_flops

_TRAINING = TrainingSpec(global_batch_size=128, micro_batch_size=1)


def _preset(name: str, tp: int = 1, **training):
    spec = ModelSpec(**preset_fields(name))
    return build_workload(spec, dataclasses.replace(_TRAINING, **training), tp)


def test_a_gqa_swiglu_layer_runs_the_gemm_flops_of_megatrons_formula():
    w = _preset("llama3.1-70b")
    k = layer_kernels(w, 1)
    executed = sum(g.flop + sum(x.flop for x in g.backward()) for g in k.dense)
    # the score and context GEMMs run the full s x s square; Megatron counts the causal half
    attention = sum(g.flop + sum(x.flop for x in g.backward()) for g in k.attention) / 2
    expected = megatron_transformer_flops(1, w.seq, 1, w.hidden, w.heads, w.groups, w.ffn, 0,
                                          swiglu=True)
    assert executed + attention == pytest.approx(expected, rel=1e-3)


def test_llama_3_1_70b_iteration_flops_equal_megatrons_formula():
    w = _preset("llama3.1-70b", tp=8, recompute="full")
    expected = megatron_transformer_flops(128, 8192, 80, 8192, 64, 8, 28672, 129024, swiglu=True)
    assert w.vocab == 129024  # 128,256 padded to a multiple of 128 x 8
    assert w.model_flop_per_iteration() == pytest.approx(expected, rel=1e-3)
    # Megatron never counts recomputation in this formula
    assert w.megatron_tflops_per_gpu(1.0, 1) * 1e12 == pytest.approx(expected, rel=1e-3)


def test_gpt_models_keep_the_sc21_formula():
    w = _preset("gpt3-175b", tp=8, recompute="full")
    B, s, L, h, V = 128, 2048, 96, 12288, 51200
    assert w.vocab == V
    sc21 = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    assert w.megatron_tflops_per_gpu(1.0, 1) * 1e12 == sc21


@pytest.mark.parametrize("ffn_factor", [2, 4, 8])
def test_gpt_flops_follow_eq_3_only_at_ffn_4h_and_megatrons_formula_otherwise(ffn_factor):
    # the case: 8 H100s, global batch 64, f = 2h reported 5.6125e15 FLOP (eq. 3)
    B, s, L, h, a = 64, 2048, 32, 4096, 32
    spec = ModelSpec(num_layers=L, hidden_size=h, num_attention_heads=a, seq_length=2048,
                     ffn_hidden_size=ffn_factor * h)
    w = build_workload(spec, TrainingSpec(global_batch_size=B, micro_batch_size=1), tp=8)
    V = w.vocab
    if ffn_factor == 4:
        # eq. 3 assumes f = 4h: Megatron-LM's log for GPT in 2021-2022 [N21]
        assert w.flops_formula == "sc21"
        expected = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    else:
        assert w.flops_formula == "megatron-core"
        expected = megatron_transformer_flops(B, s, L, h, a, a, ffn_factor * h, V, swiglu=False)
    assert w.model_flop_per_iteration() == pytest.approx(expected, rel=1e-12)
    assert w.megatron_tflops_per_gpu(1.0, 1) * 1e12 == pytest.approx(expected, rel=1e-12)
    if ffn_factor == 2:
        assert expected == pytest.approx(3.7537e15, rel=1e-4)


@pytest.mark.parametrize("name, billions", [
    ("llama2-7b", 6.74), ("llama2-13b", 13.02), ("llama2-70b", 68.98),
    ("llama3-8b", 8.03), ("llama3.1-8b", 8.03), ("llama3-70b", 70.55), ("llama3.1-70b", 70.55),
    ("llama3.1-405b", 405.85), ("nemotron4-15b", 15.6), ("nemotron4-340b", 341.0),
    ("qwen2.5-7b", 7.61), ("qwen2.5-72b", 72.7), ("gpt3-175b", 175.0),
])
def test_preset_parameter_counts_match_their_published_sizes(name, billions):
    assert _preset(name).total_params / 1e9 == pytest.approx(billions, rel=0.01)


def test_every_preset_cites_a_source_and_builds():
    for name, preset in PRESETS.items():
        assert preset.source and _preset(name).num_layers > 0


def test_gqa_shrinks_the_qkv_gemm_and_swiglu_doubles_fc1():
    w = _preset("llama3.1-70b")
    qkv, proj, fc1, fc2 = layer_kernels(w, 8).dense
    m = w.micro_batch * w.seq
    assert (qkv.m, qkv.n, qkv.k) == (m, (8192 + 2 * 8 * 128) // 8, 8192)  # h + 2 g h/a
    assert (proj.n, proj.k) == (8192, 8192 // 8)
    assert (fc1.n, fc1.k) == (2 * 28672 // 8, 8192)
    assert (fc2.n, fc2.k) == (8192, 28672 // 8)


def test_squared_relu_with_biases_pays_the_unfused_bias_add():
    """Megatron-Core fuses no bias into squared ReLU: fc1's bias is added on its own (read and
    write F x d bytes per GPU forward) and its gradient summed over the tokens (read F x d)."""
    base = dataclasses.replace(ModelSpec(**preset_fields("nemotron4-15b")), bias=False)
    plain, biased = (layer_kernels(build_workload(dataclasses.replace(base, bias=b), _TRAINING,
                                                  4), 4) for b in (False, True))
    w = build_workload(base, _TRAINING, 4)
    f_bytes = w.micro_batch * w.seq * w.ffn / 4 * w.dtype_bytes
    assert biased.other_bytes_fwd - plain.other_bytes_fwd == pytest.approx(2 * f_bytes)
    assert biased.other_bytes_bwd - plain.other_bytes_bwd == pytest.approx(
        f_bytes + (build_workload(dataclasses.replace(base, bias=True), _TRAINING, 4).layer_params
                   - w.layer_params) / 4 * (w.dtype_bytes + 2 * w.grad_bytes))


def test_gqa_and_zero_dropout_shrink_activation_memory():
    llama = _preset("llama3.1-70b")
    mha = dataclasses.replace(llama, query_groups=None)
    dropout = dataclasses.replace(llama, hidden_dropout=0.1)
    assert llama.activation_bytes_per_layer(8) < mha.activation_bytes_per_layer(8)
    assert llama.activation_bytes_per_layer(8) < dropout.activation_bytes_per_layer(8)


def test_rmsnorm_and_no_bias_and_rope_change_the_parameters_as_megatron_builds_them():
    base = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                     vocab_size=128, ffn_hidden_size=256)
    gpt = build_workload(base, _TRAINING)
    llama = build_workload(dataclasses.replace(base, normalization="rmsnorm", bias=False,
                                               position_embedding="rope"), _TRAINING)
    h, f = 64, 256
    assert gpt.layer_params - llama.layer_params == 2 * h + (3 * h + h + f + h)
    assert gpt.embedding_params - llama.embedding_params == 32 * h


def test_vocabulary_is_padded_as_megatron_pads_it():
    assert padded_vocab(50257, 128, 8) == 51200
    assert padded_vocab(128256, 128, 8) == 129024
    assert padded_vocab(152064, 128, 1) == 152064


def test_export_writes_the_architecture_flags():
    args = architecture_args(_preset("qwen2.5-7b"))
    assert args == ["--group-query-attention", "--num-query-groups", "4", "--swiglu",
                    "--normalization", "RMSNorm", "--disable-bias-linear", "--add-qkv-bias",
                    "--position-embedding-type", "rope", "--hidden-dropout", "0",
                    "--attention-dropout", "0", "--rotary-base", "1000000",
                    "--norm-epsilon", "1e-06"]
    assert architecture_args(_preset("gpt3-175b")) == []


_SCENARIO = """
clusters: [{{name: c, nodes: [{{name: n0, count: 1, gpu: a100-80gb, gpus_per_node: 8,
  nics: [{{type: ib, count: 1}}]}}]}}]
model: {model}
training: {{global_batch_size: 8, micro_batch_size: 1}}
"""


def test_a_preset_loads_and_fields_beside_it_override_it():
    s = load_scenario_text(_SCENARIO.format(model="{preset: llama3.1-8b, num_layers: 4}"))
    assert (s.model.name, s.model.num_layers, s.model.num_query_groups) == ("llama3.1-8b", 4, 8)


@pytest.mark.parametrize("model, message", [
    ("{preset: llama3-80b}", "model.preset: unknown preset 'llama3-80b'"),
    ("{preset: llama3.1-8b, num_query_groups: -1}", "model.num_query_groups: must be at least 1"),
    ("{preset: llama3.1-8b, normalization: rms}", "'rms' is not allowed"),
    ("{preset: llama3.1-8b, hidden_dropout: 1.5}", "model.hidden_dropout: must be at most 1"),
    ("{preset: llama3.1-8b, rotary_base: 1}",
     "model.rotary_base: must be greater than 1, got 1; the RoPE base theta"),
    ("{preset: llama3.1-8b, rotary_base: 5.0e5}",
     "model.rotary_base: expected a whole number, got float 500000.0"),
    ("{preset: nemotron4-15b, rotary_percent: 0}",
     "model.rotary_percent: must be greater than 0, got 0; the share of a head RoPE rotates"),
    ("{preset: nemotron4-15b, rotary_percent: 1.5}", "model.rotary_percent: must be at most 1"),
    ("{preset: llama3.1-8b, rope_scaling_factor: 0.5}",
     "model.rope_scaling_factor: must be at least 1, got 0.5; Llama 3.1 scales by 8"),
    ("{preset: qwen2.5-7b, norm_epsilon: 0}", "model.norm_epsilon: must be greater than 0, got 0"),
    ("{preset: llama3.1-8b, rope_scaling: yes}", "model.rope_scaling: expected true or false"),
    ("{preset: llama3.1-8b, rotary_bass: 1}", "model.rotary_bass: unknown key; did you mean "
                                              "'rotary_base'?"),
])
def test_loader_errors_name_the_field_and_the_fix(model, message):
    with pytest.raises(ScenarioError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_scenario_text(_SCENARIO.format(model=model))


def test_heads_not_divisible_by_groups_is_refused_with_the_fix():
    spec = dataclasses.replace(ModelSpec(**preset_fields("llama3.1-8b")), num_query_groups=5)
    with pytest.raises(FieldError, match="num_query_groups=5 must divide num_attention_heads=32"):
        build_workload(spec, _TRAINING)


def test_megatron_core_accepts_the_exported_architecture():
    config_module = pytest.importorskip("megatron.core.transformer.transformer_config")
    gpt_module = pytest.importorskip("megatron.core.models.gpt")
    import inspect
    import typing

    w = _preset("qwen2.5-7b")
    args = architecture_args(w)
    config = config_module.TransformerConfig(
        num_layers=2, hidden_size=w.hidden, num_attention_heads=w.heads,
        num_query_groups=int(args[args.index("--num-query-groups") + 1]),
        ffn_hidden_size=w.ffn, gated_linear_unit="--swiglu" in args,
        normalization=args[args.index("--normalization") + 1],
        add_bias_linear="--disable-bias-linear" not in args, add_qkv_bias="--add-qkv-bias" in args,
        hidden_dropout=float(args[args.index("--hidden-dropout") + 1]),
        attention_dropout=float(args[args.index("--attention-dropout") + 1]))
    assert config.kv_channels * config.num_query_groups == w.kv_width
    position = inspect.signature(gpt_module.GPTModel.__init__).parameters["position_embedding_type"]
    assert args[args.index("--position-embedding-type") + 1] in typing.get_args(position.annotation)



@pytest.mark.parametrize("impl", ["native", "te"])
def test_megatron_core_accepts_the_exported_cross_entropy_fusion(impl):
    """`loss_args` feeds Megatron-Core's own TransformerConfig fields of those names."""
    config_module = pytest.importorskip("megatron.core.transformer.transformer_config")
    from holmes_sim.export.model_args import loss_args
    training = TrainingSpec(global_batch_size=8, micro_batch_size=1,
                            cross_entropy_loss_fusion=True, cross_entropy_fusion_impl=impl)
    w = build_workload(ModelSpec(**preset_fields("llama3.1-8b")), training)
    args = loss_args(w)
    chosen = args[args.index("--cross-entropy-fusion-impl") + 1] if len(args) > 1 else "native"
    config = config_module.TransformerConfig(
        num_layers=2, hidden_size=w.hidden, num_attention_heads=w.heads,
        cross_entropy_loss_fusion="--cross-entropy-loss-fusion" in args,
        cross_entropy_fusion_impl=chosen)
    assert config.cross_entropy_loss_fusion and config.cross_entropy_fusion_impl == impl

def test_the_real_run_backend_refuses_architectures_its_gpt_does_not_have(tmp_path):
    from holmes_sim.bundled import default_testbed
    from holmes_sim.prepare import prepare
    from holmes_sim.validation.testbed_plan import check_backend

    text = default_testbed().read_text().replace("vocab_size: 512",
                                                       "vocab_size: 512\n  swiglu: true")
    path = tmp_path / "swiglu.yaml"
    path.write_text(text)
    with pytest.raises(FieldError, match="model.swiglu: the backend's GPT cannot run swiglu"):
        check_backend(prepare(path))



def test_the_real_run_backend_refuses_the_fused_cross_entropy(tmp_path):
    from holmes_sim.bundled import default_testbed
    from holmes_sim.prepare import prepare
    from holmes_sim.validation.testbed_plan import check_backend

    text = default_testbed().read_text()
    assert "\ntraining:\n" in text
    path = tmp_path / "fused_loss.yaml"
    path.write_text(text.replace("\ntraining:\n", "\ntraining:\n  cross_entropy_loss_fusion: true\n", 1))
    check_backend(prepare(default_testbed()))
    with pytest.raises(FieldError, match="training.cross_entropy_loss_fusion: the backend runs"):
        check_backend(prepare(path))

def test_nemotron_4_exports_its_squared_relu_and_keeps_a_non_gated_mlp():
    w = _preset("nemotron4-15b")
    assert "--squared-relu" in architecture_args(w) and "--swiglu" not in architecture_args(w)
    assert layer_kernels(w, 1).dense[2].n == w.ffn
