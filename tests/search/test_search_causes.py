"""`holmes-sim plan` says why it has nothing to search: a `search:` value that fits no layout is
refused as the file loads, naming its index, line, rule and fix; when only combinations fail,
the error counts the checks' rejections by rule, with an example and the keys to widen."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.errors import FieldError, ScenarioError
from holmes_sim.prepare import check_search_values, prepare, prepare_text
from holmes_sim.search import planner
from holmes_sim.spec.scenario import SearchSpec
from tests.conftest import SCENARIOS

runner = CliRunner()
DENSE, LLAMA, MOE = "mixed_ib_eth.yaml", "llama3_70b_h100.yaml", "moe_mixed_nics.yaml"
"""A 7.5B GPT (32 heads, 36 layers, no fused attention, batch 512), Llama 3 70B (8 query
groups, fused attention) and Mixtral 8x7B (8 experts), each on 64 GPUs of 8 a node."""


def _plan(tmp_path: Path, base: str, search: str) -> tuple[str, Path, int, Path]:
    """`plan` of `base` with `search` appended, refused: (one-line message, scenario file, the
    search block's line, the --json path it was given)."""
    text = (SCENARIOS / base).read_text() + f"search: {search}\n"
    path, out = tmp_path / "s.yaml", tmp_path / "plan.json"
    path.write_text(text)
    result = runner.invoke(app, ["plan", str(path), "--jobs", "1", "--json", str(out)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Traceback" not in result.output and not out.exists()
    return " ".join(result.output.split()), path, text.count("\n"), out


@pytest.mark.parametrize(("base", "search", "field", "fragments"), [
    (DENSE, "{context: [1, 2]}", "search.context[1]",
     ("context=2 fits no layout", "training.flash_attention", "fused attention",
      "remove 2 from search.context or change training.flash_attention")),
    (DENSE, "{expert: [1, 2]}", "search.expert[1]",
     ("expert=2 fits no layout", "needs an MoE model (model.num_experts)",
      "remove 2 from search.expert")),
    (DENSE, "{tensor: [4, 3]}", "search.tensor[1]",
     ("tensor=3 fits no layout", "must divide model.num_attention_heads=32",
      "remove 3 from search.tensor")),
    (DENSE, "{tensor: [16]}", "search.tensor[0]",
     ("tensor=16 must divide GPUs per node=8", "a TP group stays inside a node")),
    (DENSE, "{pipeline: [2, 3]}", "search.pipeline[1]",
     ("pipeline=3 fits no layout", "tensor=1 x pipeline=3 = 3 does not divide the 64 GPUs",
      "remove 3 from search.pipeline")),
    (DENSE, "{pipeline: [64]}", "search.pipeline[0]",
     ("pipeline=64 stages cannot each hold one of the model.num_layers=36 layers",)),
    (DENSE, "{micro_batch_size: [3]}", "search.micro_batch_size[0]",
     ("micro_batch_size=3 x data=1 = 3 does not divide training.global_batch_size=512",
      "remove 3 from search.micro_batch_size or change training.global_batch_size")),
    (LLAMA, "{tensor: [16]}", "search.tensor[0]",
     ("tensor=16 must divide model.num_query_groups=8",)),
    (LLAMA, "{context: [3]}", "search.context[0]",
     ("context=3 = 3 does not divide the 64 GPUs", "remove 3 from search.context")),
    (MOE, "{expert: [4, 16]}", "search.expert[1]",
     ("expert=16 fits no layout", "must divide model.num_experts=8", "remove 16 from search.expert")),
    (MOE, "{expert_tensor: [3]}", "search.expert_tensor[0]",
     ("expert_tensor=3 must divide model.num_attention_heads=32, as the tensor degree it divides",
      "remove 3 from search.expert_tensor")),
])
def test_a_value_no_layout_takes_is_refused_at_its_line(tmp_path, base, search, field, fragments):
    text, path, line, _ = _plan(tmp_path, base, search)
    assert f"{path}:{line}: {field}: " in text
    assert "whatever the other values" in text
    for fragment in fragments:
        assert fragment in text, text


@pytest.mark.parametrize(("base", "key", "values"), [
    (DENSE, "tensor", range(1, 17)), (DENSE, "pipeline", range(1, 70)),
    (LLAMA, "context", range(1, 17)), (MOE, "expert", range(1, 17)),
    (DENSE, "micro_batch_size", range(1, 33))])
def test_the_refusal_and_the_search_agree(base, key, values):
    """A value is refused up front exactly when the search, the other keys wide, finds no
    layout with it (the same checks)."""
    text = (SCENARIOS / base).read_text()
    prepared = prepare(SCENARIOS / base)
    wide = SearchSpec(tensor=(1, 2, 4, 8), context=(1, 2, 4), micro_batch_size=(1, 2, 4, 8),
                      schedule=("1f1b",), recompute=("none",), sequence_parallel=(True,))
    refused = set()
    for v in values:
        try:
            check_search_values(prepare_text(text + f"search: {{{key}: [{v}]}}\n").scenario)
        except ScenarioError as exc:
            assert f"search.{key}[0]: {key}={v} fits no layout" in str(exc)
            refused.add(v)
        found = any(True for _ in planner.layouts(prepared, replace(wide, **{key: (v,)})))
        assert found == (v not in refused), (key, v)
    assert refused  # each key has a value no layout takes


def test_only_combinations_fail_the_error_counts_the_reasons(tmp_path):
    text, path, line, _ = _plan(tmp_path, DENSE,
                                "{tensor: [1], pipeline: [1], micro_batch_size: [16]}")
    assert text.startswith(f"error: {path}:{line}: search: no layout satisfies")
    assert ("dropped 1 partial layout: [1x, e.g. tensor=1 pipeline=1 data=64 micro_batch_size=16] "
            "training.global_batch_size: micro_batch_size=16 x data=64 = 1024 does not divide "
            "training.global_batch_size=512") in text
    assert text.endswith("; widen search.micro_batch_size, search.tensor, search.pipeline, "
                         "search.context")


def test_the_reasons_leave_out_defaults_the_block_did_not_ask_for(tmp_path):
    """Mixtral at TP 8 without sequence parallelism: Megatron-Core's MoELayer refuses every
    layout; the pipeline degrees the block leaves to their default (3, 5, ... do not divide 64
    GPUs) and interleaving without a pipeline (searched as 1F1B) are no cause; GPipe, which
    the block does not list, is not searched."""
    text, path, line, _ = _plan(tmp_path, MOE, "{tensor: [8], sequence_parallel: [false]}")
    assert f"{path}:{line}: search: no layout satisfies" in text
    reasons = text.split(": [", 1)[1]
    assert reasons.startswith("50x, e.g. tensor=8 pipeline=1 data=8 micro_batch_size=1 expert=4 "
                              "expert_tensor=8 schedule=1f1b virtual_stages=1 "
                              "sequence_parallel=False] training.sequence_parallel: an MoE model")
    assert "pipeline=3" not in text and "1f1b's layout" not in text
    assert "widen search.sequence_parallel, search.tensor, search.expert_tensor, search.expert" in text


@pytest.mark.parametrize(("base", "search", "fragments"), [
    (LLAMA, "{tensor: [8], pipeline: [8], context: [2]}",
     ("[1x, e.g. tensor=8 pipeline=8 context=2] parallel.context: tensor=8 x pipeline=8 x "
      "context=2 = 128 does not divide the 64 GPUs", "widen search.context, search.tensor, "
                                                     "search.pipeline")),
    (DENSE, "{pipeline: [1], schedule: [interleaved]}",
     ("parallel.schedule: interleaved at pipeline=1 is 1f1b's layout (searched as 1f1b)",
      "widen search.schedule, search.pipeline")),
    (MOE, "{tensor: [4], expert_tensor: [8]}",
     ("expert_tensor=8 must divide tensor=4", "widen search.expert_tensor")),
])
def test_combination_causes(tmp_path, base, search, fragments):
    text, path, line, _ = _plan(tmp_path, base, search)
    assert f"{path}:{line}: search: no layout satisfies" in text
    for fragment in fragments:
        assert fragment in text, text


def test_the_candidate_limit_names_the_search_line(tmp_path):
    text = (SCENARIOS / DENSE).read_text() + "search: {tensor: [4]}\n"
    path = tmp_path / "s.yaml"
    path.write_text(text)
    result = runner.invoke(app, ["plan", str(path), "--max-candidates", "10"])
    assert result.exit_code == 2
    assert f"{path}:{text.count(chr(10))}: search: " in " ".join(result.output.split())


def test_without_a_file_the_error_keeps_its_field():
    prepared = prepare_text((SCENARIOS / DENSE).read_text() + "search: {tensor: [1], pipeline: [1], "
                            "micro_batch_size: [16]}\n")
    with pytest.raises(FieldError) as exc:
        planner.search(prepared, jobs=1)
    assert exc.value.path == "search" and "micro_batch_size=16 x data=64" in exc.value.message


def test_only_plan_reads_the_search_values(tmp_path):
    """`run` and `sweep` ignore the `search:` block, so a value no layout takes does not stop
    them; `plan` refuses it before its search."""
    path = tmp_path / "s.yaml"
    path.write_text((SCENARIOS / DENSE).read_text() + "search: {pipeline: [2, 3]}\n")
    result = runner.invoke(app, ["run", str(path), "-q", "-p", "megatron"])
    assert result.exit_code == 0, result.output
    text, _, _, _ = _plan(tmp_path, DENSE, "{pipeline: [2, 3]}")
    assert "search.pipeline[1]: pipeline=3 fits no layout" in text


def test_no_runnable_plan_is_an_error_naming_the_nics_to_change(tmp_path):
    """Every layout groups IB with RoCE nodes and none has Ethernet: each plan fails when its
    transports are chosen, and `plan` exits 2 with the node group's NICs, file and line,
    instead of printing an empty table."""
    base = (SCENARIOS / "mixed_ib_roce.yaml").read_text()
    text = base.replace(", {type: ethernet, model: eth-100g, bandwidth_gbit_per_s: 32}]}", "]}")
    (tmp_path / "noeth.yaml").write_text(text)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if "name: ib-a," in t)
    message, path, _, _ = _plan(tmp_path, str(tmp_path / "noeth.yaml"),  # absolute: kept
                                "{tensor: [1, 2], pipeline: [1, 2], micro_batch_size: [1]}")
    assert message.startswith("error: no plan of the search can run:"), message
    assert "could not be built" in message and "share no RDMA fabric" in message
    assert f"{path}:{line}: clusters[0].nodes[0].nics: nodes ib-a-0" in message, message


def test_no_plan_that_fits_is_an_error_showing_the_nearest(tmp_path):
    message, _, _, _ = _plan(tmp_path, LLAMA, "{tensor: [1], pipeline: [1, 2], "
                                              "micro_batch_size: [1]}")
    assert message.startswith("error: no plan of the search can run:"), message
    assert "do not fit in GPU memory, 0 could not be built" in message
    needs = [float(part.split(" GiB")[0]) for part in message.split("needs ")[1:]]
    assert len(needs) == 3 and needs == sorted(needs) and needs[0] > 80
