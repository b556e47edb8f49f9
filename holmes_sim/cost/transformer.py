"""The kernels of a GPT layer, the embedding and the output head, per micro-batch and per GPU of a
TP group of degree t, as Megatron-LM runs them: GEMM shapes, and the HBM bytes of the memory-bound
kernels between them.

Symbols: b micro-batch, s sequence, h hidden, f FFN width, a heads, g query groups, V padded
vocabulary, d bytes per
element (2 for bf16/fp16). Per GPU: M = b s token rows; E = b s h activation elements; F = b s f / t
MLP elements; S = b (a / t) s^2 attention-score elements.

GEMMs of a layer forward [N21, section 3.2 and appendix]: QKV (M, (h + 2k)/t, h) with
k = h g / a the K and V width of g query groups (3h/t for multi-head attention; Megatron-Core
`SelfAttention.linear_qkv`, megatron/core/transformer/attention.py), scores per head
(s, s, h/a) x b a/t, context (s, h/a, s) x b a/t, projection (M, h, h/t), MLP (M, f1/t, h) and
(M, h, f/t) with f1 = 2f for SwiGLU (gate and up in one GEMM, `MLP.linear_fc1` of
megatron/core/transformer/mlp.py) else f; each has two backward GEMMs (`Gemm.backward`).
With `precision: fp8` the four linear layers' GEMMs and their backward GEMMs run at the FP8 tensor
rate (Transformer Engine's `Linear` layers cast inputs and weights to FP8 for forward, dgrad and
wgrad, under delayed or current scaling: NVIDIA Transformer Engine documentation, "Using FP8 with
Transformer Engine"); the attention score and context GEMMs (Transformer Engine's attention runs
in bf16 unless FP8 attention is enabled), the output layer and every other kernel stay bf16.

Memory-bound kernels (bytes read + written; Megatron-LM's fused kernels: Apex fused LayerNorm,
fused bias-GeLU, fused bias-dropout-add, fused scale-mask-softmax; dropout masks one byte per
element):
- forward: 2 LayerNorms 2 x 2Ed; bias-GeLU 2Fd; 2 bias-dropout-adds 2 x (3Ed + E); softmax 2Sd;
  attention dropout S(2d + 1); context permute to [s, b, h] 2(E/t)d;
- backward: LayerNorms 2 x 3Ed; GeLU 3Fd; bias-dropout-adds 2 x (2Ed + E); softmax 3Sd; dropout
  S(2d + 1); permute 2(E/t)d.
With sequence parallelism the LayerNorm and bias-dropout-add terms are divided by t [K22, 4.2.2].
Architecture variants (Megatron-Core, megatron/core/transformer/): RMSNorm moves the same
tensors as LayerNorm (only its statistic differs); without biases the GeLU and dropout-add
kernels move the same tensors; SwiGLU reads both halves of fc1's output and writes one, 3Fd
forward and 5Fd backward (`bias_swiglu_impl`, megatron/core/fusions/fused_bias_swiglu.py);
squared ReLU moves GeLU's tensors, but with biases its launch turns the bias-activation fusion
off (Megatron-Core `TransformerConfig` fuses only GeLU, SwiGLU and quick-GeGLU with a bias), so
`MLP.forward` adds fc1's bias in a kernel of its own, 2Fd forward, and autograd sums its
gradient over the tokens, Fd backward (megatron/core/transformer/mlp.py);
hidden_dropout 0 drops the two masks (E bytes each) and attention_dropout 0 the attention
dropout (PyTorch's dropout returns its input when p = 0); rotary embeddings read and write q
and k, 2 b s (h + k) d / t bytes forward and again backward (`apply_rotary_pos_emb`,
megatron/core/models/common/embeddings/rope_utils.py).
Multi-head latent attention (`model.mla`): QKV and the projection become its query, key/value
down and up and output projections (the output projection stays second of the four last
GEMMs, the key/value up projection stands in QKV's place for the TP overlap windows); its core
runs score heads of d_n + d_r and context heads of d_v; its latent norms, rotary parts and
query/key assembly replace the rotary bytes above (`MlaShape.norm_rope_bytes`).
Every backward also adds each weight gradient into the main gradient buffer: per parameter of
the GPU's shard, the fresh gradient is read (d) and the main gradient read and written (2g, g the
bytes of a reduced gradient), as Megatron DDP's main_grad hook does. The fused weight-gradient
GEMM (`--gradient-accumulation-fusion`, Megatron-Core's default) moves 2d bytes fewer: it reads
and writes the main gradient in its epilogue instead of writing d; that alternative and why it
is not taken are in docs/cost_models.md ("Memory-bound kernels").
With fused (flash) attention the score tensor never reaches HBM: the softmax, attention dropout
and the two score GEMMs are replaced by one causal kernel of 4 b s^2 h / t FLOP forward unmasked
and 2.5 times that backward, priced by `cost.attention` (the measured rate of the kernel the
stack runs, or `attention_efficiency` on the tiles a causal mask leaves). The unfused path
computes every score.

With context parallelism of degree cp every per-GPU quantity above counts the rank's s/cp tokens
(s in M, E, F and the head), and the attention its s/cp queries against all s keys: S = b (a/t)
(s/cp) s, flash 4 b (s/cp) s h / t FLOP unmasked, in kernels of s/cp queries (Megatron-Core's load-balanced causal chunks give each
rank 1/cp of the causal work; `cost.context_parallel`).

Embedding (first stage): lookup, position add and dropout, about 8Ed bytes forward with a
learned position table, else the lookup 2Ed plus dropout 2Ed + E when hidden_dropout > 0; its
backward writes a dense (V/t) x h gradient and adds it to the main gradient: (V h / t)(2d + 2g) bytes
(PyTorch `embedding_dense_backward`; Megatron's main_grad accumulation). Head (last stage): the
logits GEMM (M, V/t, h) and the vocab-parallel cross entropy over L = b s V / t logits of d bytes
(`cross_entropy_bytes`): unfused, in fp32, about 40L bytes forward and 16L backward (cast, max,
exp, sum, normalise; Megatron `tensor_parallel/cross_entropy.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from holmes_sim.hardware.catalog import GpuModel
from holmes_sim.cost.attention import fused_attention_s
from holmes_sim.cost.gemm import Gemm, gemm_sm_loss_s, gemm_time_s
from holmes_sim.cost.moe import moe_layer_extra_s
from holmes_sim.model.workload import Workload

@dataclass(frozen=True, slots=True)
class LayerKernels:
    """Kernels of one layer on one GPU: the dense GEMMs, the attention GEMMs (empty with fused
    attention), and memory-bound bytes forward and backward, split into attention-core bytes and
    the rest (selective recomputation redoes only the attention core)."""

    dense: tuple[Gemm, ...]
    attention: tuple[Gemm, ...]
    flash_flop: float
    """Forward FLOP of the fused attention kernel without its causal mask (0: unfused)."""
    flash_seq: int
    """Queries per sequence of one fused attention call (tokens; the rank's s/cp under CP)."""
    flash_keys: int
    """Keys each query attends to at most (tokens)."""
    core_bytes_fwd: float
    core_bytes_bwd: float
    other_bytes_fwd: float
    other_bytes_bwd: float
    flash_causal_share: float = 1.0
    """Share of the fused attention's work done by kernels under the causal mask; the rest runs
    unmasked (the off-diagonal steps of ring attention, `cost.context_parallel`)."""
    flash_backend: str = "auto"
    """The attention backend that runs the fused kernel (`Workload.attention_backend`)."""


@lru_cache(maxsize=4096)
def layer_kernels(w: Workload, tp: int) -> LayerKernels:
    """The kernels of one transformer layer for one micro-batch on one GPU of a TP group."""
    b, s, h, f, a, d = w.micro_batch, w.tokens, w.hidden, w.ffn, w.heads, w.dtype_bytes
    m, hd, keys = b * s, h // a, w.seq  # a CP rank's s/cp queries attend to all s keys
    e = b * s * h
    dense = _attention_gemms(w, tp) + (Gemm(m, w.fc1_width // tp, h), Gemm(m, h, f // tp))
    context = e if w.mla is None else b * s * w.mla.v_width  # the core attention's output
    permute = 2 * (context / tp) * d
    other_fwd, other_bwd = _other_bytes(w, tp)
    if w.flash_attention:
        seq, causal_share = _fused_attention_calls(w)
        flop = 4.0 * b * s * keys * h / tp if w.mla is None else \
            w.mla.core_forward_flop(b * s, keys) / tp
        return LayerKernels(dense, (), flop, seq, keys, 0.0, 0.0,
                            other_fwd + permute, other_bwd + permute, causal_share,
                            w.attention_backend)
    batch = max(1, b * a // tp)
    attention = (Gemm(s, keys, hd, batch), Gemm(s, hd, keys, batch)) if w.mla is None else \
        tuple(Gemm(*shape, batch) for shape in w.mla.core_shapes(s, keys))
    scores = b * (a / tp) * s * keys
    dropout = scores * (2 * d + 1) if w.attention_dropout > 0 else 0.0
    core_fwd = 2 * scores * d + dropout + permute
    core_bwd = 3 * scores * d + dropout + permute
    return LayerKernels(dense, attention, 0.0, s, keys, core_fwd, core_bwd, other_fwd, other_bwd)


def _attention_gemms(w: Workload, tp: int) -> tuple[Gemm, ...]:
    """The attention's projections on one GPU, the output projection last: QKV and projection,
    or multi-head latent attention's query, key/value down and up and output projections
    (`model.mla.MlaShape.gemm_shapes`)."""
    m, h = w.micro_batch * w.tokens, w.hidden
    if w.mla is not None:
        return tuple(Gemm(*shape) for shape in
                     w.mla.gemm_shapes(m, h, tp, w.sequence_parallel))
    return Gemm(m, (h + 2 * w.kv_width) // tp, h), Gemm(m, h, h // tp)


def _fused_attention_calls(w: Workload) -> tuple[int, float]:
    """Query length of one fused attention kernel (tokens) and the share of the rank's attention
    work under the causal mask, as Transformer Engine's context-parallel attention calls it:
    ring attention (p2p) runs cp steps of s/cp queries, the first over the rank's own chunks
    with the mask, the other cp - 1 over earlier chunks without it, each 1/cp of the work
    (`AttnFuncWithCPAndKVP2P`); Ulysses (a2a) runs one masked kernel over the whole sequence for
    a/cp heads; all-gather one masked kernel per local chunk. Without CP: one masked kernel of s."""
    if w.cp == 1:
        return w.tokens, 1.0
    if w.cp_comm_type == "p2p":
        return w.tokens, 1.0 / w.cp
    if w.cp_comm_type == "a2a":
        return w.seq, 1.0
    return w.tokens, 1.0


def _other_bytes(w: Workload, tp: int) -> tuple[float, float]:
    """HBM bytes of a layer's memory-bound kernels outside the attention core, forward and
    backward: norms, MLP activation, residual adds, rotary embedding, main-gradient adds."""
    b, s, h, f, d = w.micro_batch, w.tokens, w.hidden, w.ffn, w.dtype_bytes
    e, ff = b * s * h, b * s * f / tp
    sp = tp if w.sequence_parallel else 1
    mask = e if w.hidden_dropout > 0 else 0
    act_fwd, act_bwd = (3 * ff * d, 5 * ff * d) if w.swiglu else (2 * ff * d, 3 * ff * d)
    if w.bias_added_apart:  # fc1's bias added on its own: read and write forward, sum backward
        act_fwd, act_bwd = act_fwd + 2 * ff * d, act_bwd + ff * d
    fwd = 2 * 2 * e * d / sp + act_fwd + 2 * (3 * e * d + mask) / sp
    bwd = 2 * 3 * e * d / sp + act_bwd + 2 * (2 * e * d + mask) / sp + \
        w.layer_params / tp * (d + 2 * w.grad_bytes)
    if w.mla is not None:  # latent norms, rotary parts, query and key assembly
        fwd += w.mla.norm_rope_bytes(b * s, tp, w.sequence_parallel, d, False)
        bwd += w.mla.norm_rope_bytes(b * s, tp, w.sequence_parallel, d, True)
    elif w.position_embedding == "rope":
        rope = 2 * b * s * (h + w.kv_width) / tp * d
        fwd, bwd = fwd + rope, bwd + rope
    if w.fp8_gemms:
        cast_fwd, cast_bwd = fp8_quantization_bytes(w, tp)
        fwd, bwd = fwd + cast_fwd, bwd + cast_bwd
    return fwd, bwd


def fp8_quantization_bytes(w: Workload, tp: int) -> tuple[float, float]:
    """HBM bytes of Transformer Engine's FP8 quantization kernels in one layer, forward and
    backward (delayed scaling; Hopper's FP8 GEMMs take both operands K-major, so every GEMM
    operand is also needed transposed). A cast reads d and writes 1 byte per element, a fused
    cast-transpose writes 1 + 1, an FP8 transpose reads 1 and writes 1 (TE 1.x,
    transformer_engine/pytorch/module/: `_LayerNormLinear` for QKV and fc1 (Megatron-Core
    `TELayerNormColumnParallelLinear`), `_Linear` for the projection and fc2
    (`TERowParallelLinear`), `grad_output_preprocess` in base.py).
    Forward: the norms before QKV and fc1 write their outputs in FP8 (d - 1 bytes fewer per
    element); the projection's and fc2's bf16 inputs are cast-transposed (SP: cast only).
    Backward: the two FP8 norm outputs (all of b s h) are transposed for the weight gradients
    (SP: so are the projection's and fc2's inputs); the output gradients of QKV and fc1 are
    cast-transposed, those of the projection and fc2 likewise (SP: cast on the rank's 1/t, then
    transposed after the FP8 all-gather). Per-step weight casts (once per step per parameter,
    `is_first_microbatch`) and the amax/scale updates are not counted.
    Current scaling (`Workload.fp8_current_scaling`; TE v2.8 on,
    `Float8CurrentScalingQuantizer::quantize_impl` in pytorch/csrc/quantizer.cpp) computes each
    tensor's amax before its cast, one more read of d bytes per element; the norms compute it
    in their own kernel but write bf16, which a cast then reads (`FUSED_NORM_AMAX_FP8`,
    pytorch/csrc/extensions/normalization.cpp): d - 1 written and d + 1 moved more per element."""
    b, s, h, f, d = w.micro_batch, w.tokens, w.hidden, w.ffn, w.dtype_bytes
    m, sp = b * s, w.sequence_parallel and tp > 1
    e = m * h
    row_inputs = m * h / tp + m * f / tp
    norm_elements = 2 * e / (tp if sp else 1)
    column_elements = m * ((h + 2 * w.kv_width) + w.fc1_width) / tp
    row_grad_elements = 2 * e / tp if sp else 2 * e
    fwd = row_inputs * ((d + 1) if sp else (d + 2)) - norm_elements * (d - 1)
    column_grads = column_elements * (d + 2)
    row_grads = 2 * (e / tp * (d + 1) + 2 * e if sp else e * (d + 2))
    bwd = 2 * 2 * e + (2 * row_inputs if sp else 0.0) + column_grads + row_grads
    if w.fp8_current_scaling:
        fwd += norm_elements * 2 * d + row_inputs * d
        bwd += (column_elements + row_grad_elements) * d
    return fwd, bwd


def _memory_s(gpu: GpuModel, nbytes: float) -> float:
    return nbytes / (gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency)


def _gemms_s(gpu: GpuModel, gemms: tuple[Gemm, ...], d: int, backward: bool,
             fp8: bool = False) -> float:
    if not backward:
        return sum(gemm_time_s(gpu, g, d, fp8) for g in gemms)
    return sum(gemm_time_s(gpu, x, d, fp8) for g in gemms for x in g.backward())


def attention_core_s(gpu: GpuModel, k: LayerKernels, d: int, backward: bool) -> float:
    """Score and context GEMMs, softmax, attention dropout (or the fused kernel), seconds."""
    if k.flash_flop:
        return fused_attention_s(gpu, k.flash_flop, k.flash_seq, k.flash_keys, backward,
                                 k.flash_causal_share, k.flash_backend)
    nbytes = k.core_bytes_bwd if backward else k.core_bytes_fwd
    return _gemms_s(gpu, k.attention, d, backward) + _memory_s(gpu, nbytes)


def userbuffer_rs_sms(w: Workload, tp: int) -> int:
    """SMs the forward's userbuffer reduce-scatters hold beside their GEMMs: `Workload.ub_rs_sms`
    under `--tp-comm-overlap` (with sequence parallelism and TP > 1), else 0."""
    return w.ub_rs_sms if w.tp_comm_overlap and w.sequence_parallel and tp > 1 else 0


def userbuffer_sm_gemms(w: Workload, tp: int, backward: bool) -> tuple[Gemm, ...]:
    """The GEMMs of a layer pass that run beside a pipelined userbuffer reduce-scatter under
    `--tp-comm-overlap`: the forward's projection and fc2 (TE `proj_fprop`, `fc2_fprop`). The
    all-gathers (`ring_exchange`) move data with the copy engines on one SM, and the backward's
    `bulk` overlaps run without the margin on 2-16 SMs depending on the configuration: neither
    is counted. Empty without the overlap or with no SMs held (`Workload.ub_rs_sms`)."""
    if backward or not userbuffer_rs_sms(w, tp):
        return ()
    _, proj, _, down = layer_kernels(w, tp).dense[-4:]
    return proj, down


def userbuffer_sm_loss_s(gpu: GpuModel, w: Workload, tp: int, backward: bool) -> float:
    """Seconds a layer pass's GEMMs lose to the SMs their userbuffer collectives hold: each runs
    on sm_count - `Workload.ub_rs_sms` SMs at the same per-SM rate."""
    d, fp8 = w.dtype_bytes, w.fp8_gemms
    return sum(gemm_time_s(gpu, g, d, fp8, w.ub_rs_sms) - gemm_time_s(gpu, g, d, fp8)
               for g in userbuffer_sm_gemms(w, tp, backward))


NCCL_COMM_SMS = 16
"""SMs a data-parallel collective's NCCL kernels hold on each GPU of a DGX with 8 NICs: one
block per channel, each alone on its SM ("NCCL CTAs won't share an SM with compute kernels"),
"on DGX with 8 NICs and a top speed of 190 GB/s, then it would use 16 SMs" (the NCCL
maintainer's answers in NVIDIA/nccl#689, 2023)."""


def nccl_comm_sms(nics: int) -> int:
    """SMs a data-parallel collective's NCCL kernels hold on a GPU whose node has `nics` NICs
    on its network: 2 per NIC up to `NCCL_COMM_SMS`, the two figures NVIDIA/nccl#689 gives ("a
    PCI system with a single NIC, which can achieve up to 12-24 GB/s ... should just launch 2
    SMs"; a DGX's 8 NICs 16), whatever the NIC's transport (the single-NIC figure names none)."""
    return max(1, min(NCCL_COMM_SMS, 2 * nics))


def held_sm_loss_s(gpu: GpuModel, w: Workload, tp: int, held: int) -> tuple[float, float]:
    """Seconds a layer's backward (with what its recomputation redoes) and the output layer's
    backward lose when each of their GEMMs runs on sm_count - `held` SMs at the same per-SM rate
    (`gemm_time_s(reserved_sms=)`), beside a collective whose kernels hold `held` SMs: the sum
    over the GEMMs of time on the SMs left minus time on all of them. The forward GEMMs that
    already run beside a userbuffer collective (`userbuffer_sm_gemms`) lose from sm_count -
    `Workload.ub_rs_sms`.
    Memory-bound kernels, fused attention and MoE layers' expert GEMMs are not counted; with
    `defer_embedding_wgrad` the output layer's weight gradient is not in the backward. Kept by
    the GEMMs it prices (`_HeldSmShapes`): a search's workloads differ in fields it ignores."""
    return _held_sm_loss_s(gpu, _HeldSmShapes(w, tp), held)


class _HeldSmShapes:
    """A workload and TP degree, equal to another where `held_sm_loss_s` prices the same GEMMs:
    the fields `layer_kernels`' dense and attention GEMMs are built from (micro-batch, seq, cp,
    hidden, heads, query groups, FFN, gated MLP, MLA and, with MLA, sequence parallelism, fused
    attention), the userbuffer GEMMs' condition and SMs (`userbuffer_sm_gemms`), the precision, the
    recomputation (selective as none with fused attention, which recomputes no GEMM), the
    vocabulary and the deferred head weight gradient. MoE is priced without (dense GEMMs)."""

    __slots__ = ("w", "tp", "key")

    def __init__(self, w: Workload, tp: int):
        self.w, self.tp = w, tp
        recompute = "none" if w.flash_attention and w.recompute == "selective" else w.recompute
        self.key = (tp, w.micro_batch, w.seq, w.cp, w.hidden, w.heads, w.query_groups, w.ffn,
                    w.swiglu, w.mla, w.mla is not None and w.sequence_parallel,
                    w.flash_attention, userbuffer_rs_sms(w, tp), w.dtype_bytes, w.fp8_gemms, recompute, w.vocab, w.defer_embedding_wgrad)

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _HeldSmShapes) and self.key == other.key


@lru_cache(maxsize=4096)
def _held_sm_loss_s(gpu: GpuModel, shapes: _HeldSmShapes, held: int) -> tuple[float, float]:
    """`held_sm_loss_s` of the first workload with these shapes."""
    w, tp = shapes.w, shapes.tp
    if w.moe is not None:
        w = replace(w, moe=None)
    k, d, fp8 = layer_kernels(w, tp), w.dtype_bytes, w.fp8_gemms

    def loss(gemms, fp8_gemms: bool, base: int = 0) -> float:
        return sum(gemm_sm_loss_s(gpu, g, d, fp8_gemms, held, base) for g in gemms)

    layer = loss([x for g in k.dense for x in g.backward()], fp8) + \
        loss([x for g in k.attention for x in g.backward()], False)
    if w.recompute == "full":
        ub = {len(k.dense) - 3, len(k.dense) - 1} if userbuffer_sm_gemms(w, tp, False) else set()
        layer += loss([g for i, g in enumerate(k.dense) if i not in ub], fp8) + \
            loss([k.dense[i] for i in sorted(ub)], fp8, w.ub_rs_sms)
    if w.recompute in ("full", "selective"):
        layer += loss(k.attention, False)
    dgrad, wgrad = Gemm(w.micro_batch * w.tokens, max(1, w.vocab // tp), w.hidden).backward()
    return layer, loss((dgrad,) if w.defer_embedding_wgrad else (dgrad, wgrad), False)


def layer_pass_s(gpu: GpuModel, w: Workload, tp: int, backward: bool) -> float:
    """One forward or one backward of a layer (no recomputation), seconds; with MoE layers the
    dense layer plus what they add on average (`cost.moe.moe_layer_extra_s`)."""
    if w.moe is not None:
        return layer_pass_s(gpu, replace(w, moe=None), tp, backward) + \
            moe_layer_extra_s(gpu, w, tp, backward)
    k = layer_kernels(w, tp)
    d = w.dtype_bytes
    other = k.other_bytes_bwd if backward else k.other_bytes_fwd
    return _gemms_s(gpu, k.dense, d, backward, w.fp8_gemms) + _memory_s(gpu, other) + \
        attention_core_s(gpu, k, d, backward) + userbuffer_sm_loss_s(gpu, w, tp, backward)


@lru_cache(maxsize=4096)
def layer_s(gpu: GpuModel, w: Workload, tp: int, backward: bool) -> float:
    """A layer's forward, or its backward including what the recomputation mode redoes: full
    the whole forward; selective the attention core, fused kernel included (Megatron-Core
    checkpoints the core attention whatever its kernel: `checkpoint_core_attention` in
    megatron/core/transformer/attention.py, core_r0.8.0 onwards, `recompute_modules`
    ["core_attn"] by default in later releases)."""
    if not backward:
        return layer_pass_s(gpu, w, tp, False)
    t = layer_pass_s(gpu, w, tp, True)
    if w.recompute == "full":
        t += layer_pass_s(gpu, w, tp, False)
    elif w.recompute == "selective":
        t += attention_core_s(gpu, layer_kernels(w, tp), w.dtype_bytes, False)
    return t


@lru_cache(maxsize=4096)
def tp_overlap_windows_s(gpu: GpuModel, w: Workload, tp: int) -> tuple[float, float]:
    """Weight-gradient GEMMs of the two column-parallel linears (QKV, MLP up-projection), seconds:
    the windows in which Megatron-LM's asynchronous TP all-reduce of their input gradients runs
    (`LinearWithGradAccumulationAndAsyncCommunication`)."""
    qkv, _, up, _ = layer_kernels(w, tp).dense[-4:]
    return (gemm_time_s(gpu, qkv.backward()[1], w.dtype_bytes, w.fp8_gemms),
            gemm_time_s(gpu, up.backward()[1], w.dtype_bytes, w.fp8_gemms))


@lru_cache(maxsize=4096)
def tp_userbuffer_windows_s(gpu: GpuModel, w: Workload, tp: int,
                            backward: bool) -> tuple[float, float, float, float]:
    """The GEMM each TP collective of a layer pass overlaps under Transformer Engine's userbuffer
    overlap (`--tp-comm-overlap`; TE `CommOverlap`/`CommOverlapP2P` as Megatron-Core's
    `TELinear` layers configure them), seconds, in the order all-gather, reduce-scatter,
    all-gather, reduce-scatter: forward QKV, projection, fc1, fc2 (the all-gathers feed the
    column-parallel GEMMs, the reduce-scatters drain the row-parallel ones); backward the
    projection's data-gradient GEMM (all-gather of its output gradient), QKV's weight-gradient
    GEMM (bulk reduce-scatter of its input gradient), fc2's data gradient and fc1's weight
    gradient. The forward's reduce-scatter GEMMs run on the SMs their collective leaves
    (`userbuffer_sm_gemms`)."""
    qkv, proj, up, down = layer_kernels(w, tp).dense[-4:]
    d, fp8, held = w.dtype_bytes, w.fp8_gemms, w.ub_rs_sms
    if not backward:
        return (gemm_time_s(gpu, qkv, d, fp8), gemm_time_s(gpu, proj, d, fp8, held),
                gemm_time_s(gpu, up, d, fp8), gemm_time_s(gpu, down, d, fp8, held))
    return (gemm_time_s(gpu, proj.backward()[0], d, fp8), gemm_time_s(gpu, qkv.backward()[1], d, fp8),
            gemm_time_s(gpu, down.backward()[0], d, fp8), gemm_time_s(gpu, up.backward()[1], d, fp8))


@lru_cache(maxsize=4096)
def head_wgrad_s(gpu: GpuModel, w: Workload, tp: int) -> float:
    """The output layer's weight-gradient GEMM (h x V/t, inner b s) of one micro-batch, seconds:
    what `--defer-embedding-wgrad-compute` moves to the pipeline flush."""
    logits = Gemm(w.micro_batch * w.seq, max(1, w.vocab // tp), w.hidden)
    return gemm_time_s(gpu, logits.backward()[1], w.dtype_bytes)


@lru_cache(maxsize=4096)
def embedding_s(gpu: GpuModel, w: Workload, tp: int, backward: bool) -> float:
    """Word and position embedding lookup (forward) or its dense gradient (backward), seconds."""
    e, d = w.micro_batch * w.tokens * w.hidden, w.dtype_bytes
    if not backward and w.position_embedding == "learned":
        return _memory_s(gpu, 8 * e * d)
    if not backward:
        return _memory_s(gpu, 2 * e * d + (2 * e * d + e if w.hidden_dropout > 0 else 0))
    return _memory_s(gpu, w.vocab * w.hidden / tp * (2 * d + 2 * w.grad_bytes) + 3 * e * d)


@lru_cache(maxsize=4096)
def head_s(gpu: GpuModel, w: Workload, tp: int, backward: bool) -> float:
    """Logits GEMM and vocab-parallel cross entropy, seconds."""
    logits = Gemm(w.micro_batch * w.tokens, max(1, w.vocab // tp), w.hidden)
    n = w.micro_batch * w.tokens * w.vocab / tp
    accumulate = w.vocab * w.hidden / tp * (w.dtype_bytes + 2 * w.grad_bytes) if backward else 0.0
    return _gemms_s(gpu, (logits,), w.dtype_bytes, backward) + \
        _memory_s(gpu, cross_entropy_bytes(w.cross_entropy, w.dtype_bytes, backward) * n +
                  accumulate)


def cross_entropy_bytes(kernels: str, d: int, backward: bool) -> float:
    """HBM bytes per logit of the vocabulary-parallel cross entropy's forward or backward, with
    logits of d bytes, by its kernels (`Workload.cross_entropy`):
    - unfused (Megatron-Core `tensor_parallel/cross_entropy.py`, PyTorch kernels on an fp32
      copy): 40 forward (cast, max, shift, exp, sum, normalise), 16 backward;
    - native (`--cross-entropy-loss-fusion`, megatron/core/fusions/fused_cross_entropy.py:
      four functions compiled by `jit_fuser` (torch.compile), each reading its tensor inputs
      and writing its outputs and the inputs it changes in place once): forward d + 4 (cast
      and max, the fp32 logits out), 4 + 4 (shift, exp and sum), 4 + 4 (normalise into the
      saved softmax); backward 4 + 4 + 2 (the softmax read and, changed in place, written
      back; the bf16 gradient out); a lower bound where the compiler splits a function;
    - te (`--cross-entropy-fusion-impl te`, Transformer Engine 2.2-2.17's Triton kernels,
      transformer_engine/pytorch/triton/cross_entropy.py, from 2.10 in
      transformer_engine/common/triton/): forward 3d (an online-softmax pass reads the
      logits; a second reads them and writes the gradient over them), backward 2d
      (`element_mul_kernel` scales it in place by the per-token loss's gradient)."""
    if kernels == "te":
        return (2 if backward else 3) * d
    if kernels == "native":
        return 10.0 if backward else d + 20.0
    return 16.0 if backward else 40.0
