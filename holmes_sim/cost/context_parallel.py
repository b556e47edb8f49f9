"""Context parallelism (CP) as Megatron-Core runs it: what one GPU of a CP group of degree cp
sends for a layer's attention, how much of it hides behind the attention compute, and the closed
forms the engine and the estimate share.

A CP group's ranks each hold s/cp tokens of every sequence, as two chunks of s/(2cp) (rank r
holds chunks r and 2cp - 1 - r), so that under the causal mask every rank does 1/cp of the
attention work (Megatron-Core `get_batch_on_this_cp_rank`, megatron/core/utils.py; NVIDIA
Megatron-Core "Context parallelism" guide). Everything but attention is local to a rank; the
attention needs the other ranks' keys and values, exchanged one of three ways (`--cp-comm-type`,
Transformer Engine `transformer_engine/pytorch/attention.py`):

- p2p, ring attention (`AttnFuncWithCPAndKVP2P`; Liu et al. 2023, arXiv 2310.01889): cp steps;
  in step i a rank computes attention of its queries against the K/V chunk it holds while it
  sends that chunk to the next rank of the ring and receives the previous rank's. With the
  balanced chunks every step is 1/cp of the rank's attention, C. A K/V chunk is
  N = 2 b (s/cp) (k/t) d bytes per GPU (k = h g / a the K and V width, t the TP degree, d bytes
  per element); T(n) = alpha + n / rate. The forward's step i < cp - 1 sends step i + 1's chunk
  beside its compute, the last step none: (cp - 1) max(C, T(N)) + C. The backward (non-FP8
  attention, the only kind exported) sends in every step and waits for it within the step:
  step 0 K/V only, steps 1 .. cp - 2 K/V and the dK/dV accumulated so far (2N), step cp - 1
  dK/dV only: max(C, T(N)) + (cp - 2) max(C, T(2N)) + max(C, T(N)).
- a2a, Ulysses (`AttnFuncWithCPAndQKVOA2A`; Jacobs et al. 2023, arXiv 2309.14509, section 3):
  an all-to-all turns the sequence split of Q, K, V into a head split before attention and one
  turns the output back after it; each GPU sends (cp - 1)/cp of b (s/cp)(2h + 2k)/t d bytes in
  2 (cp - 1) pairwise steps, not overlapped; the backward moves the gradients the same way.
- allgather (`AttnFuncWithCPAndKVAllGather`): K and V of the whole sequence are all-gathered
  before attention, (cp - 1) K/V chunks per GPU in cp - 1 ring steps (the ring all-gather's
  alpha-beta cost, Thakur et al. 2005); the backward gathers them again and reduce-scatters dK/dV,
  twice that; not overlapped.

The attention compute itself is priced with the layer (`cost.transformer`, 1/cp of the causal
attention a rank); what this module adds to an op is the exchange's exposed time.
"""

from __future__ import annotations

from dataclasses import dataclass

from holmes_sim.hardware.catalog import GpuModel
from holmes_sim.cost.transformer import attention_core_s, layer_kernels
from holmes_sim.memo import IdentityMemo
from holmes_sim.model.workload import Workload

CP_COMM_TYPES = ("p2p", "a2a", "allgather")


@dataclass(frozen=True, slots=True)
class CpPass:
    """One layer's CP exchange in one forward or backward pass, per GPU.

    Attributes:
        step_s: attention compute of one ring step (1/cp of the pass's attention), seconds.
        ring_bytes: bytes a GPU sends in each ring step that overlaps a transfer with its
            compute, in step order (p2p only; see the module).
        exposed_bytes: bytes a GPU sends with no compute to hide behind (a2a, allgather).
        exposed_hops: latency-bearing steps of that exposed exchange.
    """

    step_s: float
    ring_bytes: tuple[float, ...]
    exposed_bytes: float
    exposed_hops: int


def kv_chunk_bytes(w: Workload, tp: int) -> float:
    """K and V of a rank's s/cp tokens on one GPU of its TP group: 2 b (s/cp) (k/t) d bytes."""
    return 2.0 * w.micro_batch * w.tokens * w.kv_width / tp * w.dtype_bytes


def cp_pass(gpu: GpuModel, w: Workload, tp: int, backward: bool) -> CpPass:
    """The CP exchange of one layer's forward or backward on one GPU (see the module)."""
    cp = w.cp
    step = attention_core_s(gpu, layer_kernels(w, tp), w.dtype_bytes, backward) / cp
    kv = kv_chunk_bytes(w, tp)
    scale = 2 if backward else 1
    if w.cp_comm_type == "p2p":
        return CpPass(step, ring_bytes(cp, kv, backward), 0.0, 0)
    if w.cp_comm_type == "a2a":
        qkvo = w.micro_batch * w.tokens * (2 * w.hidden + 2 * w.kv_width) / tp * w.dtype_bytes
        return CpPass(step, (), (cp - 1) / cp * qkvo, 2 * (cp - 1))
    return CpPass(step, (), scale * (cp - 1) * kv, scale * (cp - 1))


def ring_bytes(cp: int, kv: float, backward: bool) -> tuple[float, ...]:
    """Bytes of each ring step's transfer, `kv` a K/V chunk: the forward's first cp - 1 steps
    send K/V; the backward's first K/V, the middle cp - 2 K/V and dK/dV, the last dK/dV
    (`AttnFuncWithCPAndKVP2P.backward`: `send_tensor[0]` at i = 0, `send_tensor[1]` at
    i = cp - 1, the whole [K/V, dK/dV] buffer between)."""
    if not backward:
        return (kv,) * (cp - 1)
    return (kv,) + (2 * kv,) * (cp - 2) + (kv,)


def cp_passes(gpu: GpuModel, w: Workload, tp: int, backward: bool) -> tuple[CpPass, ...]:
    """The CP exchanges of one layer's op: the forward's; the backward's, plus the forward's
    again when the backward recomputes the attention (full or selective recomputation:
    Megatron-Core checkpoints the core attention, CP exchanges included, `transformer.layer_s`).
    Empty without CP. Kept per GPU model and workload (`_PASSES`): the estimate asks for them
    at every op."""
    if w.cp == 1:
        return ()
    return _PASSES.get((gpu, w), (tp, backward), lambda: _cp_passes(gpu, w, tp, backward))


_PASSES: IdentityMemo[tuple[CpPass, ...]] = IdentityMemo(256)


def _cp_passes(gpu: GpuModel, w: Workload, tp: int, backward: bool) -> tuple[CpPass, ...]:
    """`cp_passes`, computed."""
    if not backward:
        return (cp_pass(gpu, w, tp, False),)
    recomputes = w.recompute in ("full", "selective")
    own = cp_pass(gpu, w, tp, True)
    return (own, cp_pass(gpu, w, tp, False)) if recomputes else (own,)


def ring_attention_s(steps: int, step_s: float, transfers_s: tuple[float, ...]) -> float:
    """Ring attention's time over `steps` compute steps of `step_s` s, the first
    len(`transfers_s`) each beside one transfer of that many seconds, which it waits for: the
    sum of the per-step maxima (`AttnFuncWithCPAndKVP2P` issues a step's send and receive before
    its compute and waits for them before the next step's)."""
    return sum(max(step_s, t) for t in transfers_s) + (steps - len(transfers_s)) * step_s


def exposed_s(p: CpPass, rate_bytes_per_s: float, latency_s: float) -> float:
    """Seconds the exchange `p` adds to its layer's op beyond the attention compute already
    priced with it, when a GPU's transfers run at `rate_bytes_per_s` with `latency_s` per step:
    the ring's, max(0, T - C) a step with a transfer of T s (`ring_attention_s` over those
    steps less their compute), plus the exposed exchange."""
    transfers = tuple(latency_s + n / rate_bytes_per_s for n in p.ring_bytes)
    ring = ring_attention_s(len(transfers), p.step_s, transfers) - len(transfers) * p.step_s
    return ring + p.exposed_hops * latency_s + p.exposed_bytes / rate_bytes_per_s


def op_exposed_s(gpu: GpuModel, w: Workload, tp: int, layers: int, backward: bool,
                 rate_bytes_per_s: float, latency_s: float) -> float:
    """`exposed_s` of every CP exchange of an op of `layers` layers (seconds; 0 without CP)."""
    return layers * sum(exposed_s(p, rate_bytes_per_s, latency_s)
                        for p in cp_passes(gpu, w, tp, backward))
