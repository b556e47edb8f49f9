"""Ray scale-out: `plan --ray` and `sweep --ray` give the local run's results (a local Ray
instance), and a bad or dead `--ray ADDRESS` is a clear, fast error naming the option."""

from __future__ import annotations

import socket

import pytest
from typer.testing import CliRunner

from holmes_sim.search import planner
from holmes_sim.cli import app
from holmes_sim.errors import FieldError
from holmes_sim.prepare import prepare
from holmes_sim.search.scaleout import check_reachable, parse_address
from holmes_sim.search.sweep import run_sweep
from tests.conftest import SCENARIOS

from .test_planner import SMALL

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _ranking(result):
    return [(c.policy, c.layout, c.predicted_iteration_s, c.simulated) for c in result.candidates]


def test_ray_search_ranks_as_the_local_one(write_scenario, local_ray):
    prepared = prepare(write_scenario(SMALL))
    local = planner.search(prepared, jobs=1)
    remote = planner.search(prepared, ray="auto")
    assert _ranking(remote) == _ranking(local)
    assert remote.evaluated == local.evaluated and remote.baseline == local.baseline


def test_ray_sweep_gives_the_local_rows_in_order(local_ray):
    sets = ["inter_cluster_links[0].bandwidth_gbit_per_s=400,50", "training.global_batch_size=256,257"]
    local = run_sweep(SCENARIOS / "mixed_ib_eth.yaml", sets, ["megatron", "holmes"], jobs=1)
    seen = []
    remote = run_sweep(SCENARIOS / "mixed_ib_eth.yaml", sets, ["megatron", "holmes"], ray="auto",
                       progress=lambda done, n: seen.append((done, n)))
    assert remote.rows == local.rows
    assert {r["status"] for r in remote.rows} == {"ok", "infeasible"}
    assert seen[-1] == (4, 4)


@pytest.mark.parametrize("address", ["bad address", "host", "host:", "host:0", "host:70000",
                                     "ray://", "ray://:10001", "http://host:1/x"])
def test_malformed_addresses_are_refused_naming_the_option(address):
    with pytest.raises(FieldError) as info:
        parse_address(address)
    assert info.value.path == "--ray" and "HOST:PORT" in str(info.value)


def test_addresses_parse_to_host_and_port():
    assert parse_address("10.0.0.1:6379") == ("10.0.0.1", 6379)
    assert parse_address("ray://head.example:10001") == ("head.example", 10001)
    assert parse_address("[fd00::1]:6379") == ("fd00::1", 6379)


def _closed_port() -> int:
    """A local TCP port nothing listens on (bound, never listened, so connects are refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_a_dead_address_is_refused_before_ray_is_asked():
    port = _closed_port()
    with pytest.raises(FieldError) as info:
        check_reachable(f"127.0.0.1:{port}")
    assert f"127.0.0.1:{port}" in str(info.value) and "ray start --head" in str(info.value)


@pytest.mark.parametrize("command", ["plan", "sweep"])
def test_cli_reports_a_dead_cluster_as_an_error_not_a_hang(command):
    extra = ["--set", "training.global_batch_size=256"] if command == "sweep" else []
    result = CliRunner().invoke(app, [command, str(SCENARIOS / "pure_ib.yaml"), *extra,
                                      "--ray", f"127.0.0.1:{_closed_port()}"])
    assert result.exit_code == 2, result.output
    assert "--ray" in result.output and "nothing answers" in result.output
    assert "Traceback" not in result.output
