"""`holmes-sim plan` says why it has nothing to search: a `search:` value that fits no layout is
refused as the file loads, naming its index, line, rule and fix."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.errors import ScenarioError
from holmes_sim.prepare import prepare, prepare_text
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
            prepare_text(text + f"search: {{{key}: [{v}]}}\n")
        except ScenarioError as exc:
            assert f"search.{key}[0]: {key}={v} fits no layout" in str(exc)
            refused.add(v)
        found = any(True for _ in planner.layouts(prepared, replace(wide, **{key: (v,)})))
        assert found == (v not in refused), (key, v)
    assert refused  # each key has a value no layout takes
