"""The per-step passes over the GPU's whole gradient buffer (`Workload.gradient_buffer_passes`):
Megatron-Core zeroes it, checks each bucket's norm for NaN and scales it by 1/DP before the
reduction (param_and_grad_buffer.py); `--ddp-average-in-collective` drops the scaling and
`--no-check-for-nan-in-loss-and-grad` the norm."""

from __future__ import annotations

import pytest

from holmes_sim.cost.compute import KernelCompute
from holmes_sim.hardware.catalog import GPUS
from holmes_sim.model.workload import build_workload
from holmes_sim.prepare import prepare_text
from holmes_sim.cost.ops import OpCosts
from holmes_sim.runner import run_policy
from holmes_sim.spec.job import ModelSpec, TrainingSpec

GRID = [(True, False, 4), (False, False, 3), (True, True, 2), (False, True, 1)]


@pytest.mark.parametrize("check, average, passes", GRID)
def test_each_switch_removes_its_own_pass(check, average, passes):
    """Bytes per gradient byte: zeroing 1 (write), NaN norm 1 (read), 1/DP scaling 2 (read and
    write); at 1e9 fp32 gradients on an H100 the step moves passes x 4 GB at the HBM rate the
    memory-bound kernels run at."""
    training = TrainingSpec(global_batch_size=8, micro_batch_size=1,
                            check_for_nan_in_loss_and_grad=check, ddp_average_in_collective=average)
    w = build_workload(ModelSpec(num_layers=2, hidden_size=1024, num_attention_heads=8,
                                 seq_length=1024, vocab_size=32000), training)
    assert w.grad_bytes == 4 and w.gradient_buffer_passes == passes
    gpu = GPUS["h100-sxm"]
    rate = gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency
    assert KernelCompute().gradient_buffer_s(gpu, w, 1e9) == pytest.approx(passes * 4e9 / rate)


def test_defaults_are_megatron_lms():
    """Megatron-LM checks for NaN unless told not to and scales before a summing reduction."""
    t = TrainingSpec(global_batch_size=8, micro_batch_size=1)
    assert t.check_for_nan_in_loss_and_grad and not t.ddp_average_in_collective


SCENARIO = """
name: buffer-passes
seed: 0
fabrics: [{name: ib, type: ib}]
clusters:
  - name: c
    nodes:
      - {count: 2, gpu: a100-80gb, nics: [{type: ib, model: ib-hdr, count: 8, fabric: ib}]}
model: {name: gpt, num_layers: 4, hidden_size: 2048, num_attention_heads: 16, seq_length: 1024,
        vocab_size: 32000}
training:
  global_batch_size: 16
  micro_batch_size: 1
  check_for_nan_in_loss_and_grad: %s
  ddp_average_in_collective: %s
parallel: {tensor: 8, pipeline: 1}
policies: [megatron]
"""


def test_the_step_grows_by_the_passes_over_the_whole_buffer():
    """Two runs that differ only in the two switches: every GPU's optimizer step (no pipeline,
    DP 2) differs by 3 passes over its whole gradient buffer, sharded optimizer or not: its
    parameters x 3 g bytes at the HBM rate."""
    slow = prepare_text(SCENARIO % ("true", "false"))
    fast = prepare_text(SCENARIO % ("false", "true"))
    outcomes = [run_policy(p, "megatron") for p in (slow, fast)]
    plan, w = outcomes[0].plan, slow.workload
    assert plan.pp == 1 and plan.dp == 2 and plan.optimizer.sharded
    params = OpCosts(outcomes[0].cluster, w, slow.compute, plan.tp).stage_params(
        plan.layers_per_stage, 1, 0) / plan.tp
    gpu = GPUS["a100-80gb"]
    rate = gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency
    difference = (outcomes[0].result.breakdown_s["optimizer"]
                  - outcomes[1].result.breakdown_s["optimizer"])
    assert difference == pytest.approx(params * 3 * w.grad_bytes / rate, rel=1e-6)
