"""Launchable exports, checked against their real consumers: Megatron-Core's layout parser, the
Holmes repository's argument rules, torchrun's rank layout and each node's NICs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from holmes_sim.errors import PlanError
from holmes_sim.export.fork import holmes_args
from holmes_sim.export.launch import launch_files, pipeline_layout
from holmes_sim.export.nccl_env import SOCKET_EXCLUDE, node_nccl_env
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from tests.conftest import SCENARIOS, small_scenario

_LAYOUT = "megatron.core.transformer.pipeline_parallel_layer_layout"
Layout = pytest.importorskip(_LAYOUT).PipelineParallelLayerLayout
LayerType = pytest.importorskip("megatron.core.transformer.enums").LayerType

CASES = {
    "uneven-1f1b": dict(nodes_ib=2, nodes_eth=2, tp=8, pp=2, layers=24, global_batch=16, eth_gbit=10),
    "interleaved": dict(nodes_ib=2, nodes_roce=2, tp=8, pp=2, layers=16, global_batch=16,
                        schedule="interleaved", virtual=2),
    "pp4": dict(nodes_ib=2, nodes_roce=2, tp=8, pp=4, layers=22, global_batch=16),
}


def _plans(write_scenario, case: str):
    prepared = prepare(write_scenario(small_scenario(**CASES[case], policies="[megatron, holmes]")))
    return prepared, [plan_policy(prepared, p) for p in ("megatron", "holmes")]


@pytest.mark.parametrize("case", CASES)
def test_layout_parses_with_megatron_core_to_the_plans_layers(write_scenario, case):
    prepared, plans = _plans(write_scenario, case)
    for plan, _ in plans:
        layout = Layout(pipeline_layout(plan), plan.pp)
        layout.validate_layer_layout(prepared.workload.num_layers, None)
        assert layout.virtual_pipeline_model_parallel_size == plan.num_chunks
        for j, n in enumerate(plan.layers_per_stage):
            assert layout.layout[j % plan.pp][j // plan.pp].count(LayerType.decoder) == n


def test_holmes_arguments_follow_its_parser_rules(write_scenario):
    prepared, plans = _plans(write_scenario, "uneven-1f1b")
    plan, cluster = plans[1]
    args, why_not = holmes_args(plan, cluster, [])
    assert why_not is None
    types = args[args.index("--hetero-device-types") + 1:args.index("--hetero-pipeline-stages")]
    stages = [int(x) for x in args[args.index("--hetero-pipeline-stages") + 1:args.index("--use-hetnet")]]
    assert len(types) == len(set(types))  # one group per device type
    counts, layers = hetero_stages(stages)
    assert len(counts) == len(types) and sum(counts) == plan.pp
    assert layers == list(plan.layers_per_stage) and sum(layers) == prepared.workload.num_layers


def test_stages_that_mix_device_types_are_not_expressed_as_holmes_arguments():
    prepared = prepare(SCENARIOS / "mixed_ib_roce.yaml")  # racked alternately
    plan, cluster = plan_policy(prepared, "megatron")
    args, why_not = holmes_args(plan, cluster, [])
    assert args == [] and "spans device types" in why_not


def test_nccl_settings_per_node_match_its_nics():
    prepared = prepare(SCENARIOS / "mixed_ib_roce.yaml")
    for node in prepared.cluster.nodes:
        env = node_nccl_env(node)
        rdma = [n for n in node.nics if n.type != "ethernet"]
        assert len(env["NCCL_IB_HCA"].split(",")) == len(rdma)
        assert "NCCL_IB_GID_INDEX" not in env  # NCCL >= 2.21 picks RoCE v2 over IPv4 itself
        assert env["NCCL_NET"] == "IB"
        assert env["NCCL_SOCKET_IFNAME"] == SOCKET_EXCLUDE  # no devices named: no guessed name


def test_reference_policies_are_refused(write_scenario):
    prepared = prepare(SCENARIOS / "mixed_ib_roce.yaml")
    plan, cluster = plan_policy(prepared, "all-ib")
    with pytest.raises(PlanError, match="hypothetical network"):
        launch_files(plan, cluster, prepared.workload, "fp16")


def test_run_plans_writes_launch_folders_for_real_policies_only(tmp_path):
    from typer.testing import CliRunner

    from holmes_sim.cli import app

    result = CliRunner().invoke(app, ["run", "mixed_ib_roce", "-p", "holmes", "-p", "all-ib",
                                      "--plans", str(tmp_path / "plans"), "-q"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "plans" / "holmes" / "launch.sh").exists()
    assert not (tmp_path / "plans" / "all-ib").exists()
    assert (tmp_path / "plans" / "plan_all-ib.json").exists()


def hetero_stages(stages: list[int]) -> tuple[list[int], list[int]]:
    """`--hetero-pipeline-stages n_A l.. n_B l..` as (stage counts per type, layers per stage)."""
    counts, layers, i = [], [], 0
    while i < len(stages):
        counts.append(stages[i])
        layers += stages[i + 1:i + 1 + stages[i]]
        i += 1 + stages[i]
    return counts, layers


def test_a_split_megatron_cannot_build_falls_back_to_the_plans_layout(monkeypatch):
    """When Megatron-Core's split flags cannot give a plan's chunks (FieldError from
    `megatron_layers_per_stage`), the exporter compares against no split instead of failing."""
    from holmes_sim.errors import FieldError
    from holmes_sim.export import launch

    def refuse(*_args, **_kwargs):
        raise FieldError("model.decoder_last_pipeline_num_layers", "cannot split")

    monkeypatch.setattr(launch, "megatron_layers_per_stage", refuse)
    workload = SimpleNamespace(num_layers=4, pipeline_split=None)
    assert launch._split_layers(workload, SimpleNamespace(pp=2, num_chunks=1)) is None


@pytest.mark.parametrize("scenario, roce", [("mixed_ib_roce", True), ("pure_ib", False)])
def test_the_roce_gid_index_is_left_to_nccl_with_a_note(scenario, roce):
    """NCCL 2.21.5 and later pick a RoCE port's GID (v2, IPv4) when NCCL_IB_GID_INDEX is unset;
    forcing 3 breaks set-ups whose table differs. No file sets it, and the README says how to
    set it for an older NCCL where the plan runs groups over RoCE."""
    prepared = prepare(SCENARIOS / f"{scenario}.yaml")
    plan, cluster = plan_policy(prepared, "holmes")
    files = launch_files(plan, cluster, prepared.workload, "fp16").files
    assert not [name for name, text in files.items() if name != "README.md" and
                "NCCL_IB_GID_INDEX" in text]
    assert ("NCCL 2.21 and later pick the RoCE v2 IPv4 GID" in files["README.md"]) == roce

