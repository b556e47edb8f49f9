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


def test_fp8_token_rows_that_are_not_a_multiple_of_8_are_refused(write_scenario):
    """seq_length 4100 at micro-batch 1: linear_qkv's FP8 input has 4100 rows, which Transformer
    Engine's `assert_dim_for_fp8_exec` refuses; the nearest seq_length values and a micro-batch
    that fix it are named. bf16 runs the same shape."""
    message = _fp8_error(write_scenario, model="seq_length: 4100")
    assert ":7: model.seq_length: under precision fp8 Transformer Engine refuses linear_qkv's " \
        "input: its rows micro_batch_size=1 x seq_length=4100 = 4100 is not a multiple of 8" \
        in message
    assert "use seq_length 4096 or 4104 (" in message
    assert "training.micro_batch_size a multiple of 2, or precision: bf16" in message
    prepare(write_scenario(_fp8(model="seq_length: 4100", mb=2, training="precision: fp8")))
    prepare(write_scenario(_fp8(model="seq_length: 4100", training="precision: bf16")))


def test_fp8_hidden_size_not_a_multiple_of_16_is_refused(write_scenario):
    """hidden_size 4104 (36 heads of 114): linear_qkv's input is 4104 wide; the nearest hidden
    sizes offered are multiples of the heads every FP8 GEMM takes."""
    model = "seq_length: 4096, hidden_size: {}, num_attention_heads: 36, num_query_groups: 12"
    message = _fp8_error(write_scenario, model=model.format(4104))
    assert "model.hidden_size: under precision fp8 Transformer Engine refuses linear_qkv's " \
        "input: its last dimension hidden_size=4104 is not a multiple of 16" in message
    assert "use hidden_size 4032 or 4176 (" in message
    for hidden in (4032, 4176):
        prepare(write_scenario(_fp8(model=model.format(hidden))))


def test_fp8_rows_count_the_tokens_each_gpu_holds_under_sp_and_cp(write_scenario):
    """seq_length 4104 passes alone; under sequence parallelism at TP 2 each GPU's QKV input has
    2052 rows (refused; turning SP off is offered), and at CP 4 without SP 1026 rows."""
    sp = "precision: fp8, sequence_parallel: true"
    prepare(write_scenario(_fp8(model="seq_length: 4104", parallel="tensor: 2")))
    message = _fp8_error(write_scenario, model="seq_length: 4104", training=sp,
                         parallel="tensor: 2")
    assert "seq_length=4104 / tensor=2 (sequence parallelism) = 2052 is not a multiple of 8" \
        in message
    assert "use seq_length 4096 or 4112 (" in message
    assert "training.sequence_parallel: false" in message
    message = _fp8_error(write_scenario, model="seq_length: 4104", parallel="tensor: 1, context: 4")
    assert "linear_qkv's input: its rows micro_batch_size=1 x seq_length=4104 / context=4 = 1026" \
        in message
    assert "use seq_length 4096 or 4128 (" in message and "a multiple of 4" in message


def test_fp8_widths_are_checked_as_tensor_parallelism_splits_them(write_scenario):
    """ffn_hidden_size 14352 is a multiple of 16, but TP 2 leaves linear_fc2 7176 columns a GPU
    (refused, offering TP 1 and the nearest widths TP 2 takes); 14344 fails at any degree."""
    model = "seq_length: 4096, ffn_hidden_size: {}"
    prepare(write_scenario(_fp8(model=model.format(14352))))
    message = _fp8_error(write_scenario, model=model.format(14352), parallel="tensor: 2")
    assert "model.ffn_hidden_size: under precision fp8 Transformer Engine refuses linear_fc2's " \
        "input: its last dimension ffn_hidden_size=14352 / tensor=2 = 7176 is not a multiple " \
        "of 16" in message
    assert "use ffn_hidden_size 14336 or 14368 (" in message and "parallel.tensor: 1" in message
    message = _fp8_error(write_scenario, model=model.format(14344))
    assert "ffn_hidden_size=14344 is not a multiple of 16" in message
    assert "parallel.tensor" not in message


def test_fp8_operands_per_gpu_follow_transformer_engines_linear_layers():
    """Llama 3 8B (h 4096, 32 heads, 8 groups, SwiGLU f 14336) at TP 2, SP, CP 2, micro-batch 2,
    s 8192: token rows 2 x 8192 / 2 = 8192 a GPU, 4096 for the column-parallel inputs under SP;
    weight shards [out / t, in] and [out, in / t]."""
    from holmes_sim.model.fp8_shapes import fp8_operands
    from holmes_sim.spec.job import ModelSpec, TrainingSpec

    model = ModelSpec(num_layers=1, hidden_size=4096, num_attention_heads=32,
                      num_query_groups=8, seq_length=8192, ffn_hidden_size=14336, swiglu=True)
    training = TrainingSpec(global_batch_size=8, micro_batch_size=2, precision="fp8",
                            sequence_parallel=True)
    shapes = {(o.layer, o.tensor): (o.rows.size, o.cols.size)
              for o in fp8_operands(model, training, tp=2, cp=2)}
    assert shapes == {("linear_qkv", "input"): (4096, 4096),
                      ("linear_qkv", "weight"): (3072, 4096),
                      ("linear_proj", "input"): (8192, 2048),
                      ("linear_proj", "weight"): (4096, 2048),
                      ("linear_fc1", "input"): (4096, 4096),
                      ("linear_fc1", "weight"): (14336, 4096),
                      ("linear_fc2", "input"): (8192, 7168),
                      ("linear_fc2", "weight"): (4096, 7168)}


def test_plan_skips_the_layouts_whose_fp8_gemms_transformer_engine_refuses(write_scenario):
    """seq_length 4100 at micro-batch 2 runs without SP; micro-batch 1 at any degree, and SP at
    TP 2 or 4 (2 x 4100 / t rows), break TE's rule: the search keeps none of those."""
    from holmes_sim.search.planner import layouts
    from holmes_sim.search.rejections import Rejections

    text = _fp8(model="seq_length: 4100", mb=2, extra="search: {micro_batch_size: [1, 2], "
                "tensor: [1, 2, 4], recompute: [none], policies: [megatron]}\n")
    prepared = prepare(write_scenario(text))
    rejections = Rejections(prepared.scenario.search)
    kept = {(lay.tp, lay.micro_batch_size, lay.sequence_parallel)
            for lay in layouts(prepared, prepared.scenario.search, rejections)}
    assert kept == {(1, 2, False), (2, 2, False), (4, 2, False)}
    assert "model.seq_length: under precision fp8 Transformer Engine refuses" in \
        rejections.summary()
