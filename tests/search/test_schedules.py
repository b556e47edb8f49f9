"""The planner searches each policy's framework's own pipeline schedules: no Megatron-based
framework runs GPipe (Megatron-LM's `get_forward_backward_func` picks no pipelining, 1F1B or
interleaved), so GPipe is simulated only where the scenario lists it, and never exported."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.policies import POLICIES, searched_schedules
from holmes_sim.prepare import prepare
from holmes_sim.search.planner import layouts, settings_per_layout
from tests.conftest import small_scenario

# The reviewer's l31_70b: before, `plan` ranked "holmes TP8 PP2 DP5 mb1 gpipe rc:full" first
# (32.661 s, 1.20x) and exported it as a Megatron-LM launch, which runs 1F1B (44.041 s).
L31_70B = """name: l31_70b
fabrics: [{name: ib, type: ib}, {name: roce, type: roce}]
clusters:
- name: c
  nodes:
  - {name: n, count: 8, gpu: h100-sxm, intra_node: nvlink4,
     nics: [{type: ib, model: connectx-7, count: 8, fabric: ib}, {type: ethernet, model: eth-100g}]}
  - {name: r, count: 2, gpu: h100-sxm, intra_node: nvlink4,
     nics: [{type: roce, model: roce-200g, count: 8, fabric: roce},
            {type: ethernet, model: eth-100g}]}
model: {preset: llama3.1-70b}
training: {global_batch_size: 160, micro_batch_size: 1, precision: bf16, sequence_parallel: true,
           flash_attention: true, distributed_optimizer: true, overlap_grad_reduce: true}
parallel: {tensor: 8, pipeline: 1}
policies: [megatron, holmes]
search: {tensor: [8], pipeline: [2, 4], micro_batch_size: [1], top_k: 2%s}
"""


def test_every_framework_lists_its_schedules_and_none_runs_gpipe():
    for name, policy in POLICIES.items():
        assert "gpipe" not in policy.schedules, name
        assert searched_schedules(None, name) == policy.schedules
    assert POLICIES["megatron"].schedules == ("1f1b", "interleaved")
    assert POLICIES["holmes-no-overlap"].schedules == ("1f1b", "interleaved")
    assert POLICIES["megatron-llama"].schedules == ("1f1b", "interleaved")
    assert POLICIES["megatron-deepspeed"].schedules == ("1f1b",)  # DeepSpeed's TrainSchedule
    assert searched_schedules(("gpipe",), "megatron") == ("gpipe",)


def test_the_default_search_has_no_gpipe_layout(write_scenario):
    """Before, the default `search.schedule` was gpipe, 1f1b and interleaved for every policy."""
    prepared = prepare(write_scenario(small_scenario(nodes_ib=4, tp=8, pp=2, layers=8)))
    spec = prepared.scenario.search
    assert spec.schedule is None
    kinds = {lay.schedule for lay in layouts(prepared, spec)}
    assert kinds == {"1f1b", "interleaved"}


def test_megatron_deepspeed_is_searched_on_1f1b_only(write_scenario):
    text = small_scenario(nodes_ib=4, tp=8, pp=2, layers=8,
                          extra="search: {policies: [megatron-deepspeed, holmes], tensor: [8], "
                                "pipeline: [2], micro_batch_size: [1], recompute: [none]}\n")
    prepared = prepare(write_scenario(text))
    spec = prepared.scenario.search
    assert settings_per_layout(spec, "1f1b") == 2 and settings_per_layout(spec, "interleaved") == 1


def _plan(tmp_path, search: str = ""):
    path = tmp_path / "l31_70b.yaml"
    path.write_text(L31_70B % search)
    out = tmp_path / "export"
    result = CliRunner().invoke(app, ["plan", str(path), "--jobs", "1", "--json", "-",
                                      "--export", str(out)])
    return result, out


def test_plan_ranks_and_exports_no_gpipe_plan_unless_listed(tmp_path):
    result, out = _plan(tmp_path)
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    assert {c["schedule"] for c in found["candidates"]} <= {"1f1b", "interleaved"}
    assert found["baseline"]["schedule"] != "gpipe"
    best = found["candidates"][0]
    # its interleaved plans simulate faster than its best 1F1B one (35.7 s against 36.0 s)
    assert (best["policy"], best["schedule"]) == ("holmes", "interleaved")
    assert found["baseline"]["predicted_iteration_s"] > best["predicted_iteration_s"]
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "1-holmes", "2-holmes"]


def test_listed_gpipe_is_simulated_but_not_exported(tmp_path):
    result, out = _plan(tmp_path, ", schedule: [gpipe, 1f1b]")
    assert result.exit_code == 0, result.output
    best = json.loads(result.stdout)["candidates"][0]
    assert (best["schedule"], best["simulated"]) == ("gpipe", True)  # still simulated when asked
    message = " ".join(result.stderr.split())
    assert ("note: no launch files for 1-holmes: Megatron-LM has no GPipe schedule "
            "(get_forward_backward_func") in message
    assert "plan with schedule 1f1b or interleaved" in message
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["2-holmes"]
    assert "gpipe" not in (out / "2-holmes" / "plan.json").read_text()
