"""YAML-facing job specs: the model, the training batch, the parallel set-up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A decoder-only transformer (Megatron-Core conventions); the defaults are GPT's."""

    name: str = "gpt"
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    """Sequence length in tokens."""
    vocab_size: int = 51200
    """Vocabulary; padded up to a multiple of make_vocab_size_divisible_by x TP as Megatron pads
    it (GPT-2's 50,257 becomes 51,200 for TP up to 8; 51,200 stays 51,200)."""
    ffn_hidden_size: int | None = None
    """MLP width; default 4 * hidden_size."""
    tie_embeddings: bool = True
    """Input embedding and output head share weights (Megatron default): the first and last
    stages then all-reduce the embedding gradient."""
    preset: str | None = None
    """A named architecture (`holmes_sim.spec.presets`); fields given beside it override it."""
    num_query_groups: int | None = None
    """Key/value head groups (grouped-query attention; 1 = multi-query); default
    num_attention_heads (multi-head attention). Megatron `--num-query-groups`."""
    swiglu: bool = False
    """Gated MLP (SwiGLU): fc1 is h x 2f (gate and up), fc2 f x h. Megatron `--swiglu`."""
    squared_relu: bool = False
    """MLP activation squared ReLU instead of GeLU (Nemotron-4; Megatron `--squared-relu`): not
    gated, so the same GEMMs, FLOPs and memory traffic."""
    normalization: Literal["layernorm", "rmsnorm"] = "layernorm"
    """Megatron `--normalization`: LayerNorm (weight and bias) or RMSNorm (weight only)."""
    bias: bool = True
    """Biases on the linear layers (Megatron `add_bias_linear`; `--disable-bias-linear`)."""
    qkv_bias: bool | None = None
    """Bias on the QKV projection alone (Megatron `--add-qkv-bias`); default `bias`."""
    position_embedding: Literal["learned", "rope", "none"] = "learned"
    """Megatron `--position-embedding-type`: a learned s x h table, rotary (applied to q and
    k in every layer), or none."""
    hidden_dropout: float = 0.1
    """Dropout after the attention projection and the MLP (Megatron `--hidden-dropout`); 0
    removes the dropout masks and their kernels."""
    attention_dropout: float = 0.1
    """Dropout of the attention probabilities (Megatron `--attention-dropout`)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads vocab_size up to a multiple of this times the TP degree."""
    rotary_base: int = 10000
    """RoPE base theta (Megatron `--rotary-base`, Hugging Face `rope_theta`; default 10000),
    read only with position_embedding rope. Like every field down to
    layernorm_zero_centered_gamma it changes the model's numbers, not its cost: the export
    writes it, the simulation does not read it."""
    rotary_percent: float = 1.0
    """Share of each head's dimensions RoPE rotates (Megatron `--rotary-percent`, Hugging Face
    `partial_rotary_factor`; default 1), read only with position_embedding rope."""
    rope_scaling: bool = False
    """Llama 3.1's RoPE frequency scaling (Megatron `--use-rope-scaling`: low factor 1, high
    factor 4, original context 8,192), read only with position_embedding rope."""
    rope_scaling_factor: float = 8.0
    """The scaling's factor (Megatron `--rope-scaling-factor`, default 8), read only with
    rope_scaling."""
    norm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm/RMSNorm (Megatron `--norm-epsilon`, Megatron-Core
    `layernorm_epsilon`; default 1e-5)."""
    layernorm_zero_centered_gamma: bool = False
    """The norms' weights are stored centered on 0 and applied as 1 + weight (Nemotron;
    Megatron `--apply-layernorm-1p`)."""
    num_experts: int | None = None
    """Routed experts of each MoE layer (Megatron `--num-experts`); None: a dense model."""
    moe_router_topk: int = 2
    """Experts each token is routed to (Megatron `--moe-router-topk`)."""
    moe_ffn_hidden_size: int | None = None
    """One routed expert's FFN width (Megatron `--moe-ffn-hidden-size`); default ffn_hidden_size."""
    moe_shared_expert_intermediate_size: int | None = None
    """FFN width of the shared experts every token passes (Megatron
    `--moe-shared-expert-intermediate-size`); None: no shared expert."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by a sigmoid gate of the token, a 1 x hidden_size weight
    per MoE layer (Megatron `--moe-shared-expert-gate`, from core_v0.16.0; Hugging Face
    Qwen2-MoE's `shared_expert_gate`); needs moe_shared_expert_intermediate_size."""
    moe_layer_freq: int | tuple[int, ...] = 1
    """Which layers are MoE (Megatron `--moe-layer-freq`): N makes layer i MoE when i % N == 0;
    a list of 0/1, one per layer, gives the pattern (0: dense MLP)."""
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss",
                                            "sinkhorn", "none"] = "aux_loss"
    """Router load-balancing loss (Megatron `--moe-router-load-balancing-type`); every type but
    none reads the router probabilities once more in the forward."""
    moe_aux_loss_coeff: float | None = None
    """Weight of the load-balancing loss (Megatron `--moe-aux-loss-coeff`, whose default 0
    trains without one); None: 0.01 with aux_loss, seq_aux_loss or global_aux_loss (Megatron-Core's
    recommended starting value, its Mixtral example's), 0 with sinkhorn or none. Like every
    router field down to moe_router_group_topk it changes the model's numbers, and the export
    writes it; of its cost only whether it is 0 counts (Megatron-Core then skips the loss and
    its read of the router probabilities, `MoeShape.aux_loss`)."""
    moe_router_pre_softmax: bool | None = None
    """Score every expert before the top-k (Megatron `--moe-router-pre-softmax`), so the k
    weights are not renormalized (Hugging Face `norm_topk_prob: false`); None: only where
    Megatron-Core requires it, top-1 softmax routing without sinkhorn."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """The router's score function (Megatron `--moe-router-score-function`)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing by a per-expert routing bias (DeepSeek-V3; Megatron
    `--moe-router-enable-expert-bias`); needs sigmoid scoring."""
    moe_router_topk_scaling_factor: float | None = None
    """Factor on the top-k weights (Megatron `--moe-router-topk-scaling-factor`, Hugging Face
    `routed_scaling_factor`); None: none."""
    moe_router_num_groups: int | None = None
    """Expert groups of group-limited routing (Megatron `--moe-router-num-groups`, Hugging Face
    `n_group`); None: no group limit. Given with moe_router_group_topk."""
    moe_router_group_topk: int | None = None
    """Groups each token's experts come from (Megatron `--moe-router-group-topk`, Hugging Face
    `topk_group`)."""
    moe_expert_capacity_factor: float | None = None
    """Expert capacity as a multiple of the mean tokens per expert (Megatron
    `--moe-expert-capacity-factor`); tokens beyond it are dropped. None: dropless."""
    moe_expert_imbalance: float = 1.0
    """Tokens of the busiest expert over the mean tokens per expert (1: perfectly balanced);
    at most num_experts / moe_router_topk (every token picks it). With every expert on each GPU
    (no expert parallelism) it changes the time only through a capacity factor's drops."""
    moe_routing: Literal["random", "even"] = "random"
    """How each micro-batch's tokens spread over the experts. random: each token's k experts an
    independent draw, balanced in expectation (Megatron's `--moe-router-force-load-balancing`
    routes exactly so; a learned router kept balanced by its loss does so at best), so in each
    MoE layer the busiest expert-parallel rank gets its share plus the draw's expected maximum
    excess; even: every expert exactly its share (the testbed backend's round-robin routing)."""
    multi_latent_attention: bool = False
    """Multi-head latent attention (DeepSeek-V2/V3; Megatron `--multi-latent-attention`,
    `MLASelfAttention`): queries, keys and values come from low-rank latents (`model.mla`).
    Not with num_query_groups; needs position_embedding rope."""
    q_lora_rank: int | None = None
    """MLA's query latent (Megatron `--q-lora-rank`); None: queries projected directly."""
    kv_lora_rank: int | None = None
    """MLA's key/value latent (Megatron `--kv-lora-rank`); default 32, Megatron's."""
    qk_head_dim: int | None = None
    """MLA: per head, the query/key dimension without rotary embedding (Megatron
    `--qk-head-dim`); default 128."""
    qk_pos_emb_head_dim: int | None = None
    """MLA: per head, the rotary query/key dimension, the key's shared by all heads (Megatron
    `--qk-pos-emb-head-dim`); default 64."""
    v_head_dim: int | None = None
    """MLA: per head, the value dimension (Megatron `--v-head-dim`); default 128."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingSpec:
    """One training iteration's batch and numerics."""

    global_batch_size: int
    """Sequences per iteration."""
    micro_batch_size: int
    """Sequences per micro-batch."""
    precision: Literal["bf16", "fp16", "fp32", "fp8"] = "bf16"
    """Training numerics. fp8: the linear layers' GEMMs (forward, dgrad, wgrad) run at the GPU's
    FP8 tensor rate (Transformer Engine, delayed or current scaling); everything else, the
    stored activations and the communication stay bf16."""
    fp8_recipe: Literal["delayed", "tensorwise"] = "delayed"
    """Megatron-LM `--fp8-recipe` (Megatron-Core `TransformerConfig.fp8_recipe`, default
    delayed), read only with precision fp8: `delayed` scales each tensor by the amax history of
    earlier steps; `tensorwise` (per-tensor current scaling, Megatron-Bridge's FP8-CS) takes
    each tensor's own amax before its cast: one more read of it, the norms' outputs written in
    bf16 and cast after, and under sequence parallelism a TP all-reduce of the amax for each
    gathered input and output gradient (Transformer Engine v2.8 on)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation: full recomputes every layer's forward in the backward;
    selective only the attention core (Korthikanti et al. 2022)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: LayerNorm and dropout work and their activations split over
    TP; each TP all-reduce becomes a reduce-scatter plus an all-gather."""
    flash_attention: bool = False
    """Fused attention kernel (FlashAttention): no s x s scores in memory."""
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = "auto"
    """Megatron-LM `--attention-backend` (Megatron-Core `TransformerConfig.attention_backend`,
    enum `AttnBackend`, default auto): which of Transformer Engine's attention kernels runs.
    auto lets TE choose, which on Hopper is its cuDNN FusedAttention (priced at
    `GpuModel.attention_rates`); fused forces cuDNN; flash forces FlashAttention-2 (flash-attn
    2.x, `GpuModel.flash_attention_rates`), as TE 1.x ran with `NVTE_FUSED_ATTN=0` (NeMo 24.07's
    launcher). flash and fused need flash_attention; unfused (TE's unfused kernels) needs it off.
    local, Megatron-Core's own attention, runs only under a layer spec without TE (`--spec local`
    in Megatron-LM's `validate_args`), which holmes-sim does not model: refused."""
    tp_comm_overlap: bool = False
    """Megatron-LM `--tp-comm-overlap` (Megatron-Core `ModelParallelConfig.tp_comm_overlap`,
    default off): Transformer Engine's userbuffer overlap of every TP all-gather and
    reduce-scatter, forward and backward, with the GEMM beside it. Needs sequence_parallel and
    TP > 1."""
    tp_comm_overlap_rs_sms: int = 16
    """With tp_comm_overlap: SMs each of the forward's two userbuffer reduce-scatters (TE
    `proj_fprop`, `fc2_fprop`) holds beside its GEMM, which runs on the SMs left (`set_sm_margin`):
    16, Transformer Engine's `pipeline` default (`initialize_ub`,
    transformer_engine/pytorch/module/base.py), as NeMo's tuned H100 configurations give 16-24;
    1 where the `--tp-comm-overlap-cfg` file runs them as `ring_exchange` with `num_sm: 1`
    (Megatron-Bridge's FP8 H100 configurations, training/comm_overlap.py); 0 for none. The
    export writes the TE configuration file for any value but 0, which TE cannot express
    (`export.model_args.userbuffer_config`)."""
    async_tensor_model_parallel_allreduce: bool = False
    """The backward's TP all-reduce (reduce-scatter with SP) of each column-parallel linear's
    input gradient runs concurrently with that linear's weight-gradient GEMM: Megatron-LM's
    asynchronous tensor-parallel all-reduce of 2022 (`--async-tensor-model-parallel-allreduce`,
    Korthikanti et al. section 6.2; absent from the 2021 code of Narayanan et al. SC'21). Off
    by default so 2021 replays keep their semantics."""
    overlap_param_gather: bool = False
    """Megatron-LM `--overlap-param-gather` (default off): the distributed optimizer's parameter
    all-gather runs bucket by bucket ahead of the next forward, which waits only for the bucket
    it needs. Needs distributed_optimizer and overlap_grad_reduce (megatron policy)."""
    overlap_p2p_comm: bool = False
    """Pipeline sends and receives overlap compute (interleaved schedule only): each receive is
    posted when the stage's previous op of its kind ends, so in the steady phase it runs while
    the op before it computes (Megatron-Core
    `ModelParallelConfig.overlap_p2p_comm`, default off; pretrain_gpt.py turns it on for the
    interleaved schedule unless `--no-overlap-p2p-communication`). Off: batched, blocking
    point-to-point (`batch_p2p_comm`)."""
    scatter_gather_tensors_in_pipeline: bool = False
    """Megatron-LM's scatter-gather of pipeline messages [N21, section 4.1]: without sequence
    parallelism each TP rank sends 1/t of the activation and the receiving TP group all-gathers
    it over NVLink. On by default in Megatron-LM from 72e4230 (2021-02-16) until its pipeline
    communication moved into Megatron-Core (39b83c7, 2023-01-31), which has none: each TP rank
    sends the whole b s h tensor (1/t of it with sequence parallelism, whose activations are
    split already). Off: current Megatron-LM, the Holmes fork, Megatron-LLaMA; on: Megatron-LM
    of 2021-2022 (the SC'21 and K22 replays), and Megatron-DeepSpeed, whose DeepSpeed pipeline
    engine splits them over the model-parallel group (`PipelineEngine.is_pipe_partitioned`; the
    scenario's setting applies to every policy). Current Megatron-LM cannot launch it."""
    defer_embedding_wgrad_compute: bool = False
    """Megatron-LM `--defer-embedding-wgrad-compute` (default off; PP > 1): the output layer's
    weight-gradient GEMMs of every micro-batch run after the last stage's final backward
    (`finish_embedding_wgrad_compute`), during the pipeline flush."""
    cross_entropy_loss_fusion: bool = False
    """Megatron-LM `--cross-entropy-loss-fusion` (Megatron-Core
    `TransformerConfig.cross_entropy_loss_fusion`, default off; on in Megatron-Bridge's GPT
    model providers): the vocabulary-parallel cross entropy runs as the fused kernels of
    `cross_entropy_fusion_impl` instead of PyTorch's separate fp32 passes."""
    cross_entropy_fusion_impl: Literal["native", "te"] = "native"
    """Megatron-LM `--cross-entropy-fusion-impl` (default native), read only with
    cross_entropy_loss_fusion: Megatron-Core's jit-fused functions
    (megatron/core/fusions/fused_cross_entropy.py) or Transformer Engine's Triton kernels
    (`parallel_cross_entropy`)."""
    decoder_first_pipeline_num_layers: int | None = None
    """Megatron-LM `--decoder-first-pipeline-num-layers`: layers of the first pipeline stage
    (megatron policy); the others split the rest evenly."""
    decoder_last_pipeline_num_layers: int | None = None
    """Megatron-LM `--decoder-last-pipeline-num-layers`: layers of the last pipeline stage."""
    account_for_embedding_in_pipeline_split: bool = False
    """Megatron-LM `--account-for-embedding-in-pipeline-split`: the input embedding counts as
    one layer of the first (virtual) stage in the even split."""
    account_for_loss_in_pipeline_split: bool = False
    """Megatron-LM `--account-for-loss-in-pipeline-split`: the output layer and loss count as
    one layer of the last (virtual) stage in the even split."""
    overlap_grad_reduce: bool = False
    """Gradient reduction overlapped with the backward, bucket by bucket (PyTorch DDP, Megatron
    `--overlap-grad-reduce`); used by the megatron policy (holmes always overlaps)."""
    distributed_optimizer: bool = True
    """Shard optimizer state across DP (used by the megatron policy; holmes always shards)."""
    grad_reduce_in_fp32: bool = True
    """Gradients are reduced in fp32 (Megatron's default for bf16), else in the training dtype."""
    ddp_average_in_collective: bool = False
    """Megatron-LM `--ddp-average-in-collective` (Megatron-Core
    `DistributedDataParallelConfig.average_in_collective`, default off; on in NeMo 2.0's and
    Megatron-Bridge's recipes): the data-parallel reduction averages (NCCL `AVG`), so the
    gradient buffer is not scaled by 1/DP before it (one read and one write fewer per gradient
    and step)."""
    nccl_nvls_enable: bool = True
    """NCCL's `NCCL_NVLS_ENABLE` as the job sets it: true for NCCL's default (2: NVLink SHARP's
    NVLS and NVLS-tree wherever the NVSwitch has it, H100 / H200 / B200 / GB200), false for 0,
    which no collective then runs as (NVIDIA/nccl src/transport/nvls.cc `ncclNvlsInit`). NeMo
    Framework Launcher (conf/config.yaml env_vars, since 2023-09) and Megatron-Bridge's
    performance scripts (scripts/performance/utils/executors.py) set 0, "to save memory"."""
    check_for_nan_in_loss_and_grad: bool = True
    """Megatron-LM's NaN check (on unless `--no-check-for-nan-in-loss-and-grad`; Megatron-Core
    `DistributedDataParallelConfig.check_for_nan_in_grad`): each gradient bucket's norm is
    computed before its reduction (one more read of the gradient buffer per step)."""
    bucket_size_mb: float | None = None
    """Gradient bucket size in MB of fp32 elements: Megatron-Core's `bucket_size` elements x 4,
    whatever the gradient dtype; a bucket closes at the first parameter boundary past it
    (`model.bucket_layout`). None (unset): the framework's default, Megatron-Core's
    max(40M, 1M x dp) elements, 40M (160 MB) for the others (`Plan.bucket_numel`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelSpec:
    """Parallel degrees and the pipeline schedule."""

    tensor: int = 1
    pipeline: int = 1
    data: int | None = None
    """Data-parallel degree; default: GPUs / (tensor * pipeline * context)."""
    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    virtual_stages: int = 1
    """Model chunks per pipeline stage (interleaved schedule only)."""
    context: int = 1
    """Context-parallel degree (Megatron `--context-parallel-size`): each rank of a CP group
    holds s/context tokens of every sequence; GPUs = tensor x context x data x pipeline."""
    expert: int = 1
    """Expert-parallel degree (Megatron `--expert-model-parallel-size`): each rank of an EP group
    holds num_experts / expert of every MoE layer's routed experts; an EP group is `expert`
    consecutive data-parallel replicas when the experts' TP degree is `tensor`."""
    expert_tensor: int | None = None
    """The experts' tensor-parallel degree (Megatron-Core `--expert-tensor-parallel-size`, MoE
    parallel folding); None: `tensor`. Expert ranks follow Megatron-Core's expert order
    "tp-ep-dp-pp": ETP fastest, then EP, then expert-data-parallel, within each pipeline stage.
    holmes-sim takes a divisor of `tensor` with expert x expert_tensor a multiple of `tensor`
    (an EP group spans whole TP groups)."""
    cp_comm_type: Literal["p2p", "a2a", "allgather"] = "p2p"
    """How a CP group's attention gets the other ranks' tokens (Megatron `--cp-comm-type`):
    p2p passes K and V chunks around a ring overlapped with attention (ring attention), a2a
    swaps the sequence split for a head split by all-to-all (Ulysses), allgather gathers the
    whole sequence's K and V before attention."""
