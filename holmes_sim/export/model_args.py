"""Megatron-LM arguments of a model's architecture beyond GPT's defaults.

Flag names and defaults follow Megatron-LM's megatron/training/arguments.py:
`--group-query-attention --num-query-groups`, `--swiglu`, `--squared-relu`, `--normalization`
(LayerNorm default), `--disable-bias-linear`, `--add-qkv-bias`, `--position-embedding-type`
(learned_absolute default), `--hidden-dropout` and `--attention-dropout` (0.1 default),
`--make-vocab-size-divisible-by` (128 default). Nothing is written for a value equal to
Megatron's default.
"""

from __future__ import annotations

from holmes_sim.model.workload import Workload

_MEGATRON_DROPOUT = 0.1
_MEGATRON_VOCAB_DIVISOR = 128


def architecture_args(w: Workload) -> list[str]:
    """Arguments of `pretrain_gpt.py` for GQA, SwiGLU, RMSNorm, biases, RoPE, dropout, padding."""
    args: list[str] = []
    if w.groups != w.heads:
        args += ["--group-query-attention", "--num-query-groups", str(w.groups)]
    if w.swiglu:
        args.append("--swiglu")
    if w.squared_relu:
        args.append("--squared-relu")
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
    if w.vocab_divisible_by != _MEGATRON_VOCAB_DIVISOR:
        args += ["--make-vocab-size-divisible-by", str(w.vocab_divisible_by)]
    return args
