"""Checks of a loaded scenario against its hardware and model, reported at the field's line."""

from __future__ import annotations

import re

import pytest

from holmes_sim.errors import ScenarioError
from holmes_sim.prepare import MAX_GRADIENT_BUCKETS, prepare
from tests.conftest import small_scenario


def line_of(text: str, key: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith(key))


def test_fp8_on_a_gpu_without_an_fp8_rate_names_the_precision_line(write_scenario):
    text = small_scenario().replace("micro_batch_size: 1}", "micro_batch_size: 1, precision: fp8}")
    with pytest.raises(ScenarioError) as exc:
        prepare(write_scenario(text))
    assert f":{line_of(text, 'training:')}: training.precision: GPU model 'a100-80gb' has no FP8 " \
           "tensor rate" in str(exc.value)


def test_too_many_buckets_of_the_default_size_blame_the_model(write_scenario):
    text = small_scenario(layers=8000, hidden=32768, heads=256, pp=1)
    with pytest.raises(ScenarioError) as exc:
        prepare(write_scenario(text))
    message = str(exc.value)
    assert f":{line_of(text, 'model:')}: model: its " in message
    assert "check num_layers, hidden_size and num_experts" in message
    least = int(re.search(r"bucket_size_mb to at least ([\d,]+)", message)[1].replace(",", ""))
    fixed = text.replace("micro_batch_size: 1}", f"micro_batch_size: 1, bucket_size_mb: {least}}}")
    assert prepare(write_scenario(fixed)).workload.bucket_bytes == least * 1e6  # the fix works


def test_too_small_a_given_bucket_names_the_least_size_that_works(write_scenario):
    text = small_scenario().replace("micro_batch_size: 1}", "micro_batch_size: 1, "
                                                            "bucket_size_mb: 0.001}")
    with pytest.raises(ScenarioError) as exc:
        prepare(write_scenario(text))
    least = int(re.search(r"training.bucket_size_mb: .* raise it to at least ([\d,]+)",
                          str(exc.value))[1].replace(",", ""))
    workload = prepare(write_scenario(text.replace("0.001", str(least)))).workload
    assert workload.total_params * 4 / workload.bucket_bytes <= MAX_GRADIENT_BUCKETS


@pytest.mark.parametrize(("nodes", "tp", "pp", "choices"), [
    (4, 4, 3, "use one of 1, 2, 4, 8 (the degrees that divide 32 GPUs / tensor=4 = 8)"),
    (3, 8, 2, "use one of 1, 3 (the degrees that divide 24 GPUs / tensor=8 = 3)"),
    (6, 1, 5, "use one of 1, 2, 3, 4, 6, 8 (the degrees that divide 48 GPUs / tensor=1 = 48)"),
])
def test_a_pipeline_that_does_not_divide_the_gpus_names_the_degrees_that_do(
        write_scenario, nodes, tp, pp, choices):
    text = small_scenario(nodes_ib=nodes, tp=tp, pp=pp, global_batch=48)
    with pytest.raises(ScenarioError) as exc:
        prepare(write_scenario(text))
    assert f"does not divide the {nodes * 8} GPUs of the clusters; {choices}" in str(exc.value)
    fixed = int(re.findall(r"\d+", choices)[1])
    assert prepare(write_scenario(small_scenario(nodes_ib=nodes, tp=tp, pp=fixed,
                                                 global_batch=48)))  # a listed degree works
