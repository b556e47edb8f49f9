"""`run --report` and `validate --real --report`: files, findings computed from the results, and
figures whose plotted data equal the results."""

from __future__ import annotations

import functools
import json

import pytest

from holmes_sim.metrics import BREAKDOWN_KEYS
from holmes_sim.prepare import prepare
from holmes_sim.report import plots
from holmes_sim.report.document import (COST_NAMES, findings, largest_cost, report_targets,
                                         write_report, write_validation_report)
from holmes_sim.report.owned import MANIFEST_NAME
from holmes_sim.runner import results_document, run_scenario, stamp
from holmes_sim.units import GIB
from tests.conftest import SCENARIOS

POLICIES = ["megatron", "holmes", "all-ethernet"]


@functools.cache
def default_run():
    """(prepared, outcomes) of scenarios/mixed_ib_eth.yaml for POLICIES, fastest first."""
    prepared = prepare(SCENARIOS / "mixed_ib_eth.yaml")
    return prepared, run_scenario(prepared, POLICIES)


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    prepared, outcomes = default_run()
    directory = tmp_path_factory.mktemp("report")
    write_report(directory, prepared, outcomes)
    return directory


def test_write_report_writes_every_output(report_dir):
    expected = {"iteration_time.png", "breakdown.png", "memory.png", "results.json", "report.md"}
    expected |= {f"timeline_{p}.png" for p in POLICIES} | {f"trace_{p}.json" for p in POLICIES}
    assert set(report_targets(POLICIES)) == expected  # what is checked before writing
    assert {p.name for p in report_dir.iterdir()} == expected | {MANIFEST_NAME}
    for name in expected:
        assert (report_dir / name).stat().st_size > 0
        if name.endswith(".png"):
            assert (report_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    prepared, outcomes = default_run()
    doc = json.loads((report_dir / "results.json").read_text())
    expected = stamp(results_document(prepared, outcomes, prepared.scenario.seed))
    assert doc == json.loads(json.dumps(expected))
    trace = json.loads((report_dir / "trace_holmes.json").read_text())
    holmes = next(o for o in outcomes if o.plan.policy == "holmes")
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == len(holmes.trace.records)


def test_report_md_names_winner_speedup_and_largest_cost(report_dir):
    _, outcomes = default_run()
    text = (report_dir / "report.md").read_text()
    times = {o.result.policy: o.result.iteration_time_s for o in outcomes}
    winner = min(times, key=times.get)
    speedup = times["megatron"] / times[winner]
    assert f"The fastest policy is {winner} " in text
    assert f"{speedup:.2f}x faster than megatron" in text
    key, seconds = largest_cost(next(o.result for o in outcomes if o.result.policy == winner))
    share = 100 * seconds / times[winner]
    assert f"({key}): {seconds:.3f} s, {share:.1f}% of its iteration" in text
    results = text.split("## Results", 1)[1].split("\n## ", 1)[0]
    table = [line for line in results.splitlines() if line.startswith("| ") and "---" not in line]
    names = [row.split("|")[1].strip().removesuffix(" \\*") for row in table[1:]]
    assert names == [o.result.policy for o in outcomes]
    for p in POLICIES:
        assert f"](timeline_{p}.png)" in text
    assert text.isascii()


def test_findings_flag_a_reference_winner_and_name_the_best_real_policy():
    _, outcomes = default_run()
    base = {o.result.policy: o for o in outcomes}
    h = base["holmes"]
    fake_ib = type(h)(h.plan, h.cluster, h.trace, _renamed(h.result, "all-ib", 0.5))
    text = findings([fake_ib, *outcomes])
    assert text.startswith("The fastest policy is all-ib ")
    assert "fastest policy on the scenario's own hardware is holmes" in text
    ratio = base["megatron"].result.iteration_time_s / base["holmes"].result.iteration_time_s
    assert f"{ratio:.2f}x faster than megatron" in text
    no_base = findings([o for o in outcomes if o.result.policy != "megatron"])
    assert "megatron was not run" in no_base


def _renamed(result, policy, scale):
    from dataclasses import replace

    return replace(result, policy=policy, iteration_time_s=result.iteration_time_s * scale)


def test_iteration_time_bars_equal_results_fastest_first():
    _, outcomes = default_run()
    results = [o.result for o in reversed(outcomes)]  # the figure sorts them itself
    fig = plots.iteration_time_figure(results)
    left, right = fig.axes[:2]
    ordered = sorted(results, key=lambda r: r.iteration_time_s)
    assert [p.get_width() for p in left.patches] == [r.iteration_time_s for r in ordered]
    assert [p.get_width() for p in right.patches] == [r.tflops_per_gpu for r in ordered]
    assert [t.get_text() for t in left.get_yticklabels()] == [r.policy for r in ordered]
    assert left.get_ylim()[0] > left.get_ylim()[1]  # the fastest (first bar) is drawn on top
    assert "(s)" in left.get_xlabel() and "TFLOP/s" in right.get_xlabel()
    plots.pyplot().close(fig)


def test_breakdown_segments_equal_result_breakdown():
    _, outcomes = default_run()
    results = [o.result for o in outcomes]
    fig = plots.breakdown_figure(results)
    ax = fig.axes[0]
    n = len(results)
    for k, key in enumerate(BREAKDOWN_KEYS):
        bars = ax.patches[k * n:(k + 1) * n]
        assert [b.get_width() for b in bars] == pytest.approx([r.breakdown_s[key] for r in results])
    totals = [sum(r.breakdown_s.values()) for r in results]
    ends = [max(p.get_x() + p.get_width() for p in ax.patches[i::n]) for i in range(n)]
    assert ends == pytest.approx(totals)
    assert totals == pytest.approx([r.iteration_time_s for r in results])
    plots.pyplot().close(fig)


def test_memory_bars_equal_per_stage_peaks_and_capacity_line():
    _, outcomes = default_run()
    results = [o.result for o in outcomes]
    fig = plots.memory_figure(results)
    ax = fig.axes[0]
    expected = [b / GIB for r in results for b in r.memory.per_stage_bytes]
    assert [p.get_height() for p in ax.patches] == pytest.approx(expected)
    lines = ax.collections[0].get_segments()
    assert [seg[0][1] for seg in lines] == pytest.approx(
        [c / GIB for c in results[0].memory.capacity_bytes])
    plots.pyplot().close(fig)


def test_png_output_is_byte_identical_across_writes(tmp_path):
    _, outcomes = default_run()
    results = [o.result for o in outcomes]
    holmes = next(o for o in outcomes if o.plan.policy == "holmes")
    for name in ("a", "b"):
        plots.save_figure(plots.iteration_time_figure(results), tmp_path / f"it_{name}.png")
        plots.save_figure(plots.timeline_figure(holmes.trace, "holmes"),
                          tmp_path / f"tl_{name}.png")
    assert (tmp_path / "it_a.png").read_bytes() == (tmp_path / "it_b.png").read_bytes()
    assert (tmp_path / "tl_a.png").read_bytes() == (tmp_path / "tl_b.png").read_bytes()
    assert b"Software" not in (tmp_path / "it_a.png").read_bytes()


def test_timeline_draws_every_op_of_the_shown_rows():
    _, outcomes = default_run()
    trace = next(o for o in outcomes if o.plan.policy == "megatron").trace
    rows, note = plots.timeline_rows(trace.entities)
    assert len(rows) == len(trace.entities) and "all 16" in note
    boxes = plots.timeline_boxes(trace, rows)
    drawn = sum(len(b) for b in boxes.values())
    assert drawn == sum(1 for r in trace.records if r.end_s > r.start_s)
    fwd = [r for r in trace.records if r.kind.value == "forward"]
    assert sorted(boxes[fwd[0].kind][:, 0, 0]) == sorted(r.start_s for r in fwd)


def test_timeline_rows_are_capped_for_big_runs():
    from holmes_sim.sim.trace import Entity

    ents = [Entity(f"s{s}.d{d}", s, d, f"n{s}", "c", ()) for d in range(8) for s in range(16)]
    rows, note = plots.timeline_rows(ents, max_rows=32)
    assert len(rows) == 30 and note.startswith("30 of 128")
    assert {(e.stage, e.replica) for e in rows if e.stage in (0, 15)} == \
        {(s, d) for s in (0, 15) for d in range(8)}
    assert [e.stage for e in rows if e.stage not in (0, 15)] == list(range(1, 15))
    few, _ = plots.timeline_rows(ents, max_rows=20)
    assert len(few) == 20 and [(e.stage, e.replica) for e in few] == sorted(
        (e.stage, e.replica) for e in few)


class _FakeValidation:
    def to_json(self) -> dict:
        return {
            "cases": [
                {"policy": "megatron", "predicted_s": 1.0, "measured_s": 1.1, "error_pct": -9.0909,
                 "measured_iterations_s": [1.05, 1.1, 1.15]},
                {"policy": "holmes", "predicted_s": 0.8, "measured_s": 0.78, "error_pct": 2.5641,
                 "measured_iterations_s": [0.77, 0.78, 0.79]},
            ],
            "ranking_agrees": True, "tolerance_pct": 15.0,
            "profile": {"fabrics": {"eth": {"bandwidth_bytes_per_s": 1e9}}},
            "provenance": {"host": "test", "torch": "2.x"},
        }


def test_validation_report_files_and_plotted_data(tmp_path):
    write_validation_report(tmp_path, _FakeValidation())
    assert (tmp_path / "predicted_vs_measured.png").read_bytes()[:4] == b"\x89PNG"
    text = (tmp_path / "validation.md").read_text()
    assert "2 of 2 policies are within the 15% tolerance" in text
    assert "largest error is -9.1% (megatron" in text and "agrees" in text
    assert "| holmes | 0.8000 | 0.7800 | 0.7700..0.7900 | +2.6 | yes |" in text
    fig = plots.validation_figure(_FakeValidation().to_json())
    ax = fig.axes[0]
    assert [p.get_height() for p in ax.patches] == [1.0, 0.8, 1.1, 0.78]
    labels = [t.get_text() for t in ax.texts]
    assert labels == ["-9.1%", "+2.6%"]
    bars = [c for c in ax.containers if getattr(c, "errorbar", None) is not None][0]
    segments = bars.errorbar.lines[2][0].get_segments()
    assert [tuple(s[:, 1]) for s in segments] == [pytest.approx((1.05, 1.15)),
                                                  pytest.approx((0.77, 0.79))]
    plots.pyplot().close(fig)


def test_timeline_of_two_wide_stages_shows_both_stages_as_its_note_says():
    from holmes_sim.sim.trace import Entity

    ents = [Entity(f"s{s}.d{d}", s, d, "n", "c", ()) for s in range(2) for d in range(32)]
    rows, note = plots.timeline_rows(ents, max_rows=32)
    assert len(rows) == 32 and {e.stage for e in rows} == {0, 1}
    replicas = sorted({e.replica for e in rows})
    assert note == (f"32 of 64 entities: replicas {', '.join(map(str, replicas))} of each of the 2 "
                    "stages")
    assert all(sum(e.replica == r for e in rows) == 2 for r in replicas)


def test_report_names_the_nodes_of_every_stage_and_marks_references(report_dir):
    _, outcomes = default_run()
    text = (report_dir / "report.md").read_text()
    assert "## Which nodes hold which pipeline stage" in text
    for o in outcomes:
        first = o.plan.entity_gpus(0, 0)[0].node
        stages = text.split("## Which nodes", 1)[1].split("\n## ", 1)[0]
        row = next(line for line in stages.splitlines() if line.startswith(f"| {o.plan.policy} |"))
        assert first in row
    fig = plots.iteration_time_figure([o.result for o in outcomes], references=("all-ethernet",))
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert "all-ethernet (reference)" in labels and "holmes" in labels
    plots.pyplot().close(fig)


def test_holmes_error_is_importable_from_the_package():
    import holmes_sim
    from holmes_sim.errors import HolmesError

    assert holmes_sim.HolmesError is HolmesError


def test_findings_name_the_category_that_saves_most_and_its_links(report_dir):
    _, outcomes = default_run()
    results = {o.result.policy: o.result for o in outcomes}
    mega, holmes = results["megatron"], results["holmes"]
    gains = {k: mega.breakdown_s[k] - holmes.breakdown_s[k] for k in BREAKDOWN_KEYS}
    key = max(gains, key=gains.get)
    text = (report_dir / "report.md").read_text()
    assert (f"Most of the saving is {COST_NAMES[key]} ({key}): {mega.breakdown_s[key]:.3f} s "
            f"against {holmes.breakdown_s[key]:.3f} s") in text
    links = text.split("## Links each group kind uses", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in links.splitlines() if line.startswith("| ") and "---" not in line}
    kinds = rows.pop("policy")
    for policy, cells in rows.items():
        assert cells == [results[policy].transports.get(k, "-") for k in kinds]
    assert findings([o for o in outcomes if o.result.policy != "megatron"]).count("saving") == 0


def _legend_inside(fig) -> bool:
    """Whether every legend of `fig` is drawn whole inside the figure."""
    fig.canvas.draw()
    box = fig.bbox
    return all(box.x0 <= (e := legend.get_window_extent()).x0 and e.x1 <= box.x1
               and box.y0 <= e.y0 and e.y1 <= box.y1 for legend in fig.legends)


def test_every_figure_legend_lies_whole_inside_its_figure():
    _, outcomes = default_run()
    results = [o.result for o in outcomes]
    figures = [plots.breakdown_figure(results), plots.memory_figure(results),
               plots.timeline_figure(outcomes[0].trace, outcomes[0].plan.policy),
               plots.validation_figure(_FakeValidation().to_json())]
    for fig in figures:
        assert fig.legends and _legend_inside(fig), fig.axes[0].get_title()
        plots.pyplot().close(fig)


class _UnstableValidation(_FakeValidation):
    """A run the host could give no verdict on (exit 3), with a memory note."""

    def to_json(self) -> dict:
        return {**super().to_json(), "host_unstable": True,
                "host_warnings": ["host overloaded before the run: 9.5 tasks running or waiting "
                                  "on 2 cores (more than 2.5 per core)"],
                "provenance": {"host": "test", "notes": ["the simulated plans do not fit"]}}


def test_validation_report_of_an_unstable_host_gives_no_verdict(tmp_path):
    write_validation_report(tmp_path, _UnstableValidation())
    text = (tmp_path / "validation.md").read_text()
    assert "**No verdict** (`validate --real` exited 3)" in text
    assert "within the 15% tolerance;" not in text and "ranking" not in text.split("|")[0]
    assert ("- Host: host overloaded before the run: 9.5 tasks running or waiting on 2 cores "
            "(more than 2.5 per core); no verdict.") in text
    assert "- Note: the simulated plans do not fit." in text
    assert "| holmes | 0.8000 | 0.7800 | 0.7700..0.7900 | +2.6 | no verdict |" in text
    assert "| yes |" not in text and "| NO |" not in text
    fig = plots.validation_figure(_UnstableValidation().to_json())
    assert "NO VERDICT: host unstable" in fig.axes[0].get_title()
    assert "agrees" not in fig.axes[0].get_title()
    plots.pyplot().close(fig)
