"""Named model architectures for `model: {preset: NAME}`, each with its published source.

Values are the model card's or its `config.json`'s: layers, hidden size, FFN size, attention
heads, key/value heads (`num_query_groups`), the tokenizer's vocabulary (unpadded: Megatron pads
it, `make_vocab_size_divisible_by`), the pre-training sequence length as the default
`seq_length`, and the RoPE and norm settings that change the model but not its cost
(`rope_theta` as `rotary_base`, `partial_rotary_factor` as `rotary_percent`, Llama 3.1's
`rope_scaling`, `rms_norm_eps`/`norm_eps` as `norm_epsilon`, and an MoE router's loss weight,
scoring, scaling and group limit as Megatron-Bridge's bridges map them to Megatron-Core), checked
against NeMo's model configs (nemo/collections/llm/gpt/model/{llama,qwen2,mixtral,nemotron,
deepseek}.py). Each preset
also names the tokenizer to launch it with (`Preset.tokenizer`, Megatron-LM's tokenizer flags).
Fields written beside `preset` override the preset's.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping


@dataclass(frozen=True, slots=True)
class Preset:
    """One published architecture: ModelSpec fields and where they come from."""

    fields: Mapping[str, Any]
    source: str
    tokenizer: tuple[str, ...]
    """Megatron-LM arguments of the model's own tokenizer (its vocabulary is `vocab_size`)."""


def _hf(model_id: str) -> tuple[str, ...]:
    """The Hugging Face tokenizer of the model `model_id` (its model card's repository)."""
    return ("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", model_id)


GPT2_TOKENIZER = ("--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "gpt2-vocab.json",
                  "--merge-file", "gpt2-merges.txt")
"""GPT-2's BPE of 50,257 tokens (51,200 padded for TP up to 8), the files Megatron-LM reads."""
_NEMOTRON_TOKENIZER = ("--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                       "/path/to/nemotron-4-256k.model")
"""Nemotron-4's own SentencePiece model of 256,000 pieces (15B technical report), at the path
the user gives."""

_GPT3 = {"normalization": "layernorm", "bias": True, "position_embedding": "learned",
         "tie_embeddings": True, "swiglu": False}
_LLAMA = {"normalization": "rmsnorm", "bias": False, "position_embedding": "rope",
          "tie_embeddings": False, "swiglu": True, "hidden_dropout": 0.0,
          "attention_dropout": 0.0, "rotary_base": 10000, "norm_epsilon": 1e-5}
_LLAMA3 = dict(_LLAMA, rotary_base=500000)
_LLAMA31 = dict(_LLAMA3, rope_scaling=True, rope_scaling_factor=8.0)
_NEMOTRON4 = {"normalization": "layernorm", "bias": False, "position_embedding": "rope",
              "tie_embeddings": False, "swiglu": False, "squared_relu": True,
              "hidden_dropout": 0.0, "attention_dropout": 0.0, "rotary_base": 10000,
              "rotary_percent": 0.5, "norm_epsilon": 1e-5, "layernorm_zero_centered_gamma": True}
_QWEN25 = dict(_LLAMA, qkv_bias=True, rotary_base=1000000, norm_epsilon=1e-6)
_MIXTRAL_BASE = dict(_LLAMA, rotary_base=1000000)


def _arch(base: dict[str, Any], layers: int, hidden: int, ffn: int, heads: int, groups: int,
          vocab: int, seq: int) -> dict[str, Any]:
    return dict(base, num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn,
                num_attention_heads=heads, num_query_groups=groups, vocab_size=vocab,
                seq_length=seq)


_LLAMA2 = ("Touvron et al., 'Llama 2', arXiv 2307.09288, Table 1 and section 2.2; "
           "meta-llama/Llama-2-{}-hf config.json (rope_theta 10000, rms_norm_eps 1e-5)")
_LLAMA3_SRC = ("Llama Team, 'The Llama 3 Herd of Models', arXiv 2407.21783, Table 3 (8,192-token "
               "pre-training sequences, section 3.4); meta-llama/{} config.json (rope_theta "
               "500000, rms_norm_eps 1e-5{}); NeMo llama.py {}")
_SCALED = ", rope_scaling llama3 factor 8"
_NEMOTRON = ("NVIDIA, '{}', {}; GQA, RoPE, squared-ReLU MLP, no biases, untied, dropout 0; "
             "NeMo nemotron.py NemotronConfig (rotary_percent 0.5, "
             "layernorm_zero_centered_gamma, epsilon 1e-5, base 10000)")
_QWEN = ("Qwen Team, 'Qwen2.5 Technical Report', arXiv 2412.15115, Table 1 and section 3.1 "
         "(4,096-token pre-training); Qwen/{} config.json (rope_theta 1000000, rms_norm_eps "
         "{}); NeMo qwen2.py {}")

def _moe(base: dict[str, Any], experts: int, topk: int, expert_ffn: int,
         shared_ffn: int | None = None, **router: Any) -> dict[str, Any]:
    """An MoE architecture; `router`: its `moe_aux_loss_coeff` and `moe_router_*` fields."""
    return dict(base, num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=expert_ffn,
                moe_shared_expert_intermediate_size=shared_ffn, **router)


_UNNORMALIZED = ("`norm_topk_prob: false` (top-k weights not renormalized) as "
                 "moe_router_pre_softmax, as Megatron-Bridge maps it (qwen3_moe_bridge.py "
                 "`moe_router_pre_softmax = not norm_topk_prob`; deepseek_v2_bridge.py and "
                 "deepseek_v3_bridge.py set it)")


_MIXTRAL = ("Jiang et al., 'Mixtral of Experts', arXiv 2401.04088, Table 1 (8 experts, top-2, "
            "32,768-token context); mistralai/{} config.json (rope_theta 1000000, rms_norm_eps "
            "1e-5, router_aux_loss_coef {} as moe_aux_loss_coeff, as Megatron-Bridge's "
            "CONFIG_MAPPING takes it; softmax over the top-k logits, Megatron's default; NeMo "
            "mixtral.py MixtralConfig, Megatron-LM "
            "examples/mixtral/train_mixtral_8x7b_distributed.sh `--rotary-base 1000000` for "
            "8x7B)")
_QWEN_MOE = ("Qwen Team, {}; Qwen/{} config.json (num_experts, num_experts_per_tok, "
             "moe_intermediate_size, shared_expert_intermediate_size, rope_theta 1000000, "
             "rms_norm_eps 1e-6, router_aux_loss_coef 0.001 as moe_aux_loss_coeff, "
             + _UNNORMALIZED + "; the shared expert's 1-wide sigmoid gate, transformers "
             "modeling_qwen2_moe.py `shared_expert_gate`, as moe_shared_expert_gate)")


def _deepseek(layers: int, hidden: int, dense_ffn: int, heads: int, vocab: int, q_rank: int | None,
              experts: int, topk: int, expert_ffn: int, shared: int,
              dense_layers: int, **router: Any) -> dict[str, Any]:
    """A DeepSeek-V2/V3 model: multi-head latent attention (kv_lora_rank 512, qk_nope_head_dim
    128, qk_rope_head_dim 64, v_head_dim 128 in both), `dense_layers` dense layers first
    (`first_k_dense_replace`), then MoE layers with `shared` shared experts of the routed
    experts' width (Megatron's one shared MLP of their summed width), 4,096-token
    pre-training sequences, a sequence-wise balancing loss and `router`'s settings."""
    base = dict(_LLAMA, norm_epsilon=1e-6, multi_latent_attention=True, q_lora_rank=q_rank,
                kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                moe_router_load_balancing_type="seq_aux_loss",
                moe_layer_freq=(0,) * dense_layers + (1,) * (layers - dense_layers))
    return _moe(dict(_arch(base, layers, hidden, dense_ffn, heads, heads, vocab, 4096),
                     num_query_groups=None), experts, topk, expert_ffn, shared * expert_ffn,
                moe_router_pre_softmax=True, **router)


_DEEPSEEK = ("DeepSeek-AI, {}; deepseek-ai/{} config.json (hidden_size, intermediate_size, "
             "moe_intermediate_size, n_routed_experts, n_shared_experts, num_experts_per_tok, "
             "first_k_dense_replace, q_lora_rank, kv_lora_rank, qk_nope_head_dim, "
             "qk_rope_head_dim, v_head_dim, vocab_size, rope_theta 10000, rms_norm_eps 1e-6; "
             "NeMo deepseek.py DeepSeekConfig); {}; its YaRN factor 40 is the long-context "
             "extension after pre-training, not modelled")

PRESETS: Mapping[str, Preset] = MappingProxyType({
    "gpt3-175b": Preset(_arch(_GPT3, 96, 12288, 49152, 96, 96, 50257, 2048),
                        "Brown et al., 'Language Models are Few-Shot Learners', arXiv "
                        "2005.14165, Table 2.1; GPT-2 BPE vocabulary of 50,257", GPT2_TOKENIZER),
    "llama2-7b": Preset(_arch(_LLAMA, 32, 4096, 11008, 32, 32, 32000, 4096),
                        _LLAMA2.format("7b"), _hf("meta-llama/Llama-2-7b-hf")),
    "llama2-13b": Preset(_arch(_LLAMA, 40, 5120, 13824, 40, 40, 32000, 4096),
                         _LLAMA2.format("13b"), _hf("meta-llama/Llama-2-13b-hf")),
    "llama2-70b": Preset(_arch(_LLAMA, 80, 8192, 28672, 64, 8, 32000, 4096),
                         _LLAMA2.format("70b"), _hf("meta-llama/Llama-2-70b-hf")),
    "llama3-8b": Preset(_arch(_LLAMA3, 32, 4096, 14336, 32, 8, 128256, 8192),
                        _LLAMA3_SRC.format("Meta-Llama-3-8B", "", "Llama3Config8B"),
                        _hf("meta-llama/Meta-Llama-3-8B")),
    "llama3-70b": Preset(_arch(_LLAMA3, 80, 8192, 28672, 64, 8, 128256, 8192),
                         _LLAMA3_SRC.format("Meta-Llama-3-70B", "", "Llama3Config70B"),
                         _hf("meta-llama/Meta-Llama-3-70B")),
    "llama3.1-8b": Preset(_arch(_LLAMA31, 32, 4096, 14336, 32, 8, 128256, 8192),
                          _LLAMA3_SRC.format("Llama-3.1-8B", _SCALED, "Llama31Config8B"),
                          _hf("meta-llama/Llama-3.1-8B")),
    "llama3.1-70b": Preset(_arch(_LLAMA31, 80, 8192, 28672, 64, 8, 128256, 8192),
                           _LLAMA3_SRC.format("Llama-3.1-70B", _SCALED, "Llama31Config70B"),
                           _hf("meta-llama/Llama-3.1-70B")),
    "llama3.1-405b": Preset(_arch(_LLAMA31, 126, 16384, 53248, 128, 8, 128256, 8192),
                            _LLAMA3_SRC.format("Llama-3.1-405B", _SCALED, "Llama31Config405B"),
                            _hf("meta-llama/Llama-3.1-405B")),
    "nemotron4-15b": Preset(_arch(_NEMOTRON4, 32, 6144, 24576, 48, 8, 256000, 4096),
                            _NEMOTRON.format("Nemotron-4 15B Technical Report",
                                             "arXiv 2402.16819, Table 1"), _NEMOTRON_TOKENIZER),
    "nemotron4-340b": Preset(_arch(_NEMOTRON4, 96, 18432, 73728, 96, 8, 256000, 4096),
                             _NEMOTRON.format("Nemotron-4 340B Technical Report",
                                              "arXiv 2406.11704, Table 1"), _NEMOTRON_TOKENIZER),
    "qwen2.5-7b": Preset(_arch(_QWEN25, 28, 3584, 18944, 28, 4, 152064, 4096),
                         _QWEN.format("Qwen2.5-7B", "1e-6", "Qwen25Config7B"),
                         _hf("Qwen/Qwen2.5-7B")),
    "qwen2.5-72b": Preset(_arch(dict(_QWEN25, norm_epsilon=1e-5), 80, 8192, 29568, 64, 8, 152064,
                                4096), _QWEN.format("Qwen2.5-72B", "1e-5", "Qwen25Config72B"),
                          _hf("Qwen/Qwen2.5-72B")),
    "mixtral-8x7b": Preset(_moe(_arch(_MIXTRAL_BASE, 32, 4096, 14336, 32, 8, 32000, 32768),
                                8, 2, 14336, moe_aux_loss_coeff=0.02),
                           _MIXTRAL.format("Mixtral-8x7B-v0.1", "0.02"),
                           _hf("mistralai/Mixtral-8x7B-v0.1")),
    "mixtral-8x22b": Preset(_moe(_arch(_MIXTRAL_BASE, 56, 6144, 16384, 48, 8, 32000, 65536),
                                 8, 2, 16384, moe_aux_loss_coeff=0.001),
                            "Mistral AI, 'Cheaper, Better, Faster, Stronger' (Mixtral 8x22B "
                            "announcement, 141B parameters, 39B active, 64K context); "
                            + _MIXTRAL.format("Mixtral-8x22B-v0.1", "0.001").split("; ", 1)[1],
                            _hf("mistralai/Mixtral-8x22B-v0.1")),
    "qwen1.5-moe-a2.7b": Preset(_moe(_arch(_QWEN25, 24, 2048, 5632, 16, 16, 151936, 8192),
                                     60, 4, 1408, 5632, moe_aux_loss_coeff=0.001,
                                     moe_router_pre_softmax=True, moe_shared_expert_gate=True),
                                _QWEN_MOE.format("'Qwen1.5-MoE: Matching 7B Model Performance "
                                                 "with 1/3 Activated Parameters' (blog, 14.3B "
                                                 "parameters, 2.7B active)",
                                                 "Qwen1.5-MoE-A2.7B"),
                                _hf("Qwen/Qwen1.5-MoE-A2.7B")),
    "qwen2-57b-a14b": Preset(_moe(_arch(_QWEN25, 28, 3584, 18944, 28, 4, 151936, 4096),
                                  64, 8, 2560, 20480, moe_aux_loss_coeff=0.001,
                                  moe_router_pre_softmax=True, moe_shared_expert_gate=True),
                             _QWEN_MOE.format("'Qwen2 Technical Report', arXiv 2407.10671, "
                                              "Table 1 (4,096-token pre-training, section 3.2)",
                                              "Qwen2-57B-A14B"), _hf("Qwen/Qwen2-57B-A14B")),
    "deepseek-v2-lite": Preset(_deepseek(27, 2048, 10944, 16, 102400, None, 64, 6, 1408, 2, 1,
                                         moe_aux_loss_coeff=0.001),
                               _DEEPSEEK.format("'DeepSeek-V2', arXiv 2405.04434, Appendix B "
                                                "(DeepSeek-V2-Lite: 15.7B parameters, 2.4B "
                                                "active, no query compression) and section "
                                                "3.1.2 (4K sequences)", "DeepSeek-V2-Lite",
                                                "softmax router with sequence-wise auxiliary "
                                                "loss, " + _UNNORMALIZED + ", aux_loss_alpha "
                                                "0.001 as "
                                                "moe_aux_loss_coeff (Megatron-LM examples/"
                                                "post_training/modelopt/conf/deepseek-ai/"
                                                "DeepSeek-V2-Lite.sh `--moe-aux-loss-coeff 1e-3 "
                                                "--moe-router-pre-softmax`); routed_scaling_"
                                                "factor 1.0 and n_group 1, no scaling or group "
                                                "limit"), _hf("deepseek-ai/DeepSeek-V2-Lite")),
    "deepseek-v3": Preset(_deepseek(61, 7168, 18432, 128, 129280, 1536, 256, 8, 2048, 1, 3,
                                    moe_aux_loss_coeff=1e-4, moe_router_score_function="sigmoid",
                                    moe_router_enable_expert_bias=True,
                                    moe_router_topk_scaling_factor=2.5, moe_router_num_groups=8,
                                    moe_router_group_topk=4),
                          _DEEPSEEK.format("'DeepSeek-V3 Technical Report', arXiv 2412.19437, "
                                           "section 4.2 (671B parameters, 37B active; 4K "
                                           "pre-training sequences)", "DeepSeek-V3",
                                           "moe_router_pre_softmax as deepseek_v3_bridge.py "
                                           "sets it (sigmoid scoring ignores it and "
                                           "renormalizes the top-k, norm_topk_prob true); "
                                           "sigmoid router (scoring_func) with expert-bias "
                                           "balancing at Megatron's bias update rate 1e-3, the "
                                           "paper's (section 4.2: 0.001, and a sequence-wise "
                                           "loss of weight 0.0001), routed_scaling_factor 2.5, "
                                           "n_group 8, topk_group 4 (node-limited routing), as "
                                           "Megatron-Bridge's deepseek_v3_bridge.py and "
                                           "Megatron-LM examples/megatron_fsdp/"
                                           "sbatch_mfsdp_deepseek_v3.sh set them (aux loss "
                                           "1e-4); the multi-token-prediction module (1 extra "
                                           "layer, 14B parameters) is not modelled, and the "
                                           "router settings change no cost"),
                          _hf("deepseek-ai/DeepSeek-V3")),
})


def preset_fields(name: str) -> dict[str, Any]:
    """The ModelSpec fields of preset `name` (with `name` set to it); KeyError if unknown."""
    return dict(PRESETS[name].fields, name=name)


def preset_source(model: Any, field: str) -> str | None:
    """The preset `model` names (`ModelSpec.preset`) when it sets `field` to the model's value,
    so that the value came from it (or was written beside it the same); None otherwise. Messages
    about such a value say where it came from and how to override it (`overridden`)."""
    name = getattr(model, "preset", None)
    fields = PRESETS[name].fields if name in PRESETS else {}
    if field in fields and fields[field] == getattr(model, field):
        return name
    return None


def overridden(preset: str, field: str, value: str) -> str:
    """The fix for a value of `preset`: `field: value` written beside the preset."""
    return f"{field} comes from preset {preset}; override it beside the preset ({field}: {value})"

