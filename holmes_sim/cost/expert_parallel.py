"""Expert parallelism (EP) as Megatron-Core runs it with the all-to-all token dispatcher: what one
GPU of an EP group of degree ep sends per MoE layer, and the closed form of one all-to-all that
the engine and the estimate share.

Megatron-Core numbers a pipeline stage's t x cp x dp ranks a second time for the experts
(`initialize_model_parallel`, megatron/core/parallel_state.py: a `RankGenerator` of order
"tp-ep-dp-pp" over expert_tensor_parallel_size etp x expert_model_parallel_size ep x
expert_data_parallel_size edp): the stage-local rank r = etp_rank + etp (ep_rank + ep edp_rank),
so an EP group is the ep ranks r with the same etp_rank and edp_rank, each with E/ep of the routed
experts. With etp = t it holds the same TP rank of ep consecutive replicas (TP groups); with
etp = t/q (q = `Workload.tp_per_etp`) it spans ep/q replicas (`Workload.ep_replicas`), q of
its GPUs in each, so a GPU has q - 1 of its ep - 1 peers in its own TP group, on the node's
intra-node link, and q in each other TP group of the EP group.
`MoEAlltoAllTokenDispatcher` (megatron/core/transformer/moe/token_dispatcher.py) sends every
routed copy of a token to the rank that holds its expert before the experts (dispatch) and back
after them (combine), each an all-to-all over the EP group; the backward moves the gradients the
same way, so an MoE layer has 2 all-to-alls forward and 2 backward per micro-batch, none of them
overlapped with compute. Full recomputation re-runs each whole layer's forward in the backward
(megatron/core/recompute.py `checkpointed_forward` wraps the layers in
`tensor_parallel.checkpoint`), the MoE layer's dispatch and combine included, so a backward then
has 4 (`exchanges_per_op`). Selective recomputation's default modules (`recompute_modules`
["core_attn"], megatron/core/transformer/transformer_config.py) redo no all-to-all, nor does
"moe_act" (the experts' activation, megatron/core/transformer/moe/experts.py); "moe" (and the
deprecated `--moe-layer-recompute`) checkpoints the MoE layer's route, dispatch, experts and
combine (megatron/core/transformer/moe/moe_layer.py) and would redo both: the workload's
`recompute` modes do not express it.

Megatron-Core requires sequence parallelism with TP and MoE, so a GPU routes its own M/t of the
micro-batch's M = b s tokens (s/cp with CP), whatever etp:

    B = (M / t) k h d   bytes of routed token copies per GPU (k = router top-k, h hidden,
                        d bytes per element; t = 1 without sequence parallelism)

of which 1/ep stays on the GPU and (ep - 1)/ep leaves it, B/ep to each peer. Megatron-Core
calls `torch.distributed.all_to_all_single` (megatron/core/tensor_parallel/mappings.py
`_AllToAll`), which runs it as one NCCL group of a send and a receive per peer
(torch/csrc/cuda/nccl.cpp `all2all_single_equal_split`: ncclGroupStart, ncclSend/ncclRecv,
ncclGroupEnd; nccl-tests src/alltoall.cu the same), all peers at once, so on an idle fabric
with every peer behind the same kind of path of per-GPU rate r and step latency alpha:

    T = (ep - 1) alpha + (ep - 1)/ep B / r        (the pairwise exchange's alpha-beta cost,
                                                   Thakur et al. 2005, all-to-all)

A TP group sends t q B/ep to each other TP group of its EP group (its t GPUs' q peers there);
its GPUs' q - 1 peers in the group itself take (q - 1) alpha + (q - 1) B/ep / r_local on the
intra-node link, at once with the rest (`local_exposed_s`).

Dropless routing sends M k rows; with a capacity factor the copies an expert drops beyond its
capacity are not sent (`MoeShape.routed_rows` of the GPU's M/t tokens). A model whose MoE
layers are every n-th layer is priced per layer at the mean (`MoeShape.moe_fraction`), as
`cost.moe` does for the MLP.
"""

from __future__ import annotations

from collections.abc import Sequence

from holmes_sim.model.workload import Workload

ALLTOALLS_PER_PASS = 2
"""All-to-alls per MoE layer in one exchange: dispatch and combine, or their gradients [module]."""


def exchanges_per_op(w: Workload, backward: bool) -> int:
    """Exchanges (`ALLTOALLS_PER_PASS` all-to-alls per MoE layer) of a forward op (1) or a
    backward op: the gradients' (1), after the recomputed forward's under full recomputation (2)
    [module]."""
    return 2 if backward and w.full_recompute else 1


def token_bytes(w: Workload, tp: int) -> float:
    """B: bytes of routed token copies one GPU holds before the dispatch of one MoE layer for one
    micro-batch (module docstring)."""
    moe = w.moe
    if moe is None:
        return 0.0
    tokens = w.micro_batch * w.tokens / (tp if w.sequence_parallel else 1)
    return moe.routed_rows(round(tokens)) * w.hidden * w.dtype_bytes


def alltoall_s(bytes_per_gpu: float, ep: int, rate_bytes_per_s: float, step_latency_s: float
               ) -> float:
    """T = (ep - 1) alpha + (ep - 1)/ep B / r: one all-to-all of B bytes per GPU over an EP group
    of ep GPUs whose every peer is reached at r bytes/s per GPU (module docstring)."""
    if ep == 1 or bytes_per_gpu <= 0:
        return 0.0
    return (ep - 1) * step_latency_s + (ep - 1) / ep * bytes_per_gpu / rate_bytes_per_s


def peer_bytes(w: Workload, tp: int, ep: int, layers: int) -> float:
    """Bytes one GPU sends to each EP peer over `layers` layers' all-to-alls of one exchange
    (`exchanges_per_op`): 2 x moe_fraction x layers x B/ep."""
    if ep == 1 or w.moe is None:
        return 0.0
    return ALLTOALLS_PER_PASS * layers * w.moe.moe_fraction * token_bytes(w, tp) / ep


def pass_latency_s(w: Workload, ep: int, layers: int, step_latency_s: float) -> float:
    """The (ep - 1) alpha steps of `layers` layers' all-to-alls of one exchange."""
    if ep == 1 or w.moe is None:
        return 0.0
    return ALLTOALLS_PER_PASS * layers * w.moe.moe_fraction * (ep - 1) * step_latency_s


def op_exposed_s(w: Workload, tp: int, ep: int, layers: int, rate_bytes_per_s: float,
                 step_latency_s: float) -> float:
    """Seconds the all-to-alls of `layers` layers add to an op per exchange (`exchanges_per_op`)
    when every peer is reached at `rate_bytes_per_s` per GPU: 2 x moe_fraction x layers x T."""
    if ep == 1 or w.moe is None:
        return 0.0
    return ALLTOALLS_PER_PASS * layers * w.moe.moe_fraction * alltoall_s(
        token_bytes(w, tp), ep, rate_bytes_per_s, step_latency_s)


def group_peer_bytes(w: Workload, tp: int, layers: int) -> float:
    """Bytes a TP group of t GPUs sends to each other TP group of its EP group over `layers`
    layers' all-to-alls of one exchange: t q `peer_bytes` (module docstring)."""
    return tp * w.tp_per_etp * peer_bytes(w, tp, w.ep, layers)


def local_exposed_s(w: Workload, tp: int, layers: int, rate_bytes_per_s: float,
                    step_latency_s: float) -> float:
    """Seconds one exchange of `layers` layers takes to a GPU's q - 1 EP peers inside its own
    TP group at `rate_bytes_per_s` per GPU on the intra-node link (module docstring); 0 when
    etp = t (q = 1)."""
    q = w.tp_per_etp
    if q == 1 or w.ep == 1 or w.moe is None:
        return 0.0
    passes = ALLTOALLS_PER_PASS * layers * w.moe.moe_fraction
    return passes * (q - 1) * (step_latency_s + token_bytes(w, tp) / w.ep / rate_bytes_per_s)


def sends_exposed_s(w: Workload, tp: int, layers: int,
                    sends: Sequence[tuple[float, float]], local_s: float = 0.0) -> float:
    """Seconds one exchange of `layers` layers adds to an op of a TP group of t GPUs whose send
    to each other TP group of its EP group has (latency s, rate bytes/s for the t GPUs together)
    in `sends` while every EP group sends at once: the last peer's latency steps plus its
    `group_peer_bytes` at its rate (`op_exposed_s` when every rate is t r and etp = t), or the
    sends inside the TP group (`local_s`, `local_exposed_s`) if they end later."""
    if w.ep == 1 or w.moe is None:
        return 0.0
    size = group_peer_bytes(w, tp, layers)
    return max([local_s] + [pass_latency_s(w, w.ep, layers, latency) + size / rate
                            for latency, rate in sends])
