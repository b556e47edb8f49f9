"""Hostile invocations of plan, sweep, validate, outputs, the API and --ray: each one exit 2 with a
single message naming what is wrong, in under 2 s and without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from tests.conftest import small_scenario, default_testbed_with

runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def _imported() -> None:
    """Import what the commands import, so the 2 s limit times the checks, not module loading."""
    import holmes_sim.cost.ops  # noqa: F401
    import holmes_sim.metrics  # noqa: F401
    import holmes_sim.runner  # noqa: F401
    import holmes_sim.search.planner  # noqa: F401
    import holmes_sim.search.sweep  # noqa: F401
    import holmes_sim.validation.real_run  # noqa: F401


def refused(args: list[str], *fragments: str, limit_s: float = 2.0) -> str:
    """Run the CLI with `args`: exit 2, every fragment in the message, no traceback, fast."""
    start = time.monotonic()
    result = runner.invoke(app, [str(a) for a in args])
    elapsed = time.monotonic() - start
    text = " ".join(result.output.split())
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in text, text
    assert elapsed < limit_s, f"{elapsed:.2f} s"
    return text


def _deep(tmp_path: Path) -> Path:
    path = tmp_path / "deep.yaml"
    path.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    return path


def _binary(tmp_path: Path) -> Path:
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe" * 100)
    return path


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo.yaml"
    os.mkfifo(path)
    return path


# ---- one way in: every command reads its scenario through the bounded loader ----------------
INPUTS = {"binary": (_binary, "not UTF-8 text"), "deep": (_deep, "nested deeper than"),
          "fifo": (_fifo, "a FIFO (named pipe), not a regular file"),
          "folder": (lambda p: p, "a folder, not a regular file"),
          "/dev/zero": (lambda p: Path("/dev/zero"), "a character device")}
COMMANDS = {"check": [], "run": ["-q"], "plan": [], "sweep": ["--set", "seed=1,2"]}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("case", sorted(INPUTS))
def test_every_command_reads_through_the_loader(command: str, case: str, tmp_path: Path) -> None:
    make, fragment = INPUTS[case]
    path = make(tmp_path)
    extra = ["--out", tmp_path / "out"] if command == "sweep" else []
    refused([command, path, *COMMANDS[command], *extra], str(path), fragment)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", sorted(INPUTS))
def test_testbed_files_read_through_the_loader(case: str, tmp_path: Path) -> None:
    make, fragment = INPUTS[case]
    path = make(tmp_path)
    refused(["validate", path, "--dry-run"], str(path), fragment)


def test_deep_set_value_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(small_scenario())
    refused(["sweep", path, "--set", "seed=" + "[" * 3000, "--out", tmp_path / "o"], "--set seed=")


# ---- one way out: every output checked first, written whole or not at all -------------------
@pytest.fixture
def mounted(tmp_path: Path):
    """mount(options) -> a fresh tmpfs folder with those mount options (root only)."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    points: list[Path] = []

    def mount(options: str) -> Path:
        point = tmp_path / f"mnt{len(points)}"
        point.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], check=True)
        points.append(point)
        return point

    yield mount
    for point in points:
        subprocess.run(["umount", str(point)], check=False)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.name.endswith(".tmp"))


def test_existing_file_where_a_launch_folder_goes(tmp_path: Path) -> None:
    (tmp_path / "holmes").write_text("keep")
    refused(["run", "mixed_ib_eth", "-q", "-p", "holmes", "--plans", tmp_path],
            "--plans", f"{tmp_path / 'holmes'} exists and is not a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["holmes"]  # nothing else written


def test_planted_symlink_in_plans_folder_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    plans = tmp_path / "plans"
    plans.mkdir()
    (plans / "holmes").symlink_to(outside)
    refused(["run", "mixed_ib_eth", "-q", "-p", "holmes", "--plans", plans], "is a symlink")
    assert not list(outside.iterdir())


def test_symlink_at_a_file_target_inside_the_folder_is_not_replaced(tmp_path: Path) -> None:
    from holmes_sim.report.files import OutputError, write_atomic

    (tmp_path / "r.json").symlink_to("/etc/hostname")
    with pytest.raises(OutputError, match="is a symlink"):
        write_atomic(tmp_path / "r.json", "x")


def test_export_into_a_file_where_a_plan_folder_goes(tmp_path: Path) -> None:
    (tmp_path / "1-holmes").write_text("keep")
    path = tmp_path / "s.yaml"
    path.write_text(small_scenario() + "search: {tensor: [8], pipeline: [2], micro_batch_size: [1], "
                    "schedule: [1f1b], recompute: [none], sequence_parallel: [false], top_k: 1, "
                    "policies: [holmes], optimizer: [distributed]}\n")
    refused(["plan", path, "--export", tmp_path], "--export", "1-holmes exists and is not a folder")


@pytest.mark.parametrize(("option", "target", "fragment"), [
    ("--json", "/dev/full", "No space left on device"),
    ("--json", "/proc/holmes.json", "is on /proc"),
    ("--json", "/proc/self/status", "is on /proc"),
    ("--report", "/sys/kernel", "is on /sys"),
    ("--plans", "/proc/self", "is on /proc"),
])
def test_special_targets(option: str, target: str, fragment: str) -> None:
    refused(["run", "mixed_ib_eth", "-q", "-p", "holmes", option, target], fragment)


@pytest.mark.parametrize("option", ["--json", "--report", "--plans"])
def test_read_only_file_system_is_refused_before_any_work(option: str, mounted) -> None:
    folder = mounted("ro,size=1m")
    target = folder / ("r.json" if option == "--json" else "out")
    refused(["run", "mixed_ib_eth", "-q", "-p", "holmes", option, target], option, "read-only")
    refused(["sweep", "mixed_ib_eth", "--set", "seed=1", "--out", folder], "--out", "read-only")


def test_full_disk_leaves_no_partial_file(mounted) -> None:
    folder = mounted("size=8k")
    text = refused(["run", "mixed_ib_eth", "-q", "-p", "holmes", "--report", folder / "r"],
                   "No space left on device", "free some space", limit_s=10)
    assert str(folder / "r") in text
    assert _leftovers(folder) == []


# ---- budgets stated up front --------------------------------------------------------------
def _scenario(tmp_path: Path, extra: str = "", **kw) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(small_scenario(**kw) + extra)
    return path


def test_check_with_many_micro_batches_is_bounded(tmp_path: Path) -> None:
    path = _scenario(tmp_path, global_batch=2**22, nodes_ib=1, pp=1)
    refused(["check", path], "4,194,304 micro-batches", "at most 16,384", f"{path}:")


def test_plan_refuses_a_search_space_past_the_limit(tmp_path: Path) -> None:
    path = _scenario(tmp_path, "search: {virtual_stages: [2, 4, 2, 4]}\n", nodes_ib=4, layers=64,
                     global_batch=1024)
    text = refused(["plan", path, "--max-candidates", "100"], "candidates to evaluate",
                   "above the limit of 100", "--max-candidates")
    assert "search" in text


def test_plan_counts_duplicates_once(tmp_path: Path) -> None:
    from holmes_sim.prepare import prepare
    from holmes_sim.search import planner

    path = _scenario(tmp_path, "search: {schedule: [1f1b, 1f1b, gpipe, 1f1b], recompute: [full, "
                     "full], tensor: [8, 8], pipeline: [2, 2], micro_batch_size: [1, 1]}\n")
    prepared = prepare(path)
    spec = planner.distinct(prepared.scenario.search)
    assert spec.schedule == ("1f1b", "gpipe") and spec.recompute == ("full",)
    grid = planner.bounded_grid(prepared, spec, 10_000)
    assert len(grid) == len(set(grid))


def test_sweep_refuses_too_many_points_before_building_them(tmp_path: Path) -> None:
    values = ",".join(str(i) for i in range(1000))
    refused(["sweep", _scenario(tmp_path), "--set", f"seed={values}", "--set",
             f"training.global_batch_size={values}", "--out", tmp_path / "o"],
            "1,000,000 points", "--max-points")
    assert not (tmp_path / "o").exists()


def test_sweep_duplicate_values_count_once(tmp_path: Path) -> None:
    from holmes_sim.search.sweep_axes import parse_set

    assert parse_set("seed=1,1,2,1").values == (1, 2)
    assert parse_set("a=1,1.0,true").values == (1, 1.0, True)


def test_jobs_are_capped_at_the_cores(tmp_path: Path) -> None:
    from holmes_sim.search.planner import usable_cores

    result = runner.invoke(app, ["sweep", str(_scenario(tmp_path)), "--set", "seed=1", "-q", "--jobs",
                                 "1000", "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert f"--jobs 1000 lowered to {usable_cores()}" in result.output


# ---- the search: block -----------------------------------------------------------------------
SEARCH = {
    "unknown policy": ("search: {policies: [holmes, hollmes]}", "search.policies[1]: unknown policy"),
    "empty policies": ("search: {policies: []}", "search.policies: list at least one value"),
    "empty schedules": ("search: {schedule: []}", "search.schedule: list at least one value, "
                        "or remove the key to search every valid value"),
    "empty contexts": ("search: {context: []}", "search.context: list at least one value, or "
                       "remove the key to search the scenario's own value"),
    "empty expert TP": ("search: {expert_tensor: []}", "search.expert_tensor: list at least one "
                        "value, or remove the key to search 1 and each layout's TP degree"),
    "virtual stages 0": ("search: {virtual_stages: [2, 0]}",
                         "search.virtual_stages[1]: must be at least 1"),
    "virtual stages -3": ("search: {virtual_stages: [-3]}",
                          "search.virtual_stages[0]: must be at least 1"),
    "tensor 4096": ("search: {tensor: [1, 4096]}", "search.tensor[1]: must be at most 1024"),
    "micro batch 0": ("search: {micro_batch_size: [0]}", "search.micro_batch_size[0]: must be at least 1"),
}


@pytest.mark.parametrize("case", sorted(SEARCH))
def test_search_block_errors_name_file_and_line(case: str, tmp_path: Path) -> None:
    extra, fragment = SEARCH[case]
    path = _scenario(tmp_path, extra + "\n")
    line = len(small_scenario().splitlines()) + 1
    refused(["plan", path], fragment, f"{path}:{line}:")
    refused(["check", path], fragment)


# ---- validate: arguments checked before anything is built ------------------------------------
@pytest.mark.parametrize("value", ["0", "-1", "100000"])
def test_validate_iterations_out_of_range(value: str) -> None:
    refused(["validate", "--real", "--iterations", value], "--iterations")


@pytest.mark.parametrize(("extra", "names"), [
    (["--real"], "--real"), (["--dry-run", "--cleanup"], "--dry-run, --cleanup"),
    (["-p", "holmes"], "--policy"), (["--report", "r"], "--report"),
    (["default"], "a testbed"), (["--iterations", "3"], "--iterations"),
])
def test_validate_published_refuses_options_it_does_not_use(extra: list[str], names: str) -> None:
    refused(["validate", "--published", *extra], f"--published does not use {names}")


@pytest.mark.parametrize(("rate", "fragment"), [
    ("0.000001", "1000 bit/s cannot carry the run's largest message"),
    ("0.00001", "10000 bit/s cannot carry"),
])
def test_validate_refuses_rates_too_low_for_gloo(rate: str, fragment: str, tmp_path: Path) -> None:
    path = default_testbed_with(tmp_path, "bandwidth_gbit_per_s: 2, fabric: ib}",
                                f"bandwidth_gbit_per_s: {rate}, fabric: ib}}")
    text = refused(["validate", path, "--dry-run"], fragment, "give at least", f"{path}:")
    assert "Gbit/s" in text


@pytest.mark.parametrize(("setting", "fragments"), [
    # 4 MB probe, 100 Mbit/s Ethernet: moved twice within half the timeout needs 1.28 s.
    ("timeout_s: 1", ("testbed.timeout_s: 1 s is too short for the run's largest message (the "
                      "link probe, 4000000 bytes) on the testbed's slowest link (0.1 Gbit/s)",
                      "raise timeout_s to at least 1.28, or lower testbed.link_probe_bytes to at "
                      "most 3125000")),
    ("timeout_s: 0.001", ("testbed.timeout_s: 0.001 s is too short",
                          "raise timeout_s to at least 1.28")),
    # Within gloo's 60 s cap no timeout helps: the probe is what is too large.
    ("link_probe_bytes: 268435456", ("testbed.link_probe_bytes: 268435456 bytes, the run's "
                                     "largest message, is too large for the testbed's slowest "
                                     "link (0.1 Gbit/s)", "lower it to at most 187500000")),
])
def test_validate_names_the_testbed_field_that_limits_the_links(
        setting: str, fragments: tuple[str, ...], tmp_path: Path) -> None:
    path = default_testbed_with(tmp_path, "  tolerance_pct: 10\n",
                                f"  tolerance_pct: 10\n  {setting}\n")
    line = path.read_text().splitlines().index(f"  {setting}") + 1
    text = refused(["validate", path, "--dry-run"], *fragments, f"{path}:{line}:")
    assert "bandwidth_gbit_per_s" not in text and "give at least" not in text


def test_a_gradient_bucket_too_large_for_the_timeout_names_the_timeout() -> None:
    from holmes_sim.errors import FieldError
    from holmes_sim.validation.testbed_plan import RateLimits, _check_rate_carries

    limits = RateLimits(run_bytes=8e6, probe_bytes=2**20, timeout_s=2)
    with pytest.raises(FieldError) as got:
        _check_rate_carries(1e8, limits, 1e8, "clusters[0].nodes[0].nics[1].bandwidth_gbit_per_s")
    assert got.value.path == "testbed.timeout_s"
    assert "(a gradient bucket or TP all-reduce, 8000000 bytes)" in got.value.message
    assert got.value.message.endswith("raise timeout_s to at least 2.56")
    # Past gloo's 60 s cap the rate itself is short: the NIC's field and the rate it needs.
    with pytest.raises(FieldError) as got:
        _check_rate_carries(1e6, RateLimits(8e6, 2**20, 240), 1e6, "x.bandwidth_gbit_per_s")
    assert got.value.path == "x.bandwidth_gbit_per_s"
    assert got.value.message.endswith("give at least 0.00427 Gbit/s")


def test_validate_refuses_more_ranks_than_the_host_runs(tmp_path: Path) -> None:
    from holmes_sim.validation.host import max_ranks

    path = default_testbed_with(tmp_path, "count: 1, gpu: cpu-rank, gpus_per_node: 1,",
                                "count: 1, gpu: cpu-rank, gpus_per_node: 64,")
    path.write_text(path.read_text().replace("global_batch_size: 32", "global_batch_size: 4096"))
    refused(["validate", path, "--dry-run"], f"this host runs at most {max_ranks()}")


# ---- the Python API, as strict as the files ----------------------------------------------------
def _api_refused(fragment: str, *args, **kwargs) -> None:
    import holmes_sim
    from holmes_sim.errors import HolmesError

    start = time.monotonic()
    with pytest.raises(HolmesError) as info:
        holmes_sim.simulate(*args, **kwargs)
    assert fragment in str(info.value), str(info.value)
    assert "\n" not in str(info.value)
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("seed", [-1, 1.5, "abc", float("nan"), [1], 2**200, True])
def test_api_seed_must_be_a_whole_number_in_range(seed) -> None:
    _api_refused("seed: expected a whole number", "mixed_ib_eth", seed=seed)


@pytest.mark.parametrize(("policies", "fragment"), [
    ("holmes", "expected a list of policy names, got str"),
    (iter(["holmes"]), "expected a list of policy names, got list_iterator"),
    (["holmes", 3], "expected policy names, got int"),
    (["holmes", "hollmes"], "unknown policy 'hollmes'"),
])
def test_api_policies_must_be_a_list_of_known_names(policies, fragment: str) -> None:
    _api_refused(fragment, "mixed_ib_eth", policies=policies)


def _mapping() -> dict:
    import yaml

    return yaml.safe_load(small_scenario())


def test_api_numpy_and_path_values_name_the_field() -> None:
    import numpy as np

    data = _mapping()
    data["training"]["global_batch_size"] = np.int64(16)
    _api_refused("training.global_batch_size: a numpy.int64 is not a plain value", data)
    data = _mapping()
    data["profile"] = Path("p.json")
    _api_refused("profile: a pathlib.PosixPath is not a plain value", data)


def test_api_deep_and_huge_mappings_are_refused() -> None:
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    data = _mapping()
    data["x"] = deep
    _api_refused("nested deeper than", data)
    data = _mapping()
    data["description"] = "x" * (50 << 20)
    _api_refused("KiB of text", data)
    data = _mapping()
    data["x"] = list(range(5_000_000))
    _api_refused("more than 100000 values", data)


def test_api_yaml_text_as_scenario_is_named() -> None:
    _api_refused("looks like YAML text", small_scenario())
    _api_refused("expected a file path, a bundled name or a dict, got int", 3)


def test_repeated_policy_flags_print_one_row() -> None:
    import holmes_sim

    result = runner.invoke(app, ["run", "mixed_ib_eth", "-p", "holmes", "-p", "holmes", "--json", "-"])
    assert result.exit_code == 0, result.output
    assert result.output.count('"policy": "holmes"') == 1
    sim = holmes_sim.simulate("mixed_ib_eth", policies=("holmes", "holmes"))
    assert [r.policy for r in sim.results] == ["holmes"]


# ---- Ray addresses: ASCII forms only, and a peer that is not Ray refused in seconds -----------
@pytest.mark.parametrize("address", ["host:6²", "host:６３７９", "a..b:6379", ".a:6379",
                                     "a" * 64 + ".example:6379", "hö.st:6379", "-a:6379",
                                     "host:000000006379", "[10.0.0.1]:6379", "ray://[]:1"])
def test_non_ascii_and_bad_labels_are_refused(address: str) -> None:
    from holmes_sim.errors import FieldError
    from holmes_sim.search.scaleout import parse_address

    with pytest.raises(FieldError, match="is not a Ray address"):
        parse_address(address)
    refused(["sweep", "mixed_ib_eth", "--set", "seed=1", "--ray", address], "--ray",
            "is not a Ray address")


def test_valid_address_forms_still_parse() -> None:
    from holmes_sim.search.scaleout import parse_address

    assert parse_address("a" * 63 + ".example:6379")[1] == 6379
    assert parse_address("fd00::1:6379") == ("fd00::1", 6379)
    assert parse_address("head-1.cluster.local.:10001") == ("head-1.cluster.local.", 10001)


@pytest.fixture
def loopback_server():
    """serve(reply) -> the loopback address of a TCP server that sends `reply` (None: nothing)
    to every connection and then holds it open."""
    import socket
    import threading

    servers = []

    def serve(reply: bytes | None) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        servers.append(sock)

        def accept() -> None:
            while True:
                try:
                    conn, _ = sock.accept()
                except OSError:
                    return
                if reply is not None:
                    conn.recv(1024)
                    conn.sendall(reply)
                servers.append(conn)

        threading.Thread(target=accept, daemon=True).start()
        return f"127.0.0.1:{sock.getsockname()[1]}"

    yield serve
    for s in servers:
        s.close()


def test_an_http_server_is_not_taken_for_ray(loopback_server) -> None:
    address = loopback_server(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    refused(["sweep", "mixed_ib_eth", "--set", "seed=1", "--ray", address],
            "answers, but not as a Ray cluster")


def test_a_silent_peer_times_out_in_seconds(loopback_server) -> None:
    from holmes_sim.errors import FieldError
    from holmes_sim.search.scaleout import check_reachable

    address = loopback_server(None)
    start = time.monotonic()
    with pytest.raises(FieldError, match="answers, but not as a Ray cluster|timed out"):
        check_reachable(address, timeout_s=0.5)
    assert time.monotonic() - start < 2.0


def test_a_grpc_peer_passes_the_probe(loopback_server) -> None:
    from holmes_sim.search.scaleout import check_reachable

    check_reachable(loopback_server(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])), timeout_s=1.0)


# ---- output folders owned, not shared ----------------------------------------------------------
@pytest.mark.parametrize("option", ["--report", "--plans"])
def test_a_second_writer_is_refused_by_name(option: str, tmp_path: Path) -> None:
    from holmes_sim.report.files import LOCK_NAME, output_lock

    with output_lock(tmp_path, option):
        text = refused(["run", "mixed_ib_eth", "-q", "-p", "holmes", option, tmp_path], option,
                       "is being written by another holmes-sim run", f"pid {os.getpid()}",
                       limit_s=10)
        assert str(tmp_path) in text
    assert not (tmp_path / LOCK_NAME).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_sweep_out_lock_is_held_and_released(tmp_path: Path) -> None:
    from holmes_sim.report.files import LOCK_NAME, output_lock

    with output_lock(tmp_path, "--out"):
        refused(["sweep", _scenario(tmp_path), "--set", "seed=1", "-q", "--out", tmp_path],
                "--out", "being written by another", limit_s=10)
    assert not (tmp_path / LOCK_NAME).exists()


def test_an_earlier_runs_plans_are_named(tmp_path: Path) -> None:
    result = runner.invoke(app, ["run", "mixed_ib_eth", "-q", "-p", "holmes", "-p", "megatron",
                                 "--plans", str(tmp_path)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["run", "mixed_ib_eth", "-q", "-p", "holmes", "--plans", str(tmp_path)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "also holds megatron, plan_megatron.json from an earlier run" in text
    assert "plan_holmes.json" not in text.split("also holds")[1]


@pytest.mark.root
def test_cleanup_removes_the_temp_folder_of_a_killed_dry_run() -> None:
    import subprocess
    import tempfile

    from holmes_sim.backend import records

    if os.geteuid() != 0:
        pytest.skip("--cleanup needs root")
    dead = subprocess.Popen(["true"])
    dead.wait()
    killed = Path(tempfile.mkdtemp(prefix="holmes-run-"))
    (killed / records.OWNER_FILE).write_text(f"{dead.pid} 1\n")
    live = Path(tempfile.mkdtemp(prefix="holmes-run-"))
    records.mark_owner(live)
    try:
        report = records.cleanup_leftovers()
        assert str(killed) in report.removed and not killed.exists()
        assert str(live) in report.foreign and live.exists()
    finally:
        import shutil

        shutil.rmtree(killed, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)


def test_a_set_with_very_many_values_is_refused_before_parsing(tmp_path: Path) -> None:
    refused(["sweep", _scenario(tmp_path), "--set", "seed=" + ",".join(["1"] * 100_000)],
            "100,000 values")


@pytest.mark.parametrize("case", ["fifo", "folder", "binary"])
def test_profiles_read_through_the_loader(case: str, tmp_path: Path) -> None:
    make, fragment = INPUTS[case]
    sub = tmp_path / "p"
    sub.mkdir()
    profile = make(sub)
    path = _scenario(tmp_path, f"profile: {profile}\n")
    refused(["check", path], str(profile), fragment)


@pytest.mark.parametrize("target, fragment", [("/dev/zero", "character device"),
                                               ("binary", "not UTF-8 text")])
def test_hosts_file_reads_through_the_loader(target: str, fragment: str, tmp_path: Path) -> None:
    if target == "binary":
        target = str(tmp_path / "hosts")
        Path(target).write_bytes(b"\xff\xfe\x00host\n")
    refused(["run", "mixed_ib_roce", "-p", "holmes", "--plans", tmp_path / "p", "--hosts", target,
             "-q"], "--hosts", fragment, limit_s=10)


@pytest.mark.parametrize("lines, fragment", [
    ("h1\nh2\n", "names 2 hosts, the plan has"),
    ("h1\nh1\nh3\nh4\n", ":2: 'h1' is the host of line 1 ('h1') again"),
    ("h1\nh2\nH1\nh4\n", ":3: 'H1' is the host of line 1 ('h1') again"),
    ("h1.example.com\nh2\nh3\nh1\n", ":4: 'h1' is the host of line 1 ('h1.example.com') again"),
    ("h1\nh2$(reboot)\n", ":2: 'h2$(reboot)' is not a host name"),
])
def test_a_bad_hosts_file_leaves_nothing_written(lines: str, fragment: str, tmp_path: Path) -> None:
    """Checked before any file is written: no plan JSON, no launch folder, no --json; a wrong
    count once the plans are known, a repeated or malformed name before the simulation."""
    hosts = tmp_path / "hosts"
    hosts.write_text(lines)
    out, plans = tmp_path / "r.json", tmp_path / "p"
    refused(["run", "mixed_ib_roce", "-p", "holmes", "-q", "--json", out, "--plans", plans,
             "--hosts", hosts], "--hosts", fragment, limit_s=10)
    assert not out.exists() and (not plans.exists() or not any(plans.iterdir()))


def test_hosts_without_a_launch_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "hosts").write_text("h1\n")
    refused(["run", "mixed_ib_roce", "-q", "--hosts", tmp_path / "hosts"], "give --plans too")


# ---- the memory guard: the command, its workers and --jobs within stated bounds --------------
def _guarded_cli(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "holmes_sim", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env})
    return proc, time.monotonic() - start


def test_a_command_past_its_memory_bound_stops_with_one_message(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc, elapsed = _guarded_cli({"HOLMES_SIM_MAX_MEMORY_GIB": "0.02"}, "run", "mixed_ib_roce",
                                 "-q", "--json", str(out))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "above the bound of 0.02 GiB" in proc.stderr
    assert "HOLMES_SIM_MAX_MEMORY_GIB" in proc.stderr and not out.exists()
    assert elapsed < 10


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: --jobs runs in-process")
def test_a_worker_past_its_bound_stops_the_sweep_and_leaves_no_output(tmp_path: Path) -> None:
    # 60 points: the workers live for several of the guard's 0.2 s samples on any host. The
    # killed workers leave nothing in the temp folder either (points are checked in memory).
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc, elapsed = _guarded_cli({"HOLMES_SIM_WORKER_MEMORY_GIB": "0.02", "TMPDIR": str(temp)},
                                 "sweep", "mixed_ib_roce",
                                 "--set", "training.micro_batch_size=1,2,4", "--set",
                                 "seed=" + ",".join(map(str, range(1, 21))), "-p", "holmes", "-j",
                                 "2", "-q", "--out", str(tmp_path / "s"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "per worker" in proc.stderr and "HOLMES_SIM_WORKER_MEMORY_GIB" in proc.stderr
    assert not (tmp_path / "s").exists() and elapsed < 10
    assert not any(temp.iterdir()), sorted(p.name for p in temp.iterdir())


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf", "1e300", "²"])
def test_a_bad_memory_bound_names_the_variable(value: str) -> None:
    proc, _ = _guarded_cli({"HOLMES_SIM_MAX_MEMORY_GIB": value}, "check", "mixed_ib_roce")
    assert proc.returncode == 2 and "HOLMES_SIM_MAX_MEMORY_GIB=" in proc.stderr, proc.stderr
    assert "positive number of GiB up to" in proc.stderr and "Traceback" not in proc.stderr


def test_jobs_are_capped_by_the_memory_per_worker(tmp_path: Path) -> None:
    proc, _ = _guarded_cli({"HOLMES_SIM_WORKER_MEMORY_GIB": "1000000"}, "sweep",
                           str(_scenario(tmp_path)), "--set", "seed=1,2", "-q", "-j", "2",
                           "--out", str(tmp_path / "o"))
    assert proc.returncode == 0, proc.stderr
    assert "--jobs 2 lowered to 1:" in proc.stderr and "of memory available over" in proc.stderr


def test_the_guard_counts_only_what_the_command_started() -> None:
    from holmes_sim.spec.limits import MemoryGuard

    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with MemoryGuard(interval_s=0.05) as guard:
            guard.worker_bytes = 1  # any process it started would be past this
            time.sleep(0.3)
        assert guard.reason is None and bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_a_body_shorter_than_one_sample_is_still_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fast host finishes `run` inside the first interval; the bound holds from the start.
    from holmes_sim.spec.limits import MemoryBoundError, MemoryGuard

    monkeypatch.setenv("HOLMES_SIM_MAX_MEMORY_GIB", "0.001")
    ran = []
    with pytest.raises(MemoryBoundError, match="above the bound of 0.001 GiB"):
        with MemoryGuard(interval_s=3600):
            ran.append(True)
    assert not ran


def test_a_command_growing_past_the_bound_is_stopped_while_it_runs(monkeypatch) -> None:
    from holmes_sim.spec.limits import MemoryBoundError, MemoryGuard, _rss_bytes

    bound = (_rss_bytes(os.getpid()) + 200 * 2**20) / 2**30  # this process now, and 200 MiB
    monkeypatch.setenv("HOLMES_SIM_MAX_MEMORY_GIB", f"{bound:.3f}")
    grown = []
    start = time.monotonic()
    with pytest.raises(MemoryBoundError, match="this command and its workers used"):
        with MemoryGuard(interval_s=0.05):
            grown.append(b"\x01" * (400 * 2**20))  # written: every page resident
            while time.monotonic() - start < 10:
                time.sleep(0.01)
    assert grown and time.monotonic() - start < 5


def test_descendants_include_grandchildren_both_ways() -> None:
    from holmes_sim.spec.limits import _descendants_by_scan, descendants

    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(20)']); time.sleep(20)")
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while len(descendants(os.getpid())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        found = descendants(os.getpid())
        assert child.pid in found and len(found) >= 2
        assert set(found) == set(_descendants_by_scan(os.getpid()))
    finally:
        for pid in descendants(child.pid):
            os.kill(pid, 9)
        child.kill()
        child.wait()


# ---- more of the same kind: outputs, addresses and indices never seen by the cases above ----
HELD_OUT = {
    "sweep out is /dev/null": (["sweep", "mixed_ib_eth", "--set", "seed=1", "--out", "/dev/null"],
                               "exists and is not a folder"),
    "plan json into /proc": (["plan", "mixed_ib_eth", "--json", "/proc/self/status"],
                             "the kernel's file system"),
    "empty ray address": (["plan", "mixed_ib_eth", "--ray", ""], "is not a Ray address"),
    "ray port past 65535": (["sweep", "mixed_ib_eth", "--set", "seed=1", "--ray",
                             "localhost:99999"], "is not a Ray address"),
    "huge list index": (["sweep", "mixed_ib_eth", "--set", "clusters[99999999999999999999].name=a"],
                        "out of range"),
}


@pytest.mark.parametrize("case", sorted(HELD_OUT))
def test_held_out_hostile_invocations(case: str) -> None:
    args, fragment = HELD_OUT[case]
    refused(args, fragment, limit_s=10)


def test_export_and_hosts_fifos_are_refused(tmp_path: Path) -> None:
    fifo = _fifo(tmp_path)
    refused(["plan", "mixed_ib_eth", "--export", fifo], "exists and is not a folder", limit_s=10)
    refused(["run", "mixed_ib_eth", "-p", "holmes", "-q", "--plans", tmp_path / "p", "--hosts", fifo],
            "a FIFO (named pipe)", limit_s=10)
