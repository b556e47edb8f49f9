"""The DGX H100 set from NVIDIA's NeMo / Megatron-Bridge performance summaries: its rows parse with
their sources, each is either simulated or reported with its reason, the step time comes from the
published tokens/s, and the table's mean and max come from the simulated rows."""

from __future__ import annotations

from dataclasses import replace

import json

import pytest
from rich.console import Console

from holmes_sim.errors import ScenarioError
from holmes_sim.spec.load import load_scenario_text
from holmes_sim.validation import nemo_summary
from holmes_sim.validation.published import (PUBLISHED_DIR, PublishedCheck, case_name, cases,
                                             check_table, evaluate, scenario_text)

STEM = "nemo_dgx_h100"
ROW_KEYS = {"source", "model", "preset", "gpus", "global_batch", "micro_batch", "seq_length", "tp",
            "pp", "cp", "vp", "precision_published", "tokens_per_s_per_gpu",
            "model_tflops_per_gpu_published"}


def _data():
    return json.loads((PUBLISHED_DIR / f"{STEM}.json").read_text())


def _cases():
    return {c.name: c for c in cases() if c.dataset == STEM}


def test_rows_parse_with_their_source_and_launch_settings():
    data = _data()
    assert nemo_summary.is_nemo_dataset(data)
    assert "4c73f77670624bc1fd97ce444dea4e22ef5eb9c5" in data["sources"]["nemo-24.07"]["measurements"]
    bridge = data["sources"]["megatron-bridge-25.11"]["measurements"]
    assert "00b7660be0254ac6f95f44164ddd0c3e9cc798ed" in bridge
    for row in data["rows"]:
        assert ROW_KEYS <= set(row), row
        assert row["source"] in data["sources"] and data["sources"][row["source"]]["software"]
        assert row["gpus"] % (row["tp"] * row["pp"] * row["cp"]) == 0, row
    assert min(r["gpus"] for r in data["rows"]) == 8 and max(r["gpus"] for r in data["rows"]) == 1024
    assert any(r["cp"] > 1 for r in data["rows"])


def test_the_later_24_07_tables_are_listed_beside_the_first():
    """NeMo's main replaced the 24.07 table (4c73f77670) twice, with vboost runs: the caveat
    gives every row's later tokens/s/GPU, in row order, and why the rows keep the first."""
    data = _data()
    caveat = next(c for c in data["caveats"] if "3a8081fef6" in c)
    assert "8e3d65dcfe" in caveat and "vboost" in caveat and "does not model" in caveat
    rows = [r for r in data["rows"] if r["source"] == "nemo-24.07"]
    first = ", ".join(str(r["tokens_per_s_per_gpu"]) for r in rows)
    assert f"4c73f77670 {first};" in caveat
    assert "3a8081fef6 23574, 5894, 745, 832, 16634, 8715, 1717, 12507, 4289, 328, 11883, 1549;" \
        in caveat


def test_the_rows_that_are_an_example_scripts_launch_are_named():
    """The launcher's H100 FP8 examples override their configs' layout: four rows are exactly an
    example's launch, and the data file and docs/cost_models.md name those four, not 'all'."""
    from tests.conftest import REPO
    caveat = next(c for c in _data()["caveats"] if "Exactly an example's launch" in c)
    exact = caveat.split("Exactly an example's launch")[1].split("The others")[0]
    assert [m for m in ("GPT3-5B", "GPT3-20B", "GPT3-175B", "LLAMA2-7B", "LLAMA2-13B",
                        "LLAMA2-70B", "LLAMA3-8B", "LLAMA3-70B", "Nemotron-8B", "Nemotron-22B")
            if f" {m} (" in exact] == ["GPT3-5B", "LLAMA2-7B", "LLAMA2-70B", "LLAMA3-8B"]
    doc = " ".join((REPO / "docs" / "cost_models.md").read_text().split())
    assert "load unchanged" not in doc
    assert "only the GPT-3 5B, Llama 2 7B, Llama 2 70B and Llama 3 8B rows are exactly an " \
           "example's launch" in doc


def test_every_row_is_simulated_or_carries_its_reason():
    data, by_name = _data(), _cases()
    assert len(by_name) == len(data["rows"])
    for row in data["rows"]:
        case = by_name[nemo_summary.row_name(row)]
        if row["cp"] > 1 and not nemo_summary.context_parallel_available():
            assert case.not_simulated == nemo_summary.NEEDS_CONTEXT_PARALLELISM
        else:
            assert case.not_simulated is None and case.scenario.exists()
        if row["preset"] is None:
            assert row["architecture"]["num_layers"] > 0 and "NVIDIA/NeMo" in row["architecture_source"]
    assert sum(c.not_simulated is None for c in by_name.values()) >= 10


def test_context_parallel_rows_simulate_once_the_spec_has_the_field(monkeypatch):
    """One switch: ParallelSpec growing `context` makes every CP row a simulated row, and its
    committed scenario already carries the degree."""
    row = next(r for r in _data()["rows"] if r["cp"] > 1)
    assert f"  {nemo_summary.CONTEXT_FIELD}: {row['cp']}\n" in scenario_text(_data(), row)
    monkeypatch.setattr(nemo_summary, "context_parallel_available", lambda: True)
    assert nemo_summary.not_simulated(row) is None


def test_405b_simulates_through_its_recipes_uneven_split(monkeypatch):
    """126 layers do not divide into PP 8 x VP 8 chunks: the row simulates through its recipe's
    split switches, rendered into the scenario, and waits without them."""
    row = next(r for r in _data()["rows"] if r["model"] == "LLAMA3.1_405B")
    assert nemo_summary.not_simulated(row) is None
    assert "  account_for_embedding_in_pipeline_split: true\n" in scenario_text(_data(), row)
    monkeypatch.setattr(nemo_summary, "_split_fields", lambda r: {})
    assert nemo_summary.not_simulated(row) == nemo_summary.NEEDS_UNEVEN_SPLIT
    monkeypatch.setattr(nemo_summary, "context_parallel_available", lambda: False)
    assert nemo_summary.not_simulated(row) == nemo_summary.NEEDS_CONTEXT_PARALLELISM


def test_a_row_without_any_architecture_is_recorded_with_its_reason():
    row = dict(next(r for r in _data()["rows"] if r["model"] == "GPT3-5B"), architecture=None)
    assert nemo_summary.not_simulated(row) == nemo_summary.NO_ARCHITECTURE
    assert scenario_text(_data(), row) is None


def test_a_row_without_a_preset_renders_its_own_architecture():
    data = _data()
    row = next(r for r in data["rows"] if r["model"] == "Nemotron-22B")
    model = load_scenario_text(scenario_text(data, row)).model
    assert (model.num_layers, model.hidden_size, model.ffn_hidden_size) == (40, 6144, 24576)
    assert model.squared_relu and not model.bias and not model.tie_embeddings
    assert model.position_embedding == "rope" and model.seq_length == 4096


def test_rendered_rows_load_with_the_recipe_settings_holmes_sim_has():
    data = _data()
    row = next(r for r in data["rows"] if r["model"] == "LLAMA2-70B")
    scenario = load_scenario_text(scenario_text(data, row))
    t, p = scenario.training, scenario.parallel
    assert (t.precision, t.recompute, t.micro_batch_size, t.global_batch_size) == ("fp8", "none", 1, 128)
    assert t.sequence_parallel and t.distributed_optimizer and t.flash_attention and t.tp_comm_overlap
    assert not t.grad_reduce_in_fp32
    assert (p.tensor, p.pipeline, p.schedule, p.virtual_stages) == (4, 4, "interleaved", 20)
    assert scenario.model.num_query_groups == 8 and scenario.model.swiglu


@pytest.mark.parametrize("model, source, kernels", [
    ("LLAMA2-70B", "nemo-24.07", "unfused"), ("LLAMA3-70B", "nemo-24.07", "native"),
    ("Nemotron-8B", "nemo-24.07", "native"), ("LLAMA3_70B", "megatron-bridge-25.11", "te")])
def test_each_row_runs_the_cross_entropy_its_launch_configuration_sets(model, source, kernels):
    """A row's own `recipe` (its model's NeMo-Framework-Launcher 24.07 configuration) over its
    source's (Megatron-Bridge's providers) over `common`, each with its citation."""
    from holmes_sim.model.workload import build_workload
    data = _data()
    row = next(r for r in data["rows"] if r["model"] == model and r["source"] == source)
    cited = row.get("recipe_source") or data["sources"][source].get("recipe_source", "")
    assert (kernels == "unfused") != ("cross_entropy_loss_fusion" in cited)
    scenario = load_scenario_text(scenario_text(data, row))
    w = build_workload(scenario.model, scenario.training, row["tp"])
    assert w.cross_entropy == kernels


@pytest.mark.parametrize("model, source, backend", [
    ("LLAMA2-7B", "nemo-24.07", "flash"), ("Nemotron-8B", "nemo-24.07", "flash"),
    ("GPT3-5B", "nemo-24.07", "flash"), ("GPT3-175B", "nemo-24.07", "fused"),
    ("LLAMA3_70B", "megatron-bridge-25.11", "auto")])
def test_each_row_runs_the_attention_kernel_its_launch_ran(model, source, backend):
    """NeMo 24.07's launcher exports NVTE_FUSED_ATTN=0 into every job (FlashAttention-2) but
    for GPT-3 175B, whose configurations turned cuDNN back on; Megatron-Bridge leaves Transformer
    Engine's choice (cuDNN on Hopper). Each with its citation."""
    data = _data()
    for row in (r for r in data["rows"] if r["model"] == model and r["source"] == source):
        cited = row.get("recipe_source", "") + data["sources"][source].get("recipe_source", "")
        assert (backend == "auto") != ("NVTE_FUSED_ATTN" in cited)
        training = load_scenario_text(scenario_text(data, row)).training
        assert training.flash_attention and training.attention_backend == backend


@pytest.mark.parametrize("model, fp32", [
    ("Nemotron-8B", True), ("Nemotron-22B", True), ("GPT3-5B", False), ("LLAMA2-7B", False),
    ("Nemotron-340B", False)])
def test_gradients_are_reduced_in_the_dtype_the_launch_synchronised(model, fp32):
    """NeMo 24.07's Nemotron 8B/22B H100 FP8 examples pass no grad_sync_dtype (the GPT-3 and
    Llama ones pass bf16, the 340B config sets it): apex's DistributedFusedAdam then syncs in
    the optimizer's fp32."""
    data = _data()
    row = next(r for r in data["rows"] if r["model"] == model)
    training = load_scenario_text(scenario_text(data, row)).training
    assert training.grad_reduce_in_fp32 == fp32
    assert ("grad_sync_dtype" in row.get("recipe_source", "")) == fp32


def test_a_recipe_key_the_renderer_does_not_write_is_refused():
    """A misspelt switch in a data file stops the rendering instead of vanishing from it."""
    data = _data()
    row = dict(next(r for r in data["rows"] if r["model"] == "LLAMA3-70B"),
               recipe={"cross_entropy_loss_fusions": True})
    with pytest.raises(ValueError, match="cross_entropy_loss_fusions"):
        scenario_text(data, row)


def test_step_time_comes_from_tokens_per_second_and_sets_the_error():
    """LLAMA3_70B on 64 GPUs, Megatron-Bridge 25.11: 128 x 8192 / (1602 x 64) = 10.227 s."""
    case = _cases()["llama3-70b-64gpu-mbridge-25.11"]
    assert case.measured_iteration_s == pytest.approx(128 * 8192 / (1602 * 64))
    result = evaluate(case)
    assert result.error == pytest.approx(result.predicted_iteration_s / case.measured_iteration_s - 1)
    assert 500 < result.case.measured_tflops_per_gpu < 900


def _waiting(case):
    """The case as recorded while context parallelism was missing."""
    return replace(case, not_simulated=nemo_summary.NEEDS_CONTEXT_PARALLELISM)


def test_not_simulated_row_refuses_to_evaluate():
    case = _waiting(_cases()["llama3.1-405b-1024gpu-mbridge-25.11"])
    with pytest.raises(ScenarioError, match="not simulated"):
        evaluate(case)


def test_table_mean_and_max_are_computed_from_the_simulated_rows():
    by_name = _cases()
    results = tuple(evaluate(by_name[n]) for n in ("llama2-7b-8gpu-nemo-24.07",
                                                   "llama2-13b-16gpu-nemo-24.07"))
    skipped = (_waiting(by_name["llama3.1-405b-1024gpu-mbridge-25.11"]),)
    check = PublishedCheck(results, None, skipped=skipped)
    errors = [abs(r.error) for r in results]
    mean, worst, n = check.by_dataset()[STEM]
    assert (mean, worst, n) == (pytest.approx(sum(errors) / 2), max(errors), 2)
    console = Console(width=250, record=True)
    console.print(check_table(check, 250, wide=True))
    text = " ".join(console.export_text().split())
    assert f"{STEM}: mean {100 * mean:.1f}%, max {100 * worst:.1f}%" in text
    assert nemo_summary.NEEDS_CONTEXT_PARALLELISM in text
    assert f"{len(skipped)} recorded rows not simulated" in text
    doc = check.to_json()
    assert {d["case"] for d in doc["not_simulated"]} == {c.name for c in skipped}
    assert doc["datasets"][STEM]["cases"] == 2


def test_case_names_are_unique_and_match_the_files():
    data = _data()
    names = [case_name(data, r) for r in data["rows"]]
    assert len(names) == len(set(names))
    folder = PUBLISHED_DIR / "scenarios" / STEM
    assert {p.stem for p in folder.glob("*.yaml")} == set(names)
