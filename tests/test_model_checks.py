"""Architecture and parallel-degree errors that name the fix: a value written beside a preset is
told apart from the preset's own, and every rule says what to write."""

from __future__ import annotations

import pytest

from holmes_sim.errors import ScenarioError
from holmes_sim.prepare import prepare

_SCENARIO = """name: m
fabrics: [{{name: ib, type: ib}}]
clusters:
  - name: c
    nodes:
      - {{count: 2, gpu: h100-sxm, gpus_per_node: 8, nics: [{{type: ib, model: connectx-7, count: 8, fabric: ib}}]}}
model: {{{model}}}
training: {{global_batch_size: 16, micro_batch_size: 1, flash_attention: true, recompute: full}}
parallel: {{{parallel}}}
policies: [megatron]
"""


def _error(write_scenario, model: str, parallel: str = "tensor: 1, pipeline: 1") -> str:
    with pytest.raises(ScenarioError) as info:
        prepare(write_scenario(_SCENARIO.format(model=model, parallel=parallel)))
    return str(info.value)


def test_groups_written_beside_a_preset_say_removing_restores_the_presets(write_scenario):
    """Removing a num_query_groups written beside llama3-8b restores the preset's 8, not
    multi-head attention: the fix says so and offers null for that."""
    message = _error(write_scenario, "preset: llama3-8b, num_query_groups: 5")
    assert "model.num_query_groups" in message
    assert "null for multi-head attention" in message
    assert "removing it restores preset llama3-8b's 8" in message


def test_heads_written_beside_a_presets_hidden_size_are_the_field_to_fix(write_scenario):
    """num_attention_heads: 24 beside llama3-8b's hidden size 4096: the error is on the written
    field and names the preset's value."""
    message = _error(write_scenario, "preset: llama3-8b, num_attention_heads: 24")
    assert "model.num_attention_heads: num_attention_heads=24 must divide hidden_size=4096, " \
        "preset llama3-8b's; give a divisor of 4096" in message


def test_hidden_size_beside_a_presets_heads_offers_both_fixes(write_scenario):
    message = _error(write_scenario, "preset: llama3-8b, hidden_size: 4001")
    assert "model.hidden_size" in message
    assert "give hidden_size a multiple of 32" in message
    assert "num_attention_heads comes from preset llama3-8b" in message


def test_tensor_degree_that_does_not_divide_the_query_groups_names_the_divisors(write_scenario):
    message = _error(write_scenario, "preset: llama3-8b, num_query_groups: 2",
                     "tensor: 4, pipeline: 1")
    assert "tensor=4 must divide model.num_query_groups=2" in message
    assert "use one of 1, 2 (the degrees that divide" in message


def test_the_tensor_degrees_offered_pass_every_rule(write_scenario):
    """Qwen2.5-7B: 28 heads, 4 query groups, FFN 18,944, 8 GPUs a node. tensor 8 fails on the
    heads; the fix offers only degrees that also divide the query groups (not 7 or 14)."""
    message = _error(write_scenario, "preset: qwen2.5-7b", "tensor: 8, pipeline: 1")
    assert "tensor=8 must divide model.num_attention_heads=28" in message
    assert "use one of 1, 2, 4 (" in message


def test_experts_take_the_tensor_degree_without_expert_tensor(write_scenario):
    """Megatron-Core's expert_tensor_parallel_size defaults to the TP degree, which must then
    divide the experts' FFN width, as an explicit expert_tensor must."""
    model = "preset: mixtral-8x7b, moe_ffn_hidden_size: 14337"
    implicit = _error(write_scenario, model, "tensor: 2, pipeline: 1")
    explicit = _error(write_scenario, model, "tensor: 2, pipeline: 1, expert_tensor: 2")
    assert "parallel.tensor: tensor=2 must divide the experts' FFN width 14337" in implicit
    assert "set parallel.expert_tensor to a divisor of it" in implicit
    assert "expert_tensor=2 must divide the experts' FFN width 14337" in explicit


@pytest.mark.parametrize("model, field, fix", [
    ("moe_router_topk: 4", "moe_router_topk", "add num_experts, or remove moe_router_topk"),
    ("moe_aux_loss_coeff: 0.5", "moe_aux_loss_coeff", "add num_experts"),
    ("rotary_base: 500000", "rotary_base",
     "set position_embedding: rope (not learned), or remove rotary_base"),
    ("position_embedding: none, rope_scaling: true", "rope_scaling",
     "set position_embedding: rope (not none), or remove rope_scaling"),
])
def test_a_written_field_the_model_has_no_use_for_is_refused(write_scenario, model, field, fix):
    """MoE fields without num_experts and RoPE fields without rotary embeddings did nothing;
    like MLA fields without MLA they are refused, naming the field and both fixes."""
    message = _error(write_scenario, "num_layers: 2, hidden_size: 256, num_attention_heads: 4, "
                                     f"seq_length: 128, {model}")
    assert f"model.{field}: {field} shapes" in message and fix in message


def test_a_presets_own_rope_fields_stay_unused_under_a_written_position_embedding(
        write_scenario):
    """llama3-8b sets rotary_base and rope fields; `position_embedding: learned` beside it is
    taken (its rope fields go unused), while a rope field written there too is refused."""
    from holmes_sim.prepare import prepare_text

    text = _SCENARIO.format(model="preset: llama3-8b, num_layers: 2, position_embedding: learned",
                            parallel="tensor: 1, pipeline: 1")
    prepared = prepare_text(text, "<llama>")
    assert prepared.scenario.model.position_embedding == "learned"
    assert prepared.scenario.model.rotary_base == 500000
    message = _error(write_scenario, "preset: llama3-8b, position_embedding: learned, "
                                     "rotary_percent: 0.5")
    assert "model.rotary_percent: rotary_percent shapes rotary position embeddings; set " \
        "position_embedding: rope (not learned), or remove rotary_percent" in message


def test_rope_fields_beside_a_presets_learned_embeddings_say_to_override_it(write_scenario):
    message = _error(write_scenario, "preset: gpt3-175b, num_layers: 2, rotary_base: 20000")
    assert "model.rotary_base: rotary_base shapes rotary position embeddings; " \
        "position_embedding comes from preset gpt3-175b" in message


_FP8 = """name: f
fabrics: [{{name: ib, type: ib}}]
clusters:
  - name: c
    nodes:
      - {{count: 2, gpu: h100-sxm, gpus_per_node: 8, nics: [{{type: ib, model: connectx-7, count: 8, fabric: ib}}]}}
model: {{preset: llama3-8b, num_layers: 4, {model}}}
training: {{global_batch_size: 64, micro_batch_size: {mb}, flash_attention: true, {training}}}
parallel: {{pipeline: 1, {parallel}}}
policies: [megatron]
{extra}"""


def _fp8(model: str = "seq_length: 4096", training: str = "precision: fp8", mb: int = 1,
         parallel: str = "tensor: 1", extra: str = "") -> str:
    return _FP8.format(model=model, training=training, mb=mb, parallel=parallel, extra=extra)


def _fp8_error(write_scenario, **fields) -> str:
    with pytest.raises(ScenarioError) as info:
        prepare(write_scenario(_fp8(**fields)))
    return str(info.value)


def test_an_fp8_recipe_without_fp8_is_refused_saying_how_to_sweep_the_recipes(write_scenario):
    """tensorwise under bf16 ran the bf16 numbers under another label; the error names the
    field, both fixes and the sweep that compares the recipes. The default recipe, written or
    not, passes under bf16, and tensorwise passes under fp8."""
    message = _fp8_error(write_scenario, training="precision: bf16, fp8_recipe: tensorwise")
    assert ":8: training.fp8_recipe: fp8_recipe=tensorwise sets how the FP8 GEMMs scale" in message
    assert "training.precision is bf16" in message
    assert "set precision: fp8, or remove fp8_recipe" in message
    assert "--set training.precision=fp8 --set training.fp8_recipe=delayed,tensorwise" in message
    for training in ("precision: bf16, fp8_recipe: delayed", "precision: bf16",
                     "precision: fp8, fp8_recipe: tensorwise"):
        prepare(write_scenario(_fp8(training=training)))


def test_a_cp_comm_type_without_context_parallelism_is_refused(write_scenario):
    """a2a at context 1 was taken and did nothing; refused, unless plan's search.context lists
    a CP degree it applies to. p2p, the default, passes written."""
    message = _fp8_error(write_scenario, training="precision: bf16",
                         parallel="tensor: 1, context: 1, cp_comm_type: a2a")
    assert ":9: parallel.cp_comm_type: cp_comm_type=a2a sets how a context-parallel group" \
        in message
    assert "set context to 2 or more, list a degree above 1 in search.context for plan, or " \
        "remove cp_comm_type" in message
    assert "--set parallel.cp_comm_type=p2p,a2a" in message
    prepare(write_scenario(_fp8(training="precision: bf16", parallel="tensor: 1, context: 1, "
                                "cp_comm_type: p2p")))
    prepare(write_scenario(_fp8(training="precision: bf16", parallel="tensor: 1, cp_comm_type: "
                                "a2a", extra="search: {context: [1, 2]}\n")))


def test_a_sweep_of_precision_and_recipe_marks_the_bf16_point_labelled_tensorwise(
        write_scenario):
    """precision fp8,bf16 x fp8_recipe delayed,tensorwise: three points run, and the fourth, a
    bf16 run labelled tensorwise, is an infeasible row saying why, not a duplicate of bf16."""
    from holmes_sim.search.sweep import run_sweep

    path = write_scenario(_fp8(training="precision: bf16"))
    result = run_sweep(path, ["training.precision=fp8,bf16",
                              "training.fp8_recipe=delayed,tensorwise"], jobs=1)
    status = {(r["training.precision"], r["training.fp8_recipe"]): r["status"]
              for r in result.rows}
    assert status == {("fp8", "delayed"): "ok", ("fp8", "tensorwise"): "ok",
                      ("bf16", "delayed"): "ok", ("bf16", "tensorwise"): "infeasible"}
    assert result.rows[3]["reason"].startswith("training.fp8_recipe: fp8_recipe=tensorwise")

