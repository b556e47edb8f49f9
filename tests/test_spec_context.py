"""Context-parallel settings in a scenario: each bad value is one ScenarioError naming the field
and the fix."""

from __future__ import annotations

import pytest

from holmes_sim.errors import ScenarioError
from holmes_sim.prepare import prepare
from tests.sim.test_context_parallel import cp_scenario


def _error(write_scenario, text: str) -> str:
    with pytest.raises(ScenarioError) as info:
        prepare(write_scenario(text))
    return str(info.value)


def test_defaults_are_no_cp_and_p2p(write_scenario):
    text = cp_scenario(cp=2, global_batch=4).replace(", context: 2, cp_comm_type: p2p", "")
    prepared = prepare(write_scenario(text))
    assert prepared.cp == 1 and prepared.workload.cp_comm_type == "p2p"
    assert prepared.scenario.parallel.context == 1


def test_context_must_be_positive(write_scenario):
    msg = _error(write_scenario, cp_scenario(cp=0))
    assert "parallel.context" in msg and "at least 1" in msg


def test_unknown_comm_type_lists_the_known_ones(write_scenario):
    msg = _error(write_scenario, cp_scenario(cp=2, comm="ring"))
    assert "parallel.cp_comm_type" in msg and "p2p" in msg and "a2a" in msg and "allgather" in msg


def test_context_must_divide_the_gpus_with_tp_and_pp(write_scenario):
    msg = _error(write_scenario, cp_scenario(tp=8, pp=2, cp=4))  # 64 of 32 GPUs
    assert "parallel.context" in msg and "does not divide the 32 GPUs" in msg


def test_data_degree_counts_cp(write_scenario):
    text = cp_scenario(tp=8, cp=2).replace("context: 2,", "context: 2, data: 4,")
    msg = _error(write_scenario, text)
    assert "parallel.data" in msg and "set data: 2" in msg


def test_sequence_must_split_into_two_chunks_per_rank(write_scenario):
    msg = _error(write_scenario, cp_scenario(cp=4, seq=8196))  # 8196 % 8 = 4
    assert "parallel.context" in msg and "multiple of 2 x context = 8" in msg


def test_cp_needs_fused_attention(write_scenario):
    text = cp_scenario(cp=2).replace("flash_attention: true", "flash_attention: false")
    msg = _error(write_scenario, text)
    assert "training.flash_attention" in msg and "TEDotProductAttention" in msg


def test_a2a_needs_heads_per_rank_divisible_by_cp(write_scenario):
    msg = _error(write_scenario, cp_scenario(tp=8, cp=4, comm="a2a"))  # 1 KV group per rank
    assert "parallel.cp_comm_type" in msg and "query groups / tensor = 1" in msg
