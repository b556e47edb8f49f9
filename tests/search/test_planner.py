"""`holmes-sim plan`: the search space obeys the rules a launcher enforces, the ranking is by time,
the top plans are confirmed by simulation, and the answer beats the scenario's own plan."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from holmes_sim.search import planner
from holmes_sim.cli import app
from holmes_sim.prepare import prepare
from holmes_sim.runner import run_policy

SMALL = """name: small-plan
fabrics: [{name: ib, type: ib}, {name: roce, type: roce}]
clusters:
  - name: lab
    nodes:
      - {name: ib, count: 2, gpu: a100-80gb,
         nics: [{type: ib, model: ib-hdr, count: 4, fabric: ib}, {type: ethernet, model: eth-25g}]}
      - {name: roce, count: 2, gpu: a100-80gb,
         nics: [{type: roce, model: roce-200g, count: 2, fabric: roce}, {type: ethernet, model: eth-25g}]}
model: {name: gpt-1.3b, num_layers: 24, hidden_size: 2048, num_attention_heads: 16, seq_length: 2048}
training: {global_batch_size: 256, micro_batch_size: 2, recompute: selective}
parallel: {tensor: 2, pipeline: 2}
policies: [megatron, holmes]
search: {tensor: [1, 2, 4], pipeline: [1, 2, 4], micro_batch_size: [1, 2], schedule: [1f1b, interleaved],
         virtual_stages: [2], recompute: [none, selective], top_k: 3}
"""


@pytest.fixture
def small(write_scenario):
    return write_scenario(SMALL)


def test_every_layout_is_one_megatron_would_accept(small):
    prepared = prepare(small)
    grid = list(planner.layouts(prepared, prepared.scenario.search))
    assert grid
    n, B, L = prepared.cluster.num_gpus, 256, 24
    for lay in grid:
        assert lay.tp * lay.pp * lay.dp == n and 8 % lay.tp == 0 and 16 % lay.tp == 0
        m = B // (lay.micro_batch_size * lay.dp)
        assert B % (lay.micro_batch_size * lay.dp) == 0
        assert lay.pp * lay.virtual_stages <= L
        if lay.schedule == "interleaved":
            assert m % lay.pp == 0 and lay.pp > 1
        assert not (lay.sequence_parallel and lay.tp == 1)


def test_search_ranks_confirms_and_beats_the_scenarios_own_plan(small):
    prepared = prepare(small)
    result = planner.search(prepared)
    times = [c.predicted_iteration_s for c in result.candidates]
    assert [c.simulated for c in result.candidates[:3]] == [True] * 3
    assert sorted(times[:3]) == times[:3] and sorted(times[3:]) == times[3:]
    assert result.baseline is not None and result.baseline.policy == "megatron" and result.baseline.simulated
    own = run_policy(prepared, "holmes").result.iteration_time_s
    assert result.candidates[0].predicted_iteration_s <= own * (1 + 1e-9)
    assert result.evaluated == len(result.candidates) + len(result.infeasible)
    assert all(c.reason for c in result.infeasible)


def test_confirmed_times_are_the_simulations(small):
    prepared = prepare(small)
    best = planner.search(prepared).candidates[0]
    again = run_policy(planner.prepared_for(prepared, best.layout), best.policy).result
    assert best.predicted_iteration_s == again.iteration_time_s


def test_plan_cli_json_and_export(small, tmp_path):
    out = tmp_path / "launch"
    result = CliRunner().invoke(app, ["plan", str(small), "--json", "-", "--export", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    keys = {"policy", "tp", "pp", "dp", "micro_batch_size", "schedule", "virtual_stages", "recompute",
            "sequence_parallel", "optimizer", "layers_per_stage", "predicted_iteration_s",
            "tflops_per_gpu", "peak_memory_gib", "fits_memory", "simulated"}
    assert {"scenario", "evaluated", "elapsed_s", "baseline", "candidates"} <= set(doc)
    assert keys <= set(doc["candidates"][0]) and keys <= set(doc["baseline"])
    folders = sorted(p for p in out.iterdir() if p.is_dir())
    assert folders[0].name.startswith("1-")
    assert (folders[0] / "launch.sh").exists()


def test_bad_search_values_are_refused(write_scenario):
    path = write_scenario(SMALL.replace("tensor: [1, 2, 4]", "tensor: [0]"))
    result = CliRunner().invoke(app, ["plan", str(path)])
    assert result.exit_code == 2 and "search.tensor" in result.output


def test_process_pool_gives_the_serial_results(small):
    prepared = prepare(small)
    spec = prepared.scenario.search
    grid = list(planner.layouts(prepared, spec))
    serial = planner.evaluate_chunk(prepared, spec, grid)
    pooled = [c for part in planner._local_map(prepared, spec, grid, 2, None) for c in part]
    assert pooled == serial


def test_bad_jobs_are_refused(small):
    result = CliRunner().invoke(app, ["plan", str(small), "--jobs", "0"])
    assert result.exit_code == 2 and "--jobs" in result.output


def _identity(c: planner.Candidate) -> str:
    """A candidate's JSON without its figures: what the plan is, not how fast it runs."""
    figures = ("predicted_iteration_s", "tflops_per_gpu", "peak_memory_gib", "fits_memory",
               "simulated", "breakdown_s", "reason")
    return json.dumps({k: v for k, v in c.to_json().items() if k not in figures}, sort_keys=True)


def test_no_two_candidates_are_the_same_plan(small):
    result = planner.search(prepare(small), jobs=1)
    ranked = [*result.candidates, *result.infeasible]
    assert len({_identity(c) for c in ranked}) == len(ranked)
    overlap = [c for c in ranked if c.overlap_grad_reduce]
    assert overlap and all(c.to_json()["overlap_grad_reduce"] for c in overlap)


def test_a_layouts_optimizers_share_one_workload_equal_to_a_fresh_build(small):
    """`prepared_for` gives every optimizer of a layout one Workload (caches kept by its
    identity then serve them all), which is right only while `build_workload` reads no optimizer
    setting: each optimizer's training settings build an equal one afresh."""
    from dataclasses import replace

    from holmes_sim.model.workload import build_workload

    prepared = prepare(small)
    for layout in list(planner.layouts(prepared, prepared.scenario.search))[::7]:
        got = [planner.prepared_for(prepared, replace(layout, optimizer=o))
               for o in ("replicated", "distributed", "distributed-overlap",
                         "distributed-overlap-gather")]
        assert len({id(p.workload) for p in got}) == 1
        assert len({(p.scenario.training.distributed_optimizer,
                     p.scenario.training.overlap_param_gather) for p in got}) == 3
        for p in got:
            s = p.scenario
            assert p.workload == build_workload(s.model, s.training, layout.tp, layout.cp,
                                                s.parallel.cp_comm_type, layout.ep, layout.etp)


def test_prepared_for_copies_as_replace_does(small):
    """`planner._copy` stands for `dataclasses.replace` on the classes it copies: frozen, every
    field set by `__init__`, no `__post_init__`; its copies equal `replace`'s."""
    from dataclasses import fields, replace

    prepared = prepare(small)
    s = prepared.scenario
    layout = next(iter(planner.layouts(prepared, s.search)))
    cases = [(layout, {"optimizer": "replicated"}), (prepared, {"tp": 4, "num_microbatches": 3}),
             (s, {"training": replace(s.training, micro_batch_size=8)}),
             (s.training, {"micro_batch_size": 8, "recompute": "full"}),
             (s.parallel, {"tensor": 4, "schedule": "interleaved", "virtual_stages": 2})]
    for obj, changes in cases:
        cls = type(obj)
        assert cls.__dataclass_params__.frozen and not hasattr(cls, "__post_init__")
        assert all(f.init for f in fields(cls))
        got = planner._copy(obj, **changes)
        assert type(got) is cls and got == replace(obj, **changes) and got is not obj


@pytest.mark.parametrize("need_gib, text", [(80.04, "needs 80.04 GiB per GPU, the GPUs have 80"),
                                            (81.0, "needs 81.0 GiB per GPU, the GPUs have 80"),
                                            (80.0004, "needs just over 80 GiB per GPU, the GPUs have 80")])
def test_a_shortfall_shows_the_need_above_the_capacity(need_gib, text):
    from holmes_sim.metrics import MemoryReport

    gib = 2**30
    report = MemoryReport((need_gib * gib, 10 * gib), (80 * gib, 80 * gib))
    assert not report.fits and report.shortfall().startswith(text)


def test_plans_left_out_are_shown_nearest_to_fitting_one_per_layout(write_scenario):
    from holmes_sim.search.report import infeasible_summary, layout_label, optimizer_label

    # 8 GPUs of 40 GB for a 6.7B model: many layouts fit, many do not
    text = SMALL.replace("a100-80gb", "a100-40gb").replace(
        "num_layers: 24, hidden_size: 2048", "num_layers: 32, hidden_size: 4096")
    result = planner.search(prepare(write_scenario(text)))
    memory = [c for c in result.infeasible if c.reason.startswith("needs")]
    assert len(memory) > 3
    lines = infeasible_summary(result)
    shown = lines[1:]
    assert len(shown) == 3 and len(set(shown)) == 3
    needs = [float(line.split("needs ")[1].split(" GiB")[0]) for line in shown]
    assert needs == sorted(needs) and needs[0] <= min(c.peak_memory_gib for c in memory) + 0.05
    labels = {f"  {c.policy}, {layout_label(c)}, {optimizer_label(c)}: {c.reason}" for c in memory}
    assert set(shown) <= labels  # each names its optimizer, as the table does


def _left_out(tp: int, reason: str, peak: float = 0.0, excess: float = 0.0,
              optimizer: str = "distributed", policy: str = "megatron") -> planner.Candidate:
    layout = planner.Layout(tp, 1, 8 // tp, 1, "1f1b", 1, "none", False)
    return planner.Candidate(policy, layout, optimizer, (), float("inf"), 0.0, peak, False,
                             reason=reason, excess_gib=excess)


def test_the_nearest_to_fitting_is_the_least_over_its_own_gpus():
    """GPUs of two sizes: a 90 GiB plan 0.1 over its 89.9 GiB GPUs is nearer to fitting than a
    41 GiB one 1 over its 40 GiB GPUs."""
    from holmes_sim.search.report import infeasible_summary

    far = _left_out(1, "needs 41.0 GiB per GPU, the GPUs have 40", 41.0, 1.0)
    near = _left_out(2, "needs 90.0 GiB per GPU, the GPUs have 89.9", 90.0, 0.1)
    lines = infeasible_summary(planner.PlanSearch("s", (), None, (far, near), 2, 0.0))
    assert "TP2" in lines[1] and "TP1" in lines[2]


def test_one_build_fault_met_by_many_layouts_is_one_example_beside_the_nearest():
    from holmes_sim.search.report import infeasible_summary

    fault = "s.yaml:21: clusters[0].nodes[0].nics: nodes {} share no RDMA fabric; add one"
    failures = [_left_out(tp, fault.format(nodes)) for tp, nodes in
                ((1, "ib-a-0, ib-a-1, roce-a-0"), (2, "ib-a-0, roce-b-3"), (4, "ib-b-1, roce-a-0"))]
    memory = [_left_out(8, "needs 81.0 GiB per GPU, the GPUs have 80", 81.0, 1.0,
                        optimizer="distributed-overlap-gather")]
    lines = infeasible_summary(planner.PlanSearch("s", (), None, (*failures, *memory), 4, 0.0))
    assert lines[0] == "4 plans left out: 1 do not fit in GPU memory, 3 could not be built"
    assert len(lines) == 3 and "ib-a-0, ib-a-1, roce-a-0" in lines[1]
    assert lines[2] == ("  megatron, TP8 PP1 DP1 mb1 1f1b rc:none, distributed-overlap-gather: "
                        "needs 81.0 GiB per GPU, the GPUs have 80")


def test_a_search_without_megatron_says_it_has_no_baseline(write_scenario, tmp_path):
    path = write_scenario(SMALL.replace("top_k: 3}", "top_k: 3, policies: [holmes]}"))
    result = CliRunner().invoke(app, ["plan", str(path), "--jobs", "1"])
    text = " ".join(result.output.split())
    assert result.exit_code == 0 and "no speed-up: the search has no megatron plan" in text
    assert "speed-up over the best Megatron-LM" not in text


def test_export_of_references_only_is_refused_before_the_search(write_scenario, tmp_path):
    path = write_scenario(SMALL.replace("top_k: 3}", "top_k: 3, policies: [all-ib]}"))
    result = CliRunner().invoke(app, ["plan", str(path), "--export", str(tmp_path / "ex")])
    assert result.exit_code == 2 and "references on a hypothetical network" in result.output
    assert not (tmp_path / "ex").exists()


def test_a_saving_shows_the_decimals_that_tell_its_ends_apart():
    from holmes_sim.search.report import _seconds

    assert _seconds(0.0114, 0.0061) == "0.011 s -> 0.006 s"
    assert _seconds(2.02, 0.6) == "2.02 s -> 0.60 s"
    assert _seconds(0.01234, 0.01231) == "0.0123 s -> 0.0123 s"


def test_a_baseline_confirmed_apart_is_shown_once_as_simulated(write_scenario):
    """With top_k 1 the best plan is holmes' and the Megatron-LM baseline is simulated apart:
    the table shows it once, with its simulated time, where its estimated copy ranks."""
    from holmes_sim.search.report import plan_table
    result = planner.search(prepare(write_scenario(SMALL.replace("top_k: 3}", "top_k: 1}"))),
                            jobs=1)
    assert result.candidates[0].policy == "holmes" and result.baseline.simulated
    rank = next(i for i, c in enumerate(result.candidates)
                if _identity(c) == _identity(result.baseline))
    text = _rendered(plan_table(result, rows=rank + 1, wide=True))
    assert text.count(f"{result.baseline.predicted_iteration_s:.3f}*") == 1
    assert "base " not in text


def _rendered(table) -> str:
    from rich.console import Console
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_the_default_search_tries_every_chunk_count_from_2_to_9():
    """NVIDIA's Llama 3 70B recipe on 64 H100 interleaves 5 chunks a stage (Megatron-Bridge
    perf_recipes/llama/h100/llama3.py), NeMo's 405B configuration 7."""
    from holmes_sim.spec.scenario import SearchSpec
    assert SearchSpec().virtual_stages == tuple(range(2, 10))


def test_a_winner_that_is_the_baseline_is_not_said_to_beat_it(write_scenario):
    """With megatron the only policy the best plan is the baseline: the sentence says so instead
    of "beats the best Megatron-LM default by 1.00x"."""
    from holmes_sim.search.report import why_the_winner_wins
    result = planner.search(prepare(write_scenario(
        SMALL.replace("top_k: 3}", "top_k: 1, policies: [megatron]}"))), jobs=1)
    assert result.candidates[0] == result.baseline
    sentence = why_the_winner_wins(result)
    assert "is the best Megatron-LM default: no plan searched is faster" in sentence
    assert "beats" not in sentence


def test_json_says_a_holmes_plan_overlaps_the_gradient_reduction_as_its_export_does(small):
    # It said "overlap_grad_reduce": false for holmes plans whose export writes
    # --overlap-grad-reduce and whose simulation overlaps the reduction.
    from holmes_sim.export.launch import _optimizer_args

    prepared = prepare(small)
    layout = next(iter(planner.layouts(prepared, prepared.scenario.search)))
    for policy in ("holmes", "megatron"):
        c = planner.evaluate(prepared, layout, policy)
        plan = run_policy(planner.prepared_for(prepared, layout), policy).plan
        exported = "--overlap-grad-reduce" in _optimizer_args(plan)
        assert c.to_json()["overlap_grad_reduce"] is plan.releases_gradients_in_backward is exported
    assert planner.evaluate(prepared, layout, "holmes").to_json()["overlap_grad_reduce"] is True


@pytest.mark.parametrize("flag", [False, True])
def test_json_overlap_follows_every_optimizer_as_the_plan_does(flag):
    from holmes_sim.plan import _RELEASING_MODES, OptimizerMode

    lay = planner.Layout(2, 2, 16, 4, "1f1b", 1, "selective", True)
    for mode in OptimizerMode:
        c = planner.Candidate("p", lay, mode.value, (18, 18), 1.0, 1.0, 1.0, True,
                              overlap_grad_reduce=flag)
        assert c.to_json()["overlap_grad_reduce"] is (flag or mode in _RELEASING_MODES), mode
