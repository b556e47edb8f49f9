"""A corpus of malformed inputs (issue 8): each one is a single ScenarioError naming file, line and
field, raised in under 2 s and without a traceback; a few also through the CLI (exit 2)."""

from __future__ import annotations

import copy
import json
import time
import tracemalloc
from pathlib import Path

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.errors import ScenarioError
from holmes_sim.prepare import prepare
from holmes_sim.spec import load
from tests.conftest import REPO, small_scenario

runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def _imported() -> None:
    """Import what the commands import, so the 2 s limit times the checks, not module loading."""
    import holmes_sim.cost.ops  # noqa: F401
    import holmes_sim.metrics  # noqa: F401
    import holmes_sim.runner  # noqa: F401
    import holmes_sim.validation.real_run  # noqa: F401
BASE = small_scenario()
TESTBED = (REPO / "validation" / "testbeds" / "default.yaml").read_text()
RESULTS = REPO / "validation" / "results" / "2026-11-30-default.json"
BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True))


def _sub(old: str, new: str, text: str = BASE) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


SCENARIOS = {
    "python tag": (_sub("name: small", "name: !!python/object/apply:os.system [ls]"), "YAML tag"),
    "tag on a mapping": (BASE + "engine: !!python/object:x {}\n", "engine: YAML tag"),
    "binary tag": (_sub("name: small", "name: !!binary aGVsbG8="), "YAML tag"),
    "unhashable key": (BASE + "? [a, b]\n: 1\n", "key must be a plain name"),
    "deep nesting": (BASE + "x: " + "[" * 5000 + "]" * 5000 + "\n", "nested deeper than"),
    "recursive alias": ("a: &a [*a]\n", "nested deeper than"),
    "alias bomb": (BASE + BOMB, "values after expanding aliases"),
    "many aliases": ("a: &a 1\nb: [" + ", ".join(["*a"] * 200) + "]\n", "aliases"),
    "5000-digit integer": (_sub("seed: 0", "seed: " + "9" * 5000), "seed: number too long"),
    "4000-digit integer": (_sub("seed: 0", "seed: " + "9" * 4000), "seed: must be at most"),
    "negative seed": (_sub("seed: 0", "seed: -1"), "seed: must be at least 0"),
    "no clusters": (_sub("clusters:\n  - name: c\n    nodes:\n", "clusters: []\nx:\n    nodes:\n")
                    .replace("x:\n    nodes:\n", "fabrics2:\n    nodes:\n"), "clusters"),
    "nan latency": (small_scenario(latency_us=".nan"), "latency_us: must be a finite number"),
    "inf bandwidth": (small_scenario(ib_gbit=".inf"), "bandwidth_gbit_per_s: must be a finite"),
    "denormal bandwidth": (small_scenario(ib_gbit="5e-324"),
                           "bandwidth_gbit_per_s: must be at least 1e-06"),
    "1e308 bandwidth": (small_scenario(ib_gbit="1e308"), "must be at most 1e+09"),
    "count 1e9": (_sub("count: 2", "count: 1e9"), "count: expected a whole number"),
    "count 10^9": (_sub("count: 2", "count: 1000000000"), "count: must be at most 100000"),
    "global batch 2^40": (small_scenario(global_batch=2**40), "global_batch_size: must be at most"),
    "num_layers 1e9": (small_scenario(layers=10**9), "num_layers: must be at most 10000"),
    "bucket 1e-12": (_sub("micro_batch_size: 1}", "micro_batch_size: 1, bucket_size_mb: 1e-12}"),
                     "bucket_size_mb: must be at least 0.001"),
    "bucket count": (_sub("micro_batch_size: 1}", "micro_batch_size: 1, bucket_size_mb: 0.001}"),
                     "bucket_size_mb: the gradients would fill"),
    "compute_cv inf": (BASE + "engine: {compute_cv: .inf}\n", "compute_cv: must be a finite"),
    "compute_cv nan": (BASE + "engine: {compute_cv: .nan}\n", "compute_cv: must be a finite"),
    "compute_cv 1e6": (BASE + "engine: {compute_cv: 1e6}\n", "compute_cv: must be at most 2"),
    "400-digit number": (BASE + "engine: {compute_cv: 1" + "0" * 400 + "}\n",
                         "compute_cv: must be a finite number, got a whole number of 401 digits"),
    "tolerance nan": (BASE + "testbed: {tolerance_pct: .nan}\n", "tolerance_pct: must be a finite"),
    "timeout inf": (BASE + "testbed: {timeout_s: .inf}\n", "timeout_s: must be a finite"),
    "nodes empty": (_sub("    nodes:\n", "    nodes: []\n    x:\n"), "clusters[0].x"),
    "nics empty": (_sub("nics: [{type: ib", "nics: [], x: [{type: ib"), "nodes[0].x"),
    "trailing newline name": (_sub("  - name: c\n", '  - name: "c\\n"\n'), "control character"),
    "too many nodes in all": (_sub("- {name: ib, count: 2,", "- {name: ib, count: 99999,", BASE)
                              .replace("    nodes:\n", "    nodes:\n      - {count: 99999, gpu: a100-80gb, "
                                       "nics: [{type: ethernet, model: eth-100g}]}\n", 1),
                              "at most 100,000 nodes"),
    "gpu peak inf": (_sub("a100-80gb", "my-gpu") + "catalog:\n  gpus:\n    my-gpu: {peak_tflops: .inf,"
                     " memory_gib: 24, memory_bandwidth_gbyte_per_s: 900}\n",
                     "catalog.gpus.my-gpu.peak_tflops: must be a finite"),
    "nic efficiency 2": (BASE + "catalog:\n  nics:\n    n: {type: ib, bandwidth_gbit_per_s: 1, "
                         "latency_us: 1, efficiency: 2}\n", "efficiency: must be at most 1"),
    "catalog key markup": (BASE + "catalog:\n  gpus:\n    \"[/x]\\n\": {peak_tflops: 1, memory_gib: 1,"
                           " memory_bandwidth_gbyte_per_s: 1}\n", "control character"),
    "NUL in profile path": (BASE + 'profile: "a\\0b"\n', "control character"),
}
# Separate lists, since the corpus above builds on a valid file.
SCENARIOS["no clusters"] = (_sub("clusters:\n  - name: c\n    nodes:\n",
                                 "clusters: []\nunused:\n  - name: c\n    nodes:\n"), "unknown key")
SCENARIOS["clusters: []"] = (BASE.split("clusters:")[0] + "clusters: []\n" + BASE.split("model:", 1)[1]
                             .join(["model:", ""]), "clusters: must list at least one entry")
SCENARIOS["nodes: []"] = (BASE.split("    nodes:")[0] + "    nodes: []\nmodel:" + BASE.split("model:", 1)[1],
                          "clusters[0].nodes: must list at least one entry")
SCENARIOS["nics: []"] = (_sub("nics: [{type: ib, bandwidth_gbit_per_s: 200, count: 1, fabric: ib}, "
                              "{type: ethernet, bandwidth_gbit_per_s: 100}]", "nics: []"),
                         "nics: must list at least one entry")


def _check(path: Path, fragment: str, source: Path | None = None, timed: bool = True) -> str:
    """The ScenarioError of loading `path`: it holds `fragment`, names `source` (default: the
    file itself), is one line and came in under 2 s."""
    start = time.monotonic()
    with pytest.raises(ScenarioError) as info:
        prepare(path)
    elapsed = time.monotonic() - start
    msg = str(info.value)
    assert fragment in msg, msg
    assert str(source or path) in msg and "\n" not in msg
    assert not timed or elapsed < 2.0, f"{elapsed:.2f} s"
    return msg


@pytest.mark.parametrize("case", sorted(SCENARIOS))
def test_malformed_scenario(case: str, write_scenario) -> None:
    text, fragment = SCENARIOS[case]
    _check(write_scenario(text), fragment)


def test_field_errors_name_the_line(write_scenario) -> None:
    text = small_scenario(latency_us=".nan")
    line = next(i for i, t in enumerate(text.splitlines(), 1) if ".nan" in t)
    assert f".yaml:{line}: " in _check(write_scenario(text), "latency_us")


@pytest.mark.parametrize(("data", "fragment"), [
    ("\ufeffname: x\n\x00".encode("utf-16"), "not UTF-8 text"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "not UTF-8 text"),
    (b"x" * (load.MAX_VALUES * 20), "larger than the limit"),
])
def test_binary_and_huge_files(tmp_path: Path, data: bytes, fragment: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(data)
    _check(path, fragment)


def test_dev_zero_and_a_directory_are_refused_in_bounded_memory(tmp_path: Path) -> None:
    tracemalloc.start()
    try:
        _check(Path("/dev/zero"), "a character device, not a regular file")
        _check(tmp_path, "cannot read scenario file")
        _check(tmp_path / "bomb.yaml", "cannot read")
        (tmp_path / "bomb.yaml").write_text(BASE + BOMB)
        _check(tmp_path / "bomb.yaml", "values after expanding aliases", timed=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 * 2**20, peak


def test_every_numeric_field_has_a_bound() -> None:
    """A new numeric spec field needs its line in FIELD_BOUNDS (else only |x| <= 1e15 holds)."""
    import dataclasses
    import typing

    from holmes_sim.spec import hardware, job, scenario

    numeric = set()
    for module in (hardware, job, scenario):
        for cls in vars(module).values():
            if dataclasses.is_dataclass(cls) and cls.__module__ == module.__name__:
                for name, tp in typing.get_type_hints(cls).items():
                    if {int, float} & {tp, *typing.get_args(tp)} and tp is not bool:
                        numeric.add(name)
    assert numeric - set(load.FIELD_BOUNDS) == set()


# ---- profiles -------------------------------------------------------------------------------
def _profile() -> dict:
    return json.loads(RESULTS.read_text())["profile"]


def _broken(edit) -> str:
    doc = copy.deepcopy(_profile())
    edit(doc)
    return json.dumps(doc, indent=1)


PROFILES = {
    "a list": ("[1, 2]", "a profile must be a JSON object"),
    "binary": (b"\x00\xff\xfe\x00", "not UTF-8 text"),
    "not JSON": ("{", "not valid JSON"),
    "missing key": (_broken(lambda d: d["compute"]["cpu-rank"].pop("layer_forward_s")),
                    "compute.cpu-rank.layer_forward_s: is missing"),
    "no compute": (_broken(lambda d: d.pop("compute")), "compute: is missing"),
    "NaN": (_broken(lambda d: d["fabrics"]["ib"].update(latency_s=float("nan"))), "NaN"),
    "Infinity": (_broken(lambda d: d["host"].update(compute_cv=float("inf"))), "Infinity"),
    "huge cv": (_broken(lambda d: d["host"].update(compute_cv=1e308)), "host.compute_cv"),
    "string rate": (_broken(lambda d: d["fabrics"]["ib"].update(bandwidth_bytes_per_s="fast")),
                    "fabrics.ib.bandwidth_bytes_per_s: expected a number"),
    "zero rate": (_broken(lambda d: d["fabrics"]["ib"].update(bandwidth_bytes_per_s=0)),
                  "fabrics.ib.bandwidth_bytes_per_s"),
    "denormal rate": (_broken(lambda d: d["fabrics"]["ib"].update(bandwidth_bytes_per_s=5e-324)),
                      "fabrics.ib.bandwidth_bytes_per_s: 4.94066e-324 is outside [1, 1e+15]"),
    "denormal cores": (_broken(lambda d: d["host"].update(effective_cores=5e-324)),
                       "host.effective_cores: 4.94066e-324 is outside [0.001, 1e+06]"),
    "400-digit latency": (_broken(lambda d: d["fabrics"]["ib"].update(latency_s=10 ** 400)),
                          "fabrics.ib.latency_s: must be a finite number, got a whole number"),
    "schema": (_broken(lambda d: d.update(schema="other/1")), "schema: is \"other/1\""),
    "fabric a string": (_broken(lambda d: d["fabrics"].update(ib="x")), "fabrics.ib: must be"),
    "intra-node a list": (_broken(lambda d: d.update(intra_node=[1])), "intra_node: must be"),
    "intra-node without rate": (_broken(lambda d: d.update(intra_node={"latency_s": 1e-4})),
                                "intra_node.bandwidth_bytes_per_s: is missing"),
    "intra-node NaN step": (_broken(lambda d: d.update(intra_node={
        "bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4, "collective_step_s": float("nan")})),
        "NaN"),
    "deep": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "long integer": ('{"schema": ' + "9" * 5000 + "}", "too many digits"),
    "duplicate key": ('{"schema": 1, "schema": 2}', "appears twice"),
}


@pytest.mark.parametrize("case", sorted(PROFILES))
def test_malformed_profile(case: str, tmp_path: Path) -> None:
    data, fragment = PROFILES[case]
    profile = tmp_path / "profile.json"
    if isinstance(data, bytes):
        profile.write_bytes(data)
    else:
        profile.write_text(data)
    scenario = tmp_path / "s.yaml"
    scenario.write_text(BASE + "profile: profile.json\n")
    _check(scenario, fragment, source=profile)


def test_profile_error_names_the_line(tmp_path: Path) -> None:
    text = _broken(lambda d: d["host"].update(compute_cv=5))
    (tmp_path / "p.json").write_text(text)
    (tmp_path / "s.yaml").write_text(BASE + "profile: p.json\n")
    line = next(i for i, t in enumerate(text.splitlines(), 1) if '"compute_cv"' in t)
    msg = _check(tmp_path / "s.yaml", "outside [0, 2]", source=tmp_path / "p.json")
    assert f"p.json:{line}: host.compute_cv" in msg


def test_dev_zero_as_profile(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text(BASE + "profile: /dev/zero\n")
    _check(tmp_path / "s.yaml", "a character device", source=Path("/dev/zero"))


# ---- testbed files (checked before anything is built: --dry-run refuses them) ---------------
TESTBEDS = {
    "16-character node name": (_sub("name: ib-a,", "name: abcdefghijklmn,", TESTBED),
                               "clusters[0].nodes[0].name: node name 'abcdefghijklmn-0'"),
    "trailing newline name": (_sub("name: ib-a,", 'name: "ib-a\\n",', TESTBED), "control character"),
    "infinite NIC rate": (_sub("bandwidth_gbit_per_s: 2, fabric: ib}", "bandwidth_gbit_per_s: .inf, "
                               "fabric: ib}", TESTBED), "must be a finite number"),
    "unshapeable NIC rate": (_sub("bandwidth_gbit_per_s: 2, fabric: ib}", "bandwidth_gbit_per_s: 5000, "
                                  "fabric: ib}", TESTBED), "cannot be shaped"),
    "single node on a fabric": ("\n".join(line for line in TESTBED.splitlines()
                                          if "name: ib-b" not in line and "name: roce-b" not in line),
                                "fabric 'ib' reaches only node 'ib-a-0'"),
}


@pytest.mark.parametrize("case", sorted(TESTBEDS))
def test_malformed_testbed_is_refused_by_dry_run(case: str, write_scenario) -> None:
    text, fragment = TESTBEDS[case]
    path = write_scenario(text)
    start = time.monotonic()
    result = runner.invoke(app, ["validate", str(path), "--dry-run", "-p", "holmes"])
    assert result.exit_code == 2, result.output
    assert fragment in " ".join(result.output.split()) and "Traceback" not in result.output
    assert f"{path.name}:" in result.output.replace("\n", "")
    assert time.monotonic() - start < 2.0


# ---- through the CLI: exit 2, one message, no traceback, user text printed as written --------
@pytest.mark.parametrize("case", ["python tag", "alias bomb", "nan latency", "5000-digit integer",
                                  "400-digit number", "denormal bandwidth",
                                  "unhashable key", "clusters: []"])
def test_cli_exits_2_without_traceback(case: str, write_scenario) -> None:
    text, fragment = SCENARIOS[case]
    start = time.monotonic()
    result = runner.invoke(app, ["check", str(write_scenario(text))])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output and fragment in " ".join(result.output.split())
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("args", [["check", "[/x]"], ["check", "pure_ib", "[index]"],
                                  ["run", "pure_ib", "-q", "-p", "[/x]"]])
def test_user_text_is_not_markup(args: list[str]) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "MarkupError" not in repr(result.exception) and "Traceback" not in result.output
    assert args[-1] in result.output


def test_indices_in_messages_and_help_are_kept(write_scenario) -> None:
    result = runner.invoke(app, ["check", str(write_scenario(small_scenario(latency_us=".nan")))])
    assert result.exit_code == 2
    assert "clusters[0].nodes[0].nics[0].latency_us" in " ".join(result.output.split())
    help_text = runner.invoke(app, ["sweep", "--help"]).output
    assert "[index]" in help_text


def test_scenario_name_with_markup_and_mathtext(tmp_path: Path, write_scenario) -> None:
    text = _sub("name: small", 'name: "[/x] $a_{[b]}$ [index]"', small_scenario(tp=8, pp=2))
    result = runner.invoke(app, ["run", str(write_scenario(text)), "-p", "megatron",
                                 "--report", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    assert "[/x] $a_{[b]}$ [index]" in result.output
    assert (tmp_path / "report" / "iteration_time.png").exists()


def test_negative_seed_flag_is_refused() -> None:
    result = runner.invoke(app, ["run", "pure_ib", "--seed", "-1"])
    assert result.exit_code == 2


def test_json_over_the_scenarios_profile_is_refused_before_the_run(tmp_path: Path) -> None:
    profile = json.dumps(_profile(), indent=1)
    (tmp_path / "p.json").write_text(profile)
    (tmp_path / "s.yaml").write_text(BASE + "profile: p.json\n")
    result = CliRunner().invoke(app, ["run", str(tmp_path / "s.yaml"), "-q", "--json",
                                      str(tmp_path / "p.json")])
    assert result.exit_code == 2 and "is a file this command reads" in result.output
    assert (tmp_path / "p.json").read_text() == profile
