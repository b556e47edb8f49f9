"""Plans that do not fit in GPU memory: no speed-up in the JSON, the API or report.md, and no
finding that compares them, whether megatron fits and another plan does not, or none fits."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

import holmes_sim
from holmes_sim.cli import app
from holmes_sim.metrics import memory_fix
from holmes_sim.prepare import prepare
from holmes_sim.report.document import findings
from holmes_sim.runner import ranked, results_document, run_scenario
from tests.conftest import SCENARIOS

runner = CliRunner()
SMALL = ("catalog:\n  gpus: {a56: {peak_tflops: 312, memory_gib: 56, memory_bandwidth_gbyte_per_s: "
         "2039, compute_efficiency: 0.738, sm_count: 108, intra_node: nvlink3}}\n")
UNFIT = "holmes-no-adaptive-partition"


def straggler_small_ib_b(folder: Path) -> Path:
    """scenarios/straggler.yaml with 56 GiB GPUs on its ib-b nodes: every policy puts them on the
    last stage (one micro-batch in flight), where all plans fit (`UNFIT` made not to fit by
    `unfit_patch`)."""
    text = (SCENARIOS / "straggler.yaml").read_text()
    old = "{name: ib-b, count: 2, gpu: a100-80gb"
    assert text.count(old) == 1
    path = folder / "sg.yaml"
    path.write_text(text.replace(old, "{name: ib-b, count: 2, gpu: a56") + SMALL)
    return path


def _squeezed(outcome):
    """`outcome` with each stage's GPU memory 1 MiB below what its plan needs (so it does not
    fit), its times and plan unchanged."""
    memory = outcome.result.memory
    short = type(memory)(memory.per_stage_bytes,
                         tuple(b - 2**20 for b in memory.per_stage_bytes))
    return type(outcome)(outcome.plan, outcome.cluster, outcome.trace,
                         replace(outcome.result, memory=short))


@pytest.fixture()
def unfit_patch(monkeypatch):
    """`UNFIT`'s plan does not fit in GPU memory in every run of this test (`runner.run_policy`
    squeezes it), whatever order the placement picks for the small GPUs."""
    import holmes_sim.runner as runner_module

    real = runner_module.run_policy

    def run_policy(prepared, name, *args, **kwargs):
        outcome = real(prepared, name, *args, **kwargs)
        return _squeezed(outcome) if name == UNFIT else outcome

    monkeypatch.setattr(runner_module, "run_policy", run_policy)


def none_fit(folder: Path) -> Path:
    """scenarios/mixed_ib_eth.yaml with micro-batches of 16: no plan fits."""
    text = (SCENARIOS / "mixed_ib_eth.yaml").read_text()
    assert "micro_batch_size: 2\n" in text
    text = text.replace("micro_batch_size: 2\n", "micro_batch_size: 16\n")
    path = folder / "oom.yaml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """'some' (megatron fits, `UNFIT` does not) and 'none' (no plan fits): (prepared, outcomes)."""
    folder = tmp_path_factory.mktemp("unfit")
    out = {}
    for kind, path in (("some", straggler_small_ib_b(folder)), ("none", none_fit(folder))):
        prepared = prepare(path)
        outcomes = run_scenario(prepared)
        if kind == "some":
            outcomes = ranked([_squeezed(o) if o.plan.policy == UNFIT else o for o in outcomes])
        out[kind] = prepared, outcomes
    return out


def test_the_scenarios_fit_as_these_tests_assume(runs):
    _, some = runs["some"]
    fits = {o.plan.policy: o.result.memory.fits for o in some}
    assert fits["megatron"] and fits["holmes"] and not fits[UNFIT]
    _, none = runs["none"]
    assert not any(o.result.memory.fits for o in none)


def test_a_plan_that_does_not_fit_has_a_null_speedup_in_the_document(runs):
    prepared, outcomes = runs["some"]
    doc = results_document(prepared, outcomes, 0)
    ups = {r["policy"]: r["speedup_over_megatron"] for r in doc["results"]}
    assert ups[UNFIT] is None and ups["megatron"] == 1.0 and ups["holmes"] > 1.0
    none_doc = results_document(*runs["none"], 0)
    assert all(r["speedup_over_megatron"] is None for r in none_doc["results"])


def test_run_json_and_report_exit_0_when_megatron_fits_and_another_does_not(tmp_path,
                                                                            unfit_patch):
    scenario = straggler_small_ib_b(tmp_path)
    out, report = tmp_path / "r.json", tmp_path / "report"
    result = runner.invoke(app, ["run", str(scenario), "--json", str(out), "--report",
                                 str(report), "-q"])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    records = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    assert records[UNFIT]["speedup_over_megatron"] is None
    assert not records[UNFIT]["fits_memory"]
    assert json.loads((report / "results.json").read_text())["results"] == \
        json.loads(out.read_text())["results"]


def test_simulate_gives_none_for_a_plan_that_does_not_fit(tmp_path, unfit_patch):
    sim = holmes_sim.simulate(straggler_small_ib_b(tmp_path))
    assert sim.result(UNFIT).speedup_over_megatron is None
    assert sim.result("megatron").speedup_over_megatron == 1.0
    doc = sim.to_json()
    assert {r["policy"]: r["speedup_over_megatron"] for r in doc["results"]}[UNFIT] is None


def test_findings_compare_no_plan_when_none_fits(runs):
    prepared, outcomes = runs["none"]
    text = findings(outcomes, memory_fix(prepared))
    assert "faster than megatron" not in text and "The fastest policy" not in text
    assert "saving" not in text
    nearest = min((o.result for o in outcomes), key=lambda r: (r.memory.excess_gib, r.policy))
    assert text.startswith(f"No policy's plan fits in GPU memory (the nearest, {nearest.policy}, "
                           f"{nearest.memory.shortfall()}), so no plan is compared and there is no "
                           "speed-up to report")
    assert ("to report: lower training.micro_batch_size, set training.recompute: full, raise "
            "parallel.tensor or raise parallel.pipeline. Not fitting") in text


def test_findings_give_no_speedup_over_a_megatron_that_does_not_fit(runs):
    _, outcomes = runs["none"]
    fitting = outcomes[-1]  # made to fit: its plan, with all the memory it needs
    memory = type(fitting.result.memory)(fitting.result.memory.per_stage_bytes,
                                         fitting.result.memory.per_stage_bytes)
    fake = type(fitting)(fitting.plan, fitting.cluster, fitting.trace,
                         replace(fitting.result, policy="holmes-x", memory=memory))
    text = findings([*outcomes, fake])
    assert text.startswith("The fastest policy is holmes-x ")
    assert "megatron's plan does not fit in GPU memory, so there is no speed-up" in text
    assert "faster than megatron" not in text and "saving" not in text


def test_findings_name_only_plans_that_fit_when_megatron_fits(runs):
    _, outcomes = runs["some"]
    fits = [o.result.policy for o in outcomes if o.result.memory.fits]
    text = findings(outcomes)
    assert text.startswith(f"The fastest policy is {fits[0]} ")
    assert f"{UNFIT} (tied" not in text and f"The largest cost {UNFIT} " not in text
    assert f"Not fitting in GPU memory: {UNFIT}" in text


def test_report_md_of_a_run_where_no_plan_fits_claims_no_speedup(tmp_path):
    report = tmp_path / "report"
    result = runner.invoke(app, ["run", str(none_fit(tmp_path)), "--report", str(report), "-q"])
    assert result.exit_code == 0, result.output
    text = (report / "report.md").read_text()
    found = text.split("## Findings", 1)[1].split("\n## ", 1)[0]
    assert "No policy's plan fits in GPU memory" in found and "faster than" not in found
