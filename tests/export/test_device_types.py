"""The Holmes fork's device types: one per pipeline stage, the RDMA fabric its DP groups run on
in the plan, so a node on two fabrics takes its stage's, not the first it lists."""

from __future__ import annotations

import json
import shlex

from holmes_sim.export.device_types import device_types
from holmes_sim.export.launch import launch_files
from holmes_sim.plan import GroupKind
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from tests.export.test_hosts_mapping import arrays
from tests.test_nic_order import _dual_fabric_listings, _scenario


def _export(prepared, policy: str) -> dict[str, str]:
    plan, cluster = plan_policy(prepared, policy)
    return launch_files(plan, cluster, prepared.workload, "bf16").files


def test_a_dual_fabric_node_takes_the_fabric_its_stage_runs_on(write_scenario):
    """RoCE nodes ra and rb, nodes d on RoCE (listed first) and IB, IB nodes i, TP 4 PP 2:
    Holmes puts d beside i on stage 1, whose DP groups run on IB. The fork's export used to
    refuse it ("pipeline stage 1 spans device types ib-a, roce-a", d typed by its first
    fabric); now d runs as ib-a with its IB HCA, and the README says that the shared ib-a
    entry also names d's RoCE HCA."""
    prepared = _dual_fabric_listings(write_scenario, "roce-a")[1]
    plan = plan_policy(prepared, "holmes")[0]
    assert {str(g.transport) for g in plan.groups_of(GroupKind.DATA)} == {"rdma:roce-a",
                                                                          "rdma:ib-a"}
    files = _export(prepared, "holmes")
    args = shlex.split(files["holmes_args.txt"])
    assert args[args.index("--hetero-device-types"):args.index("--use-hetnet")] == [
        "--hetero-device-types", "roce-a", "ib-a", "--hetero-pipeline-stages", "1",
        str(plan.layers_per_stage[0]), "1", str(plan.layers_per_stage[1])]
    hosts = arrays(files["launch.sh"])
    assert dict(zip(hosts["HOSTS"], hosts["TYPES"])) == {
        "ra0-0": "roce-a", "ra1-0": "roce-a", "rb0-0": "roce-a", "rb1-0": "roce-a",
        "d0-0": "ib-a", "d1-0": "ib-a", "i0-0": "ib-a", "i1-0": "ib-a"}
    config = {e["CLUSTER_NAME"]: e for e in json.loads(files["holmes_config.json"])}
    assert config["ib-a"]["NCCL_IB_HCA"] == "mlx5_1,mlx5_0"  # d's IB HCA is its second
    assert "NCCL_IB_GID_INDEX" not in config["ib-a"]
    assert config["roce-a"]["NCCL_IB_HCA"] == "mlx5_0"
    assert "runs as device type ib-a (its HCAs there: mlx5_1)" in files["README.md"]
    assert "also names mlx5_0" in files["README.md"]


def test_a_stage_whose_nodes_share_no_fabric_is_still_refused(write_scenario):
    """In listing order `ra d | i rb` stage 1 holds IB and RoCE nodes only: no device type."""
    prepared = _dual_fabric_listings(write_scenario, "roce-a")[0]
    files = _export(prepared, "holmes-no-nic-aware-order")
    assert files["holmes_args.txt"] == (
        "# not expressible: pipeline stage 1 spans device types ib-a, roce-a\n")
    assert "holmes_config.json" not in files


def test_a_node_holding_stages_of_two_device_types_is_refused(write_scenario):
    """Nodes r (RoCE), d (RoCE and IB), i (IB), TP 4 PP 2 DP 3: stage 0 holds r and half of d
    (RoCE), stage 1 the other half and i (IB): d would need two device types."""
    nodes = [("r", "a100-80gb", ("roce-a",)), ("d", "a100-80gb", ("roce-a", "ib-a")),
             ("i", "a100-80gb", ("ib-a",))]
    text = _scenario(nodes, tp=4, pp=2).replace("global_batch_size: 16", "global_batch_size: 12")
    prepared = prepare(write_scenario(text))
    plan, cluster = plan_policy(prepared, "holmes-no-nic-aware-order")
    types, why = device_types(plan, cluster)
    assert why == "node d-0 holds pipeline stages 0 (roce-a) and 1 (ib-a) of different device types"
    assert types == {"r-0": "roce-a", "d-0": "ib-a", "i-0": "ib-a"}  # NIC classes (tie: by name)
    files = launch_files(plan, cluster, prepared.workload, "bf16").files
    assert files["holmes_args.txt"] == f"# not expressible: {why}\n"
