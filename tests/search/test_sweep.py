"""`holmes-sim sweep`: paths, values, errors naming the --set, ordered results, outputs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.errors import ScenarioError
from holmes_sim.prepare import prepare_text
from holmes_sim.search.sweep import build_points, run_sweep
from holmes_sim.search.sweep_axes import parse_set
from tests.conftest import SCENARIOS

DEFAULT = SCENARIOS / "mixed_ib_eth.yaml"
BANDWIDTH = "inter_cluster_links[0].bandwidth_gbit_per_s"


def test_parse_set_reads_paths_and_yaml_scalars():
    axis = parse_set("clusters[1].nodes[0].nics[0].model=eth-25g,eth-100g")
    assert axis.tokens == ("clusters", 1, "nodes", 0, "nics", 0, "model")
    assert axis.values == ("eth-25g", "eth-100g")
    assert parse_set(f"{BANDWIDTH}=50,100.5").values == (50, 100.5)
    assert parse_set("training.distributed_optimizer=true,false").values == (True, False)


@pytest.mark.parametrize(("arg", "says"), [
    ("clusters[7].nodes[0].count=2", "index [7] out of range: clusters has 2 item(s)"),
    ("traning[0].global_batch_size=256", "the scenario has no list 'traning' to index"),
    ("model.num_layers[0]=2", "is not a list"),
    ("training.global_batch_size", "expected PATH=V1,V2"),
    ("training.global_batch_size=256,,512", "empty value"),
    ("clusters[x].count=2", "is not a field name"),
])
def test_bad_set_argument_is_a_scenario_error_naming_it(arg, says):
    with pytest.raises(ScenarioError) as info:
        build_points(DEFAULT, [parse_set(arg)])
    assert f"--set {arg}" in str(info.value) and says in str(info.value)


def test_unknown_final_key_and_bad_value_are_reported_by_the_loader_with_the_set():
    with pytest.raises(ScenarioError) as info:
        run_sweep(DEFAULT, ["training.global_batch_sise=256"], ["holmes"], jobs=1)
    assert "--set training.global_batch_sise=256" in str(info.value)
    assert "did you mean 'global_batch_size'" in str(info.value)
    with pytest.raises(ScenarioError) as info:
        run_sweep(DEFAULT, [f"{BANDWIDTH}=100,-5"], ["holmes"], jobs=1)
    assert f"--set {BANDWIDTH}=100,-5 (value -5)" in str(info.value)
    assert "must be greater than 0" in str(info.value) and "holmes-sweep-" not in str(info.value)


def test_a_section_the_file_leaves_out_is_swept_and_a_misspelt_one_is_named():
    result = run_sweep(DEFAULT, ["variability.compute_spread=0,0.1"], ["holmes"], jobs=1)
    times = [r["iteration_time_s"] for r in result.rows]
    assert "variability" not in yaml.safe_load(DEFAULT.read_text()) and times[1] > times[0]
    with pytest.raises(ScenarioError) as info:
        run_sweep(DEFAULT, ["trainign.global_batch_size=256"], ["holmes"], jobs=1)
    assert "--set trainign.global_batch_size=256" in str(info.value)
    assert "trainign: unknown key" in str(info.value)


def test_a_quoted_number_in_the_file_stays_text_in_every_point(tmp_path):
    path = tmp_path / "quoted.yaml"
    path.write_text(DEFAULT.read_text().replace("description: ", "description: '1e9' #", 1))
    for point in build_points(path, [parse_set("seed=1,2")]):
        assert prepare_text(point.text).scenario.description == "1e9"


@pytest.mark.parametrize("written", ["1.50", "1e9", "12"])
def test_a_plain_number_in_a_text_field_stays_as_written_in_every_point(tmp_path, written):
    path = tmp_path / "plain.yaml"
    path.write_text(DEFAULT.read_text().replace("description: ", f"description: {written} #", 1))
    for point in build_points(path, [parse_set("seed=1,2")]):
        assert prepare_text(point.text).scenario.description == written


def test_a_profile_named_like_a_number_resolves_as_run_reads_it(tmp_path):
    (tmp_path / "s.yaml").write_text(DEFAULT.read_text() + "profile: 2024.10\n")
    points = build_points(tmp_path / "s.yaml", [parse_set("seed=1")])
    assert yaml.safe_load(points[0].text)["profile"] == str((tmp_path / "2024.10").resolve())


def test_a_yaml_1_1_number_in_a_set_gets_the_yaml_1_1_note_not_a_quotes_fix():
    with pytest.raises(ScenarioError) as info:
        run_sweep(DEFAULT, ["model.hidden_size=0x1000"], ["holmes"], jobs=1)
    assert "YAML 1.1 would read 4096" in str(info.value)
    assert "without quotes" not in str(info.value)  # the user typed none


def test_a_point_is_checked_without_writing_a_file(monkeypatch):
    """A sweep worker the memory guard kills (SIGKILL) runs no cleanup, so checking a point
    must leave nothing behind: it writes no file at all, valid point or refused one."""
    import tempfile

    from holmes_sim.search.sweep import prepare_point

    def refuse(*args, **kwargs):
        raise AssertionError("a sweep point wrote a file")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    monkeypatch.setattr(Path, "write_text", refuse)
    axes = [parse_set("training.global_batch_size=256,-1")]
    good, bad = build_points(DEFAULT, axes)
    assert prepare_point(good, DEFAULT, axes).source == str(DEFAULT)
    with pytest.raises(ScenarioError, match="global_batch_size=256,-1 \\(value -1\\)"):
        prepare_point(bad, DEFAULT, axes)


def test_relative_profile_resolves_against_the_original_folder(tmp_path):
    text = DEFAULT.read_text() + "profile: measured/profile.json\n"
    (tmp_path / "s.yaml").write_text(text)
    points = build_points(tmp_path / "s.yaml", [parse_set("training.global_batch_size=256")])
    data = yaml.safe_load(points[0].text)
    assert Path(data["profile"]) == (tmp_path / "measured" / "profile.json").resolve()
    assert data["training"]["global_batch_size"] == 256


def test_two_bandwidths_run_in_product_order_and_more_bandwidth_is_not_slower():
    result = run_sweep(DEFAULT, [f"{BANDWIDTH}=400,50", "training.global_batch_size=256,512"],
                       ["megatron", "holmes"], jobs=2)
    keys = [(r[BANDWIDTH], r["training.global_batch_size"], r["policy"]) for r in result.rows]
    policies = ("megatron", "holmes")
    assert keys == [(b, g, p) for b in (400, 50) for g in (256, 512) for p in policies]
    assert [r["point"] for r in result.rows] == [0, 0, 1, 1, 2, 2, 3, 3]
    holmes = {(r[BANDWIDTH], r["training.global_batch_size"]): r["iteration_time_s"]
              for r in result.rows if r["policy"] == "holmes"}
    for g in (256, 512):
        assert holmes[(400, g)] <= holmes[(50, g)]
    assert holmes[(50, 512)] > holmes[(50, 256)]


def test_cli_sweep_writes_csv_json_and_plots(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["sweep", str(DEFAULT), "--set", f"{BANDWIDTH}=100,200",
                                      "--policy", "holmes", "--out", str(out), "--jobs", "1"])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [(r[BANDWIDTH], r["policy"]) for r in rows] == [("100", "holmes"), ("200", "holmes")]
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["axes"] == [{"path": BANDWIDTH, "values": [100, 200]}]
    times = [r["iteration_time_s"] for r in doc["rows"]]
    assert [float(r["iteration_time_s"]) for r in rows] == times
    assert float(rows[1]["iteration_time_s"]) <= float(rows[0]["iteration_time_s"])
    for name in ("sweep_iteration_time.png", "sweep_tflops.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "holmes" in result.output


def test_cli_sweep_bad_path_exits_2_naming_it(tmp_path):
    args = ["sweep", str(DEFAULT), "--set", "clusters[5].nodes[0].count=2",
            "--out", str(tmp_path / "out")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert "--set clusters[5].nodes[0].count=2" in result.output
    assert "out of range" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("path", "says"), [
    ("x." * 400 + "y", "a path of 801 characters; field paths are at most 300"),
    ("x" * 2000, "a path of 2,000 characters; field paths are at most 300"),
    ("x." * 100 + "y", "a path of 101 parts; scenario fields nest at most 31 deep"),
    ("clusters" + "[0]" * 31 + ".count", "a path of 33 parts"),
])
def test_a_path_too_deep_or_too_long_is_refused_on_one_line_before_anything_runs(tmp_path, path,
                                                                                 says):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["sweep", str(DEFAULT), "--set", f"{path}=1",
                                      "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert says in result.output and f"--set {path[:40]}..." in result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()


def test_a_path_as_deep_as_the_loader_allows_gets_the_loaders_verdict():
    with pytest.raises(ScenarioError) as info:
        run_sweep(DEFAULT, ["x." * 30 + "y=1"], ["holmes"], jobs=1)
    assert "x: unknown key" in str(info.value) and "nested deeper" not in str(info.value)


def test_an_index_with_a_leading_zero_is_refused_so_a_field_cannot_be_swept_twice(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["sweep", str(DEFAULT), "--set", "clusters[0].nodes[0].count=1,2",
                                      "--set", "clusters[0].nodes[00].count=2,1",
                                      "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "--set clusters[0].nodes[00].count=2,1: index [00] has a leading zero; write [0]" \
        in result.output
    assert not out.exists()


@pytest.mark.parametrize(("field", "values", "bad"), [
    ("clusters[0].nodes[0].name", "n1,nü", "'nü'"),
    ("clusters[0].nodes[0].name", "nü,n1", "'nü'"),
    ("clusters[0].nodes[0].name", "n1,1e3", "1e3"),
    ("clusters[1].name", "eth,9eth", "'9eth'"),
])
def test_a_bad_name_is_refused_up_front_whatever_the_order_of_the_values(field, values, bad):
    """A name's rule is the value's alone (unlike a batch that the data-parallel degree must
    divide), so the schema refuses it in any point, as a mistake of the user's."""
    arg = f"{field}={values}"
    with pytest.raises(ScenarioError) as info:
        run_sweep(DEFAULT, [arg], ["holmes"], jobs=1)
    assert f"--set {arg} (value {bad})" in str(info.value)
    assert f"{field}: '{bad.strip(chr(39))}' is not a valid name; use a letter" in str(info.value)


def test_a_valid_value_that_does_not_fit_the_rest_of_the_point_is_still_skipped():
    result = run_sweep(DEFAULT, ["training.global_batch_size=256,250"], ["holmes"], jobs=1)
    assert [r["status"] for r in result.rows] == ["ok", "infeasible"]
    assert "250 is not a multiple of" in result.rows[1]["reason"]


@pytest.mark.parametrize(("arg", "read"), [
    ("name=1e3,1000,0.10", ["1e3", "1000", "0.10"]),
    ("description=1.50,1.5", ["1.50", "1.5"]),
])
def test_set_values_in_a_text_field_keep_their_written_text(arg, read):
    points = build_points(DEFAULT, [parse_set(arg)])
    field = arg.partition("=")[0]
    assert [getattr(prepare_text(p.text).scenario, field) for p in points] == read
    result = run_sweep(DEFAULT, [arg], ["holmes"], jobs=1)
    assert [r[field] for r in result.rows] == read
    assert result.to_json()["axes"] == [{"path": field, "values": read}]


def test_set_numbers_keep_their_written_text_and_stay_numbers_in_the_outputs():
    points = build_points(DEFAULT, [parse_set(f"{BANDWIDTH}=1e2,0.50")])
    assert "bandwidth_gbit_per_s: 1e2" in points[0].text
    assert "bandwidth_gbit_per_s: 0.50" in points[1].text
    assert [prepare_text(p.text).scenario.inter_cluster_links[0].bandwidth_gbit_per_s
            for p in points] == [100.0, 0.5]
    result = run_sweep(DEFAULT, [f"{BANDWIDTH}=1e2,0.50"], ["holmes"], jobs=1)
    assert [r[BANDWIDTH] for r in result.rows] == [100.0, 0.5]


def test_one_number_written_two_ways_runs_once_in_a_number_field():
    result = run_sweep(DEFAULT, [f"{BANDWIDTH}=50,100.0,1e2", "seed=0,1"], ["holmes"], jobs=1)
    assert [(r[BANDWIDTH], r["seed"]) for r in result.rows] == \
        [(50, 0), (50, 1), (100.0, 0), (100.0, 1)]


@pytest.mark.parametrize("values", ["a100-80gb,h100x", "h100x,a100-80gb"])
def test_a_misspelt_catalog_model_ends_the_sweep_in_any_order(values):
    """Whether a GPU model exists depends on its name and the file's catalog alone: a mistake,
    refused before anything runs, not an infeasible point skipped."""
    with pytest.raises(ScenarioError) as info:
        run_sweep(DEFAULT, [f"clusters[0].nodes[0].gpu={values}"], ["holmes"], jobs=1)
    assert "(value 'h100x'): clusters[0].nodes[0].gpu: unknown GPU model 'h100x'" in str(info.value)


@pytest.mark.parametrize("policy", [[], ["--policy", "holmes"]])
def test_a_sweep_with_no_valid_point_exits_2_writing_nothing_with_or_without_policy(tmp_path,
                                                                                   policy):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["sweep", str(DEFAULT), "--set", "parallel.tensor=3,5",
                                      *policy, "--out", str(out), "--jobs", "1"])
    assert result.exit_code == 2, result.output
    assert "--set parallel.tensor=3,5 (value 3): parallel.tensor: tensor=3 must divide" \
        in " ".join(result.output.split())
    assert not out.exists()


def test_an_int_and_a_float_of_one_number_run_once_shown_as_first_given():
    result = run_sweep(DEFAULT, [f"{BANDWIDTH}=200,50,100,100.0,1e2"], ["holmes"], jobs=1)
    assert [r[BANDWIDTH] for r in result.rows] == [200, 50, 100]
    assert result.to_json()["axes"] == [{"path": BANDWIDTH, "values": [200, 50, 100]}]
    result = run_sweep(DEFAULT, [f"{BANDWIDTH}=1e2,100"], ["holmes"], jobs=1)
    assert [r[BANDWIDTH] for r in result.rows] == [100.0]


def test_a_boolean_is_not_merged_with_the_number_one():
    from holmes_sim.search.sweep import _merge_numbers

    axis = parse_set("x=1,true,1.0,false,0")
    assert _merge_numbers(axis).values == (1, True, False, 0)


LATENCY = "inter_cluster_links[0].latency_us"


def test_max_points_raises_the_number_of_values_one_set_may_list(tmp_path):
    from holmes_sim.search.sweep import parse_axes

    values = ",".join(str(i) for i in range(1, 12_001))
    assert len(parse_axes([f"{LATENCY}={values}"], 15_000)[0].values) == 12_000
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["sweep", str(DEFAULT), "--set", f"{LATENCY}={values}",
                                      "--max-points", "500", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert (f"--set {LATENCY}=...: 12,000 values; with --max-points 500 one --set lists at "
            "most 10,000; give fewer values or raise --max-points") \
        in " ".join(result.output.split())
    assert not out.exists()


def test_a_set_past_the_hard_bound_is_refused_fast_whatever_max_points(tmp_path):
    import time

    start = time.monotonic()
    with pytest.raises(ScenarioError) as info:
        run_sweep(DEFAULT, [f"{LATENCY}=" + ",".join(["1"] * 1_000_001)], ["holmes"],
                  max_points=10**7)
    assert time.monotonic() - start < 1.0
    assert str(info.value) == (f"--set {LATENCY}=...: 1,000,001 values; one --set lists at "
                               "most 100,000 whatever --max-points; give fewer values")


def test_a_sweep_point_keeps_nothing_of_the_points_before():
    """Each point is prepared anew, so the identity-keyed caches of an earlier point (holding
    its clusters and plans) are dropped: a worker's memory stays flat over a long sweep."""
    from holmes_sim import memo
    from holmes_sim.search import sweep

    path = SCENARIOS / "pure_ib.yaml"
    axes, points = sweep._checked_points(path, sweep.parse_axes(["seed=1,2,3"], 10))

    def held() -> dict[int, int]:
        return {id(m): len(m._entries) for m in list(memo._MEMOS)}

    sweep.run_point(points[0], path, axes, None)
    after_one = held()
    for point in points[1:]:
        sweep.run_point(point, path, axes, None)
    assert held() == after_one and sum(after_one.values()) > 0


_CATALOG_GPU = """name: my-gpu-sweep
catalog:
  gpus: {my-gpu: {peak_tflops: 400, memory_gib: 80, memory_bandwidth_gbyte_per_s: 2000,
                  intra_node: nvlink3}}
clusters:
  - name: c
    nodes: [{count: 2, gpu: my-gpu, gpus_per_node: 8, nics: [{type: ethernet, model: eth-100g}]}]
model: {num_layers: 4, hidden_size: 1024, num_attention_heads: 16, seq_length: 1024}
training: {global_batch_size: 32, micro_batch_size: 1}
parallel: {tensor: 8, pipeline: 1}
policies: [megatron]
"""


def test_a_catalog_gpu_named_with_a_dash_is_swept(tmp_path):
    """Catalog names take '-' (every built-in one has it): `catalog.gpus.my-gpu.peak_tflops` is
    a path, and the faster GPU gives the faster iteration."""
    (tmp_path / "s.yaml").write_text(_CATALOG_GPU)
    path = "catalog.gpus.my-gpu.peak_tflops"
    result = run_sweep(tmp_path / "s.yaml", [f"{path}=300,400"], jobs=1)
    times = {r[path]: r["iteration_time_s"] for r in result.rows}
    assert list(times) == [300, 400] and times[400] < times[300]
