"""`--hosts` names the scenario's nodes in the scenario's order (or `HOST NODE` lines), so one
hosts file puts every real host on the same scenario node in every plan's launch folder, however
the plan orders its nodes; a host name torchrun would read as an option is refused by line."""

from __future__ import annotations

import random
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.errors import PlanError
from holmes_sim.export.device_types import device_types
from holmes_sim.export.fork import fork_attention_env
from holmes_sim.export.hosts import _same_host, read_hosts
from holmes_sim.export.nccl_env import process_env, upstream_net, upstream_node_env
from holmes_sim.plan import Plan
from holmes_sim.prepare import prepare
from tests.conftest import SCENARIOS

runner = CliRunner()


def arrays(launch_sh: str) -> dict[str, list[str]]:
    """The `NAME=(...)` arrays of a launch.sh, as bash reads their words."""
    out = {}
    for line in launch_sh.splitlines():
        name, sep, rest = line.partition("=(")
        if sep and name.isidentifier() and rest.endswith(")"):
            out[name] = shlex.split(rest[:-1])
    return out


def env_words(env: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(env.items()))


def check_folder_maps_hosts(folder: Path, prepared, real: dict[str, str]) -> list[str]:
    """Every host of the folder's hostfile and launch.sh runs as its own scenario node (`real`:
    scenario node -> host): its device type and NCCL environment are that node's. Returns the
    folder's host order."""
    plan = Plan.from_json((folder / "plan.json").read_text())
    node_of = {host: node for node, host in real.items()}
    got = arrays((folder / "launch.sh").read_text())
    hostfile = [line.split()[0] for line in (folder / "hostfile").read_text().splitlines()]
    assert hostfile == got["HOSTS"]
    assert sorted(got["HOSTS"]) == sorted(real.values())
    net = upstream_net(plan)
    types = device_types(plan, prepared.cluster)[0]
    fork = not (folder / "holmes_args.txt").read_text().startswith("# not expressible")
    attention = fork_attention_env(prepared.workload) if fork else {}
    for i, host in enumerate(got["HOSTS"]):
        node = prepared.cluster.node(node_of[host])
        assert got["TYPES"][i] == types[node.name], (folder.name, host)
        assert got["ENV_MEGATRON"][i] == env_words(
            upstream_node_env(node, net) | process_env(plan, node, "megatron"))
        assert got["ENV_HOLMES"][i] == env_words(
            upstream_node_env(node, "Socket") | process_env(plan, node, "holmes") | attention)
    # the plan's own rank order: the node of rank r x GPUs is the node at line r
    ranks = [g.node for g in plan.rank_to_gpu[::prepared.cluster.nodes[0].num_gpus]]
    assert [node_of[h] for h in got["HOSTS"]] == ranks
    return got["HOSTS"]


@pytest.fixture(scope="module")
def mixed():
    return prepare(SCENARIOS / "mixed_ib_roce.yaml")


def _real(prepared) -> dict[str, str]:
    return {n.name: f"real-{n.name}.example" for n in prepared.cluster.nodes}


@pytest.mark.parametrize("form", ["scenario order", "HOST NODE, shuffled"])
def test_run_plans_puts_each_host_on_its_scenario_node_in_every_folder(tmp_path, mixed, form):
    real = _real(mixed)
    lines = [f"{host} slots=8 {node}" for node, host in real.items()] \
        if form.startswith("HOST NODE") else [f"{host}  # {node}" for node, host in real.items()]
    if form.startswith("HOST NODE"):
        random.Random(1).shuffle(lines)
    (tmp_path / "hosts").write_text("\n".join(lines) + "\n")
    result = runner.invoke(app, ["run", "mixed_ib_roce", "-q", "-p", "megatron", "-p", "holmes",
                                 "--plans", str(tmp_path / "p"),
                                 "--hosts", str(tmp_path / "hosts")])
    assert result.exit_code == 0, result.output
    orders = [check_folder_maps_hosts(tmp_path / "p" / policy, mixed, real)
              for policy in ("megatron", "holmes")]
    assert orders[0] != orders[1]  # the policies order the nodes differently


def test_plan_export_puts_each_host_on_its_scenario_node_in_every_folder(tmp_path):
    """The review's case: holmes groups the IB nodes, megatron keeps the racked order."""
    text = (SCENARIOS / "moe_mixed_nics.yaml").read_text()
    text = "\n".join("policies: [megatron, holmes]" if line.startswith("policies:") else line
                     for line in text.splitlines())
    text += ("\nsearch: {tensor: [8], pipeline: [2], micro_batch_size: [1], schedule: [1f1b], "
             "recompute: [selective], sequence_parallel: [true], policies: [holmes, megatron], "
             "top_k: 2}\n")
    (tmp_path / "moe2.yaml").write_text(text)
    prepared = prepare(tmp_path / "moe2.yaml")
    real = _real(prepared)
    (tmp_path / "hosts").write_text("".join(f"{h}\n" for h in real.values()))
    result = runner.invoke(app, ["plan", str(tmp_path / "moe2.yaml"), "--export",
                                 str(tmp_path / "ex"), "--hosts", str(tmp_path / "hosts")])
    assert result.exit_code == 0, result.output
    folders = sorted(p for p in (tmp_path / "ex").iterdir() if p.is_dir())
    assert {f.name.split("-", 1)[1] for f in folders} == {"holmes", "megatron"}
    orders = {tuple(check_folder_maps_hosts(f, prepared, real)) for f in folders}
    assert len(orders) == 2


@pytest.mark.parametrize("lines, fragment", [
    ("a n0\nb n1\nc n9\n",
     ":3: 'n9' is not a node of the scenario (n0, n1, n2); fix the node name"),
    ("a n0\nb n0\nc n2\n", ":2: node 'n0' already has host 'a'; give each node one line"),
    ("a n0\nb\nc n2\n", ":2: every line names its scenario node (HOST NODE) or none does"),
    ("a n0 x\nb n1\nc n2\n", ":1: 'n0 x' after the host; give HOST, or HOST NODE"),
    ("a\nb\n", "names 2 hosts, the plan has 3 nodes; list one host a line for each node in "
               "the scenario's order (n0, n1, n2)"),
])
def test_a_hosts_file_that_does_not_name_each_node_once_is_refused(tmp_path, lines, fragment):
    (tmp_path / "hosts").write_text(lines)
    with pytest.raises(PlanError) as info:
        read_hosts(tmp_path / "hosts", ["n0", "n1", "n2"])
    assert fragment in str(info.value)


def test_host_node_lines_map_by_name_and_plain_lines_by_scenario_order(tmp_path):
    (tmp_path / "named").write_text("c n2\na n0 # rack 1\nb slots=8 n1\n")
    (tmp_path / "plain").write_text("a\nb slots=8\n# spare\nc\n")
    expected = {"n0": "a", "n1": "b", "n2": "c"}
    assert read_hosts(tmp_path / "named", ["n0", "n1", "n2"]) == expected
    assert read_hosts(tmp_path / "plain", ["n0", "n1", "n2"]) == expected


@pytest.mark.parametrize("command", ["plan", "run"])
@pytest.mark.parametrize("bad", ["--help", "-h1"])
def test_a_host_starting_with_a_dash_is_refused_by_line_before_the_work(tmp_path, monkeypatch,
                                                                        command, bad):
    """torchrun would read `--master-addr --help` as an option: refused with its line and the
    fix before the search or simulation, and nothing is written."""
    from holmes_sim import runner as run_module
    from holmes_sim.search import planner

    def no_work(*args, **kwargs):
        raise AssertionError("the search or simulation ran")

    monkeypatch.setattr(planner, "search", no_work)
    monkeypatch.setattr(run_module, "run_scenario", no_work)
    (tmp_path / "hosts").write_text(f"h0\n{bad}\n" + "".join(f"h{k}\n" for k in range(2, 8)))
    out = tmp_path / "out"
    args = ["plan", "mixed_ib_roce", "--export", str(out)] if command == "plan" else \
        ["run", "mixed_ib_roce", "-q", "-p", "holmes", "--plans", str(out)]
    result = runner.invoke(app, [*args, "--hosts", str(tmp_path / "hosts")])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert f"hosts:2: '{bad}' starts with '-', which no host name does (RFC 1123)" in text
    assert "fix the line" in text and "Traceback" not in result.output
    assert not out.exists()


def test_the_hosts_help_says_the_scenarios_node_order():
    for command in ("plan", "run"):
        result = runner.invoke(app, [command, "--help"], terminal_width=200)
        assert "scenario's node order" in " ".join(result.output.split()), result.output


def test_run_checks_the_hosts_against_the_scenario_before_the_simulation(tmp_path, monkeypatch):
    from holmes_sim import runner as run_module

    def no_work(*args, **kwargs):
        raise AssertionError("the simulation ran")

    monkeypatch.setattr(run_module, "run_scenario", no_work)
    (tmp_path / "hosts").write_text("h0 ib-a-0\nh1 nowhere\n")
    result = runner.invoke(app, ["run", "mixed_ib_roce", "-q", "-p", "holmes", "--plans",
                                 str(tmp_path / "p"), "--hosts", str(tmp_path / "hosts")])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "names 2 hosts, the plan has 8 nodes; list one host a line for each node in the " \
           "scenario's order (ib-a-0, " in text
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("a, b, same", [
    ("h1", "H1", True), ("h1", "h1.example.com", True), ("h1.a.com", "h1.b.com", False),
    ("10.0.0.1", "10.0.0.2", False), ("10.0.0.1", "10", False), ("fe80::1", "fe80::2", False),
    ("gpu01", "gpu010", False)])
def test_hosts_that_name_one_machine_are_told_apart_from_others(a, b, same):
    """Case (RFC 4343) and a short name beside its full one name one machine; addresses and
    different domains do not."""
    assert _same_host(a, b) is same and _same_host(b, a) is same
