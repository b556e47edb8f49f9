"""The transformer's costs: parameters, FLOPs, message and memory sizes (Megatron-LM conventions).

Symbols: h hidden size, f FFN size (4h by default), s sequence length, b micro-batch size,
V vocabulary (padded), L layers, a attention heads, g key/value groups (g = a: multi-head
attention), k = h g / a the width of K and of V, t tensor-parallel degree.

Architecture options follow Megatron-Core's `TransformerConfig`
(megatron/core/transformer/transformer_config.py): `num_query_groups`, `gated_linear_unit`
(`--swiglu`: fc1 of width 2f, megatron/core/transformer/mlp.py), `normalization`,
`add_bias_linear` / `add_qkv_bias`, `position_embedding_type`, `hidden_dropout`,
`attention_dropout`.

Sources:
- [N21] Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC'21, arXiv 2104.04473: FLOPs (section 5.1, appendix), parameters, the
  TFLOP/s formula, scatter-gather of pipeline messages (section 4.1).
- [K22] Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
  arXiv 2205.05198: activation memory per layer (section 4, Table 2).
- [MLM] Megatron-LM, megatron/training/training.py `num_floating_point_operations`
  (`holmes_sim.model.flops`).
- [R20] Rajbhandari et al., "ZeRO", SC'20, arXiv 1910.02054: 16 bytes/param for mixed-precision
  Adam (section 3.1); sharding the optimizer state over DP (P_os).
- [DO] Megatron-LM docs/user-guide/features/dist_optimizer.md: bytes per parameter by weight and
  gradient dtype, with and without the distributed optimizer (d: data-parallel size).
- [CP] Megatron-Core context parallelism (megatron/core/parallel_state.py; Transformer Engine
  `attention.py` `AttnFuncWithCPAndKVP2P`): a rank holds s/cp tokens in two load-balanced
  chunks, so its linear layers, activations and messages scale with s/cp and its causal
  attention with s^2/cp (`holmes_sim.cost.context_parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from holmes_sim.model.checks import check_attention_backend, check_model
from holmes_sim.model.flops import megatron_core_flop, sc21_flop
from holmes_sim.model.mla import MlaShape, check_mla, mla_shape
from holmes_sim.model.moe import (AUX_LOSS_COEFF_START, MoeRouter, MoeShape, expert_params,
                                  megatron_mlp_term, mlp_params, moe_layer_pattern,
                                  moe_mlp_forward_flop, moe_mlp_params, shared_gate_params)
from holmes_sim.model.pipeline_split import PipelineSplit
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
    attention_backend: str = "auto"
    """`TrainingSpec.attention_backend`: with flash_attention, whose rates the fused kernel runs at."""
    tp_comm_overlap: bool = False
    """Transformer Engine userbuffer overlap of every TP collective with a GEMM (`TrainingSpec`)."""
    ub_rs_sms: int = 16
    """SMs the forward's userbuffer reduce-scatters hold (`TrainingSpec.tp_comm_overlap_rs_sms`)."""
    async_tp_allreduce: bool = False
    """The backward's TP all-reduces overlap the weight-gradient GEMMs (2022, `TrainingSpec`)."""
    overlap_p2p_comm: bool = False
    """Pipeline receives posted after the previous op of their kind (interleaved, `TrainingSpec`)."""
    defer_embedding_wgrad: bool = False
    """The output layer's weight gradients run at the pipeline flush (`TrainingSpec`)."""
    pp_scatter_gather: bool = False
    """Pipeline messages split over the TP group (`TrainingSpec.scatter_gather_tensors_in_pipeline`)."""
    cross_entropy: str = "unfused"
    """The cross entropy's kernels: unfused | native | te (`TrainingSpec.cross_entropy_loss_fusion`
    and `cross_entropy_fusion_impl`; `cost.transformer.cross_entropy_bytes`)."""
    pipeline_split: PipelineSplit = PipelineSplit()
    """Megatron-LM's uneven pipeline split flags (used by the megatron policy)."""
    average_in_collective: bool = False
    """The DP reduction averages; no 1/DP scaling pass (`TrainingSpec.ddp_average_in_collective`)."""
    nvls_enable: bool = True
    """NCCL may run NVLS and NVLS-tree (`TrainingSpec.nccl_nvls_enable`, `nccl_algorithms.with_nvls`)."""
    check_for_nan_in_grad: bool = False
    """Each bucket's gradient norm is checked for NaN before its reduction
    (`TrainingSpec.check_for_nan_in_loss_and_grad`)."""
    query_groups: int | None = None
    """Key/value groups g; None: one per head (multi-head attention)."""
    swiglu: bool = False
    squared_relu: bool = False
    """Squared-ReLU MLP activation: GeLU's GEMMs, FLOPs and traffic; kept for the exporter."""
    bias_added_apart: bool = False
    """fc1's bias is added by a kernel of its own, not fused into the activation
    (`--no-bias-gelu-fusion`), in every layer: biases with squared-ReLU, which Megatron-Core's
    bias-activation fusion refuses, or with an MoE model's GeLU, whose grouped experts fuse a
    bias only into SwiGLU (`TEGroupedMLP.forward`, megatron/core/transformer/moe/experts.py)."""
    rmsnorm: bool = False
    bias: bool = True
    """Biases on the projection and MLP linears."""
    qkv_bias: bool = True
    position_embedding: str = "learned"
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    vocab_divisible_by: int = 128
    """Megatron's `make_vocab_size_divisible_by` (`vocab` is already padded with it)."""
    vocab_size: int = 0
    """The vocabulary before padding (`ModelSpec.vocab_size`); 0 where unknown."""
    preset: str | None = None
    """The preset the model names (`ModelSpec.preset`); the export names its tokenizer."""
    rotary_base: int = 10000
    """RoPE settings and the norms' epsilon and gamma (`ModelSpec`): the export writes them; no
    cost reads them."""
    rotary_percent: float = 1.0
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    norm_epsilon: float = 1e-5
    zero_centered_gamma: bool = False
    flops_formula: str = "sc21"
    """Model FLOPs reported beside TFLOP/s: `sc21` (eq. 3 of [N21], what Megatron-LM logged
    for GPT in 2021-2022) or `megatron-core` (`num_floating_point_operations`, [MLM])."""

    fp8_gemms: bool = False
    """The linear layers' GEMMs run in FP8 (`precision: fp8`, Transformer Engine)."""
    fp8_current_scaling: bool = False
    """FP8 casts take each tensor's own amax (`TrainingSpec.fp8_recipe: tensorwise`)."""
    cp: int = 1
    """Context-parallel degree: each rank holds `tokens` = s/cp of every sequence [CP]."""
    cp_comm_type: str = "p2p"
    """How a CP group exchanges tokens for attention: p2p | a2a | allgather (`ParallelSpec`)."""
    ep: int = 1
    """Expert-parallel degree: a GPU holds E/ep of each MoE layer's routed experts
    (`cost.expert_parallel`)."""
    tp_per_etp: int = 1
    """q = t / etp: the TP degree over the experts' TP degree (Megatron-Core
    `expert_tensor_parallel_size`); 1: the experts split over the TP group like the dense
    layers. A GPU holds 1/etp of each of its experts' weights."""
    moe: MoeShape | None = None
    """The mixture-of-experts layers (`model.moe`); None: every MLP is dense. Every layer is
    priced at the mean of the model's dense and MoE layers (`moe.moe_fraction`)."""
    mla: MlaShape | None = None
    """Multi-head latent attention in every layer (`model.mla`); None: standard attention."""
    bucket_size_given: bool = True
    """`bucket_bytes` is the scenario's `training.bucket_size_mb`; False: it was unset and
    `bucket_bytes` holds 160 MB, the framework's default (`Plan.bucket_numel`)."""

    @property
    def given_bucket_numel(self) -> int | None:
        """The scenario's gradient elements per bucket (`bucket_bytes` / 4 bytes of fp32,
        `model.bucket_layout`); None where it leaves the framework's default."""
        return max(1, int(self.bucket_bytes // 4)) if self.bucket_size_given else None

    @property
    def ep_replicas(self) -> int:
        """Replicas (TP groups of t GPUs) one EP group spans: ep x etp / t = ep / q; the
        expert-data-parallel groups join every `ep_replicas`-th replica (`policies.groups`)."""
        return self.ep // self.tp_per_etp

    def expert_tp(self, tp: int) -> int:
        """The experts' tensor-parallel degree etp = t / q for TP degree `tp`."""
        return tp // self.tp_per_etp

    @property
    def tokens(self) -> int:
        """Sequence tokens one rank of a CP group holds: s/cp (s without CP)."""
        return self.seq // self.cp

    @property
    def groups(self) -> int:
        return self.query_groups or self.heads

    @property
    def kv_width(self) -> int:
        """k = h g / a: the width of K and of V (`kv_channels * num_query_groups`)."""
        return self.hidden * self.groups // self.heads

    @property
    def fc1_width(self) -> int:
        """The MLP's first GEMM's output width: 2f for a gated MLP (gate and up), else f."""
        return 2 * self.ffn if self.swiglu else self.ffn

    @property
    def norm_params(self) -> int:
        """One LayerNorm (weight and bias, 2h) or RMSNorm (weight, h)."""
        return self.hidden if self.rmsnorm else 2 * self.hidden

    @property
    def full_recompute(self) -> bool:
        return self.recompute == "full"

    # ---- parameters [N21] -------------------------------------------------------------------
    @property
    def layer_params(self) -> int:
        """Parameters of one layer a GPU holds times t (a whole TP group's); with MoE the mean
        over the layer pattern, rounded, with the routed experts' share t / (ep etp) = 1 /
        `ep_replicas` (a GPU holds 1/(ep etp) of them; 1/ep with etp = t) (`moe_mlp_params`)."""
        if self.moe is None:
            return self.dense_layer_params
        m, n = self.moe, self.ep_replicas
        held = self.layers_params - m.moe_layers * expert_params(m, self.hidden, self.swiglu,
                                                                 self.bias) * (n - 1) // n
        return round(held / self.num_layers)

    @property
    def layer_replicated_params(self) -> int:
        """Of `layer_params`, those every TP rank holds whole instead of 1/t of (mean over the
        layer pattern, rounded; `layer_kind_params`)."""
        if self.moe is None:
            return round(self.layer_kind_params(False)[2])
        moe = self.moe.moe_layers
        return round((moe * self.layer_kind_params(True)[2]
                      + (self.num_layers - moe) * self.layer_kind_params(False)[2])
                     / self.num_layers)

    def layer_kind_params(self, moe_layer: bool) -> tuple[float, float, float]:
        """One dense (`moe_layer` False) or MoE layer's (parameters a GPU holds times t, of
        them the routed experts' share in their own buffers, of them those each TP rank holds
        whole): `layer_params`, `expert_layer_params` and `layer_replicated_params` without the
        mean over the layer pattern. Held whole: the two norms, latent attention's duplicated
        down projections and latent norms (`MlaShape.replicated_params`), and an MoE layer's
        router, h E (Megatron-Core `TopKRouter.weight`, not split over TP), and the shared
        expert's gate, h (`SharedExpertMLP.gate_weight`, likewise)."""
        h, replicated = self.hidden, 2 * self.norm_params
        if self.mla is not None:
            replicated += self.mla.replicated_params(h, self.norm_params // h)
        if not moe_layer or self.moe is None:
            return float(self.dense_layer_params), 0.0, float(replicated)
        m, n = self.moe, self.ep_replicas
        experts = expert_params(m, h, self.swiglu, self.bias)
        layer = self.dense_layer_params - mlp_params(h, self.ffn, self.swiglu, self.bias) + \
            moe_mlp_params(m, h, self.swiglu, self.bias)
        own = experts / n if self.ep > 1 else 0.0
        return layer - experts * (n - 1) / n, own, \
            float(replicated + h * m.experts + shared_gate_params(m, h))

    @property
    def expert_layer_params(self) -> int:
        """Of `layer_params`, the routed experts' parameters (times t, the GPU's 1/(ep etp) share;
        mean over the layers, rounded) that Megatron-Core keeps in its `expert_parallel_buffers` and reduces
        over the expert-data-parallel group (megatron/core/distributed/
        distributed_data_parallel.py; expert weights carry `allreduce = not (is_expert and
        expert_parallel)`, megatron/core/extensions/transformer_engine.py): 0 without MoE or
        with ep = 1, where they sit in the dense buffers."""
        if self.moe is None or self.ep == 1:
            return 0
        m, n = self.moe, self.ep_replicas
        routed = m.moe_layers * expert_params(m, self.hidden, self.swiglu, self.bias)
        return round((routed - routed * (n - 1) // n) / self.num_layers)

    @property
    def layers_params(self) -> int:
        """Parameters of all transformer layers: dense layers plus MoE layers, whose MLP is the
        router, the routed experts and the shared expert."""
        dense, m = self.dense_layer_params, self.moe
        if m is None:
            return self.num_layers * dense
        h, gated = self.hidden, self.swiglu
        moe_layer = dense - mlp_params(h, self.ffn, gated, self.bias) + \
            moe_mlp_params(m, h, gated, self.bias)
        return (m.layers - m.moe_layers) * dense + m.moe_layers * moe_layer

    @property
    def dense_layer_params(self) -> int:
        """Parameters of one dense transformer layer: QKV h(h + 2k) (+ h + 2k bias), projection h^2
        (+ h), MLP h f1 + f h (+ f1 + h bias; f1 = 2f gated), two norms. Equals 12h^2 + 13h for
        GPT (k = h, f = 4h, biases, LayerNorm) [N21, eq. 2]; Megatron-Core
        `SelfAttention.linear_qkv`, `MLP.linear_fc1` (megatron/core/transformer/attention.py,
        mlp.py)."""
        h, qkv = self.hidden, self.hidden + 2 * self.kv_width
        mlp = mlp_params(h, self.ffn, self.swiglu, self.bias)
        if self.mla is not None:  # its projections and latent norms (`MlaShape.params`)
            return self.mla.params(h, self.norm_params // h, self.bias) + mlp + \
                2 * self.norm_params
        attention = h * qkv + h * h + (qkv if self.qkv_bias else 0) + (h if self.bias else 0)
        return attention + mlp + 2 * self.norm_params

    @property
    def embedding_params(self) -> int:
        """Word (V h) and, when learned, position (s h) embeddings, on the first stage."""
        position = self.seq * self.hidden if self.position_embedding == "learned" else 0
        return self.vocab * self.hidden + position

    @property
    def head_params(self) -> int:
        """Final norm plus the output projection (V h) on the last stage; with tied embeddings
        the last stage holds a copy of the word embedding [N21]."""
        return self.norm_params + self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        head = self.norm_params if self.tie_embeddings else self.head_params
        return self.layers_params + self.embedding_params + head

    # ---- FLOPs per micro-batch [N21, appendix] ------------------------------------------------
    @property
    def layer_forward_flop(self) -> float:
        """Forward FLOP of one layer for one micro-batch on one rank of a CP group: QKV
        2bsh(h + 2k), scores and weighted sum 4bs^2h, projection 2bsh^2, MLP 2bsh(f1 + f). With
        k = h, f = 4h: 24bsh^2 + 4bs^2h [N21]; with CP every term over cp [CP]. Latent
        attention's projections and core replace QKV, projection and scores (`model.mla`)."""
        b, s, h, f = self.micro_batch, self.tokens, self.hidden, self.ffn
        projections = 2 * b * s * h * (h + 2 * self.kv_width) + 2 * b * s * h * h
        scores = 4 * b * s * self.seq * h  # s/cp queries against all s keys [CP]
        if self.mla is not None:  # its projections and core (`MlaShape`)
            projections = self.mla.projection_forward_flop(b * s, h)
            scores = self.mla.core_forward_flop(b * s, self.seq)
        mlp = 2 * b * s * h * (self.fc1_width + f)
        if self.moe is not None:  # the mean over the layer pattern
            m = self.moe
            mlp += m.moe_fraction * (moe_mlp_forward_flop(m, b * s, h, self.swiglu) - mlp)
        return projections + scores + mlp

    @property
    def logits_forward_flop(self) -> float:
        """Output projection forward, 2bshV, on the last stage (s/cp tokens a rank) [N21]."""
        return 2 * self.micro_batch * self.tokens * self.hidden * self.vocab

    @property
    def backward_factor(self) -> float:
        """Backward FLOP as a multiple of forward: 2, plus 1 recomputed forward [N21]."""
        return 3.0 if self.full_recompute else 2.0

    # ---- messages (bytes) --------------------------------------------------------------------
    @property
    def pp_split_over_tp(self) -> bool:
        """Whether each TP rank sends 1/t of a pipeline message (`pp_message_bytes`)."""
        return self.sequence_parallel or self.pp_scatter_gather

    def pp_message_bytes(self, tp: int) -> float:
        """Bytes each TP rank sends of an activation (forward) or its gradient (backward)
        crossing a stage boundary: b s h elements (s/cp tokens with CP), divided by t with
        sequence parallelism (Megatron-Core `get_tensor_shapes`, schedules.py) or with
        Megatron-LM's scatter-gather of 2021-2022 [N21, section 4.1]; else every rank sends
        the whole tensor."""
        split = tp if self.pp_split_over_tp else 1
        return self.micro_batch * self.tokens * self.hidden * self.dtype_bytes / split

    def tp_allreduce_bytes(self) -> float:
        """One TP all-reduce of a layer's b s h activations (s/cp tokens) [N21, section 3.2]."""
        return self.micro_batch * self.tokens * self.hidden * self.dtype_bytes

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

    @property
    def gradient_buffer_passes(self) -> int:
        """Bytes per gradient byte a step moves over the GPU's whole gradient buffer outside the
        backward's kernels (Megatron-Core megatron/core/distributed/param_and_grad_buffer.py,
        core_r0.8.0 to the current main): the zeroing before the first micro-batch (1, a write:
        `ParamAndGradBuffer.reset`, `grad_data.zero_()`), the NaN check's norm of each bucket
        before its reduction (1, a read: `start_grad_sync`, `grad_data.norm(p=2)`) and the
        scaling by the averaging factor (2, a read and a write: `grad_data *=
        gradient_scaling_factor`), which averaging in the collective skips (factor 1,
        `ReduceOp.AVG`)."""
        return 1 + (1 if self.check_for_nan_in_grad else 0) + (0 if self.average_in_collective else 2)

    # ---- memory (bytes per GPU) [R20, K22] ----------------------------------------------------
    def state_bytes_per_param(self, dp: int, sharded: bool) -> float:
        """Weights + gradients + Adam state per parameter held through the iteration (bytes)
        [DO]: the weight in the training dtype, the gradient buffer in its reduction dtype
        (`grad_bytes`), fp32 momentum and variance (8) and an fp32 master weight for 16-bit
        weights (4), the last two sharded over DP with the distributed optimizer: bf16 with fp32
        gradients 18, or 6 + 12/dp; 16-bit gradients 16, or 4 + 12/dp; fp32 16, or 8 + 8/dp.
        Pass the expert-data-parallel size for expert parameters (their state is sharded over
        the replicas holding the same experts, `expert_layer_params`)."""
        optimizer = 8 + (4 if self.dtype_bytes < 4 else 0)
        return self.dtype_bytes + self.grad_bytes + optimizer / (dp if sharded else 1)

    def step_bytes_per_param(self, dp: int, sharded: bool) -> float:
        """Bytes per parameter the optimizer step adds while no activation is held: the fp32
        copy of 16-bit gradients it steps with (4, or 4/dp sharded; Megatron-Core's
        `_copy_model_grads_to_main_grads`, `main_grad.float()`), which makes [DO]'s 20 and
        4 + 16/dp for fp16; none for fp32 gradients, which it steps with in place."""
        return (4 if self.grad_bytes < 4 else 0) / (dp if sharded else 1)

    def output_activation_bytes(self, tp: int) -> float:
        """Activations of the output layer and the cross-entropy loss for one micro-batch, held
        on the last stage between its forward and backward: 4 s b (h + V) / t bytes (the output
        layer's input and the fp32 logits the loss keeps for its gradient; s/cp tokens a rank),
        Megatron-LM's `compute_activation_memory` (megatron/training/theoretical_memory_usage.py,
        "Inputs to output layer and CE loss")."""
        return 4 * self.tokens * self.micro_batch * (self.hidden + self.vocab) / tp

    def activation_bytes_per_layer(self, tp: int) -> float:
        """Activations one layer holds for one micro-batch until its backward [K22, Table 2]:
        s b h (34 + 5 a s / h) without parallelism; with TP t: s b h (10 + 24/t + 5 a s/(h t));
        with sequence parallelism everything is divided by t; with full recomputation only the
        layer input, 2 s b h (divided by t with SP). Selective recomputation (or fused attention,
        which never stores the scores) drops the 5as/h term [K22, Table 2].
        The terms, in bytes per s b h element with 2-byte values [K22, section 4.1]: replicated
        over TP, the two norm inputs (4), the QKV and fc1 inputs (2 + 2) and the two dropout
        masks (2, none when hidden_dropout is 0); split over TP, Q (2), K and V (4k/h), the
        projection input (2), the MLP's activation input (2 f1/h) and fc2 input (2f/h); the scores
        (5as/h: softmax output 2, dropout mask 1 and output 2; 2as/h without attention dropout).
        An MoE layer's terms are `_moe_activation_terms`'; those its expert-TP group all-gathers
        count etp times (etp/t of the s b h elements a GPU holds under SP).
        fp32 training doubles the values, not the 1-byte masks or the fp32 router logits.
        With CP every term is divided by cp (s/cp tokens, s/cp x s scores a rank) [CP]; a2a
        adds the attention output before its all-to-all, d b (s/cp) h/t: TE's
        `AttnFuncWithCPAndQKVOA2A` saves it (`out_part`) apart from the output after it, which
        the projection keeps (p2p and allgather save the returned output itself); not under
        recomputation, selective (which checkpoints the core attention) or full."""
        s, b, h, a = self.seq, self.micro_batch, self.hidden, self.heads
        if self.cp > 1:  # every term over cp: s/cp tokens, s/cp x s scores a rank [CP]
            pre_a2a = self.cp_comm_type == "a2a" and self.recompute == "none"
            return (replace(self, cp=1).activation_bytes_per_layer(tp) / self.cp
                    + pre_a2a * self.dtype_bytes * b * self.tokens * h / tp)
        v = self.dtype_bytes / 2  # values scale with the dtype; masks and router logits do not
        if self.full_recompute:
            return 2 * v * s * b * h / (tp if self.sequence_parallel else 1)
        scores = 0.0
        if self.recompute != "selective" and not self.flash_attention:
            scores = (4 * v + 1 if self.attention_dropout > 0 else 2 * v) * a * s / h
        replicated = 8 * v + (2 if self.hidden_dropout > 0 else 0)
        split = v * (4 + 4 * self.kv_width / h + 2 * (self.fc1_width + self.ffn) / h)
        if self.mla is not None:  # its latents, Q, K, V and projection input (`MlaShape`)
            extra_replicated, attention_split = self.mla.activation_terms(h)
            replicated += v * extra_replicated
            split += v * (attention_split - 4 - 4 * self.kv_width / h)
        gathered = 0.0
        if self.moe is not None:
            extra_replicated, extra_split, gathered = self._moe_activation_terms(v)
            replicated, split = replicated + extra_replicated, split + extra_split
            gathered *= max(1, self.expert_tp(tp))
        if self.sequence_parallel:
            return s * b * h * (replicated + split + scores + gathered) / tp
        return s * b * h * (replicated + gathered + split / tp + scores / tp)

    def _moe_activation_terms(self, v: float) -> tuple[float, float, float]:
        """What an MoE MLP stores beyond a dense MLP, per s b h element and averaged over the
        layer pattern, (replicated over TP, split over TP, gathered over expert TP); `v`: value
        bytes over 2 (2 in fp32 training). Replicated: the fp32 router logits (4E/h) and, with
        the shared expert's gate, its output and 1-wide score, kept for their product
        (2 (h + 1)/h; `SharedExpertMLP.forward`). Split: each routed expert's and the shared
        expert's activation and fc2 inputs in place of the dense MLP's (2 k (f1_e + f_e)/h +
        2 (f1_s + f_s)/h). Gathered, for the tokens of the GPU's etp-wide expert-TP group: the
        k permuted rows the grouped fc1 keeps as its input (2k) and their probabilities, which
        the weighted activation keeps (2k/h). `MoEAlltoAllTokenDispatcher.dispatch_postprocess`
        all-gathers both over the expert-TP group (`gather_from_sequence_parallel_region`,
        megatron/core/transformer/moe/token_dispatcher.py) and `TEGroupedLinear` runs with
        tp_size 1 on them (`explicit_expert_comm`, megatron/core/extensions/
        transformer_engine.py), so a GPU holds etp/t of them under SP; its fc1 output and fc2
        input have etp times the rows at 1/etp of the width, so they stay split over t."""
        m, h = self.moe, self.hidden
        e = 2 if self.swiglu else 1  # f1 = e f
        replicated = 4 * m.experts / h + (2 * v * (h + 1) / h if m.shared_gate and m.shared_ffn
                                          else 0.0)
        split = 2 * v * ((e + 1) * (m.topk * m.ffn + m.shared_ffn) - self.fc1_width - self.ffn) / h
        gathered = 2 * v * m.topk * (h + 1) / h
        return m.moe_fraction * replicated, m.moe_fraction * split, m.moe_fraction * gathered

    # ---- reporting ----------------------------------------------------------------------------
    def megatron_tflops_per_gpu(self, iteration_s: float, num_gpus: int) -> float:
        """TFLOP/s per GPU as Megatron-LM logs it, with `flops_formula`'s model FLOPs: `sc21`
        counts the recomputed forward under full recomputation (96 for 72, [N21]);
        `megatron-core` never does ([MLM])."""
        return self._flop(hardware=True) / (iteration_s * num_gpus) / 1e12

    def model_flop_per_iteration(self) -> float:
        """Model FLOP of one iteration (no recomputation): the MFU numerator."""
        return self._flop(hardware=False)

    def _flop(self, hardware: bool) -> float:
        B, s, L, h, V = self.global_batch, self.seq, self.num_layers, self.hidden, self.vocab
        if self.flops_formula == "sc21":
            return sc21_flop(96 if (hardware and self.full_recompute) else 72, B, s, L, h, V)
        mlp_term = None if self.moe is None else \
            megatron_mlp_term(self.moe, h, self.ffn, self.swiglu)
        attention_term = None if self.mla is None else self.mla.megatron_attention_term(h, s)
        return megatron_core_flop(B, s, L, h, V, self.ffn, self.heads, self.groups, self.swiglu,
                                  mlp_term=mlp_term, attention_term=attention_term)


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: up to a multiple of divisible_by x t
    (`_vocab_size_with_padding`, megatron/training/tokenizer/tokenizer.py)."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def expert_ffn_width(model: ModelSpec) -> int:
    """One routed expert's FFN width: `moe_ffn_hidden_size`, else the dense FFN's (Megatron's
    `--moe-ffn-hidden-size` default), else 4h."""
    return model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size


def moe_shape(model: ModelSpec) -> MoeShape | None:
    """The MoE part of `model`, None for a dense model."""
    if model.num_experts is None:
        return None
    return MoeShape(
        experts=model.num_experts, topk=model.moe_router_topk,
        ffn=expert_ffn_width(model),
        shared_ffn=model.moe_shared_expert_intermediate_size or 0,
        shared_gate=model.moe_shared_expert_gate,
        pattern=moe_layer_pattern(model.moe_layer_freq, model.num_layers),
        capacity_factor=model.moe_expert_capacity_factor, imbalance=model.moe_expert_imbalance,
        load_balancing=model.moe_router_load_balancing_type, routing=model.moe_routing,
        router=moe_router(model))


def moe_router(model: ModelSpec) -> MoeRouter:
    """`model`'s router settings with their defaults resolved: the balancing loss weighted
    `AUX_LOSS_COEFF_START` where its type has a loss and none is given, pre-softmax scoring where
    Megatron-Core requires it (top-1 softmax routing but sinkhorn's) and none is given."""
    balancing = model.moe_router_load_balancing_type
    coeff, pre_softmax = model.moe_aux_loss_coeff, model.moe_router_pre_softmax
    chosen = []
    if coeff is None:
        coeff = AUX_LOSS_COEFF_START if balancing.endswith("aux_loss") else 0.0
        chosen += ["moe_aux_loss_coeff"] if coeff else []
    if pre_softmax is None:
        pre_softmax = (model.moe_router_topk == 1 and balancing != "sinkhorn"
                       and model.moe_router_score_function == "softmax")
        chosen += ["moe_router_pre_softmax"] if pre_softmax else []
    return MoeRouter(aux_loss_coeff=coeff, pre_softmax=pre_softmax, chosen=tuple(chosen),
                     score_function=model.moe_router_score_function,
                     expert_bias=model.moe_router_enable_expert_bias,
                     topk_scaling=model.moe_router_topk_scaling_factor,
                     num_groups=model.moe_router_num_groups,
                     group_topk=model.moe_router_group_topk)


def _is_gpt(model: ModelSpec) -> bool:
    """The GPT-2/3 architecture [N21]'s eq. 3 counts: MHA, GeLU MLP of width 4h, LayerNorm,
    biases, learned positions, dense."""
    ffn = model.ffn_hidden_size or 4 * model.hidden_size
    return (model.num_query_groups in (None, model.num_attention_heads) and not model.swiglu
            and not model.squared_relu and ffn == 4 * model.hidden_size
            and model.normalization == "layernorm" and model.bias
            and model.position_embedding == "learned" and model.num_experts is None
            and not model.multi_latent_attention)


def build_workload(model: ModelSpec, training: TrainingSpec, tp: int = 1, cp: int = 1,
                   cp_comm_type: str = "p2p", ep: int = 1, etp: int | None = None) -> Workload:
    """Resolve defaults (FFN 4h, gradient dtype, vocabulary padded for TP degree `tp`) into a
    Workload for context-parallel degree `cp`, expert-parallel degree `ep` and the experts' TP
    degree `etp` (None: `tp`). GPT models report [N21]'s FLOPs, every other architecture
    [MLM]'s."""
    check_model(model)
    check_attention_backend(training)
    check_mla(model, cp, training.precision)
    dtype = _DTYPE_BYTES[training.precision]
    return Workload(
        num_layers=model.num_layers, hidden=model.hidden_size, heads=model.num_attention_heads,
        seq=model.seq_length,
        vocab=padded_vocab(model.vocab_size, model.make_vocab_size_divisible_by, tp),
        ffn=model.ffn_hidden_size or 4 * model.hidden_size, tie_embeddings=model.tie_embeddings,
        micro_batch=training.micro_batch_size, global_batch=training.global_batch_size,
        dtype_bytes=dtype, grad_bytes=4 if training.grad_reduce_in_fp32 else dtype,
        recompute=training.recompute, sequence_parallel=training.sequence_parallel,
        bucket_bytes=160e6 if training.bucket_size_mb is None else training.bucket_size_mb * 1e6,
        bucket_size_given=training.bucket_size_mb is not None,
        flash_attention=training.flash_attention, attention_backend=training.attention_backend,
        tp_comm_overlap=training.tp_comm_overlap, ub_rs_sms=training.tp_comm_overlap_rs_sms,
        async_tp_allreduce=training.async_tensor_model_parallel_allreduce,
        overlap_p2p_comm=training.overlap_p2p_comm,
        defer_embedding_wgrad=training.defer_embedding_wgrad_compute,
        pp_scatter_gather=training.scatter_gather_tensors_in_pipeline,
        cross_entropy=training.cross_entropy_fusion_impl if training.cross_entropy_loss_fusion
        else "unfused",
        pipeline_split=PipelineSplit.of(training), fp8_gemms=training.precision == "fp8",
        fp8_current_scaling=training.precision == "fp8" and training.fp8_recipe == "tensorwise",
        average_in_collective=training.ddp_average_in_collective,
        nvls_enable=training.nccl_nvls_enable,
        check_for_nan_in_grad=training.check_for_nan_in_loss_and_grad,
        query_groups=model.num_query_groups,
        swiglu=model.swiglu, squared_relu=model.squared_relu,
        bias_added_apart=model.bias and not model.swiglu and (
            model.squared_relu or model.num_experts is not None),
        rmsnorm=model.normalization == "rmsnorm", bias=model.bias,
        qkv_bias=model.bias if model.qkv_bias is None else model.qkv_bias,
        position_embedding=model.position_embedding, hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        vocab_divisible_by=model.make_vocab_size_divisible_by,
        vocab_size=model.vocab_size, preset=model.preset, rotary_base=model.rotary_base,
        rotary_percent=model.rotary_percent, rope_scaling=model.rope_scaling,
        rope_scaling_factor=model.rope_scaling_factor, norm_epsilon=model.norm_epsilon,
        zero_centered_gamma=model.layernorm_zero_centered_gamma,
        flops_formula="sc21" if _is_gpt(model) else "megatron-core", cp=cp,
        cp_comm_type=cp_comm_type, ep=ep, tp_per_etp=tp // (etp or tp), moe=moe_shape(model),
        mla=mla_shape(model),
    )
