"""NICs' OS device names (`nics[].devices`): checked by the loader, exported exactly as NCCL's
interface lists (`nccl.json`, `launch.sh` under both targets, `holmes_config.json`), and no
guessed name (`eth0`, holmes-sim's own label) where the scenario gives none; the simulation does
not depend on them."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.export.fork import _merged
from holmes_sim.export.launch import LaunchFiles, launch_files
from holmes_sim.export.nccl_env import DEVICES_NAMED_NOTE, SOCKET_EXCLUDE
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy, results_document, run_scenario

IB = "{type: ib, bandwidth_gbit_per_s: 200, count: 2, fabric: ib%s}"
ETH = "{type: ethernet, bandwidth_gbit_per_s: 10%s}"
NAMED = {"ib": ", devices: [mlx5_0, 'mlx5_1:1']", "ib-eth": ", devices: [ens1f0]",
         "eth": ", devices: [bond0]"}


def scenario(named: bool, eth_nodes: int = 2, ib_devices: str | None = None,
             eth_devices: str | None = None) -> str:
    """Two IB nodes (two HCAs and an Ethernet NIC each) and `eth_nodes` Ethernet-only nodes
    (line 11: the IB group's NICs; line 13: the Ethernet group's), their NICs named or not;
    `ib_devices` / `eth_devices` replace the IB NICs' / the Ethernet-only NIC's names."""
    names = dict(NAMED) if named else {k: "" for k in NAMED}
    if ib_devices is not None:
        names["ib"] = f", devices: {ib_devices}"
    if eth_devices is not None:
        names["eth"] = f", devices: {eth_devices}"
    eth_group = (f"      - {{name: eth, count: {eth_nodes}, gpu: a100-80gb, gpus_per_node: 8,\n"
                 f"         nics: [{ETH % names['eth']}]}}\n") if eth_nodes else ""
    return f"""name: devices
seed: 0
fabrics:
  - {{name: ib, type: ib}}
clusters:
  - name: c
    nodes:
      - name: ib
        count: 2
        gpu: a100-80gb
        nics: [{IB % names['ib']}, {ETH % names['ib-eth']}]
{eth_group}model: {{num_layers: 24, hidden_size: 1024, num_attention_heads: 16, seq_length: 1024}}
training: {{global_batch_size: 16, micro_batch_size: 1}}
parallel: {{tensor: 8, pipeline: 2}}
policies: [megatron, holmes]
"""


def _export(write_scenario, text: str, policy: str) -> dict[str, str]:
    prepared = prepare(write_scenario(text))
    plan, cluster = plan_policy(prepared, policy)
    return launch_files(plan, cluster, prepared.workload, "fp16").files


def _dry_run(tmp_path: Path, files: dict[str, str], target: str, rank: int) -> dict[str, str]:
    """The NCCL environment `launch.sh target` gives node `rank`'s torchrun (dry run)."""
    out = tmp_path / "out"
    LaunchFiles(files).write(out)
    env = {**os.environ, "DRY_RUN": "1", "NODE_RANK": str(rank)}
    proc = subprocess.run(["bash", str(out / "launch.sh"), target], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    return dict(w.split("=", 1) for w in words[1:words.index("torchrun")])


def test_named_devices_are_exported_exactly_in_nccl_json_and_holmes_config(write_scenario):
    files = _export(write_scenario, scenario(named=True), "holmes")
    nodes = json.loads(files["nccl.json"])["nodes"]
    assert nodes["ib-0"]["NCCL_SOCKET_IFNAME"] == "=ens1f0"
    assert nodes["ib-1"]["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1:1"
    assert nodes["eth-0"]["NCCL_SOCKET_IFNAME"] == "=bond0" and "NCCL_IB_HCA" not in nodes["eth-0"]
    config = {e["CLUSTER_NAME"]: e for e in json.loads(files["holmes_config.json"])}
    assert config["ib"]["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1:1"
    assert config["ib"]["NCCL_SOCKET_IFNAME"] == "=ens1f0"
    assert config["ethernet"]["NCCL_SOCKET_IFNAME"] == "=bond0"
    # one entry for the groups that mix both kinds of node: NCCL on each matches the name it has
    assert config["heter"]["NCCL_SOCKET_IFNAME"] == "=ens1f0,bond0"
    assert DEVICES_NAMED_NOTE in files["README.md"] and "Placeholders" not in files["README.md"]


@pytest.mark.parametrize("target", ["megatron", "holmes"])
def test_named_devices_reach_each_nodes_torchrun_under_both_targets(write_scenario, tmp_path,
                                                                     target):
    files = _export(write_scenario, scenario(named=True), "holmes")
    order = list(json.loads(files["nccl.json"])["nodes"])  # sorted names; rank order below
    ranks = {h.split()[0]: r for r, h in enumerate(files["hostfile"].splitlines())}
    assert set(ranks) == set(order)
    for host, want in (("ib-0", "ens1f0"), ("eth-1", "bond0")):
        env = _dry_run(tmp_path, files, target, ranks[host])
        assert env["NCCL_SOCKET_IFNAME"] == f"={want}"
        assert env["GLOO_SOCKET_IFNAME"] == want  # exact names, PyTorch's only form
        assert env["NCCL_NET"] == "Socket"  # IB and Ethernet-only nodes share only TCP


def test_named_hcas_reach_torchrun_when_upstream_runs_on_rdma(write_scenario, tmp_path):
    files = _export(write_scenario, scenario(named=True, eth_nodes=0), "megatron")
    for rank in (0, 1):
        env = _dry_run(tmp_path, files, "megatron", rank)
        assert env["NCCL_NET"] == "IB" and env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1:1"
        assert env["NCCL_SOCKET_IFNAME"] == "=ens1f0"


def test_without_names_no_guessed_interface_is_exported(write_scenario, tmp_path):
    files = _export(write_scenario, scenario(named=False), "holmes")
    # plan.json keeps holmes-sim's NIC labels (ib0, eth0): the bundled worker maps them to
    # devices with its run config's nic_devices; no file NCCL or a launcher reads holds one.
    assert [name for name, text in files.items() if "eth0" in text] == ["plan.json"]
    nodes = json.loads(files["nccl.json"])["nodes"]
    assert {env["NCCL_SOCKET_IFNAME"] for env in nodes.values()} == {SOCKET_EXCLUDE}
    assert "GLOO_SOCKET_IFNAME" not in files["launch.sh"]  # Gloo takes the host name's address
    assert nodes["ib-0"]["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"  # the ConnectX default, prefixes
    for target in ("megatron", "holmes"):
        assert _dry_run(tmp_path, files, target, 0)["NCCL_SOCKET_IFNAME"] == SOCKET_EXCLUDE
    readme = files["README.md"]
    assert f"`NCCL_SOCKET_IFNAME={SOCKET_EXCLUDE}`" in readme and "`NCCL_IB_HCA=mlx5_0" in readme
    assert "Placeholders, not your device names" in readme and "devices: [ens1f0]" in readme
    assert "clusters[0].nodes[0], clusters[0].nodes[1]" in readme


def test_one_config_entry_for_nodes_with_different_names_holds_them_all():
    assert _merged(["=ens1f0", "=ens1f0"]) == "=ens1f0"
    assert _merged(["=ens1f0", "=bond0", "=ens1f0"]) == "=ens1f0,bond0"
    assert _merged(["=mlx5_2", "mlx5_0,mlx5_1"]) == "mlx5_2,mlx5_0,mlx5_1"  # prefixes hold both
    assert _merged(["=ens1f0", SOCKET_EXCLUDE]) == SOCKET_EXCLUDE


BAD = {
    "wrong count": (None, "[bond0, bond1]", 13, "nodes[1].nics[0].devices: 2 names for 1 NICs "
                                                "(count); give one device name per NIC"),
    "leading dash": (None, "[-x]", 13, "nodes[1].nics[0].devices[0]: '-x' is not a device name "
                                       "NCCL can take"),
    "space": (None, "['a b']", 13, "nodes[1].nics[0].devices[0]: 'a b' is not a device name "
                                   "NCCL can take"),
    "exclusion": (None, "['^eth']", 13, "'^eth' is not a device name NCCL can take; use letters"),
    "port on Ethernet": (None, "['bond0:1']", 13, "'bond0:1': NCCL reads ':' as a port; give "
                                                  "the interface name alone"),
    "bad port": ("[mlx5_0, 'mlx5_1:x']", None, 11, "nodes[0].nics[0].devices[1]: 'mlx5_1:x' is "
                                                   "not HCA[:port]"),
    "duplicate": ("[mlx5_0, mlx5_0]", None, 11, "nodes[0].nics[0].devices[1]: device 'mlx5_0' "
                                                "is named by this node group's "
                                                "nics[0].devices[0] already"),
    "HCA and its port": ("[mlx5_0, 'mlx5_0:1']", None, 11, "device 'mlx5_0:1' is named by this "
                                                           "node group's nics[0].devices[0]"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_device_list_is_one_error_naming_file_line_and_fix(write_scenario, tmp_path, case):
    ib, eth, line, message = BAD[case]
    path = write_scenario(scenario(named=True, ib_devices=ib, eth_devices=eth))
    out = tmp_path / "plans"
    result = CliRunner().invoke(app, ["run", str(path), "-p", "holmes", "--plans", str(out), "-q"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "Traceback" not in result.output
    assert f"{path}:{line}: clusters[0]." in result.output and message in result.output
    assert not out.exists()


def test_a_device_shared_by_two_nic_entries_of_a_node_is_refused(write_scenario):
    text = scenario(named=True).replace("devices: [ens1f0]", "devices: [mlx5_0]")
    result = CliRunner().invoke(app, ["check", str(write_scenario(text))])
    assert result.exit_code == 2
    assert (":11: clusters[0].nodes[0].nics[1].devices[0]: device 'mlx5_0' is named by this "
            "node group's nics[0].devices[0] already; give each NIC of a node its own device"
            ) in result.output


def test_a_node_group_names_all_its_nics_of_a_kind_or_none(write_scenario):
    text = scenario(named=True).replace("devices: [ens1f0]}", "devices: [ens1f0]}, "
                                        "{type: ethernet, bandwidth_gbit_per_s: 10}")
    result = CliRunner().invoke(app, ["check", str(write_scenario(text))])
    assert result.exit_code == 2
    assert (":11: clusters[0].nodes[0].nics[2]: names no `devices`, but nics[1] of this node "
            "group does; give `devices` on every Ethernet NIC entry of the group, or on none"
            ) in result.output


def test_device_names_leave_every_simulated_result_unchanged(write_scenario):
    documents = []
    for named in (False, True):
        prepared = prepare(write_scenario(scenario(named=named)))
        document = results_document(prepared, run_scenario(prepared, None,
                                                           full_simulation=True), 0)
        document["scenario"].pop("file")
        documents.append(json.dumps(document, indent=1, sort_keys=True))
    assert documents[0] == documents[1]
    assert '"results"' in documents[0] and len(documents[0]) > 1000


def dual_fabric(ib_count: int, ib_gbit: int, roce_gbit: int) -> str:
    """Two nodes with IB and RoCE HCAs (named), two with IB only."""
    ib = "{type: ib, bandwidth_gbit_per_s: %d, count: %d, fabric: ib, devices: [%s]}"
    roce = ("{type: roce, bandwidth_gbit_per_s: %d, count: 2, fabric: roce, "
            "devices: [mlx5_8, mlx5_9]}" % roce_gbit)
    eth = "{type: ethernet, bandwidth_gbit_per_s: 25, devices: [eth0]}"
    dual_ib = ib % (ib_gbit, ib_count, ", ".join(f"mlx5_{k}" for k in range(ib_count)))
    return f"""name: dual
seed: 0
fabrics:
  - {{name: ib, type: ib}}
  - {{name: roce, type: roce}}
clusters:
  - name: c
    nodes:
      - {{name: dual, count: 2, gpu: a100-80gb, nics: [{dual_ib}, {roce}, {eth}]}}
      - {{name: ibonly, count: 2, gpu: a100-80gb,
         nics: [{ib % (200, 2, "mlx5_0, mlx5_1")}, {eth}]}}
model: {{num_layers: 8, hidden_size: 1024, num_attention_heads: 16, seq_length: 1024}}
training: {{global_batch_size: 16, micro_batch_size: 1}}
parallel: {{tensor: 8, pipeline: 2}}
policies: [megatron, holmes]
"""


@pytest.mark.parametrize("policy", ["megatron", "holmes"])
def test_a_node_on_two_fabrics_lists_only_the_hcas_its_groups_use(write_scenario, tmp_path,
                                                                   policy):
    """Every group of this plan runs on the IB fabric: the dual nodes' RoCE HCAs are not listed
    (NCCL picks a GPU's HCA by locality, so a listed RoCE HCA could meet an IB peer)."""
    files = _export(write_scenario, dual_fabric(2, 200, 100), policy)
    groups = json.loads(files["nccl.json"])["groups"]
    assert {g["transports"] for g in groups.values()} <= {"local", "rdma:ib"}
    nodes = json.loads(files["nccl.json"])["nodes"]
    assert {env["NCCL_IB_HCA"] for env in nodes.values()} == {"=mlx5_0,mlx5_1"}
    ranks = [h.split()[0] for h in files["hostfile"].splitlines()]
    env = _dry_run(tmp_path, files, "megatron", ranks.index("dual-0"))
    assert env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1" and "NCCL_IB_GID_INDEX" not in env
    assert "not as planned" not in files["README.md"]


def test_groups_of_a_node_that_needs_two_fabrics_are_not_as_planned_upstream(write_scenario):
    """The holmes plan runs the dual nodes' DP groups on RoCE and their pipeline pairs with the
    IB-only nodes on IB: under upstream's one environment those nodes list both fabrics' HCAs,
    and the README marks their groups not as planned."""
    files = _export(write_scenario, dual_fabric(1, 100, 200), "holmes")
    groups = json.loads(files["nccl.json"])["groups"]
    assert "rdma:roce" in groups["dp"]["transports"] and groups["pp"]["transports"] == "rdma:ib"
    nodes = json.loads(files["nccl.json"])["nodes"]
    assert nodes["dual-0"]["NCCL_IB_HCA"] == "=mlx5_0,mlx5_8,mlx5_9"
    assert nodes["ibonly-0"]["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"
    rows = {line.split(" | ")[0].strip("| "): line for line in files["README.md"].splitlines()
            if line.startswith("| ")}
    assert rows["dp"].endswith("not as planned |") and rows["pp"].endswith("not as planned |")
    assert "groups of dual-0 (ib and roce), dual-1 (ib and roce)" in files["README.md"]
