"""Context-parallel attention's transient buffers against closed forms read off Transformer
Engine's code (context_parallel.py at d0067d0), and the stage peak they raise: once, by what
exceeds the part of a layer stored after its attention."""

from __future__ import annotations

from dataclasses import replace

import pytest

from holmes_sim.cost.ops import OpCosts
from holmes_sim.estimate import memory
from holmes_sim.model import cp_buffers
from holmes_sim.model.workload import build_workload
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from holmes_sim.spec.job import ModelSpec, TrainingSpec

MIB = 2**20
# Multi-head attention, h 4096, 32 heads, f 4h, s 32,768 over CP 8 and TP 8 with SP, b 1, bf16:
# a rank holds 4,096 tokens, so O = 4,096 x 4,096/8 x 2 = 4 MiB (its queries or attention
# output), N = 2 O = 8 MiB (its K and V), S = 4 x 32/8 x 4,096 = 64 KiB (fp32 log-sum-exp).
MHA = ModelSpec(num_layers=4, hidden_size=4096, num_attention_heads=32, seq_length=32768)
TRAINING = TrainingSpec(global_batch_size=8, micro_batch_size=1, flash_attention=True,
                        sequence_parallel=True)
O, N, S = 4 * MIB, 8 * MIB, MIB / 16


def _workload(comm: str, recompute: str = "none", model: ModelSpec = MHA, tp: int = 8,
              cp: int = 8):
    return build_workload(model, replace(TRAINING, recompute=recompute), tp, cp, comm)


@pytest.mark.parametrize("comm,forward,backward", [
    # forward: rank 7's 8 ring chunks (p2p_comm_buffers), 8 partial outputs (out_per_step),
    # 8 + 1 statistics; backward: rank 0's dq_buffer, two [K/V, dK/dV] buffers, an
    # upper-triangle step's Q/O/dO halves, half dQ, whole dK/dV, half statistics
    ("p2p", 8 * N + 8 * O + 9 * S, O + 4 * N + (3 * O / 2 + O / 2 + N) + S / 2),
    # forward: k_ag/v_ag (8 N) and, at V's index_select, V as gathered (4 N) less the output
    # not yet made (larger than the later zeroed `out`, two half outputs and statistics);
    # backward: dq, dk/dv of the whole sequence, k_ag/v_ag, the per-step grads, one reordered dK
    ("allgather", 8 * N + 4 * N - O, O + 8 * N + 8 * N + (O + 17 * N / 2) + 4 * N),
    # forward: Q, K, V each as head-major copy, all-to-all output, reordered copy, less the
    # output and the output before the all-to-all not yet made; backward: dO reordered, the
    # kernel's dQ/dK/dV and their three copies in the all-to-all back
    ("a2a", 3 * (O + N) - 2 * O, O + 4 * (O + N)),
])
def test_buffers_are_te_allocations(comm, forward, backward):
    assert cp_buffers.buffer_bytes(_workload(comm), 8) == (forward, backward)


def test_a2a_forward_holds_the_output_before_its_all_to_all_under_recomputation():
    """Not a stored activation once recomputed, so beside the output's all-to-all it counts:
    reordered Q, K, V, the output's reordered copy and all-to-all output, and it."""
    for recompute in ("selective", "full"):
        assert cp_buffers.buffer_bytes(_workload("a2a", recompute), 8)[0] == \
            max(3 * (O + N) - O, (O + N) + 2 * O + O)


def test_tail_is_what_a_layer_stores_after_its_attention():
    """SP, f = 4h, dropout: the second norm's and fc1's inputs (2 + 2 bytes an element), two
    1-byte dropout masks, the MLP's GeLU and fc2 inputs (2 x 4 + 2 x 4), over t: 22 s b h/(cp t)."""
    tail = 22 * 4096 * 4096 / 8
    for comm in ("p2p", "allgather", "a2a"):
        assert cp_buffers.tail_bytes(_workload(comm), 8) == tail
        assert cp_buffers.tail_bytes(_workload(comm, "selective"), 8) == tail
        assert cp_buffers.tail_bytes(_workload(comm, "full"), 8) == 0
    assert cp_buffers.peak_bytes(_workload("p2p"), 8) == 8 * N + 8 * O + 9 * S - tail


def test_grouped_query_attention_at_cp_2_adds_nothing():
    """Llama-3-70B's shape at TP 4 CP 2 (the published NeMo row): K and V are 1/8 of Q, and the
    MLP stores more after the attention than the ring's buffers hold."""
    llama = ModelSpec(num_layers=4, hidden_size=8192, num_attention_heads=64,
                      num_query_groups=8, seq_length=8192, ffn_hidden_size=28672, swiglu=True,
                      hidden_dropout=0.0, attention_dropout=0.0)
    w = _workload("p2p", model=llama, tp=4, cp=2)
    forward, backward = cp_buffers.buffer_bytes(w, 4)
    assert (forward, backward) == (40.75 * MIB, 68.125 * MIB)
    assert cp_buffers.tail_bytes(w, 4) == 200 * MIB
    assert cp_buffers.peak_bytes(w, 4) == 0
    assert cp_buffers.peak_bytes(_workload("p2p", cp=1), 8) == 0


SCENARIO = """name: cp-memory
fabrics: [{{name: ib, type: ib}}]
clusters:
  - name: c
    nodes:
      - {{count: 8, gpu: h100-sxm, gpus_per_node: 8,
         nics: [{{type: ib, bandwidth_gbit_per_s: 400, count: 8, fabric: ib}}]}}
model: {{num_layers: 8, hidden_size: 4096, num_attention_heads: 32, seq_length: 32768,
        vocab_size: 32000, tie_embeddings: false}}
training: {{global_batch_size: 8, micro_batch_size: 1, flash_attention: true,
           sequence_parallel: true}}
parallel: {{tensor: 8, pipeline: 2, context: {cp}, cp_comm_type: {comm}}}
policies: [megatron]
"""


@pytest.mark.parametrize("comm", ["p2p", "allgather", "a2a"])
def test_cp_plan_peak_grows_by_the_buffers(write_scenario, monkeypatch, comm):
    """PP 2 of a CP 4 plan: the first stage's peak is its in-flight layers' activations plus
    `peak_bytes`, once; the last stage's only by what exceeds its output layer and loss, which
    are not alive with them."""
    prepared = prepare(write_scenario(SCENARIO.format(cp=4, comm=comm)))
    plan, cluster = plan_policy(prepared, "megatron")
    w = prepared.workload
    costs = OpCosts(cluster, w, prepared.compute, plan.tp)
    added = cp_buffers.peak_bytes(w, plan.tp)
    assert added > 10 * MIB
    with_buffers = memory._memory_report(plan, cluster, w, costs).per_stage_bytes
    monkeypatch.setattr(cp_buffers, "peak_bytes", lambda *_: 0.0)
    without = memory._memory_report(plan, cluster, w, costs).per_stage_bytes
    assert with_buffers[0] - without[0] == pytest.approx(added, rel=1e-12)
    beyond_output = max(0.0, added - w.output_activation_bytes(plan.tp))
    assert with_buffers[1] - without[1] == pytest.approx(beyond_output, abs=1e-3)
