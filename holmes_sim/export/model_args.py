"""Megatron-LM arguments of a model's architecture beyond GPT's defaults.

Flag names and defaults follow Megatron-LM's megatron/training/arguments.py:
`--group-query-attention --num-query-groups`, `--swiglu`, `--squared-relu` (with biases also
`--no-bias-gelu-fusion`: Megatron-Core's `TransformerConfig` refuses the default bias-activation
fusion for any activation but GeLU and SwiGLU, since 6b3b884, 2024-01; so does an MoE model's
GeLU with biases, whose grouped experts fuse a bias only into SwiGLU and quick-GeGLU:
`TEGroupedMLP.forward`, megatron/core/transformer/moe/experts.py, "Only support fusion of
swiglu and quick_gelu in TEGroupedMLP."; without biases Megatron-LM turns the GeLU fusion off
itself), `--normalization`
(LayerNorm default), `--disable-bias-linear`, `--add-qkv-bias`, `--position-embedding-type`
(learned_absolute default), `--hidden-dropout` and `--attention-dropout` (0.1 default),
`--make-vocab-size-divisible-by` (128 default; written so Megatron-LM pads the tokenizer's
vocabulary to the simulated one, `vocab_args`), `--multi-latent-attention` with `--q-lora-rank`,
`--kv-lora-rank`, `--qk-head-dim`, `--qk-pos-emb-head-dim`, `--v-head-dim` (`_add_mla_args`;
all written, the latent norms as `--qk-layernorm`), and with RoPE `--rotary-base` (10000
default), `--rotary-percent` (1.0), `--use-rope-scaling` with `--rope-scaling-factor` (8.0; `pretrain_gpt.py` does not pass the
factor on: `rope_factor_note`), and
`--norm-epsilon` (1e-5), `--apply-layernorm-1p` (`rope_norm_args`; at HEAD the last two come
from Megatron-Core's `TransformerConfig.layernorm_epsilon` and
`layernorm_zero_centered_gamma`). Nothing else is written for a value equal to Megatron's
default. The Holmes fork's arguments.py (2024-08) has no `--rotary-base`, `--use-rope-scaling`
or `--rope-scaling-factor` (`FORK_LACKS`).

The overlaps and the uneven split (`overlap_args`, `split_args`): `--tp-comm-overlap`,
`--no-overlap-p2p-communication` (pretrain_gpt.py overlaps p2p on the interleaved schedule
unless told not to), `--defer-embedding-wgrad-compute`, `--decoder-first-pipeline-num-layers`,
`--decoder-last-pipeline-num-layers`, `--account-for-embedding-in-pipeline-split`,
`--account-for-loss-in-pipeline-split`. The 2022 asynchronous TP all-reduce has no flag in
current Megatron-LM (always on), so nothing is written for it. The fused cross entropy
(`loss_args`): `--cross-entropy-loss-fusion`, with `--cross-entropy-fusion-impl te` for
Transformer Engine's kernels (native is the default). The attention kernel (`attention_args`):
`--attention-backend` (auto default; `type=AttnBackend[name]`, since fa0dcc4, 2024-12).
"""

from __future__ import annotations

from holmes_sim.model.moe import MoeRouter
from holmes_sim.model.pipeline_split import PipelineSplit
from holmes_sim.model.workload import Workload
from holmes_sim.spec.presets import GPT2_TOKENIZER, PRESETS

_MEGATRON_DROPOUT = 0.1
_MEGATRON_VOCAB_DIVISOR = 128
_MEGATRON_ROTARY_BASE = 10000
_MEGATRON_ROPE_SCALING_FACTOR = 8.0
_MEGATRON_NORM_EPSILON = 1e-5
GPT2_VOCAB, GPT2_PADDED = 50257, 51200
"""GPT-2's BPE vocabulary, and padded as Megatron-LM pads it at TP 8 (a multiple of 128 x 8)."""


def architecture_args(w: Workload) -> list[str]:
    """Arguments of `pretrain_gpt.py` for GQA, SwiGLU, RMSNorm, biases, RoPE, dropout (the
    vocabulary's padding, which depends on TP: `vocab_args`)."""
    args: list[str] = []
    if w.groups != w.heads:
        args += ["--group-query-attention", "--num-query-groups", str(w.groups)]
    if w.swiglu:
        args.append("--swiglu")
    if w.squared_relu:
        args.append("--squared-relu")
    if w.bias_added_apart:
        args.append("--no-bias-gelu-fusion")  # refused fusions: the module docstring
    if w.rmsnorm:
        args += ["--normalization", "RMSNorm"]
    if not w.bias:
        args.append("--disable-bias-linear")
        if w.qkv_bias:
            args.append("--add-qkv-bias")
    if w.position_embedding != "learned":
        kind = "rope" if w.position_embedding == "rope" else "none"
        args += ["--position-embedding-type", kind]
    if w.hidden_dropout != _MEGATRON_DROPOUT:
        args += ["--hidden-dropout", f"{w.hidden_dropout:g}"]
    if w.attention_dropout != _MEGATRON_DROPOUT:
        args += ["--attention-dropout", f"{w.attention_dropout:g}"]
    return args + rope_norm_args(w) + mla_args(w) + moe_args(w)


def vocab_args(w: Workload, tp: int) -> list[str]:
    """`--make-vocab-size-divisible-by` where `vocab_divisor` leaves Megatron-LM's 128."""
    divisor = vocab_divisor(w, tp)
    return [] if divisor == _MEGATRON_VOCAB_DIVISOR else ["--make-vocab-size-divisible-by",
                                                          str(divisor)]


def vocab_divisor(w: Workload, tp: int) -> int:
    """The `make_vocab_size_divisible_by` D with which Megatron-LM pads the tokenizer's
    vocabulary (`tokenizer_vocab`) to the one simulated, `w.vocab`, at TP `tp`: up to a
    multiple of D x TP (`vocab_size_with_padding`, megatron/core/tokenizers/utils/
    build_tokenizer.py). The scenario's own divisor where it does; else the smallest multiple
    of TP that divides `w.vocab` and is above its padding, over TP (GPT-2's 50,257 tokens to
    51,200: 1024 / TP)."""
    own, padded = w.vocab_divisible_by, w.vocab
    tokens = tokenizer_vocab(w)
    if tokens > padded or -(-tokens // (own * tp)) * own * tp == padded:
        return own
    return next(m for m in range(tp, padded + 1, tp) if padded % m == 0 and padded - m < tokens) // tp


def tokenizer_vocab(w: Workload) -> int:
    """The vocabulary of `tokenizer_args`' tokenizer: GPT-2's 50,257 tokens for a vocabulary
    of 50,257 or 51,200, else the scenario's (`model.vocab_size`)."""
    vocab = w.vocab_size or w.vocab
    preset = PRESETS.get(w.preset or "")
    if preset is not None and preset.fields.get("vocab_size") == vocab:
        return vocab
    return GPT2_VOCAB if vocab in (GPT2_VOCAB, GPT2_PADDED) else vocab


def rope_norm_args(w: Workload) -> list[str]:
    """Arguments of `pretrain_gpt.py` for the RoPE base, share and Llama 3.1 scaling (with
    RoPE only: Megatron reads them only then) and the norms' epsilon and zero-centered gamma,
    each where it leaves Megatron-LM's default; none changes a cost."""
    args: list[str] = []
    if w.position_embedding == "rope":
        if w.rotary_base != _MEGATRON_ROTARY_BASE:
            args += ["--rotary-base", str(w.rotary_base)]
        if w.rotary_percent != 1.0:
            args += ["--rotary-percent", repr(float(w.rotary_percent))]
        if w.rope_scaling:
            args.append("--use-rope-scaling")
            if w.rope_scaling_factor != _MEGATRON_ROPE_SCALING_FACTOR:
                args += ["--rope-scaling-factor", repr(float(w.rope_scaling_factor))]
    if w.norm_epsilon != _MEGATRON_NORM_EPSILON:
        args += ["--norm-epsilon", repr(float(w.norm_epsilon))]
    if w.zero_centered_gamma:
        args.append("--apply-layernorm-1p")
    return args


def rope_factor_note(w: Workload) -> str | None:
    """The export README's note on a Llama 3.1 RoPE scaling factor other than 8, None if none:
    `pretrain_gpt.py`'s `gpt_builder` (gpt_builders.py, Megatron-LM d98e8a6) passes GPTModel
    `rope_scaling=args.use_rope_scaling` and not `--rope-scaling-factor`, so GPTModel keeps
    its default factor, 8."""
    factor = w.rope_scaling_factor
    if not (w.position_embedding == "rope" and w.rope_scaling) \
            or factor == _MEGATRON_ROPE_SCALING_FACTOR:
        return None
    return (f"`--rope-scaling-factor {float(factor)!r}` is written as simulated, but "
            "`pretrain_gpt.py` does not pass it on: its `gpt_builder` (gpt_builders.py) gives "
            "GPTModel `rope_scaling=args.use_rope_scaling` alone, so the launch trains RoPE "
            f"scaling factor 8, not {factor:g}. That costs the same as simulated (RoPE's settings "
            "change no kernel's size) but is not the model simulated; add "
            "`rope_scaling_factor=args.rope_scaling_factor` to that GPTModel call to train it.")


def pipeline_split_note(w: Workload, tp: int, pp: int) -> str | None:
    """The export README's note on a plan simulated with Megatron-LM 2021-2022's scatter-gather
    of pipeline messages (`Workload.pp_scatter_gather`), None where it changes nothing (TP 1,
    PP 1 or sequence parallelism): Megatron-Core, which both launches run, has none."""
    if not w.pp_scatter_gather or w.sequence_parallel or tp == 1 or pp == 1:
        return None
    return ("This plan was simulated with pipeline messages split over the TP group "
            "(`training.scatter_gather_tensors_in_pipeline: true`, Megatron-LM of 2021-2022), "
            "but Megatron-Core and the Holmes fork send each message whole from every TP rank: "
            f"the launch moves {tp} times the pipeline bytes simulated. Plan it with the field "
            "false, or with sequence parallelism, to simulate what it runs.")


FORK_LACKS = ("--rotary-base", "--use-rope-scaling", "--rope-scaling-factor")
"""Model flags of upstream Megatron-LM the Holmes fork's parser predates (its RoPE has base
10000 and no scaling); its export leaves them out and the README says so (`fork_lacks_note`)."""


def without_flags(args: list[str], flags: tuple[str, ...] | list[str]) -> list[str]:
    """`args` without each of `flags` and the values that follow it (words not starting
    with `--`)."""
    out: list[str] = []
    dropping = False
    for word in args:
        if word.startswith("--"):
            dropping = word in flags
        if not dropping:
            out.append(word)
    return out


def fork_lacks_note(margs: list[str]) -> str | None:
    """The README's note on the `FORK_LACKS` flags among upstream's `margs`, None if none."""
    others = [a for a in margs if a.startswith("--") and a not in FORK_LACKS]
    lacked = without_flags(margs, others)
    if not lacked:
        return None
    return (f"`megatron_args.txt` sets `{' '.join(lacked)}`, which `holmes_args.txt` leaves out: "
            "the Holmes fork's arguments.py (2024-08) predates these flags, so the fork trains "
            "RoPE at base 10000 without scaling. That costs the same as simulated (RoPE's "
            "settings change no kernel's size) but is not the model simulated; add the flags "
            "to the fork's parser to train that one.")


def mla_args(w: Workload) -> list[str]:
    """Arguments of `pretrain_gpt.py` for multi-head latent attention (Megatron-LM
    arguments.py `_add_mla_args`); `--qk-layernorm` builds the latent norms the cost model
    prices (`model.mla`); nothing without MLA."""
    m = w.mla
    if m is None:
        return []
    args = ["--multi-latent-attention"]
    if m.q_rank:
        args += ["--q-lora-rank", str(m.q_rank)]
    return args + ["--kv-lora-rank", str(m.kv_rank), "--qk-head-dim", str(m.qk_dim),
                   "--qk-pos-emb-head-dim", str(m.rope_dim), "--v-head-dim", str(m.v_dim),
                   "--qk-layernorm"]


def moe_args(w: Workload) -> list[str]:
    """Arguments of `pretrain_gpt.py` for an MoE model (all in Megatron-LM's
    megatron/training/arguments.py `_add_moe_args`, but `--moe-shared-expert-gate`: from
    core_v0.16.0, generated from `TransformerConfig`, `SHARED_GATE_NOTE`): experts, top-k,
    expert and shared FFN widths, the shared expert's gate, the layer pattern, load balancing,
    capacity; the expert-parallel degree (its
    expert-TP degree: `expert_parallel_args`); the all-to-all dispatcher and grouped GEMM the
    cost model prices (`cost.moe`, `cost.expert_parallel`)."""
    m = w.moe
    if m is None:
        return []
    args = ["--num-experts", str(m.experts), "--moe-router-topk", str(m.topk),
            "--moe-ffn-hidden-size", str(m.ffn)]
    if w.ep > 1:
        args += ["--expert-model-parallel-size", str(w.ep)]
    if m.shared_ffn:
        args += ["--moe-shared-expert-intermediate-size", str(m.shared_ffn)]
        args += ["--moe-shared-expert-gate"] if m.shared_gate else []
    if 0 in m.pattern:
        args += ["--moe-layer-freq", "[" + ",".join(map(str, m.pattern)) + "]"]
    if m.load_balancing != "aux_loss":
        args += ["--moe-router-load-balancing-type", m.load_balancing]
    if m.capacity_factor is not None:
        args += ["--moe-expert-capacity-factor", f"{m.capacity_factor:g}"]
    return args + router_args(m.router) + ["--moe-token-dispatcher-type", "alltoall",
                                           "--moe-grouped-gemm"]


def router_args(r: MoeRouter) -> list[str]:
    """Arguments of `pretrain_gpt.py` for the router (`MoeRouter`), each where it leaves
    Megatron-Core's default: the loss weight (default 0, no loss), pre-softmax scoring (which
    `TransformerConfig` requires of top-1 softmax routing), sigmoid scoring, the expert bias,
    the top-k scaling factor and the group limit."""
    args: list[str] = []
    if r.aux_loss_coeff:
        args += ["--moe-aux-loss-coeff", repr(float(r.aux_loss_coeff))]
    if r.pre_softmax:
        args.append("--moe-router-pre-softmax")
    if r.score_function != "softmax":
        args += ["--moe-router-score-function", r.score_function]
    if r.expert_bias:
        args.append("--moe-router-enable-expert-bias")
    if r.topk_scaling is not None:
        args += ["--moe-router-topk-scaling-factor", repr(float(r.topk_scaling))]
    if r.num_groups is not None:
        args += ["--moe-router-num-groups", str(r.num_groups), "--moe-router-group-topk",
                 str(r.group_topk)]
    return args


def router_note(w: Workload) -> str | None:
    """The export README's note on router arguments written for fields the scenario left
    unset (`MoeRouter.chosen`); None if none."""
    chosen = w.moe.router.chosen if w.moe is not None else ()
    parts = []
    if "moe_aux_loss_coeff" in chosen:
        parts.append(f"`--moe-aux-loss-coeff {w.moe.router.aux_loss_coeff:g}`: the scenario "
                     "gives no `model.moe_aux_loss_coeff`, so the export writes Megatron-Core's "
                     "recommended starting weight of the load-balancing loss (its Mixtral "
                     "example's); Megatron-LM's own default, 0, would train the router without "
                     "that loss. Give the weight you train with (0 for none): the simulated time "
                     "depends only on whether it is 0, which skips the loss.")
    if "moe_router_pre_softmax" in chosen:
        parts.append("`--moe-router-pre-softmax`: Megatron-Core refuses top-1 softmax routing "
                     "without it (a softmax over the one chosen expert has no gradient); set "
                     "`model.moe_router_pre_softmax` to say so in the scenario.")
    return " ".join(parts) or None


SHARED_GATE_NOTE = (
    "`--moe-shared-expert-gate` builds the shared expert's sigmoid gate simulated "
    "(`model.moe_shared_expert_gate`); Megatron-LM has the flag from core_v0.16.0 (commit "
    "bddd0a8, 2026-01). An earlier Megatron-LM (93da800 of 2025-12, say) stops at it as an "
    "unrecognized argument and has no way to build the gate: there, remove the flag "
    "and the launch trains a model without the gate, with h parameters and one kept b s h / t "
    "tensor fewer per MoE layer than simulated; set `model.moe_shared_expert_gate: false` to "
    "simulate that model.")
"""The export README's note on `--moe-shared-expert-gate`."""

AFTER_RELEASE = ("--moe-shared-expert-gate",)
"""Upstream flags the export writes that Megatron-LM at 93da800 (2025-12, the argument table
the export is checked against) predates; Megatron-LM main has them, and the README says from which
release each parses (`SHARED_GATE_NOTE`)."""


def shared_gate_note(w: Workload) -> str | None:
    """`SHARED_GATE_NOTE` where the export writes `--moe-shared-expert-gate`, else None."""
    m = w.moe
    return SHARED_GATE_NOTE if m is not None and m.shared_gate and m.shared_ffn else None


def expert_tensor_args(w: Workload, tp: int) -> list[str]:
    """`--expert-tensor-parallel-size` of an MoE model at TP degree `tp` (Megatron-LM
    arguments.py `_add_moe_args`; default None: the TP degree), written for every MoE plan so
    the launch states its expert layout; nothing for a dense model."""
    if w.moe is None:
        return []
    return ["--expert-tensor-parallel-size", str(w.expert_tp(tp))]


def overlap_args(w: Workload, interleaved: bool) -> list[str]:
    """Arguments of `pretrain_gpt.py` for the TP, pipeline and output-layer overlaps."""
    args: list[str] = []
    if w.tp_comm_overlap:
        args.append("--tp-comm-overlap")
    if interleaved and not w.overlap_p2p_comm:
        args.append("--no-overlap-p2p-communication")
    if w.defer_embedding_wgrad:
        args.append("--defer-embedding-wgrad-compute")
    return args


USERBUFFER_CONFIG = "tp_comm_overlap_cfg.yaml"
"""The export's Transformer Engine userbuffer configuration (`--tp-comm-overlap-cfg`)."""
_RS_GEMMS = ("proj_fprop", "fc2_fprop")


def userbuffer_config(w: Workload) -> str | None:
    """YAML for `--tp-comm-overlap-cfg` (Megatron-LM loads it with `yaml.safe_load` and passes it
    to Transformer Engine's `initialize_ub` as `ub_cfgs`, each entry updating that GEMM's
    default): the forward's two reduce-scatter GEMMs, `proj_fprop` and `fc2_fprop`, holding the
    SMs the plan was simulated with (`TrainingSpec.tp_comm_overlap_rs_sms`). 1 SM is a
    `ring_exchange` as in Megatron-Bridge's FP8 H100 configurations, n >= 2 a `pipeline` of n
    SMs with 4 splits (its `PipelineOverlapCfg`, megatron/bridge/training/comm_overlap.py),
    each with `set_sm_margin`. Written at 16 SMs too: Transformer Engine 2.0 on holds 16 with the
    margin by default (`get_default_config`, transformer_engine/pytorch/module/base.py), but
    1.7-1.13 hold them without it (`add_ub`'s `set_sm_margin=0`), the GEMM launched on every SM.
    None without the overlap and at 0, which no TE configuration expresses
    (`USERBUFFER_ZERO_SMS`)."""
    sms = w.ub_rs_sms
    if not w.tp_comm_overlap or sms == 0:
        return None
    fields = ({"method": "ring_exchange", "num_sm": 1, "cga_size": 1, "set_sm_margin": "true"}
              if sms == 1 else
              {"method": "pipeline", "num_sm": sms, "cga_size": 2, "num_splits": 4,
               "set_sm_margin": "true"})
    lines = [f"# Transformer Engine userbuffer overlap (`--tp-comm-overlap-cfg`): the forward's "
             f"reduce-scatter GEMMs hold {sms} SM{'s' if sms > 1 else ''} each, as simulated "
             "(training.tp_comm_overlap_rs_sms); every other GEMM keeps TE's default."]
    for gemm in _RS_GEMMS:
        lines += [f"{gemm}:", *(f"  {key}: {value}" for key, value in fields.items())]
    return "\n".join(lines) + "\n"


USERBUFFER_ZERO_SMS = (
    "The plan was simulated with `training.tp_comm_overlap_rs_sms: 0` (the forward's userbuffer "
    "reduce-scatters holding no SM), which no Transformer Engine configuration expresses: every "
    "userbuffer overlap holds at least one SM. The launch runs TE's default, 16 SMs each, "
    "and its forward GEMMs run beside them, slower than simulated.")
"""The export README's note on `tp_comm_overlap_rs_sms: 0`."""


def loss_args(w: Workload) -> list[str]:
    """Arguments of `pretrain_gpt.py` for the fused cross entropy; nothing when unfused.
    Megatron-LM from core_v0.19.0 (168cb15, 2026-06) refuses `--cross-entropy-fusion-impl te`
    with the fusion (`TE_CROSS_ENTROPY_REFUSED`, which the export's README repeats)."""
    if w.cross_entropy == "unfused":
        return []
    impl = ["--cross-entropy-fusion-impl", "te"] if w.cross_entropy == "te" else []
    return ["--cross-entropy-loss-fusion", *impl]


TE_CROSS_ENTROPY_REFUSED = (
    "`--cross-entropy-fusion-impl te` is what this plan was simulated with (Transformer "
    "Engine's fused cross entropy); Megatron-LM from core_v0.19.0 refuses it with "
    "`--cross-entropy-loss-fusion` (commit 168cb15, 2026-06). On such a release use "
    "`--cross-entropy-fusion-impl native`, which the simulation prices at about three times "
    "the HBM traffic (`training.cross_entropy_fusion_impl: native`).")
"""The export README's note on `--cross-entropy-fusion-impl te`."""


def launched_attention_backend(w: Workload) -> str | None:
    """The `--attention-backend` the launch needs to run the simulated kernel: the scenario's
    backend where it is not Megatron-LM's default, auto (`TrainingSpec.attention_backend`);
    unfused for a plan simulated without a fused kernel (`training.flash_attention: false`),
    where auto would run a fused one; None where auto runs what was simulated."""
    if w.attention_backend == "auto":
        return None if w.flash_attention else "unfused"
    return w.attention_backend


def attention_args(w: Workload) -> list[str]:
    """`--attention-backend` where the launch needs one (`launched_attention_backend`);
    Megatron-Core then sets Transformer Engine's NVTE_FLASH_ATTN, NVTE_FUSED_ATTN and
    NVTE_UNFUSED_ATTN to match (`_set_attention_backend`,
    megatron/core/models/common/language_module/language_module.py)."""
    backend = launched_attention_backend(w)
    return [] if backend is None else ["--attention-backend", backend]


def split_args(split: PipelineSplit) -> list[str]:
    """Arguments of `pretrain_gpt.py` for Megatron-Core's uneven pipeline split."""
    args: list[str] = []
    if split.first_layers is not None:
        args += ["--decoder-first-pipeline-num-layers", str(split.first_layers)]
    if split.last_layers is not None:
        args += ["--decoder-last-pipeline-num-layers", str(split.last_layers)]
    if split.account_for_embedding:
        args.append("--account-for-embedding-in-pipeline-split")
    if split.account_for_loss:
        args.append("--account-for-loss-in-pipeline-split")
    return args


def tokenizer_args(w: Workload) -> tuple[list[str], str]:
    """Megatron-LM's tokenizer arguments for `w`'s vocabulary and what they are: the preset's
    own tokenizer where `w` keeps its vocabulary (`Preset.tokenizer`), GPT-2's BPE for its
    50,257 tokens (or the 51,200 Megatron pads them to), else a placeholder."""
    vocab = w.vocab_size or w.vocab
    preset = PRESETS.get(w.preset or "")
    if preset is not None and preset.fields.get("vocab_size") == vocab:
        return list(preset.tokenizer), f"preset {w.preset}'s own tokenizer"
    if vocab in (GPT2_VOCAB, GPT2_PADDED):
        return list(GPT2_TOKENIZER), "GPT-2's BPE of 50,257 tokens"
    return (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "NAME"],
            f"no tokenizer is known for this vocabulary: give one of {vocab:,} tokens")


def vocabulary_section(w: Workload, tp: int) -> str:
    """The export README's paragraph on the vocabulary simulated and the tokenizer to use."""
    args, what = tokenizer_args(w)
    vocab, tokens, divisor = w.vocab_size or w.vocab, tokenizer_vocab(w), vocab_divisor(w, tp)
    other = "Llama 3's 128,256" if vocab in (GPT2_VOCAB, GPT2_PADDED) else "GPT-2's 50,257"
    by = (f"`--make-vocab-size-divisible-by {divisor}`"
          if divisor != _MEGATRON_VOCAB_DIVISOR else
          f"Megatron-LM's default make_vocab_size_divisible_by {divisor}")
    launched = -(-tokens // (divisor * tp)) * divisor * tp
    rows = (f"the {w.vocab:,} rows simulated" if launched == w.vocab else
            f"{launched:,} rows, not the {w.vocab:,} simulated")
    return (f"The plan was simulated at a vocabulary of {vocab:,} tokens (`model.vocab_size`), "
            f"padded to {w.vocab:,} rows (a multiple of make_vocab_size_divisible_by "
            f"{w.vocab_divisible_by} x TP {tp}). Tokenizer: {what}, `{' '.join(args)}`. "
            f"Megatron-LM sizes the embedding and the output layer from the tokenizer's "
            f"vocabulary, {tokens:,} tokens, padded up to a multiple of "
            f"make_vocab_size_divisible_by x TP (`vocab_size_with_padding`); with {by}, "
            f"{divisor} x TP {tp} = {divisor * tp} gives {rows}. A tokenizer of another "
            f"vocabulary ({other} tokens, say) trains a different model from the one simulated, "
            f"with other parameters, memory and step time. A preset's vocabulary is its "
            f"config.json's embedding rows, which some models pad beyond their tokenizer's length "
            f"(Qwen2.5: 152,064 rows for 151,665 tokens); Megatron-LM pads the tokenizer's own "
            f"length, so for those the embedding and output layer come out a few hundred rows "
            f"smaller than simulated (151,680 rows for Qwen2.5 at TP 1).")
