"""Architectures Megatron-Core refuses, found before anything is priced: query groups that do not
divide the heads, two MLP activations, a hidden size the heads do not divide, and MoE settings
`TransformerConfig` rejects; training and parallel fields written although the run never reads
them; and, at the scenario's layout, FP8 GEMM shapes Transformer Engine refuses
(`model.fp8_shapes`). A value a preset set is named as the preset's, with the field to write
beside the preset to override it (`spec.presets.overridden`)."""

from __future__ import annotations

import dataclasses

from holmes_sim.errors import FieldError
from holmes_sim.model.fp8_shapes import check_fp8_shapes
from holmes_sim.spec.job import ModelSpec, TrainingSpec
from holmes_sim.spec.presets import PRESETS, overridden, preset_source
from holmes_sim.spec.scenario import Scenario


def check_model(model: ModelSpec) -> None:
    """Raise FieldError for an architecture Megatron-Core refuses."""
    heads, groups = model.num_attention_heads, model.num_query_groups
    if groups is not None and heads % groups:
        raise FieldError("model.num_query_groups", f"num_query_groups={groups} must divide "
                         f"num_attention_heads={heads}; {_groups_fix(model, heads)}")
    if model.swiglu and model.squared_relu:
        raise FieldError("model.squared_relu", "squared_relu and swiglu are two MLP "
                         f"activations; {_one_activation(model)}")
    if model.hidden_size % heads:
        _refuse_head_width(model)
    if model.num_experts is not None:
        check_moe(model)
    else:
        _refuse_unused(model, ("moe_",), "the experts of an MoE model", "add num_experts")
    if model.position_embedding != "rope":
        preset = preset_source(model, "position_embedding")
        _refuse_unused(model, ("rotary_", "rope_"), "rotary position embeddings",
                       overridden(preset, "position_embedding", "rope") if preset else
                       f"set position_embedding: rope (not {model.position_embedding})")


def _refuse_unused(model: ModelSpec, prefixes: tuple[str, ...], shapes: str, fix: str) -> None:
    """Raise FieldError for the first field named with one of `prefixes` that was written (not
    its default, not its preset's value) although the model has no `shapes` for it to shape."""
    for f in dataclasses.fields(model):
        if f.name.startswith(prefixes) and getattr(model, f.name) != f.default and \
                preset_source(model, f.name) is None:
            raise FieldError(f"model.{f.name}", f"{f.name} shapes {shapes}; {fix}, or remove "
                             f"{f.name}")


def _groups_fix(model: ModelSpec, heads: int) -> str:
    """The fix for query groups that do not divide the heads, saying which value a preset set
    (removing a value written beside a preset restores the preset's, not multi-head attention)."""
    choices = f"a divisor of {heads}, or null for multi-head attention"
    if (preset := preset_source(model, "num_query_groups")) is not None:
        return overridden(preset, "num_query_groups", choices)
    if model.preset in PRESETS and "num_query_groups" in PRESETS[model.preset].fields:
        kept = PRESETS[model.preset].fields["num_query_groups"]
        return f"give {choices} (removing it restores preset {model.preset}'s {kept})"
    return f"give {choices}, or remove it"


def _refuse_head_width(model: ModelSpec) -> None:
    """Raise FieldError for a hidden size that the heads do not divide, on the field that was
    written when the other came from a preset."""
    h, heads = model.hidden_size, model.num_attention_heads
    hidden_preset = preset_source(model, "hidden_size")
    heads_preset = preset_source(model, "num_attention_heads")
    if hidden_preset is not None and heads_preset is None:
        raise FieldError("model.num_attention_heads", f"num_attention_heads={heads} must divide "
                         f"hidden_size={h}, preset {hidden_preset}'s; give a divisor of {h}, or "
                         "override hidden_size beside the preset")
    fix = f"give hidden_size a multiple of {heads}, or " + (
        overridden(heads_preset, "num_attention_heads", f"a divisor of {h}") if heads_preset
        else f"num_attention_heads a divisor of {h}")
    raise FieldError("model.hidden_size", f"hidden_size={h} must be a multiple of "
                     f"num_attention_heads={heads}; {fix}")


def _one_activation(model: ModelSpec) -> str:
    """The fix for swiglu with squared_relu: turn off the one a preset set, else keep one."""
    for preset_set, other in (("swiglu", "squared_relu"), ("squared_relu", "swiglu")):
        if (preset := preset_source(model, preset_set)) is not None:
            return f"{overridden(preset, preset_set, 'false')} to use {other}, or remove {other}"
    return "keep one"


def check_moe(model: ModelSpec) -> None:
    """Raise FieldError for MoE settings Megatron-Core refuses (`TransformerConfig`) or
    ignores (a shared-expert gate without a shared expert)."""
    experts, topk, freq = model.num_experts, model.moe_router_topk, model.moe_layer_freq
    if topk > experts:
        raise FieldError("model.moe_router_topk", f"moe_router_topk={topk} must be at most "
                         f"num_experts={experts}"
                         f"{_preset_fix(model, 'moe_router_topk', f'at most {experts}')}")
    if isinstance(freq, int) and freq < 1:
        raise FieldError("model.moe_layer_freq", f"an interval must be at least 1, got {freq} "
                         "(1: every layer is MoE); or give a 0/1 list, one entry per layer")
    if isinstance(freq, tuple):
        _check_layer_pattern(freq, model.num_layers, preset_source(model, "moe_layer_freq"))
    if model.moe_expert_imbalance > experts / topk:
        raise FieldError("model.moe_expert_imbalance", f"at most num_experts / moe_router_topk "
                         f"= {experts / topk:g} (every token routed to the busiest expert)")
    if model.moe_expert_capacity_factor is not None and \
            model.moe_router_load_balancing_type == "sinkhorn":
        raise FieldError("model.moe_expert_capacity_factor", "a capacity factor needs "
                         "aux_loss, seq_aux_loss, global_aux_loss or none load balancing")
    if model.moe_shared_expert_gate and not model.moe_shared_expert_intermediate_size:
        _refuse_shared_gate(model)
    check_router(model)


def _refuse_shared_gate(model: ModelSpec) -> None:
    """Raise FieldError for a shared-expert gate on a model without a shared expert (which
    Megatron-Core would ignore: the model simulated would not be the one trained)."""
    fix = _preset_fix(model, "moe_shared_expert_gate", "false") or \
        " (remove moe_shared_expert_gate)"
    raise FieldError("model.moe_shared_expert_gate", "moe_shared_expert_gate gates the shared "
                     "expert, but the model has none: set moe_shared_expert_intermediate_size, "
                     f"or turn the gate off{fix}")


def check_router(model: ModelSpec) -> None:
    """Raise FieldError for router settings Megatron-Core refuses (`TransformerConfig`, the
    sinkhorn router's assertion) or ignores (a loss weight without a loss)."""
    balancing, coeff = model.moe_router_load_balancing_type, model.moe_aux_loss_coeff
    if coeff and not balancing.endswith("aux_loss"):
        raise FieldError("model.moe_aux_loss_coeff", f"moe_aux_loss_coeff={coeff:g} weights "
                         f"a loss that {balancing} load balancing does not compute; give 0, or "
                         "aux_loss, seq_aux_loss or global_aux_loss balancing"
                         f"{_preset_fix(model, 'moe_aux_loss_coeff', '0')}")
    if model.moe_router_pre_softmax is False and model.moe_router_topk == 1 and \
            balancing != "sinkhorn" and model.moe_router_score_function == "softmax":
        raise FieldError("model.moe_router_pre_softmax", "Megatron-Core refuses top-1 softmax "
                         "routing without it (a softmax over the one chosen expert has no "
                         "gradient); set it true, or remove it")
    if model.moe_router_enable_expert_bias and model.moe_router_score_function != "sigmoid":
        raise FieldError("model.moe_router_enable_expert_bias", "Megatron-Core's expert bias "
                         "needs moe_router_score_function: sigmoid"
                         f"{_preset_fix(model, 'moe_router_enable_expert_bias', 'false')}")
    _check_groups(model)


def _preset_fix(model: ModelSpec, field: str, value: str) -> str:
    """'; <field> comes from preset P; override it beside the preset (<field>: value)' where
    the model's `field` is its preset's, else ''."""
    preset = preset_source(model, field)
    return f"; {overridden(preset, field, value)}" if preset else ""


def _check_groups(model: ModelSpec) -> None:
    """Raise FieldError unless group-limited routing is off or its groups divide the experts and
    each token's k experts can come from its chosen groups."""
    groups, chosen = model.moe_router_num_groups, model.moe_router_group_topk
    if (groups is None) != (chosen is None):
        missing = "moe_router_group_topk" if chosen is None else "moe_router_num_groups"
        given = "moe_router_num_groups" if chosen is None else "moe_router_group_topk"
        raise FieldError(f"model.{missing}", "group-limited routing needs both "
                         "moe_router_num_groups and moe_router_group_topk; give it, or remove "
                         f"the other{_preset_fix(model, given, 'null')}")
    if groups is None:
        return
    experts, topk = model.num_experts, model.moe_router_topk
    if experts % groups:
        raise FieldError("model.moe_router_num_groups", f"moe_router_num_groups={groups} must "
                         f"divide num_experts={experts}")
    if chosen > min(groups, topk):
        raise FieldError("model.moe_router_group_topk", f"moe_router_group_topk={chosen} must "
                         f"be at most moe_router_num_groups={groups} and moe_router_topk={topk} "
                         "(each chosen group is scored by its top topk / group_topk experts)"
                         f"{_preset_fix(model, 'moe_router_group_topk', f'at most {topk}')}")
    per_group = experts // groups
    if topk // chosen > per_group or chosen * per_group < topk:
        raise FieldError("model.moe_router_num_groups", f"moe_router_num_groups={groups} leaves "
                         f"{per_group} expert(s) a group, too few for moe_router_topk={topk} from "
                         f"moe_router_group_topk={chosen} group(s): Megatron-Core scores each group "
                         "by its top topk / group_topk experts and picks the k among the chosen "
                         "groups' (moe_utils.group_limited_topk); use fewer groups or choose more")


def _check_layer_pattern(freq: tuple[int, ...], layers: int, preset: str | None) -> None:
    """Raise FieldError unless `freq` (`preset`'s, if it came from one) is a 0/1 entry per
    layer, naming the rule it breaks."""
    bad = next((i for i, v in enumerate(freq) if v not in (0, 1)), None)
    if bad is not None:
        raise FieldError(f"model.moe_layer_freq[{bad}]", f"is {freq[bad]}; each entry is 0 (a "
                         "dense layer) or 1 (an MoE layer)")
    if len(freq) != layers:
        fix = (overridden(preset, "moe_layer_freq", f"a list of {layers} entries of 0 (dense) "
                          "or 1 (MoE), or an interval such as 1") if preset else
               "give one entry (0: dense, 1: MoE) per layer")
        raise FieldError("model.moe_layer_freq", f"lists {len(freq)} entries, but num_layers="
                         f"{layers}; {fix}")


def check_attention_backend(training: TrainingSpec) -> None:
    """Raise FieldError where `training.attention_backend` cannot run with
    `training.flash_attention` (Megatron-Core `AttnBackend`)."""
    backend, flash_attention = training.attention_backend, training.flash_attention
    if backend == "local":
        raise FieldError("training.attention_backend", "local is Megatron-Core's own attention, "
                         "which Megatron-LM runs only with `--spec local` (layers without "
                         "Transformer Engine), not modelled here; use unfused (TE's unfused "
                         "kernels) or auto")
    if backend in ("flash", "fused") and not flash_attention:
        raise FieldError("training.attention_backend", f"{backend} runs a fused attention "
                         "kernel; set training.flash_attention: true, or attention_backend: "
                         "unfused")
    if backend == "unfused" and flash_attention:
        raise FieldError("training.attention_backend", "unfused computes the s x s scores, "
                         "which flash_attention: true leaves out; set flash_attention: false "
                         "or attention_backend auto, flash or fused")


def check_layout_settings(s: Scenario, tp: int, cp: int) -> None:
    """Raise FieldError for a training or parallel field written that the run never reads
    (`check_unused_settings`), or for FP8 GEMM shapes Transformer Engine refuses at the
    scenario's own TP degree `tp` and CP degree `cp` (`model.fp8_shapes.check_fp8_shapes`)."""
    check_unused_settings(s)
    check_fp8_shapes(s.model, s.training, tp, cp)


def check_unused_settings(s: Scenario) -> None:
    """Raise FieldError for a field written (not its default, which never trips this) that
    changes nothing, so that a scenario, or a sweep point, does not run under a setting it
    ignores: `training.fp8_recipe` without precision fp8 (Megatron-Core reads it only where
    `config.fp8` is set, megatron/core/fp8_utils.py `get_fp8_context`), and
    `parallel.cp_comm_type` without context parallelism (`TEDotProductAttention` hands it to
    Transformer Engine only under `context_parallel_size > 1`,
    megatron/core/extensions/transformer_engine.py), unless `search.context` lists a degree
    above 1 for `plan` to search. A sweep point so refused is an infeasible row whose reason
    says how to sweep the field instead."""
    training, parallel = s.training, s.parallel
    recipe = _written(training, "fp8_recipe")
    if recipe is not None and training.precision != "fp8":
        raise FieldError("training.fp8_recipe", f"fp8_recipe={recipe} sets how the FP8 GEMMs "
                         f"scale their inputs, but training.precision is {training.precision}: "
                         "no GEMM runs in FP8 and the run is the same as without it; set "
                         "precision: fp8, or remove fp8_recipe (to compare the recipes in a "
                         "sweep, sweep them at precision fp8 only: --set training.precision=fp8 "
                         "--set training.fp8_recipe=delayed,tensorwise)")
    comm = _written(parallel, "cp_comm_type")
    if comm is not None and parallel.context == 1 and not any(
            c > 1 for c in s.search.context or ()):
        raise FieldError("parallel.cp_comm_type", f"cp_comm_type={comm} sets how a "
                         "context-parallel group exchanges tokens for attention, but "
                         "parallel.context is 1 (no such group): the run is the same as without "
                         "it; set context to 2 or more, list a degree above 1 in search.context "
                         "for plan, or remove cp_comm_type (a sweep over parallel.context finds "
                         "its context 1 point with p2p, the default: --set "
                         f"parallel.cp_comm_type=p2p,{comm})")


def _written(spec, name: str):
    """The value of `spec`'s field `name` where it is not the field's default, else None."""
    value = getattr(spec, name)
    default = next(f.default for f in dataclasses.fields(spec) if f.name == name)
    return None if value == default else value
