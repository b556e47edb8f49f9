"""FP8 per-tensor current scaling (`training.fp8_recipe: tensorwise`): each tensor's own amax
before its cast (one more read), norms writing bf16 for a cast after them, and under sequence
parallelism a TP all-reduce of the amax before each gathered cast (Transformer Engine v2.8 on)."""

from __future__ import annotations

import shlex
from math import inf

import pytest

from holmes_sim.cost import transformer as T
from holmes_sim.cost.nccl_algorithms import CollectiveTopology, choose
from holmes_sim.cost.ops import OpCosts
from holmes_sim.export.launch import launch_files
from holmes_sim.model.workload import Workload, build_workload
from holmes_sim.prepare import prepare_text
from holmes_sim.runner import plan_policy
from holmes_sim.spec.job import ModelSpec, TrainingSpec
from tests.export.test_launch_targets import FORK, UPSTREAM, parse


def _small(sp: bool, current: bool, recompute: str = "none") -> Workload:
    return Workload(num_layers=2, hidden=1024, heads=8, seq=512, vocab=32000, ffn=4096,
                    tie_embeddings=False, micro_batch=2, global_batch=16, dtype_bytes=2,
                    grad_bytes=2, recompute=recompute, sequence_parallel=sp, bucket_bytes=40e6,
                    flash_attention=True, fp8_gemms=True, fp8_current_scaling=current)


@pytest.mark.parametrize("sp", [False, True])
def test_current_scaling_moves_the_amax_reads_and_the_unfused_norm_casts(sp):
    """M = 1024 tokens, h = 1024, f = 4096, t = 2, d = 2. Forward: the two norm outputs (M h,
    SP M h / t) written in bf16 (d - 1 more) and cast after (d + 1): 2d each; the projection's
    and fc2's inputs (M h/t + M f/t) read once more for their amax. Backward: the output
    gradients of QKV (3 M h / t), fc1 (M f / t) and the two row-parallel linears (M h each, SP
    their rank's M h / t) read once more."""
    m, h, f, d, t = 1024, 1024, 4096, 2, 2
    delayed, current = (T.fp8_quantization_bytes(_small(sp, c), t) for c in (False, True))
    norms = 2 * m * h / (t if sp else 1)
    row_grads = 2 * m * h / (t if sp else 1)
    assert current[0] - delayed[0] == norms * 2 * d + (m * h / t + m * f / t) * d
    assert current[1] - delayed[1] == (3 * m * h / t + m * f / t + row_grads) * d


def test_the_recipe_is_read_only_with_fp8():
    model = ModelSpec(num_layers=2, hidden_size=1024, num_attention_heads=8, seq_length=512,
                      vocab_size=32000)
    for precision, expected in (("fp8", True), ("bf16", False)):
        training = TrainingSpec(global_batch_size=8, micro_batch_size=1, precision=precision,
                                fp8_recipe="tensorwise")
        assert build_workload(model, training).fp8_current_scaling == expected


SCENARIO = """
name: fp8-cs
seed: 0
fabrics: [{name: ib, type: ib}]
clusters:
  - name: c
    nodes:
      - {count: 2, gpu: h100-sxm, intra_node: nvlink4, nics: [{type: ib, model: connectx-7, count: 8, fabric: ib}]}
model: {name: gpt, num_layers: 4, hidden_size: 4096, num_attention_heads: 32, seq_length: 2048,
        vocab_size: 32000}
training:
  global_batch_size: 16
  micro_batch_size: 1
  precision: fp8
  fp8_recipe: %s
  sequence_parallel: %s
  flash_attention: true
  recompute: %s
parallel: {tensor: 8, pipeline: 1}
policies: [megatron, holmes]
"""


@pytest.mark.parametrize("recompute, backward_count", [("none", 2), ("full", 4)])
def test_each_gathered_cast_waits_for_a_tp_amax_all_reduce(recompute, backward_count):
    """TP 8 on NVLink 4 with SP: two 4-byte all-reduces per forward (QKV and fc1 inputs), two
    per backward (projection and fc2 output gradients), two more where the backward recomputes
    the forward; each the one-node all-reduce NCCL picks (ring LL). None without SP, none under
    delayed scaling."""
    costs = {}
    for recipe, sp in (("tensorwise", "true"), ("delayed", "true"), ("tensorwise", "false")):
        prepared = prepare_text(SCENARIO % (recipe, sp, recompute))
        plan, cluster = plan_policy(prepared, "megatron")
        costs[recipe, sp] = (OpCosts(cluster, prepared.workload, prepared.compute, plan.tp),
                             cluster.node(plan.rank_to_gpu[0].node))
    cs, node = costs["tensorwise", "true"]
    one = choose(_topology(node, 8), "all-reduce", 4.0)
    assert (one.algorithm, one.protocol) == ("ring", "LL")
    assert cs.amax_reductions_s(node, False) == pytest.approx(2 * one.time_s)
    assert cs.amax_reductions_s(node, True) == pytest.approx(backward_count * one.time_s)
    delayed, _ = costs["delayed", "true"]
    assert cs.tp_comm_layer_s(node, True) - delayed.tp_comm_layer_s(node, True) == \
        pytest.approx(backward_count * one.time_s)
    assert delayed.amax_reductions_s(node, True) == 0.0
    assert costs["tensorwise", "false"][0].amax_reductions_s(node, True) == 0.0


def _topology(node, members):
    link = node.intra_link
    lat = link.step_latency_s
    return CollectiveTopology(members, 1, link.bandwidth_bytes_per_s * link.efficiency, inf,
                              lat, lat, lat, "nvlink", link.nvls_efficiency)


def test_the_recipe_is_exported_and_the_fork_left_out():
    """`--fp8-recipe tensorwise` for upstream Megatron-LM; the Holmes fork's parser has no
    `--fp8-recipe` and its export is left out with the reason."""
    prepared = prepare_text(SCENARIO % ("tensorwise", "true", "none"))
    plan, cluster = plan_policy(prepared, "megatron")
    files = launch_files(plan, cluster, prepared.workload, "fp8").files
    parsed = parse(shlex.split(files["megatron_args.txt"]), UPSTREAM)
    assert parsed["--fp8-recipe"] == ["tensorwise"] and parsed["--fp8-format"] == ["hybrid"]
    assert "--fp8-recipe" not in FORK
    delayed = prepare_text(SCENARIO % ("delayed", "true", "none"))
    assert "--fp8-recipe" not in launch_files(*plan_policy(delayed, "megatron"),
                                              delayed.workload, "fp8").files["megatron_args.txt"]
    holmes, holmes_cluster = plan_policy(prepared, "holmes")
    fork = launch_files(holmes, holmes_cluster, prepared.workload, "fp8").files["holmes_args.txt"]
    assert fork.startswith("# not expressible") and "--fp8-recipe" in fork
    plain, plain_cluster = plan_policy(delayed, "holmes")
    assert not launch_files(plain, plain_cluster, delayed.workload, "fp8").files[
        "holmes_args.txt"].startswith("# not expressible")
