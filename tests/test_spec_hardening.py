"""Scenario inputs a fuzzing pass found read silently or worded wrongly: each is now one
ScenarioError naming the file, line and field, with the fix."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.errors import ScenarioError
from holmes_sim.prepare import prepare
from holmes_sim.spec.load import load_plain, load_scenario_text, mapping_text
from tests.conftest import small_scenario

runner = CliRunner()
BASE = small_scenario()


def _line(text: str, fragment: str) -> int:
    return next(i for i, t in enumerate(text.splitlines(), 1) if fragment in t)


def _refused(write_scenario, text: str, *fragments: str, at: str | None = None) -> str:
    """`holmes-sim check` on `text`: exit 2, one line holding every fragment and, with `at`,
    the line of the first line of `text` holding `at`; nothing written beside the file."""
    path = write_scenario(text)
    before = set(path.parent.iterdir())
    result = runner.invoke(app, ["check", str(path)])
    message = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and message.startswith(f"error: {path}:"), message
    for fragment in fragments:
        assert fragment in message, message
    if at is not None:
        assert f"{path}:{_line(text, at)}: " in message, message
    assert set(path.parent.iterdir()) == before
    return message


# ---- YAML 1.2 numbers and booleans ---------------------------------------------------------
@pytest.mark.parametrize("written,yaml11", [("8:32", 512), ("0x200", 512), ("5_12", 512),
                                            ("01000", 512), ("0b1000000000", 512)])
def test_yaml11_integer_forms_are_refused_with_the_plain_decimal_fix(write_scenario, written,
                                                                     yaml11):
    text = small_scenario(global_batch=written)
    _refused(write_scenario, text, f"training.global_batch_size: expected a whole number, got "
             f"str '{written}'", f"YAML 1.1 would read {yaml11}",
             "write it as a plain decimal whole number", at="global_batch_size")


@pytest.mark.parametrize("written", ["0o1000", "!!int 0x200", "'16'"])
def test_other_non_decimal_integers_are_refused(write_scenario, written):
    text = small_scenario(global_batch=written)
    message = _refused(write_scenario, text, "training.global_batch_size: ",
                       "write it as a plain decimal whole number", at="global_batch_size")
    assert "without quotes" in message if written == "'16'" else "YAML 1.1" not in message


@pytest.mark.parametrize("written", ["1_0.5", "1:30.5"])
def test_yaml11_float_forms_are_refused(write_scenario, written):
    text = small_scenario(latency_us=written)
    _refused(write_scenario, text, "latency_us: expected a number, got str",
             "write it as a plain decimal number", at=f"latency_us: {written}")


@pytest.mark.parametrize("written", ["yes", "on", "No", "OFF"])
def test_yaml11_booleans_are_text(write_scenario, written):
    text = small_scenario(tie=True).replace("tie_embeddings: true", f"tie_embeddings: {written}")
    _refused(write_scenario, text, f"model.tie_embeddings: expected true or false, got str "
             f"'{written}'", "YAML 1.1 would read", "write true or false", at="tie_embeddings")


def test_yaml12_numbers_and_booleans_still_read():
    data = load_plain("a: [512, -3, +7, 0, 0.5, .5, 1e9, 2.5E-3, -1.5e+2, true, False, TRUE, "
                      "null, ~, no, 2002-12-14, 0x10]", "t")
    assert data == {"a": [512, -3, 7, 0, 0.5, 0.5, 1e9, 2.5e-3, -150.0, True, False, True, None,
                          None, "no", "2002-12-14", "0x10"]}
    for value in (1e9, 1e-7, float("inf"), 10**20):  # floats and big ints as the API gives them
        assert load_plain(mapping_text({"x": value}, "api"), "t") == {"x": value}


def test_api_strings_that_yaml12_reads_as_numbers_stay_strings():
    data = {"name": "1e9", "description": "yes", "seed": 3}
    assert load_plain(mapping_text(data, "api"), "t") == data


def test_a_name_may_be_a_yaml11_boolean(write_scenario):
    prepared = prepare(write_scenario(BASE.replace("name: small", "name: no")))
    assert prepared.scenario.name == "no"


@pytest.mark.parametrize("written", ["1e9", "1.50", "007", "-0.0", "12"])
def test_a_text_field_takes_a_number_as_written(write_scenario, written):
    text = BASE.replace("name: small", f"name: small\ndescription: {written}")
    assert prepare(write_scenario(text)).scenario.description == written


# ---- characters YAML refuses -------------------------------------------------------------------
@pytest.mark.parametrize("char", ["\x00", "\x01", "\x7f"])
def test_a_control_byte_is_one_line_with_its_line_number(write_scenario, char):
    text = BASE.replace("name: c\n", f"name: c{char}\n")
    _refused(write_scenario, text, f"the character U+{ord(char):04X} is not allowed in YAML; "
             "remove it", at="name: c")


def test_a_control_byte_in_api_text_names_the_source():
    with pytest.raises(ScenarioError, match=r"^<text>:2: the character U\+0000 is not allowed"):
        load_scenario_text("a: 1\nb: x\x00\n", "<text>")


# ---- profile -----------------------------------------------------------------------------------
@pytest.mark.parametrize("written", ['""', "''", '"  "'])
def test_an_empty_profile_path_is_refused(write_scenario, written):
    text = BASE + f"profile: {written}\n"
    message = _refused(write_scenario, text, "profile: is empty; give the path of a profile JSON",
                       "or remove `profile:`", at="profile:")
    assert "folder" not in message


# ---- names -------------------------------------------------------------------------------------
_GPU = "{peak_tflops: 300, memory_gib: 80, memory_bandwidth_gbyte_per_s: 2000, intra_node: nvlink3}"


@pytest.mark.parametrize("table,key", [("gpus", '"my gpu!"'), ("gpus", '""'), ("nics", '"9nic"'),
                                       ("links", '"a.b"')])
def test_catalog_keys_follow_the_name_rule(write_scenario, table, key):
    entry = {"gpus": _GPU, "nics": "{type: ib, bandwidth_gbit_per_s: 200, latency_us: 2, "
                                   "efficiency: 0.9}",
             "links": "{bandwidth_gbyte_per_s: 200, latency_us: 3, efficiency: 0.8}"}[table]
    text = BASE + f"catalog:\n  {table}:\n    {key}: {entry}\n"
    _refused(write_scenario, text, f"catalog.{table}.{key.strip(chr(34))}: '{key.strip(chr(34))}'"
             " is not a valid name; use a letter then letters, digits, '-' or '_'", at=key)


@pytest.mark.parametrize("name", ["''", "'gpt 7b'", "'-x'", "x" * 65])
def test_the_model_name_follows_the_name_rule(write_scenario, name):
    text = BASE.replace("model: {", f"model: {{name: {name}, ")
    _refused(write_scenario, text, "model.name: ", "is not a valid model name; use a letter then "
             "letters, digits, '.', '-' or '_'", at="model:")


def test_model_names_with_versions_and_a_catalog_entry_are_accepted(write_scenario):
    text = (BASE.replace("model: {", "model: {name: llama3.1-8b_v2, ").replace("a100-80gb", "my-gpu_2")
            + f"catalog:\n  gpus:\n    my-gpu_2: {_GPU}\n")
    prepared = prepare(write_scenario(text))
    assert prepared.scenario.model.name == "llama3.1-8b_v2"
    assert prepared.cluster.nodes[0].gpu.name == "my-gpu_2"


@pytest.mark.parametrize("name", ["''", "'   '", "x" * 129, "x" * 1_000_000])
def test_the_scenario_name_is_1_to_128_characters(write_scenario, name):
    """The name titles the report's plots: a 10^6-character one took minutes to draw."""
    text = BASE.replace("name: small", f"name: {name}")
    message = _refused(write_scenario, text, "name: a scenario name is 1 to 128 characters, not "
                       "all spaces", at="name: ")
    assert len(message) < 400


def test_a_scenario_name_of_128_characters_of_any_script_is_taken(write_scenario):
    name = "Ünïcødé 名前 🚀 " + "x" * 115
    assert len(name) == 128
    text = BASE.replace("name: small", f"name: '{name}'")
    assert prepare(write_scenario(text)).scenario.name == name


# ---- variability.slow_gpus ---------------------------------------------------------------------
def _slow(*entries: str) -> str:
    return BASE + "variability:\n  slow_gpus:\n" + "".join(f"    - {e}\n" for e in entries)


@pytest.mark.parametrize("entries,field,words", [
    (("{node: ib-0, speed_factor: 0.8}", "{node: ib-0, speed_factor: 0.9, gpus: [3]}"),
     "variability.slow_gpus[1].gpus[0]", "GPU 3 of node ib-0 is named by variability.slow_gpus[0] "
     "already"),
    (("{node: ib-0, speed_factor: 0.8, gpus: [1, 3]}", "{node: ib-1, speed_factor: 0.8, gpus: [3]}",
      "{node: ib-0, speed_factor: 0.9, gpus: [2, 3]}"),
     "variability.slow_gpus[2].gpus[1]", "GPU 3 of node ib-0 is named by "
     "variability.slow_gpus[0].gpus[1] already"),
    (("{node: ib-0, speed_factor: 0.8, gpus: [4, 2, 4]}",),
     "variability.slow_gpus[0].gpus[2]", "GPU 4 of node ib-0 is named by "
     "variability.slow_gpus[0].gpus[0] already"),
    (("{node: ib-1, speed_factor: 0.8, gpus: [5]}", "{node: ib-1, speed_factor: 0.9}"),
     "variability.slow_gpus[1]", "this entry names every GPU of node ib-1, but "
     "variability.slow_gpus[0].gpus[0] names one of them already"),
    (("{node: ib-1, speed_factor: 0.8}", "{node: ib-1, speed_factor: 0.9}"),
     "variability.slow_gpus[1]", "this entry names every GPU of node ib-1, but "
     "variability.slow_gpus[0] names all of them already"),
])
def test_a_gpu_slowed_twice_is_refused_naming_both_places(write_scenario, entries, field, words):
    text = _slow(*entries)
    _refused(write_scenario, text, f"{field}: {words}; list each GPU once",
             at=entries[int(re.search(r"slow_gpus\[(\d)\]", field).group(1))])


def test_distinct_gpus_of_one_node_may_be_slowed_apart(write_scenario):
    prepared = prepare(write_scenario(_slow("{node: ib-0, speed_factor: 0.8, gpus: [1, 3]}",
                                            "{node: ib-0, speed_factor: 0.5, gpus: [2]}",
                                            "{node: ib-1, speed_factor: 0.9}")))
    speeds = {n.name: n.gpu_speeds for n in prepared.cluster.nodes}
    assert speeds["ib-0"] == (1.0, 0.8, 0.5, 0.8, 1.0, 1.0, 1.0, 1.0)
    assert speeds["ib-1"] == (0.9,) * 8


# ---- the interleaved schedule at pipeline 1 ----------------------------------------------------
@pytest.mark.parametrize("virtual,extra", [(1, ""), (2, ""), (2, "overlap_p2p_comm: true, ")])
def test_interleaved_without_a_pipeline_is_refused_as_megatron_does(write_scenario, virtual,
                                                                    extra):
    text = small_scenario(pp=1, schedule="interleaved", virtual=virtual)
    text = text.replace("training: {", f"training: {{{extra}")
    _refused(write_scenario, text, "parallel.schedule: the interleaved schedule needs "
             "parallel.pipeline > 1 (Megatron-LM refuses virtual pipeline stages at pipeline 1); "
             "use schedule: 1f1b, or raise parallel.pipeline", at="parallel:")


def test_interleaved_with_a_pipeline_and_1f1b_without_are_accepted(write_scenario):
    assert prepare(write_scenario(small_scenario(pp=2, schedule="interleaved", virtual=2))).pp == 2
    assert prepare(write_scenario(small_scenario(pp=1))).pp == 1


def test_the_planner_searches_a_pipeline_1_scenario_without_interleaved_layouts(write_scenario):
    from holmes_sim.search.planner import layouts

    text = small_scenario(pp=1, layers=4) + "search: {tensor: [8], pipeline: [1, 2], " \
        "micro_batch_size: [1], recompute: [none], sequence_parallel: [false], " \
        "schedule: [1f1b, interleaved], virtual_stages: [2]}\n"
    prepared = prepare(write_scenario(text))
    found = {(lay.pp, lay.schedule) for lay in layouts(prepared, prepared.scenario.search)}
    assert found == {(1, "1f1b"), (2, "1f1b"), (2, "interleaved")}


# ---- moe_layer_freq: each message states the rule it breaks ------------------------------------
def _with_model(text: str, fields: str) -> str:
    """`text` with its model mapping replaced by `{fields}` (on one line)."""
    return re.sub(r"model: \{.*?\}\n", f"model: {{{fields}}}\n", text, count=1, flags=re.S)


def _moe(fields: str, tp: int = 2) -> str:
    """The small scenario with Mixtral cut to 4 layers and `fields` (TP 2 needs SP for MoE)."""
    text = small_scenario(tp=tp, pp=1).replace("training: {", "training: {sequence_parallel: "
                                                "true, ")
    return _with_model(text, f"preset: mixtral-8x7b, num_layers: 4, seq_length: 1024, {fields}")


@pytest.mark.parametrize("freq,field,words", [
    ("-1", "model.moe_layer_freq", "must be at least 1, got -1; an interval N makes every N-th "
     "layer MoE; or give a list of 0/1, one entry per layer"),
    ("0", "model.moe_layer_freq", "must be at least 1, got 0; an interval N"),
    ("[1, 2, 1, 1]", "model.moe_layer_freq[1]", "must be at most 1, got 2; each entry is 0 (a "
     "dense layer) or 1 (an MoE layer)"),
    ("[1, 1, -1, 1]", "model.moe_layer_freq[2]", "must be at least 0, got -1; each entry is 0"),
    ("[1, 1, 1]", "model.moe_layer_freq", "lists 3 entries, but num_layers=4; give one entry "
     "(0: dense, 1: MoE) per layer"),
])
def test_moe_layer_freq_messages_state_the_rule_broken(write_scenario, freq, field, words):
    text = _moe(f"moe_layer_freq: {freq}")
    message = _refused(write_scenario, text, f"{field}: {words}", at="moe_layer_freq")
    assert "got 4" not in message


def test_check_moe_names_the_wrong_entry_and_the_count():
    import dataclasses

    from holmes_sim.errors import FieldError
    from holmes_sim.model.checks import check_model
    from holmes_sim.spec.job import ModelSpec
    from holmes_sim.spec.presets import preset_fields

    model = ModelSpec(**dict(preset_fields("mixtral-8x7b"), num_layers=4))
    for freq, path, words in [((1, 0, 3, 1), "model.moe_layer_freq[2]", "is 3; each entry is 0"),
                              ((1, 0, 1), "model.moe_layer_freq", "lists 3 entries, but "
                               "num_layers=4"),
                              (-2, "model.moe_layer_freq", "at least 1, got -2")]:
        with pytest.raises(FieldError) as info:
            check_model(dataclasses.replace(model, moe_layer_freq=freq))
        assert info.value.path == path and words in info.value.message, info.value


# ---- values a preset filled in ---------------------------------------------------------------
def _preset(name: str, fields: str) -> str:
    """The small scenario (TP 1, PP 1) with model `name` and `fields` ("a: 1, b: [0, 1]"),
    one field a line."""
    lines = "".join(f"  {f}\n" for f in re.split(r", (?=\w+:)", fields))
    block = f"model:\n  preset: {name}\n{lines}"
    return re.sub(r"model: \{.*?\}\n", lambda _: block, small_scenario(tp=1, pp=1), count=1,
                  flags=re.S)


@pytest.mark.parametrize("name,fields,words,at,override", [
    ("llama3-70b", "num_attention_heads: 128, hidden_size: 7680, num_query_groups: 7",
     "model.num_query_groups: num_query_groups=7 must divide num_attention_heads=128; give a "
     "divisor", "num_query_groups:", None),
    ("llama3-70b", "num_attention_heads: 60, hidden_size: 7680",
     "model.num_query_groups: num_query_groups=8 must divide num_attention_heads=60; "
     "num_query_groups comes from preset llama3-70b; override it beside the preset "
     "(num_query_groups: a divisor of 60, or null for multi-head attention)", "preset:",
     "num_query_groups: 6"),
    ("llama3-8b", "multi_latent_attention: true", "model.num_query_groups: multi-head latent "
     "attention has no key/value groups (Megatron refuses --group-query-attention with "
     "--multi-latent-attention); num_query_groups comes from preset llama3-8b; override it "
     "beside the preset (num_query_groups: null)", "preset:", "num_query_groups: null"),
    ("deepseek-v3", "multi_latent_attention: false", "model.q_lora_rank: preset deepseek-v3 "
     "sets q_lora_rank, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim for "
     "multi-head latent attention; keep multi_latent_attention: true, or override each beside "
     "the preset with null", "preset:", "q_lora_rank: null, kv_lora_rank: null, qk_head_dim: "
     "null, qk_pos_emb_head_dim: null, v_head_dim: null"),
    ("deepseek-v2-lite", "num_layers: 4", "model.moe_layer_freq: lists 27 entries, but "
     "num_layers=4; moe_layer_freq comes from preset deepseek-v2-lite; override it beside the "
     "preset (moe_layer_freq: a list of 4 entries of 0 (dense) or 1 (MoE), or an interval such "
     "as 1)", "preset:", "moe_layer_freq: [0, 1, 1, 1]"),
    ("mixtral-8x7b", "num_layers: 4, num_experts: 1", "model.moe_router_topk: "
     "moe_router_topk=2 must be at most num_experts=1; moe_router_topk comes from preset "
     "mixtral-8x7b; override it beside the preset (moe_router_topk: at most 1)", "preset:",
     "moe_router_topk: 1"),
    ("llama2-7b", "squared_relu: true", "model.squared_relu: squared_relu and swiglu are two "
     "MLP activations; swiglu comes from preset llama2-7b; override it beside the preset "
     "(swiglu: false) to use squared_relu, or remove squared_relu", "squared_relu:",
     "swiglu: false"),
    ("nemotron4-15b", "swiglu: true", "model.squared_relu: squared_relu and swiglu are two MLP "
     "activations; squared_relu comes from preset nemotron4-15b; override it beside the preset "
     "(squared_relu: false) to use swiglu, or remove swiglu", "preset:", "squared_relu: false"),
])
def test_a_presets_value_is_named_with_its_override(write_scenario, name, fields, words, at,
                                                    override):
    """The message says which preset set the value and how to override it, at the `preset:`
    line; writing that override makes the scenario valid."""
    message = _refused(write_scenario, _preset(name, fields), words, at=at)
    if override is None:  # a value written beside the preset: the plain message
        return
    assert "remove num_query_groups" not in message and "remove it" not in message
    assert prepare(write_scenario(_preset(name, f"{fields}, {override}"))).scenario.model.preset


def test_a_long_base_60_number_is_refused_fast(write_scenario):
    import time

    text = small_scenario(global_batch="1" + ":1" * 300_000)
    start = time.monotonic()
    _refused(write_scenario, text, "training.global_batch_size: expected a whole number")
    assert time.monotonic() - start < 2.0


def test_a_link_probe_too_small_to_time_throughput_is_refused(write_scenario):
    # A 4-byte probe timed the latency: a 2 Gbit/s link read 75 kB/s, every prediction 100x off.
    text = BASE + "testbed:\n  iterations: 2\n  link_probe_bytes: 4\n"
    _refused(write_scenario, text, "testbed.link_probe_bytes: must be at least 1048576, got 4",
             "measures a fabric's throughput", "give at least 1048576 (1 MiB",
             at="link_probe_bytes")
    ok = BASE + "testbed:\n  link_probe_bytes: 1048576\n"
    assert runner.invoke(app, ["check", str(write_scenario(ok))]).exit_code == 0


def test_an_alias_bomb_names_the_line_of_the_key_it_expands_under(write_scenario):
    # An alias's own place is not kept by the YAML composer; the line was the document's first.
    text = ("# a comment\n" + BASE + "x0: &a0 [" + ", ".join(["lol"] * 9) + "]\n"
            + "".join(f"x{k}: &a{k} [" + ", ".join([f"*a{k - 1}"] * 9) + "]\n" for k in (1, 2, 3))
            + "bomb: [" + ", ".join(["*a3"] * 20) + "]\n")
    message = _refused(write_scenario, text, "more than 100000 values after expanding aliases",
                       at="bomb:")
    assert re.search(r": bomb(\[\d+\])+: more than", message), message
