"""The out-of-memory hint names only the changes still open to the scenario: no lower
micro-batch below 1, no full recomputation twice, a higher tensor, pipeline, expert or context
degree only where the scenario would accept it, and the distributed optimizer where it is off."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.metrics import memory_fix
from holmes_sim.prepare import prepare_text
from tests.conftest import small_scenario

DSV3 = """name: dsv3
fabrics: [{name: ib, type: ib}]
clusters:
- name: c
  nodes:
  - {name: n, count: 64, gpu: h100-sxm, intra_node: nvlink4,
     nics: [{type: ib, model: connectx-7, count: 8, fabric: ib}, {type: ethernet, model: eth-100g}]}
model: {preset: deepseek-v3}
training: {global_batch_size: 512, micro_batch_size: 1, sequence_parallel: true,
           flash_attention: true, recompute: full}
parallel: {tensor: 8, pipeline: 8}
policies: [megatron, holmes]
"""


def test_check_of_an_moe_model_at_its_limits_names_only_pipeline_and_expert(write_scenario):
    # It said "lower training.micro_batch_size, set training.recompute: full, or raise
    # parallel.tensor / parallel.pipeline" at micro-batch 1, recompute full and TP 8 of 8 GPUs,
    # and never parallel.expert (deepseek-v3 fits at expert 4).
    result = CliRunner().invoke(app, ["check", str(write_scenario(DSV3))])
    assert result.exit_code == 2
    assert "does not fit in GPU memory" in result.output
    assert result.output.rstrip().endswith("; raise parallel.pipeline or raise parallel.expert")


@pytest.mark.parametrize("change,fix", [
    ("training: {global_batch_size: 16, micro_batch_size: 1, distributed_optimizer: false}",
     "set training.distributed_optimizer: true"),
    ("training: {global_batch_size: 16, micro_batch_size: 2}", "lower training.micro_batch_size"),
])
def test_each_open_training_setting_is_named(change, fix):
    text = small_scenario(tp=2, pp=2).replace(
        "training: {global_batch_size: 16, micro_batch_size: 1}", change)
    assert fix in memory_fix(prepare_text(text))


def test_context_parallelism_is_named_for_a_long_sequence_only():
    short = memory_fix(prepare_text(small_scenario(tp=8, seq=1024)))
    long = memory_fix(prepare_text(small_scenario(nodes_ib=4, tp=8, seq=16384).replace(
        "micro_batch_size: 1}", "micro_batch_size: 1, flash_attention: true}")))
    assert "parallel.context" not in short and "parallel.tensor" not in short
    assert long == ("set training.recompute: full, raise parallel.pipeline or raise "
                    "parallel.context")


def test_a_tensor_degree_the_heads_refuse_is_not_offered():
    # 12 heads at TP 4 on 8-GPU nodes: TP 8 would fit the node but not the heads, and `check`
    # refuses it; it was offered ("raise parallel.tensor") because 2 x 4 <= 8.
    fix = memory_fix(prepare_text(small_scenario(nodes_ib=1, tp=4, pp=1, heads=12, hidden=1536)))
    assert "parallel.tensor" not in fix and "raise parallel.pipeline" in fix


def test_no_degree_is_offered_without_gpus_to_give_it():
    # One 8-GPU node at TP 8, PP 1: data parallelism is 1, so a higher pipeline or context
    # degree needs GPUs the scenario does not have; pipeline was offered.
    one_node = small_scenario(nodes_ib=1, tp=8, pp=1, seq=16384).replace(
        "micro_batch_size: 1}", "micro_batch_size: 1, flash_attention: true}")
    assert memory_fix(prepare_text(one_node)) == "set training.recompute: full"
    at_limit = one_node.replace("flash_attention: true}", "flash_attention: true, recompute: full}")
    assert memory_fix(prepare_text(at_limit)).endswith("use GPUs with more memory or more GPUs")


def test_the_distributed_optimizer_is_named_only_where_megatron_runs():
    # Holmes always shards its optimizer state: the switch changes nothing for it.
    text = small_scenario(tp=2, pp=2).replace(
        "micro_batch_size: 1}", "micro_batch_size: 1, distributed_optimizer: false}")
    assert "distributed_optimizer" in memory_fix(prepare_text(text))
    holmes_only = text.replace("policies: [megatron, holmes]", "policies: [holmes]")
    assert "distributed_optimizer" not in memory_fix(prepare_text(holmes_only))


def test_a_written_data_degree_is_named_with_the_degree_that_must_take_its_gpus():
    # With parallel.data written, check refused the raised tensor or pipeline degree the hint
    # offered (tensor x pipeline x data no longer the GPU count).
    text = small_scenario(tp=2, pp=2).replace("pipeline: 2,", "pipeline: 2, data: 4,")
    assert "raise parallel.pipeline (removing parallel.data)" in memory_fix(prepare_text(text))


def test_a_lower_micro_batch_is_named_only_where_the_batch_allows_it():
    # 32,768 sequences at micro-batch 2 on one data-parallel rank: micro-batch 1 would make
    # 32,768 micro-batches, past the 16,384 simulated, and check refuses it.
    text = small_scenario(nodes_ib=1, tp=8, pp=1, global_batch=32768, micro=2)
    assert "micro_batch_size" not in memory_fix(prepare_text(text))
    assert "lower training.micro_batch_size" in memory_fix(prepare_text(
        small_scenario(nodes_ib=1, tp=8, pp=1, global_batch=64, micro=2)))
