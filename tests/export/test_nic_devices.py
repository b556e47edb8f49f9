"""NICs' OS device names (`nics[].devices`): checked by the loader; the simulation does not
depend on them."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.prepare import prepare
from holmes_sim.runner import results_document, run_scenario

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
