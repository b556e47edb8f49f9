"""The transient buffers of context-parallel attention, as Transformer Engine allocates them, and
what they add to a stage's peak memory (`estimate.memory`).

Source: [TE] transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py at
d0067d0 (`AttnFuncWithCPAndKVP2P`, `AttnFuncWithCPAndKVAllGather`, `AttnFuncWithCPAndQKVOA2A`),
BF16/FP16 attention (the only kind exported) in Megatron-Core's sbhd layout. Per GPU of a TP
group, d bytes per value, a CP rank's s/cp tokens:

    O = b (s/cp)(h/t) d         its queries, or its attention output
    N = 2 b (s/cp)(k/t) d       its K and V (k = h g / a)
    S = 4 b (a/t)(s/cp)         the fp32 softmax statistics (log-sum-exp) of its queries

Each function's buffers are counted at the point where most are alive, at the worst CP rank
(a stage's GPUs all hold one), beyond the layer's tensors the peak already counts (its Q, K, V
and attention output, less those not yet made at that point):

- p2p forward, rank cp - 1, while it merges the steps: the cp K/V chunks of the ring
  (`p2p_comm_buffers`, kept in a list until it returns), cp partial outputs and cp statistics
  (`out_per_step`, `softmax_lse_per_step`) and the merged statistics (`softmax_lse`):
  cp N + cp O + (cp + 1) S.
- p2p backward, rank 0: dQ (`dq_buffer`), the two [K/V, dK/dV] ring buffers (`p2p_comm_buffers`,
  4 N), and in an upper-triangle step (rank 0's first cp - 1) the copies of the second half of
  Q, O and dO (`.contiguous()`, 3 O/2), the kernel's half dQ and whole dK, dV (O/2 + N) and the
  second half of the statistics (S/2): 3 O + 5 N + S/2.
- allgather forward: the gathered, reordered K and V of the whole sequence (`k_ag`, `v_ag`,
  cp N) with, at V's `index_select`, V as gathered (cp N/2, before the output exists: - O), or
  later the zeroed accumulator `out`, the two half outputs and statistics (2 O + S):
  cp N + max(cp N/2 - O, 2 O + S).
- allgather backward: dQ, the whole sequence's dK and dV (cp N, zeroed), `k_ag` and `v_ag`
  again (cp N), each step's dQ half and dK, dV over the K/V it sees (O + (2 cp + 1) N/2, kept
  in `dq_per_step`, `dk_per_step`, `dv_per_step`) and at the reorder of dK and dV before their
  reduce-scatter one reordered copy (cp N/2): 2 O + (7 cp + 1) N/2.
- a2a forward: `flash_attn_a2a_communicate` on Q, K and V keeps each one's head-major copy, the
  all-to-all's output (held by its NCCL work until it returns) and the reordered copy, 3 (O + N),
  before the outputs exist (- O, and - O more for the output before the all-to-all, a stored
  activation without recomputation); on the output, a reordered copy and the all-to-all's
  output (2 O) beside the reordered Q, K, V (O + N) and, under recomputation, the output before
  it (O): max(3 (O + N) - O - [no recomputation] O, O + N + 2 O + [recomputation] O).
- a2a backward: dO reordered (O), the kernel's dQ, dK, dV (O + N) and, in the all-to-all back,
  their reordered copies, the all-to-all's outputs and the final copies: O + 4 (O + N).

They add to the peak once, not per layer, and only beyond what the peak already holds: the
last layer's attention forward runs before that layer stores what follows its attention output
(the projection's dropout mask, the second norm's input, the MLP's activations), and the first
backward's attention runs after they are freed. So the stage peak's in-flight activations
gain max(0, B - T), B the larger of the forward's and the backward's buffers, T what one layer
stores after its attention output (`tail_bytes`; 0 under full recomputation, where a layer
stores only its input). Not counted: FP8 attention's buffers, the kernels' workspaces, the
activation gradients the backward passes between layers, and a recomputed attention's working
set, which the model does not count for any plan.
"""

from __future__ import annotations

from holmes_sim.model.workload import Workload


def buffer_bytes(w: Workload, tp: int) -> tuple[float, float]:
    """(forward, backward) transient bytes of one layer's CP attention on one GPU of TP degree
    `tp`, at the worst CP rank (see the module); (0, 0) without CP."""
    cp = w.cp
    if cp == 1:
        return 0.0, 0.0
    rows = w.micro_batch * w.tokens * w.dtype_bytes  # b (s/cp) d
    o, n = rows * w.hidden / tp, 2 * rows * w.kv_width / tp
    lse = 4 * w.micro_batch * w.heads / tp * w.tokens
    if w.cp_comm_type == "p2p":
        return cp * n + cp * o + (cp + 1) * lse, 3 * o + 5 * n + lse / 2
    if w.cp_comm_type == "allgather":
        return cp * n + max(cp * n / 2 - o, 2 * o + lse), 2 * o + (7 * cp + 1) * n / 2
    qkv, stored = o + n, w.recompute == "none"  # the output before the all-to-all is stored
    return max(3 * qkv - o - stored * o, qkv + 2 * o + (not stored) * o), o + 4 * qkv


def tail_bytes(w: Workload, tp: int) -> float:
    """Bytes one layer stores after its attention output (`Workload.activation_bytes_per_layer`
    less what it stores up to it: the first norm's input and the QKV input, replicated over TP
    without sequence parallelism, 2 d b (s/cp) h, and Q, K, V and the attention output, split,
    2 d b (s/cp)(h + k)/t, with a2a its output before the all-to-all); 0 under full
    recomputation."""
    if w.full_recompute:
        return 0.0
    rows = w.micro_batch * w.tokens * w.dtype_bytes
    replicated = 2 * rows * w.hidden / (tp if w.sequence_parallel else 1)
    split = 2 * rows * (w.hidden + w.kv_width) / tp
    pre_a2a = rows * w.hidden / tp if w.cp_comm_type == "a2a" and w.recompute == "none" else 0.0
    return max(0.0, w.activation_bytes_per_layer(tp) - replicated - split - pre_a2a)


def peak_bytes(w: Workload, tp: int) -> float:
    """What CP attention's buffers add to a stage's peak memory per GPU: max(0, B - T), B the
    larger of `buffer_bytes`, T `tail_bytes` (see the module); 0 without CP."""
    if w.cp == 1:
        return 0.0
    return max(0.0, max(buffer_bytes(w, tp)) - tail_bytes(w, tp))
