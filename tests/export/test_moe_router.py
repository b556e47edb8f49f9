"""An MoE export's router and expert arguments start under Megatron-LM: top-1 softmax routing
scores before the top-k (`TransformerConfig` refuses it otherwise), a GeLU MoE model with biases
turns off the bias-GeLU fusion its grouped experts refuse, the load-balancing loss has a weight
(Megatron's default 0 trains without one), and each MoE preset's router is its model card's."""

from __future__ import annotations

import shlex

import pytest
import yaml
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.errors import FieldError, ScenarioError
from holmes_sim.export.model_args import architecture_args
from holmes_sim.model.workload import build_workload
from holmes_sim.prepare import prepare
from holmes_sim.spec.job import ModelSpec, TrainingSpec
from holmes_sim.spec.presets import PRESETS, preset_fields
from tests.export.test_launch_targets import UPSTREAM, parse
from tests.export.test_validate_args import _export, _moe, core_config


def _router(fields: str, bias: bool = False) -> str:
    """The 8-expert top-2 scenario of test_validate_args with `fields` beside the model's."""
    topk = "" if "moe_router_topk" in fields else "moe_router_topk: 2, "
    return _moe(bias, "expert: 4, expert_tensor: 1" if bias else "expert: 4").replace(
        "moe_router_topk: 2}", f"{topk}{fields}}}".replace(", }", "}"))

def _refused_run(path, out) -> str:
    """`run PATH --plans OUT`'s one-line refusal (exit 2, no traceback), whitespace joined."""
    result = CliRunner().invoke(app, ["run", str(path), "-q", "--plans", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    return " ".join(result.output.split())



def _megatron(write_scenario, fields: str, bias: bool = False) -> tuple[list[str], str]:
    files = _export(write_scenario, _router(fields, bias))
    return shlex.split(files["megatron_args.txt"]), files["README.md"]


def grouped_experts_refuse(config) -> bool:
    """Whether Megatron-Core's `TEGroupedMLP.forward` raises "Only support fusion of swiglu and
    quick_gelu in TEGroupedMLP." (megatron/core/transformer/moe/experts.py, `bias_act_func`):
    the bias-activation fusion on, without TE's activation module, for anything but a gated
    SiLU or quick-GeLU."""
    import torch.nn.functional as F
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    gated_fused = config.gated_linear_unit and config.activation_func in (F.silu, quick_gelu)
    return bool(config.bias_activation_fusion and not config.use_te_activation_func
                and not gated_fused)


@pytest.mark.parametrize("fields, pre_softmax", [
    ("moe_router_topk: 1", True), ("", False),
    ("moe_router_topk: 1, moe_router_load_balancing_type: sinkhorn", False),
    ("moe_router_topk: 1, moe_router_pre_softmax: true", True)])
def test_top1_softmax_routing_scores_before_the_top_k(write_scenario, fields, pre_softmax):
    """Top-1 routing was exported as `--moe-router-topk 1` alone, and Megatron-Core's
    `TransformerConfig` raised "Please use --moe-router-pre-softmax when topk is 1."; sinkhorn
    routing needs no flag. The README says why the flag is there when the scenario did not."""
    args, readme = _megatron(write_scenario, fields)
    config = core_config(args)  # raises Megatron-Core's ValueError where it refuses
    assert config.moe_router_pre_softmax == pre_softmax
    assert ("--moe-router-pre-softmax" in args) == pre_softmax
    chosen = "Megatron-Core refuses top-1 softmax routing without it" in " ".join(readme.split())
    assert chosen == (pre_softmax and "pre_softmax" not in fields)


def test_top1_softmax_routing_told_not_to_score_first_is_refused(write_scenario, tmp_path):
    """`moe_router_pre_softmax: false` at top-1 is what Megatron-Core refuses: one line at the
    field's line, exit 2, nothing written."""
    path, out = write_scenario(_router("moe_router_topk: 1, moe_router_pre_softmax: false")), tmp_path / "plans"
    message = _refused_run(path, out)
    assert f"{path}:" in message and "model.moe_router_pre_softmax: Megatron-Core refuses " \
        "top-1 softmax routing without it" in message and "set it true, or remove it" in message
    assert not out.exists()


@pytest.mark.parametrize("bias, swiglu, flag", [(True, False, True), (False, False, False),
                                                (True, True, False)])
def test_a_gelu_moe_model_with_biases_turns_off_the_bias_gelu_fusion(write_scenario, bias,
                                                                     swiglu, flag):
    """GeLU with biases and grouped experts: Megatron-LM fuses the bias into the activation by
    default and `TEGroupedMLP` fuses only SwiGLU and quick-GeGLU, so the export had a launch
    that stopped at the first MoE layer's forward. Without biases Megatron-LM turns the fusion
    off itself; SwiGLU keeps its fusion."""
    args, _ = _megatron(write_scenario, "swiglu: true" if swiglu else "", bias)
    config = core_config(args)
    assert "--moe-grouped-gemm" in args and config.add_bias_linear == bias
    assert ("--no-bias-gelu-fusion" in args) == flag
    assert not grouped_experts_refuse(config)
    assert config.bias_activation_fusion == (bias and swiglu)


@pytest.mark.parametrize("fields, coeff", [
    ("", "0.01"), ("moe_aux_loss_coeff: 0.02", "0.02"), ("moe_aux_loss_coeff: 0", None),
    ("moe_router_load_balancing_type: seq_aux_loss", "0.01"),
    ("moe_router_load_balancing_type: sinkhorn", None),
    ("moe_router_load_balancing_type: none", None)])
def test_the_load_balancing_loss_has_a_weight(write_scenario, fields, coeff):
    """No export wrote `--moe-aux-loss-coeff`, and at Megatron's default 0 the router skips its
    loss (router.py `_apply_aux_loss`): without a weight given the export writes 0.01,
    Megatron-Core's recommended start, and its README says so; none for sinkhorn (which asserts
    a weight of 0) or no balancing."""
    args, readme = _megatron(write_scenario, fields)
    parsed = parse(args, UPSTREAM)
    assert parsed.get("--moe-aux-loss-coeff") == ([coeff] if coeff else None)
    core_config(args)
    told = "the scenario gives no `model.moe_aux_loss_coeff`" in " ".join(readme.split())
    assert told == (coeff is not None and "coeff" not in fields)


@pytest.mark.parametrize("fields, field, message", [
    ("moe_aux_loss_coeff: 0.02, moe_router_load_balancing_type: sinkhorn",
     "model.moe_aux_loss_coeff", "moe_aux_loss_coeff=0.02 weights a loss that sinkhorn"),
    ("moe_aux_loss_coeff: 0.02, moe_router_load_balancing_type: none",
     "model.moe_aux_loss_coeff", "a loss that none load balancing does not compute"),
    ("moe_router_enable_expert_bias: true", "model.moe_router_enable_expert_bias",
     "needs moe_router_score_function: sigmoid"),
    ("moe_router_num_groups: 4", "model.moe_router_group_topk", "needs both"),
    ("moe_router_group_topk: 2", "model.moe_router_num_groups", "needs both"),
    ("moe_router_num_groups: 3, moe_router_group_topk: 1", "model.moe_router_num_groups",
     "moe_router_num_groups=3 must divide num_experts=8"),
    ("moe_router_num_groups: 4, moe_router_group_topk: 3", "model.moe_router_group_topk",
     "moe_router_group_topk=3 must be at most moe_router_num_groups=4 and moe_router_topk=2"),
    ("moe_router_num_groups: 8, moe_router_group_topk: 1", "model.moe_router_num_groups",
     "leaves 1 expert.s. a group, too few for moe_router_topk=2 from moe_router_group_topk=1"),
    ("moe_aux_loss_coeff: -1", "model.moe_aux_loss_coeff", "must be at least 0")])
def test_router_settings_megatron_core_refuses_are_refused_at_load(write_scenario, fields,
                                                                   field, message):
    with pytest.raises(ScenarioError, match=f"{field}: .*{message}"):
        prepare(write_scenario(_router(fields)))


_TRAINING = TrainingSpec(global_batch_size=64, micro_batch_size=1)
ROUTERS = {
    "mixtral-8x7b": {"--moe-aux-loss-coeff": ["0.02"]},
    "mixtral-8x22b": {"--moe-aux-loss-coeff": ["0.001"]},
    "qwen1.5-moe-a2.7b": {"--moe-aux-loss-coeff": ["0.001"], "--moe-router-pre-softmax": []},
    "qwen2-57b-a14b": {"--moe-aux-loss-coeff": ["0.001"], "--moe-router-pre-softmax": []},
    "deepseek-v2-lite": {"--moe-router-load-balancing-type": ["seq_aux_loss"],
                         "--moe-aux-loss-coeff": ["0.001"], "--moe-router-pre-softmax": []},
    "deepseek-v3": {"--moe-router-load-balancing-type": ["seq_aux_loss"],
                    "--moe-aux-loss-coeff": ["0.0001"], "--moe-router-pre-softmax": [],
                    "--moe-router-score-function": ["sigmoid"],
                    "--moe-router-enable-expert-bias": [],
                    "--moe-router-topk-scaling-factor": ["2.5"],
                    "--moe-router-num-groups": ["8"], "--moe-router-group-topk": ["4"]},
}
"""Each MoE preset's router flags (its source cites each value): the loss weight of its
config.json (`router_aux_loss_coef`, DeepSeek's `aux_loss_alpha`; DeepSeek-V3's paper's
0.0001), pre-softmax scoring for `norm_topk_prob: false` and where Megatron-Bridge sets it,
DeepSeek-V3's sigmoid scoring, expert bias, scaling and node-limited groups."""


@pytest.mark.parametrize("preset", sorted(ROUTERS))
def test_each_moe_preset_exports_its_router(preset):
    """Before, no preset wrote a loss weight and the DeepSeek presets routed renormalized
    softmax top-k although their cards do not renormalize (or score by sigmoid)."""
    args = architecture_args(build_workload(ModelSpec(**preset_fields(preset)), _TRAINING, 8))
    parsed = parse(args, UPSTREAM)
    router = {f: v for f, v in parsed.items()
              if f.startswith(("--moe-router-", "--moe-aux-loss"))}
    assert router == {"--moe-router-topk": [str(PRESETS[preset].fields["moe_router_topk"])],
                      **ROUTERS[preset]}
    f = PRESETS[preset].fields
    shape = ["--num-layers", str(f["num_layers"]), "--hidden-size", str(f["hidden_size"]),
             "--num-attention-heads", str(f["num_attention_heads"])]
    config = core_config(shape + args)  # Megatron-Core builds each preset's router
    assert config.moe_aux_loss_coeff == float(ROUTERS[preset]["--moe-aux-loss-coeff"][0])


def test_every_moe_preset_has_a_router_row():
    assert {p for p in PRESETS if "num_experts" in PRESETS[p].fields} == set(ROUTERS)


def test_router_settings_change_no_cost():
    """The router fields are the model's numbers: the same workload's kernels and parameters."""
    from holmes_sim.cost.transformer import layer_kernels

    fields = preset_fields("deepseek-v2-lite")
    base = build_workload(ModelSpec(**fields), _TRAINING, 8)
    other = build_workload(ModelSpec(**dict(fields, moe_aux_loss_coeff=0.05,
                                            moe_router_pre_softmax=False)), _TRAINING, 8)
    assert base.moe != other.moe and base.total_params == other.total_params
    assert repr(layer_kernels(base, 8)) == repr(layer_kernels(other, 8))


def test_router_weights_are_exported_exactly(write_scenario):
    """Not rounded to six figures: the weight a run trains with is the one written."""
    text = _router("moe_aux_loss_coeff: 0.0012345678")
    args = architecture_args(prepare(write_scenario(text)).workload)
    assert args[args.index("--moe-aux-loss-coeff") + 1] == "0.0012345678"


@pytest.mark.parametrize("preset, fields, message", [
    ("mixtral-8x7b", "moe_router_load_balancing_type: sinkhorn",
     "moe_aux_loss_coeff comes from preset mixtral-8x7b; override it beside the preset "
     "(moe_aux_loss_coeff: 0)"),
    ("deepseek-v3", "moe_router_score_function: softmax",
     "moe_router_enable_expert_bias comes from preset deepseek-v3; override it beside the "
     "preset (moe_router_enable_expert_bias: false)"),
    ("deepseek-v3", "moe_router_num_groups: null",
     "moe_router_group_topk comes from preset deepseek-v3; override it beside the preset "
     "(moe_router_group_topk: null)"),
    ("deepseek-v3", "moe_router_topk: 2",
     "moe_router_group_topk comes from preset deepseek-v3; override it beside the preset "
     "(moe_router_group_topk: at most 2)"),
    ("qwen2-57b-a14b", "moe_shared_expert_intermediate_size: null",
     "model has none: set moe_shared_expert_intermediate_size, or turn the gate off; "
     "moe_shared_expert_gate comes from preset qwen2-57b-a14b; override it beside the preset "
     "(moe_shared_expert_gate: false)")])
def test_a_router_value_from_a_preset_is_named_as_the_presets(preset, fields, message):
    spec = ModelSpec(**dict(preset_fields(preset), preset=preset,
                            **yaml.safe_load("{" + fields + "}")))
    with pytest.raises(FieldError) as info:
        build_workload(spec, TrainingSpec(global_batch_size=64, micro_batch_size=1), 1)
    assert str(info.value).endswith(message)


_GATED = "moe_shared_expert_intermediate_size: 512, moe_shared_expert_gate: true"


@pytest.mark.parametrize("fields, gate", [(_GATED, True),
                                          ("moe_shared_expert_intermediate_size: 512", False)])
def test_the_shared_experts_gate_is_exported_with_its_note(write_scenario, fields, gate):
    """The Qwen MoE presets' shared expert has a sigmoid gate (Hugging Face Qwen2-MoE
    `shared_expert_gate`) and no export wrote `--moe-shared-expert-gate`, so the launch trained
    an ungated shared expert. Now Megatron-Core's `TransformerConfig` gets the gate, and the
    README says the flag needs Megatron-LM core_v0.16.0 or later."""
    args, readme = _megatron(write_scenario, fields)
    config = core_config(args)
    assert config.moe_shared_expert_gate is gate
    assert ("--moe-shared-expert-gate" in args) is gate
    assert ("`--moe-shared-expert-gate` builds the shared expert's sigmoid gate simulated"
            in " ".join(readme.split())) is gate


@pytest.mark.parametrize("preset", ["qwen1.5-moe-a2.7b", "qwen2-57b-a14b"])
def test_qwen_moe_presets_export_the_shared_experts_gate(preset):
    args = architecture_args(build_workload(ModelSpec(**preset_fields(preset)), _TRAINING, 8))
    assert "--moe-shared-expert-gate" in parse(args, UPSTREAM)
    assert "not modelled" not in PRESETS[preset].source


def test_a_gate_without_a_shared_expert_is_refused_at_load(write_scenario, tmp_path):
    """Megatron-Core ignores the gate without a shared expert, so the model simulated would
    not be the one trained: one line at the field's line, exit 2, nothing written."""
    path, out = write_scenario(_router("moe_shared_expert_gate: true")), tmp_path / "plans"
    message = _refused_run(path, out)
    assert f"{path}:" in message and "model.moe_shared_expert_gate: moe_shared_expert_gate " \
        "gates the shared expert, but the model has none: set " \
        "moe_shared_expert_intermediate_size, or turn the gate off (remove " \
        "moe_shared_expert_gate)" in message
    assert not out.exists()
