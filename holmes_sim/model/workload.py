"""The transformer's costs: parameters, FLOPs, message and memory sizes (Megatron-LM conventions).

Symbols: h hidden size, f FFN size (4h by default), s sequence length, b micro-batch size,
V vocabulary, L layers, a attention heads, t tensor-parallel degree.

Sources:
- [N21] Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC'21, arXiv 2104.04473: FLOPs (section 5.1, appendix), parameters, the
  TFLOP/s formula, scatter-gather of pipeline messages (section 4.1).
- [K22] Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
  arXiv 2205.05198: activation memory per layer (section 4, Table 2).
- [R20] Rajbhandari et al., "ZeRO", SC'20, arXiv 1910.02054: 16 bytes/param for mixed-precision
  Adam (section 3.1); sharding the optimizer state over DP (P_os).
"""

from __future__ import annotations

from dataclasses import dataclass

from holmes_sim.spec.job import ModelSpec, TrainingSpec

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 2}
"""Bytes per stored element: FP8 training keeps activations, weights and communication in bf16."""


@dataclass(frozen=True, slots=True)
class Workload:
    """A GPT decoder and its training batch, with every cost the models need."""

    num_layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int
    tie_embeddings: bool
    micro_batch: int
    global_batch: int
    dtype_bytes: int
    grad_bytes: int
    recompute: str
    """Activation recomputation: none | selective (attention core, [K22]) | full (every layer)."""
    sequence_parallel: bool
    bucket_bytes: float
    flash_attention: bool = False
    """Fused attention (Dao et al. 2022/2023): no s x s score tensor in memory."""
    tp_comm_overlap: bool = False
    """The backward's TP all-reduces overlap the weight-gradient GEMMs (`TrainingSpec`)."""
    fp8_gemms: bool = False
    """The linear layers' GEMMs run in FP8 (`precision: fp8`, Transformer Engine)."""

    @property
    def full_recompute(self) -> bool:
        return self.recompute == "full"

    # ---- parameters [N21] -------------------------------------------------------------------
    @property
    def layer_params(self) -> int:
        """Parameters of one transformer layer: QKV + projection (4h^2 + 4h), MLP (2hf + f + h),
        two LayerNorms (4h). Equals 12h^2 + 13h when f = 4h [N21, eq. 2]."""
        h, f = self.hidden, self.ffn
        return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h

    @property
    def embedding_params(self) -> int:
        """Word (V h) and position (s h) embeddings, on the first stage."""
        return self.vocab * self.hidden + self.seq * self.hidden

    @property
    def head_params(self) -> int:
        """Final LayerNorm (2h) plus the output projection (V h) on the last stage; with tied
        embeddings the last stage holds a copy of the word embedding [N21]."""
        return 2 * self.hidden + self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        head = 2 * self.hidden if self.tie_embeddings else self.head_params
        return self.num_layers * self.layer_params + self.embedding_params + head

    # ---- FLOPs per micro-batch [N21, appendix] ------------------------------------------------
    @property
    def layer_forward_flop(self) -> float:
        """Forward FLOP of one layer for one micro-batch: QKV 6bsh^2, scores and weighted sum
        4bs^2h, projection 2bsh^2, MLP 4bshf. With f = 4h: 24bsh^2 + 4bs^2h [N21]."""
        b, s, h, f = self.micro_batch, self.seq, self.hidden, self.ffn
        return 8 * b * s * h * h + 4 * b * s * s * h + 4 * b * s * h * f

    @property
    def logits_forward_flop(self) -> float:
        """Output projection forward, 2bshV, on the last stage [N21]."""
        return 2 * self.micro_batch * self.seq * self.hidden * self.vocab

    @property
    def backward_factor(self) -> float:
        """Backward FLOP as a multiple of forward: 2, plus 1 recomputed forward [N21]."""
        return 3.0 if self.full_recompute else 2.0

    # ---- messages (bytes) --------------------------------------------------------------------
    def pp_message_bytes(self, tp: int) -> float:
        """Activation (forward) or its gradient (backward) crossing a stage boundary: b s h
        elements, divided by t with Megatron's scatter-gather optimisation [N21, section 4.1]."""
        return self.micro_batch * self.seq * self.hidden * self.dtype_bytes / tp

    def tp_allreduce_bytes(self) -> float:
        """One TP all-reduce of a layer's b s h activations [N21, section 3.2]."""
        return self.micro_batch * self.seq * self.hidden * self.dtype_bytes

    def tp_allreduces_per_layer(self, backward: bool) -> int:
        """2 in the forward (attention and MLP); 2 in the backward, 2 more when the backward
        recomputes the whole forward [N21, section 3.2]. Selective recomputation redoes only the
        attention core, which has no TP communication [K22, section 5]."""
        if not backward:
            return 2
        return 4 if self.full_recompute else 2

    def grad_bytes_of(self, params: float) -> float:
        """Gradient bytes of `params` parameters as reduced over DP."""
        return params * self.grad_bytes

    # ---- memory (bytes per GPU) [R20, K22] ----------------------------------------------------
    def state_bytes_per_param(self, dp: int, sharded: bool) -> float:
        """Weights + gradients + Adam state per parameter: 16 bytes (2 weight, 2 grad, 12 fp32
        master, momentum, variance) [R20]; with the optimizer state sharded over DP: 4 + 12/dp."""
        return 4 + 12 / dp if sharded else 16.0

    def activation_bytes_per_layer(self, tp: int) -> float:
        """Activations one layer holds for one micro-batch until its backward [K22, Table 2]:
        s b h (34 + 5 a s / h) without parallelism; with TP t: s b h (10 + 24/t + 5 a s/(h t));
        with sequence parallelism everything is divided by t; with full recomputation only the
        layer input, 2 s b h (divided by t with SP). Selective recomputation (or fused attention,
        which never stores the scores) drops the 5as/h term: s b h (34/t with SP, else
        10 + 24/t) [K22, Table 2]."""
        s, b, h, a = self.seq, self.micro_batch, self.hidden, self.heads
        if self.full_recompute:
            return 2 * s * b * h / (tp if self.sequence_parallel else 1)
        scores = 0.0 if (self.recompute == "selective" or self.flash_attention) else 5 * a * s / h
        if self.sequence_parallel:
            return s * b * h * (34 + scores) / tp
        return s * b * h * (10 + 24 / tp + scores / tp)

    # ---- reporting [N21, section 5.1] --------------------------------------------------------
    def megatron_tflops_per_gpu(self, iteration_s: float, num_gpus: int) -> float:
        """TFLOP/s per GPU as Megatron-LM and Holmes log it:
        F = 96 B s L h^2 (1 + s/(6h) + V/(16 L h)) with full recomputation, 72 without [N21]."""
        factor = 96 if self.full_recompute else 72
        flop = self._megatron_flop(factor)
        return flop / (iteration_s * num_gpus) / 1e12

    def model_flop_per_iteration(self) -> float:
        """Model FLOP of one iteration (the 72 form, no recomputation): the MFU numerator."""
        return self._megatron_flop(72)

    def _megatron_flop(self, factor: int) -> float:
        B, s, L, h, V = self.global_batch, self.seq, self.num_layers, self.hidden, self.vocab
        return factor * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def build_workload(model: ModelSpec, training: TrainingSpec) -> Workload:
    """Resolve defaults (FFN 4h, gradient dtype) into a Workload."""
    dtype = _DTYPE_BYTES[training.precision]
    return Workload(
        num_layers=model.num_layers, hidden=model.hidden_size, heads=model.num_attention_heads,
        seq=model.seq_length, vocab=model.vocab_size,
        ffn=model.ffn_hidden_size or 4 * model.hidden_size, tie_embeddings=model.tie_embeddings,
        micro_batch=training.micro_batch_size, global_batch=training.global_batch_size,
        dtype_bytes=dtype, grad_bytes=4 if training.grad_reduce_in_fp32 else dtype,
        recompute=training.recompute, sequence_parallel=training.sequence_parallel,
        bucket_bytes=training.bucket_size_mb * 1e6, flash_attention=training.flash_attention,
        tp_comm_overlap=training.tp_comm_overlap, fp8_gemms=training.precision == "fp8",
    )
