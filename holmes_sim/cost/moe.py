"""The kernels of an MoE layer's MLP on one GPU, per micro-batch, as Megatron-Core runs them with
the all-to-all token dispatcher and grouped GEMM (`--moe-grouped-gemm`), and what they cost beyond
the dense MLP they replace.

Symbols as in `cost.transformer`, plus (`model.moe`) E routed experts, k experts per token, f_e
and f_s the routed and shared experts' FFN widths, t the tensor-parallel degree, etp the
experts' tensor-parallel degree (`Workload.expert_tp`; etp = t unless `parallel.expert_tensor`
says otherwise), M = b s tokens of a TP group (s/cp with CP), of which each GPU holds M/t under
sequence parallelism, R the expert rows of the GPU (`MoeShape.rank_rows`): the GPU's E/ep
experts' share of the tokens of its ep x etp GPUs' EP x ETP block, ep x etp x M/t tokens
(ep x M with etp = t; M k rows when dropless without EP), d bytes per element.

The experts' TP group gathers its etp GPUs' dispatched rows after the all-to-all and scatters
them back before it (`MoEAlltoAllTokenDispatcher`, megatron/core/transformer/moe/
token_dispatcher.py: `gather_from_sequence_parallel_region` / `reduce_scatter_to_sequence_
parallel_region` over the expert-TP group, skipped at etp = 1): at etp = 1 the tokens stay
sequence-split, each attention TP rank dispatching its own M/t (MoE parallel folding, Liu et
al. arXiv 2504.14960).

Kernels [MC: megatron/core/transformer/moe/ `TopKRouter`, `MoEAlltoAllTokenDispatcher`,
`TEGroupedMLP`, `SharedExpertMLP`; moe_utils.py `permute`, `unpermute`]:
- the router and the first permutation see the GPU's own M' = M/t tokens (sequence
  parallelism; M' = M without TP): router GEMM (M', E, h) and its softmax and top-k over fp32
  logits, 3 x 4 M' E bytes forward (read logits, write probabilities, read them for the top-k)
  and again backward; a load-balancing loss reads the probabilities once more (4 M' E) forward;
- permute (read M' h d, write R h d / etp) and unpermute (the reverse) forward, the same bytes
  backward; with etp > 1 the gathered R rows are sorted by expert and back
  (`sort_chunks_by_idxs`, permutation 2): 4 R h d more;
- the routed experts as one grouped GEMM each for fc1 and fc2: the E/ep experts' GEMMs of
  R ep / E rows each, fc1 (R ep/E, f1_e/etp, h) and fc2 (R ep/E, h, f_e/etp), batched so tile
  and wave quantization apply over all experts' tiles together (`Gemm.batch`); R counts the
  busiest expert's imbalance and the capacity (`MoeShape.expert_rows`);
- the activation over R f_e / etp elements and the shared expert (M rows, like a dense MLP of
  width f_s, split over t), with the dense MLP's memory-bound bytes (`cost.transformer`);
- backward: each GEMM's two backward GEMMs and the main-gradient adds of the MoE MLP's
  parameters on the GPU (router and shared expert over t, routed experts over ep x etp),
  (d + 2g) bytes each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from holmes_sim.cost.gemm import Gemm, gemm_time_s
from holmes_sim.hardware.catalog import GpuModel
from holmes_sim.model.moe import expert_params, mlp_params, moe_mlp_params
from holmes_sim.model.workload import Workload


@dataclass(frozen=True, slots=True)
class MlpKernels:
    """One MLP (dense or MoE) of a layer on one GPU: GEMMs in the training dtype (`gemms`), GEMMs
    that run in FP8 under `precision: fp8` (`linear`), memory-bound bytes forward and backward."""

    gemms: tuple[Gemm, ...]
    linear: tuple[Gemm, ...]
    bytes_fwd: float
    bytes_bwd: float


def _activation_bytes(w: Workload, elements: float) -> tuple[float, float]:
    """The MLP activation over `elements` fc1 outputs (per gate half): SwiGLU 3 and 5 bytes per
    element and d, GeLU 2 and 3, and 2 and 1 more where fc1's bias is added apart
    (`Workload.bias_added_apart`; `cost.transformer`)."""
    d = w.dtype_bytes
    fwd, bwd = (3, 5) if w.swiglu else (2, 3)
    if w.bias_added_apart:
        fwd, bwd = fwd + 2, bwd + 1
    return fwd * elements * d, bwd * elements * d


def _grad_add_bytes(w: Workload, params: float) -> float:
    return params * (w.dtype_bytes + 2 * w.grad_bytes)


def dense_mlp_kernels(w: Workload, tp: int) -> MlpKernels:
    """The dense MLP of a layer: fc1 (M, f1/t, h), fc2 (M, h, f/t), its activation and its
    parameters' main-gradient adds."""
    m, h, f = w.micro_batch * w.tokens, w.hidden, w.ffn
    fc1_width = 2 * f if w.swiglu else f
    fwd, bwd = _activation_bytes(w, m * f / tp)
    bwd += _grad_add_bytes(w, mlp_params(h, f, w.swiglu, w.bias) / tp)
    return MlpKernels((), (Gemm(m, fc1_width // tp, h), Gemm(m, h, f // tp)), fwd, bwd)


def expert_rows(w: Workload, tp: int) -> int:
    """R: rows the GPU's E/ep routed experts process per MoE layer and micro-batch, from the
    ep x etp x M/t tokens of its EP x ETP block (`MoeShape.rank_rows` of M etp/t tokens per EP
    rank; M at etp = t)."""
    m, etp = w.micro_batch * w.tokens, w.expert_tp(tp)
    return w.moe.rank_rows(m if etp == tp else m * etp / tp, w.ep)


def moe_mlp_kernels(w: Workload, tp: int) -> MlpKernels:
    """The MoE MLP of a layer: router, permutation, grouped expert GEMMs, shared expert."""
    moe, h, d, etp = w.moe, w.hidden, w.dtype_bytes, w.expert_tp(tp)
    m = w.micro_batch * w.tokens
    rows = expert_rows(w, tp)
    local_experts = moe.experts // w.ep
    per_expert = max(1, math.ceil(rows / local_experts))
    gated = 2 if w.swiglu else 1
    linear = [Gemm(per_expert, gated * moe.ffn // etp, h, local_experts),
              Gemm(per_expert, h, moe.ffn // etp, local_experts)]
    local = m / (tp if w.sequence_parallel else 1)  # the GPU's sequence-parallel share
    probs = 4 * local * moe.experts
    permute = 2 * (local + rows / etp) * h * d + (4 * rows * h * d if etp > 1 else 0)
    fwd, bwd = _activation_bytes(w, rows * moe.ffn / etp)
    fwd += 3 * probs + (probs if moe.aux_loss else 0) + permute
    bwd += 3 * probs + permute
    if moe.shared_ffn:
        linear += [Gemm(m, gated * moe.shared_ffn // tp, h), Gemm(m, h, moe.shared_ffn // tp)]
        shared_fwd, shared_bwd = _activation_bytes(w, m * moe.shared_ffn / tp)
        fwd, bwd = fwd + shared_fwd, bwd + shared_bwd
    n = w.ep_replicas  # held / t: the routed experts' 1/(ep etp), the rest's 1/t
    held = moe_mlp_params(moe, h, w.swiglu, w.bias) - \
        expert_params(moe, h, w.swiglu, w.bias) * (n - 1) / n
    bwd += _grad_add_bytes(w, held / tp)
    return MlpKernels((Gemm(math.ceil(local), moe.experts, h),), tuple(linear), fwd, bwd)


def mlp_s(gpu: GpuModel, w: Workload, k: MlpKernels, backward: bool) -> float:
    """One forward or backward of an MLP's kernels, seconds."""
    d = w.dtype_bytes

    def gemms_s(gemms: tuple[Gemm, ...], fp8: bool) -> float:
        if backward:
            return sum(gemm_time_s(gpu, x, d, fp8) for g in gemms for x in g.backward())
        return sum(gemm_time_s(gpu, g, d, fp8) for g in gemms)

    nbytes = k.bytes_bwd if backward else k.bytes_fwd
    return gemms_s(k.gemms, False) + gemms_s(k.linear, w.fp8_gemms) + \
        nbytes / (gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency)


@lru_cache(maxsize=4096)
def moe_layer_extra_s(gpu: GpuModel, w: Workload, tp: int, backward: bool) -> float:
    """Seconds the MoE layers add to a layer pass, averaged over the layer pattern: the MoE
    fraction of the layers times (MoE MLP - dense MLP); 0 for a dense model."""
    if w.moe is None:
        return 0.0
    dense = replace(w, moe=None)
    return w.moe.moe_fraction * (mlp_s(gpu, w, moe_mlp_kernels(w, tp), backward) -
                                 mlp_s(gpu, dense, dense_mlp_kernels(dense, tp), backward))


def tp_comm_factor(w: Workload, tp: int) -> float:
    """A layer's TP communication as a multiple of a dense layer's, averaged over the layer
    pattern. Of a dense layer's collectives half are the MLP's (one all-reduce, or all-gather
    plus reduce-scatter, of M h elements each way over t GPUs); an MoE layer instead all-gathers
    the R dispatched rows over the etp GPUs of its expert-TP group and reduce-scatters them back
    (`MoEAlltoAllTokenDispatcher`: `gather_from_sequence_parallel_region` and
    `reduce_scatter_to_sequence_parallel_region` over the expert-TP group), a ring moving
    (etp - 1)/etp R rows against the dense MLP's (t - 1)/t M: R / M times the bytes at etp = t,
    none at etp = 1 (the tokens stay sequence-split); plus the shared expert's dense-MLP pair.
    The ratio scales the whole ring time, its t - 1 latency steps included."""
    moe = w.moe
    if moe is None:
        return 1.0
    m, etp = w.micro_batch * w.tokens, w.expert_tp(tp)
    routed = expert_rows(w, tp) / m
    if etp != tp:
        routed *= (etp - 1) / etp * tp / (tp - 1)
    mlp = routed + (1 if moe.shared_ffn else 0)
    return 1.0 + moe.moe_fraction * (mlp - 1) / 2
