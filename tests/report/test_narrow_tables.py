"""Every table the CLI prints, at 80 columns: each row's name in full, no line over 80
characters, no ellipsis; `--wide` keeps every column."""

from __future__ import annotations

from dataclasses import replace

import io

import pytest

from rich.console import Console

from holmes_sim.report.tables import print_table
from holmes_sim.search.planner import Candidate, Layout, PlanSearch
from holmes_sim.search.report import plan_table, why_the_winner_wins
from holmes_sim.search.sweep import SweepAxis, SweepResult, sweep_table
from holmes_sim.validation import comparison, published
from holmes_sim.validation.paper import PaperComparison


def _printed(table, width: int = 80, wide: bool = False) -> str:
    buf = io.StringIO()
    print_table(Console(file=buf, width=width), table, wide)
    return buf.getvalue()


def _check(text: str, names: list[str], width: int = 80) -> None:
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width, text
    assert "…" not in text and "\ufffd" not in text, text
    text.encode("utf-8")
    for name in names:
        assert any(f" {name} " in line for line in lines), f"{name} not whole in:\n{text}"


def _candidate(policy: str, t: float, mb: int, optimizer: str, overlap: bool) -> Candidate:
    lay = Layout(2, 2, 16, mb, "1f1b", 1, "selective", True)
    return Candidate(policy, lay, optimizer, (18, 18), t, 120.0, 40.0, True, simulated=True,
                     breakdown_s=(("dp_exposed", t / 4), ("pp_exposed", 3.59)),
                     overlap_grad_reduce=overlap)


def _search(names=("holmes", "megatron-llama")) -> PlanSearch:
    cands = tuple(_candidate(n, 24.0 + i, 4, "distributed-overlapped", False)
                  for i, n in enumerate(names))
    base = _candidate("megatron", 33.0, 4, "distributed", True)
    return PlanSearch("mixed-ib-roce", cands, base, (), 10_500, 35.5)


def test_plan_table_keeps_every_policy_and_layout_whole():
    result = _search()
    text = _printed(plan_table(result, 10, 80))
    _check(text, [c.policy for c in result.candidates] + ["megatron"])
    assert "TP2 PP2 DP16 mb4 1f1b rc:selective SP" in text
    assert "distributed +overlap" in text and "--wide shows them" in text
    wide = _printed(plan_table(result, 10, 80, wide=True), wide=True)
    assert "TFLOP/s" in wide and "--wide" not in wide


def test_plan_table_folds_the_layout_rather_than_cut_a_long_policy_name():
    result = _search(("holmes-no-adaptive-partition", "holmes"))
    _check(_printed(plan_table(result, 10, 80)), ["holmes-no-adaptive-partition", "holmes"])


def test_winner_sentence_names_only_material_savings():
    line = why_the_winner_wins(_search())
    assert "dp_exposed" in line and "pp_exposed" not in line


def _validation() -> comparison.ValidationResult:
    names = ["holmes", "holmes-no-adaptive-partition", "holmes-no-nic-aware-order",
             "holmes-no-nic-selection", "megatron"]
    cases = tuple(comparison.Case(n, 0.5 + i / 10, 0.55 + i / 10,
                                  tuple(0.55 + i / 10 + j / 1000 for j in range(10)), ())
                  for i, n in enumerate(names))
    return comparison.ValidationResult(cases, 15.0, {}, {})


def test_validation_table_keeps_every_policy_whole():
    result = _validation()
    text = _printed(comparison.comparison_table(result, 80))
    _check(text, [c.policy for c in result.cases])


def test_published_tables_keep_every_case_whole():
    # A NeMo row's measured TFLOP/s comes from its step time once simulated: stand one in.
    cases = tuple(replace(c, measured_tflops_per_gpu=c.measured_tflops_per_gpu or 500.0)
                  for c in published.cases())
    results = tuple(published.CaseResult(c, c.measured_tflops_per_gpu * 1.02, 1.0) for c in cases)
    paper = PaperComparison(28.6, {"holmes": 1.38, "megatron-llama": 1.1, "megatron": 1.0},
                            {"holmes": 1.38, "megatron-llama": 1.12, "megatron": 1.0},
                            "holmes", 10.0)
    check = published.PublishedCheck(results, paper)
    _check(_printed(published.check_table(check, 80)),
           [f"{c.dataset}/{c.name}" for c in cases])
    _check(_printed(published.paper_table(check, 80)), ["megatron-llama", "holmes (fitted)"])


def test_published_table_keeps_names_whole_beside_a_row_not_simulated():
    simulated = [replace(c, measured_tflops_per_gpu=c.measured_tflops_per_gpu or 500.0)
                 for c in published.cases() if not c.not_simulated]
    skipped = tuple(replace(c, not_simulated="needs a recipe the simulator does not model, "
                                             "named here at length")
                    for c in published.cases()[:1])
    results = tuple(published.CaseResult(c, c.measured_tflops_per_gpu * 1.02, 1.0)
                    for c in simulated)
    text = _printed(published.check_table(published.PublishedCheck(results, None, skipped=skipped),
                                          80))
    _check(text, [f"{c.dataset}/{c.name}" for c in (*simulated, *skipped)])
    assert "named here at length" in " ".join(text.split())


def test_sweep_table_keeps_values_and_policies_whole():
    path = "clusters[0].nodes[0].nics[1].bandwidth_gbit_per_s"
    axes = [SweepAxis("", path, (), (25, 100)), SweepAxis("", "training.micro_batch_size", (), (2, 4))]
    policies = ["holmes", "holmes-no-adaptive-partition"]
    rows = [{path: bw, "training.micro_batch_size": mb, "policy": p, "point": i, "status": "ok",
             "iteration_time_s": 27.2, "tflops_per_gpu": 115.6, "peak_memory_gib": 53.9,
             "fits_memory": True}
            for i, (bw, mb) in enumerate([(25, 2), (25, 4), (100, 2), (100, 4)]) for p in policies]
    text = _printed(sweep_table(SweepResult("mixed_ib_roce.yaml", axes, policies, rows), 80))
    _check(text, policies)
    assert f"bandwidth_gbit_per_s: {path}" in text


@pytest.mark.parametrize("tolerance,shown", [(0.4, "tolerance 0.4%"), (2.5, "tolerance 2.5%"),
                                             (10.0, "tolerance 10%")])
def test_validation_table_shows_the_tolerance_unrounded(tolerance, shown):
    # 2.5 printed as "2%" above a +2.6 row marked out of tolerance.
    case = comparison.Case("holmes", 1.026, 1.0, (1.0,), ())
    result = comparison.ValidationResult((case,), tolerance, {}, {})
    text = _printed(comparison.comparison_table(result, 120), 120)
    assert f"validation ({shown}): mean |error| 2.6%" in text


def test_validation_rows_give_no_verdict_when_the_host_gave_none():
    case = comparison.Case("holmes", 1.03, 1.0, (1.0,), ())
    result = comparison.ValidationResult((case,), 10.0, {}, {}, host_warnings=("host overloaded",))
    text = _printed(comparison.comparison_table(result, 120), 120)
    assert "NO VERDICT: host overloaded" in text and "no verdict" in text
    assert " ok " not in text


def _long_outcomes():
    from tests.report.test_document import default_run

    _, outcomes = default_run()
    layers = (2, 3, 5, 7) * 8
    long = {"holmes": "holmes-no-adaptive-partition"}  # the longest policy name
    return [replace(o, plan=replace(o.plan, policy=long.get(o.plan.policy, o.plan.policy)),
                    result=replace(o.result, layers_per_stage=layers)) for o in outcomes]


@pytest.mark.parametrize("width", [50, 70])
def test_results_table_prints_every_number_whole_however_narrow(width):
    # At 70 columns rich printed "18.0…" and "speed-…"; at 50, "1.…" as the speed-up.
    from holmes_sim.report.tables import results_table

    outcomes = _long_outcomes()
    text = _printed(results_table("t", outcomes, width), width)
    assert "…" not in text, text
    for o in outcomes:
        row = next(line for line in text.splitlines() if f" {o.plan.policy} " in line)
        for number in (f"{o.result.iteration_time_s:.3f}", f"{o.result.tflops_per_gpu:.1f}",
                       f"{o.result.memory.peak_gib:.1f}"):
            assert f" {number} " in row, (number, row)
    for header in ("iter s", "TFLOP/s/GPU", "mem GiB", "speed-up"):
        assert header in text


def test_wide_results_table_prints_the_whole_layer_list():
    from holmes_sim.report.tables import results_table

    text = _printed(results_table("t", _long_outcomes(), 80, wide=True), 80, wide=True)
    assert "/".join(map(str, (2, 3, 5, 7) * 8)) in text and "..." not in text, text


def test_column_widths_take_the_widest_cell_or_header_line():
    from holmes_sim.report.tables import column_widths

    rows = [["eth-100g", "holmes", "18.520", "a long note"], ["eth-25g", "megatron", "-", ""]]
    assert column_widths(rows, ["nics[1].\nmodel", "policy", ""]) == [8, 8, 6]
    assert column_widths([], ["", "policy"]) == [1, 6]


def test_the_run_and_sweep_tables_size_their_columns_with_one_helper(monkeypatch):
    # Each table had its own line for "at least as wide as the widest cell".
    from holmes_sim.report import tables

    seen = []
    helper = tables.column_widths
    monkeypatch.setattr(tables, "column_widths",
                        lambda rows, headers: seen.append(list(headers)) or helper(rows, headers))
    tables.results_table("t", _long_outcomes(), 80)
    axes = [SweepAxis("", "training.micro_batch_size", (), (2,))]
    row = {"training.micro_batch_size": 2, "policy": "holmes", "point": 0, "status": "ok",
           "iteration_time_s": 27.2, "tflops_per_gpu": 115.6, "peak_memory_gib": 53.9,
           "fits_memory": True}
    sweep_table(SweepResult("s.yaml", axes, ["holmes"], [row]), 80)
    assert seen[0][0] == "policy" and ["micro_batch_size", "policy"] == seen[-1][:2]
