"""Context-parallel settings in a scenario: each bad value is one ScenarioError naming the field
and the fix."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.errors import ScenarioError
from holmes_sim.prepare import prepare
from holmes_sim.search.planner import layouts
from holmes_sim.search.rejections import Rejections
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


@pytest.mark.parametrize("cp,seq,tokens", [(4, 8200, "8200 / context=4 = 2050 tokens"),
                                           (1, 8196, "8196 tokens")])
def test_sequence_parallel_needs_each_ranks_tokens_split_evenly_over_tp(write_scenario, cp, seq,
                                                                          tokens):
    """Megatron-Core's `_split_along_first_dim` asserts seq_length / context divisible by the TP
    size under sequence parallelism: `check` refuses it with one line at the training mapping,
    and writes nothing."""
    text = cp_scenario(tp=8, cp=cp, seq=seq, global_batch=4,
                       extra_training=", sequence_parallel: true")
    path = write_scenario(text)
    before = set(path.parent.iterdir())
    result = CliRunner().invoke(app, ["check", str(path)])
    line = next(i for i, row in enumerate(text.splitlines(), 1) if row.startswith("training:"))
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output
    message = " ".join(result.output.split())
    assert message.startswith(f"error: {path}:{line}: training.sequence_parallel: "
                              f"model.seq_length={tokens} are not a multiple of tensor=8"), message
    assert "_split_along_first_dim" in message and "set sequence_parallel: false" in message
    assert f"multiple of {8 * cp}" in message
    assert set(path.parent.iterdir()) == before
    assert prepare(write_scenario(text.replace("sequence_parallel: true",
                                               "sequence_parallel: false"))).tp == 8


def test_the_planner_skips_sequence_parallel_where_tp_does_not_split_the_tokens(write_scenario):
    """seq_length 8196 splits over TP 4 (2049 tokens a rank) but not TP 8: the search keeps TP 8
    without SP only, and says why when SP is all it may use."""
    search = ("search: {{tensor: {tp}, pipeline: [1], micro_batch_size: [1], recompute: [none], "
              "sequence_parallel: {sp}, schedule: [1f1b]}}\n")
    text = cp_scenario(tp=8, cp=1, seq=8196, global_batch=8)
    prepared = prepare(write_scenario(text + search.format(tp="[4, 8]", sp="[false, true]")))
    found = {(lay.tp, lay.sequence_parallel) for lay in layouts(prepared, prepared.scenario.search)}
    assert found == {(4, False), (4, True), (8, False)}
    prepared = prepare(write_scenario(text + search.format(tp="[8]", sp="[true]")))
    rejections = Rejections(prepared.scenario.search)
    assert not list(layouts(prepared, prepared.scenario.search, rejections))
    summary = rejections.summary()
    assert "training.sequence_parallel: model.seq_length=8196 tokens are not a multiple of " \
        "tensor=8" in summary and "widen search.sequence_parallel, search.tensor" in summary


def test_an_moe_model_is_not_told_to_turn_sequence_parallelism_off(write_scenario):
    """An MoE model at TP > 1 must run sequence parallelism (Megatron-Core's MoELayer), so the
    uneven split's fix leaves `sequence_parallel: false` out (check refused what it said)."""
    path = write_scenario("""name: moe-sp
fabrics: [{name: ib, type: ib}]
clusters:
  - name: lab
    nodes:
      - {count: 2, gpu: h100-sxm, nics: [{type: ib, model: ib-ndr, count: 8, fabric: ib},
                                         {type: ethernet, model: eth-100g}]}
model: {preset: qwen1.5-moe-a2.7b, seq_length: 4097}
training: {global_batch_size: 64, micro_batch_size: 1, flash_attention: true,
           sequence_parallel: true, recompute: selective}
parallel: {tensor: 2, pipeline: 1, expert: 4}
policies: [megatron, holmes]
""")
    result = CliRunner().invoke(app, ["check", str(path)])
    message = " ".join(result.output.split())
    assert result.exit_code == 2 and "model.seq_length=4097 tokens are not a multiple" in message
    assert "sequence_parallel: false" not in message
    assert "use a seq_length that is a multiple of 2, or another tensor degree" in message


def test_an_empty_comm_type_is_said_to_be_empty(write_scenario):
    """`cp_comm_type:` left empty reads as null; the message said "'None' is not allowed", a
    value the file does not hold."""
    from tests.conftest import SCENARIOS

    text = (SCENARIOS / "mixed_ib_eth.yaml").read_text()
    assert text.count("  schedule: 1f1b\n") == 1
    path = write_scenario(text.replace("  schedule: 1f1b\n", "  schedule: 1f1b\n  cp_comm_type:\n"))
    result = CliRunner().invoke(app, ["check", str(path)])
    assert result.exit_code == 2
    assert " ".join(result.output.split()).endswith(
        "parallel.cp_comm_type: nothing (null) is not allowed (expected one of: p2p, a2a, "
        "allgather)")
