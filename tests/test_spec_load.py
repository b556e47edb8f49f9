"""The scenario loader: every bad input is one clear ScenarioError naming file, line and field."""

from __future__ import annotations

import pytest

from holmes_sim.errors import ScenarioError
from holmes_sim.prepare import prepare
from tests.conftest import SCENARIOS, small_scenario


def _error(write_scenario, text: str) -> str:
    with pytest.raises(ScenarioError) as info:
        prepare(write_scenario(text))
    return str(info.value)


def test_every_bundled_scenario_loads():
    names = sorted(p.stem for p in SCENARIOS.glob("*.yaml"))
    assert "mixed_ib_eth" in names and len(names) >= 7
    for path in SCENARIOS.glob("*.yaml"):
        prepared = prepare(path)
        assert prepared.tp * prepared.pp * prepared.dp == prepared.cluster.num_gpus


def test_malformed_yaml_names_the_line(write_scenario):
    msg = _error(write_scenario, "clusters: [\nmodel: {")
    assert "malformed YAML" in msg and ".yaml:" in msg


def test_unknown_key_suggests_the_right_one(write_scenario):
    text = small_scenario().replace("num_layers:", "num_layer:")
    msg = _error(write_scenario, text)
    assert "model.num_layer" in msg and "did you mean 'num_layers'" in msg
    line = next(i for i, t in enumerate(text.splitlines(), 1) if "num_layer:" in t)
    assert f".yaml:{line}:" in msg


def test_duplicate_key_is_rejected(write_scenario):
    msg = _error(write_scenario, small_scenario() + "seed: 3\n")
    assert "seed: duplicate key" in msg


def test_unknown_nic_type_lists_the_known_ones(write_scenario):
    msg = _error(write_scenario, small_scenario().replace("type: ib,", "type: infiniband,"))
    assert "clusters[0].nodes[0].nics[0].type" in msg
    assert "'infiniband' is not allowed (expected one of: ib, roce, ethernet)" in msg


def test_nic_on_undeclared_fabric(write_scenario):
    msg = _error(write_scenario, small_scenario().replace("fabric: ib", "fabric: ib-west"))
    assert "clusters[0].nodes[0].nics[0].fabric" in msg and "ib-west" in msg
    assert "declare it under `fabrics:`" in msg


def test_nic_type_no_fabric_carries(write_scenario):
    text = small_scenario().replace("- {name: ib, type: ib}", "- {name: ib, type: roce}")
    msg = _error(write_scenario, text)
    assert "fabric 'ib' is roce, but this NIC is ib" in msg


def test_degrees_that_do_not_multiply(write_scenario):
    msg = _error(write_scenario, small_scenario(nodes_ib=3, tp=8, pp=2))
    assert "parallel.pipeline" in msg and "24 GPUs" in msg


def test_explicit_data_degree_mismatch(write_scenario):
    text = small_scenario().replace("schedule: 1f1b,", "data: 4, schedule: 1f1b,")
    msg = _error(write_scenario, text)
    assert "parallel.data" in msg and "set data: 1" in msg


def test_tp_larger_than_a_node(write_scenario):
    msg = _error(write_scenario, small_scenario(gpus=4, nodes_ib=4, tp=8))
    assert "parallel.tensor: tensor=8 must divide GPUs per node=4" in msg


def test_fewer_layers_than_stages(write_scenario):
    msg = _error(write_scenario, small_scenario(nodes_ib=4, tp=8, pp=4, layers=3))
    assert "parallel.pipeline: pipeline=4 stages cannot each hold one of the model.num_layers=3" \
        in msg
    msg = _error(write_scenario, small_scenario(nodes_ib=4, tp=8, pp=2, layers=3,
                                                schedule="interleaved", virtual=2))
    assert "model.num_layers: 3 layers cannot fill pipeline=2 x virtual_stages=2" in msg


def test_batch_not_divisible(write_scenario):
    msg = _error(write_scenario, small_scenario(nodes_ib=4, tp=8, pp=2, global_batch=15))
    assert "training.global_batch_size" in msg and "15" in msg


def test_interleaved_needs_microbatches_multiple_of_stages(write_scenario):
    msg = _error(write_scenario, small_scenario(nodes_ib=4, tp=8, pp=4, global_batch=6,
                                                schedule="interleaved", virtual=2))
    assert "parallel.schedule" in msg and "multiple of" in msg


def test_unknown_policy(write_scenario):
    msg = _error(write_scenario, small_scenario(policies="[megatron, holmez]"))
    assert "policies[1]" in msg and "holmez" in msg and "holmes" in msg


def test_unknown_gpu_model(write_scenario):
    msg = _error(write_scenario, small_scenario().replace("a100-80gb", "a100-96gb", 1))
    assert "clusters[0].nodes[0].gpu" in msg and "unknown GPU model 'a100-96gb'" in msg


def test_wrong_value_type(write_scenario):
    msg = _error(write_scenario, small_scenario().replace("micro_batch_size: 1", "micro_batch_size: two"))
    assert "training.micro_batch_size" in msg and "whole number" in msg


def test_negative_bandwidth(write_scenario):
    msg = _error(write_scenario, small_scenario(ib_gbit=-5))
    assert "bandwidth_gbit_per_s" in msg and "greater than 0" in msg


def test_clusters_without_a_link(write_scenario):
    text = small_scenario().replace("clusters:\n  - name: c\n", "clusters:\n  - name: d\n    nodes:\n"
                                    "      - {gpu: a100-80gb, nics: [{type: ethernet, model: eth-25g}]}\n"
                                    "  - name: c\n")
    msg = _error(write_scenario, text)
    assert "inter_cluster_links" in msg and "'d' and 'c' are not joined" in msg


def test_catalog_override_is_used(write_scenario):
    text = small_scenario().replace("a100-80gb", "my-gpu") + (
        "catalog:\n  gpus:\n    my-gpu: {peak_tflops: 100, memory_gib: 24, "
        "memory_bandwidth_gbyte_per_s: 900, intra_node: pcie4}\n")
    prepared = prepare(write_scenario(text))
    gpu = prepared.cluster.nodes[0].gpu
    assert gpu.peak_flop_per_s == 100e12 and gpu.memory_bytes == 24 * 2**30
    assert prepared.cluster.nodes[0].intra_link.name == "pcie4"  # the GPU's own default


def _declared(write_scenario, gpu: str, fields: str):
    """The GPU model the nodes of a small scenario on `gpu` get with `gpu` declared under
    catalog.gpus with `fields` (YAML flow-mapping entries)."""
    text = small_scenario().replace("a100-80gb", gpu) + f"catalog:\n  gpus:\n    {gpu}: {{{fields}}}\n"
    return prepare(write_scenario(text)).cluster.nodes[0].gpu


@pytest.mark.parametrize(("gpu", "sheet"), [("a100-80gb", (312, 80, 2039)),
                                            ("h100-sxm", (989, 80, 3350)),
                                            ("b200", (2250, 180, 8000))])
def test_a_built_in_gpu_declared_with_its_data_sheet_is_the_built_in(write_scenario, gpu, sheet):
    from dataclasses import replace

    from holmes_sim.hardware.catalog import GPUS

    peak, memory, bandwidth = sheet
    got = _declared(write_scenario, gpu, f"peak_tflops: {peak}, memory_gib: {memory}, "
                                         f"memory_bandwidth_gbyte_per_s: {bandwidth}")
    # Everything but the source, down to the GEMM search shapes and the attention rates.
    assert got == replace(GPUS[gpu], source="user")


def test_a_built_in_gpus_measurements_go_with_the_field_they_belong_to(write_scenario):
    from holmes_sim.hardware.catalog import GPUS

    sheet = "peak_tflops: 989, memory_gib: 94, memory_bandwidth_gbyte_per_s: 3900"
    h100 = GPUS["h100-sxm"]
    own = _declared(write_scenario, "h100-sxm", sheet + ", compute_efficiency: 0.6, "
                                                        "attention_efficiency: 0.5")
    assert (own.compute_efficiency, own.benchmark_shape) == (0.6, None)
    assert (own.attention_efficiency, own.attention_rates, own.flash_attention_rates) == \
        (0.5, None, None)
    # What the stated fields do not touch stays the built-in's: FP8, SMs, kernels, NVLink.
    assert (own.fp8_compute_efficiency, own.fp8_benchmark_shape) == \
        (h100.fp8_compute_efficiency, h100.fp8_benchmark_shape)
    assert (own.sm_count, own.persistent_gemm, own.overlapped_epilogue, own.compute_capability,
            own.nvlink) == (132, True, False, 9, "nvlink4")
    kept = _declared(write_scenario, "h100-sxm", sheet + ", persistent_gemm: false")
    assert kept.memory_bytes == 94 * 2**30 and kept.attention_rates == h100.attention_rates
    assert kept.benchmark_shape == h100.benchmark_shape and kept.persistent_gemm is False


def test_a_built_in_gpu_re_declared_with_one_field_keeps_every_other(write_scenario):
    from dataclasses import replace

    from holmes_sim.hardware.catalog import GPUS

    got = _declared(write_scenario, "h100-sxm", "memory_gib: 94")
    assert got == replace(GPUS["h100-sxm"], memory_bytes=94 * 2**30, source="user")


@pytest.mark.parametrize("missing", ["peak_tflops", "memory_gib", "memory_bandwidth_gbyte_per_s"])
def test_a_new_gpu_without_its_data_sheet_is_refused_naming_the_field(write_scenario, missing):
    fields = {"peak_tflops": 100, "memory_gib": 24, "memory_bandwidth_gbyte_per_s": 900}
    del fields[missing]
    stated = ", ".join(f"{k}: {v}" for k, v in fields.items())
    with pytest.raises(ScenarioError) as info:
        _declared(write_scenario, "my-gpu", stated + ", intra_node: pcie4")
    assert f"catalog.gpus.my-gpu.{missing}: required for a GPU that is not built in" in \
        str(info.value)


def test_a_new_gpu_gets_the_documented_defaults(write_scenario):
    got = _declared(write_scenario, "my-gpu", "peak_tflops: 100, memory_gib: 24, "
                                              "memory_bandwidth_gbyte_per_s: 900, intra_node: pcie4")
    assert (got.compute_efficiency, got.sm_count, got.memory_efficiency,
            got.attention_efficiency, got.persistent_gemm, got.overlapped_epilogue) == \
        (0.8, None, 0.9, 0.6, False, True)
    assert (got.fp8_peak_flop_per_s, got.benchmark_shape, got.attention_rates,
            got.compute_capability) == (None, None, None, None)


@pytest.mark.parametrize(("gpu", "link"), [("a100-80gb", "nvlink3"), ("h100-sxm", "nvlink4"),
                                           ("h200", "nvlink4"), ("b200", "nvlink5"),
                                           ("gb200", "nvlink5")])
def test_a_node_without_intra_node_gets_its_gpus_nvlink(write_scenario, gpu, link):
    text = small_scenario().replace("a100-80gb", gpu)
    assert "intra_node" not in text
    assert prepare(write_scenario(text)).cluster.nodes[0].intra_link.name == link
    named = text.replace(f"gpu: {gpu},", f"gpu: {gpu}, intra_node: pcie5,")
    assert prepare(write_scenario(named)).cluster.nodes[0].intra_link.name == "pcie5"


@pytest.mark.parametrize("where", ["nodes", "catalog"])
def test_an_empty_intra_node_link_is_refused_naming_the_links(write_scenario, where):
    """`intra_node: ""` read as the GPU's own link; it is an unknown link, on a node group as
    under catalog.gpus (where removing it gives the default)."""
    text = small_scenario()
    if where == "nodes":
        text = text.replace("gpu: a100-80gb,", 'gpu: a100-80gb, intra_node: "",')
        field = r"clusters\[0\].nodes\[0\].intra_node"
    else:
        text += ("catalog:\n  gpus:\n    a100-80gb: {peak_tflops: 100, memory_gib: 24, "
                 'memory_bandwidth_gbyte_per_s: 900, intra_node: ""}\n')
        field = "catalog.gpus.a100-80gb.intra_node"
    with pytest.raises(ScenarioError, match=rf":\d+: {field}: unknown intra-node link '' "
                                            r"\(known: nvlink3, nvlink4, nvlink5, pcie4, pcie5"):
        prepare(write_scenario(text))


def test_a_declared_gpu_without_a_link_asks_for_one(write_scenario):
    text = small_scenario().replace("a100-80gb", "my-gpu") + (
        "catalog:\n  gpus:\n    my-gpu: {peak_tflops: 100, memory_gib: 24, "
        "memory_bandwidth_gbyte_per_s: 900}\n")
    with pytest.raises(ScenarioError, match=r":\d+: clusters\[0\].nodes\[0\].intra_node: GPU model "
                                            "'my-gpu' has no default intra-node link; name one"):
        prepare(write_scenario(text))
    overridden = text.replace("my-gpu", "h100-sxm")  # a built-in's redefinition keeps its link
    assert prepare(write_scenario(overridden)).cluster.nodes[0].intra_link.name == "nvlink4"


def test_a_declared_gpu_names_its_gemm_kernels(write_scenario):
    """`persistent_gemm` and `overlapped_epilogue` reach the GEMM model: a Hopper-like GPU pays
    each tile's epilogue, a Blackwell-like one (the default with persistent kernels) does not."""
    from holmes_sim.cost.gemm import epilogue_s, tile_overhead_s

    def declared(extra: str):
        text = small_scenario().replace("a100-80gb", "my-gpu") + (
            "catalog:\n  gpus:\n    my-gpu: {peak_tflops: 100, memory_gib: 24, sm_count: 100, "
            f"memory_bandwidth_gbyte_per_s: 900, intra_node: nvlink4, persistent_gemm: true{extra}}}\n")
        return prepare(write_scenario(text)).cluster.nodes[0].gpu

    hopper_like, blackwell_like = declared(", overlapped_epilogue: false"), declared("")
    assert not hopper_like.overlapped_epilogue and blackwell_like.overlapped_epilogue
    assert tile_overhead_s(hopper_like, 128, 256, 4096, (2, 2)) == \
        epilogue_s(hopper_like, 128, 256, (2, 2)) > 0.0
    assert tile_overhead_s(blackwell_like, 128, 256, 4096, (2, 2)) == 0.0


@pytest.mark.parametrize("gpu", ["my-gpu", "a100-80gb", "unused-gpu"])
def test_a_declared_gpus_unknown_link_is_named_at_its_own_line(write_scenario, gpu):
    """Where the GPU's nodes use it, where it overrides a built-in, and where no node uses it."""
    text = small_scenario().replace("a100-80gb", "my-gpu" if gpu == "my-gpu" else "a100-80gb") + (
        f"catalog:\n  gpus:\n    {gpu}: {{peak_tflops: 100, memory_gib: 24,\n"
        "      memory_bandwidth_gbyte_per_s: 900, intra_node: nvlnk9}\n")
    line = text.splitlines().index("      memory_bandwidth_gbyte_per_s: 900, intra_node: nvlnk9}") + 1
    with pytest.raises(ScenarioError, match=rf":{line}: catalog.gpus.{gpu}.intra_node: unknown "
                                            "intra-node link 'nvlnk9'"):
        prepare(write_scenario(text))
