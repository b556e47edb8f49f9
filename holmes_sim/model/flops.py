"""Model FLOPs of one training iteration as Megatron-LM logs them (the TFLOP/s numerator).

Symbols: B global batch (sequences), s sequence length, L layers, h hidden size, f FFN size,
a attention heads, g key/value groups, V padded vocabulary.

Sources:
- [N21] Narayanan et al., SC'21, arXiv 2104.04473, section 5.1, eq. 3:
  F = 96 B s L h^2 (1 + s/(6h) + V/(16 L h)) with full recomputation; 72 without.
- [MLM] Megatron-LM, `num_floating_point_operations` in megatron/training/training.py
  (`transformer_flops`, dense layers, no multi-latent attention): every GEMM counted 3 times
  (forward, weight and data gradient), 2 FLOP per multiply-add, causal attention counted half:
  F = 6 B s [L (h f e + h (h + 2 h g / a) + h s + h^2) + h V], e = 3 with SwiGLU, else 2.
  Recomputation is never counted. Its multi-latent-attention branch: `model.mla`.
"""

from __future__ import annotations


def sc21_flop(factor: int, B: int, s: int, L: int, h: int, V: int) -> float:
    """[N21] eq. 3 with `factor` 96 (full recomputation) or 72."""
    return factor * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def megatron_core_flop(B: int, s: int, L: int, h: int, V: int, f: int, a: int, g: int,
                       swiglu: bool, mlp_term: float | None = None,
                       attention_term: float | None = None) -> float:
    """[MLM] `transformer_flops` of a decoder with kv_channels = h / a; `mlp_term` replaces the
    dense L h f e of every layer's MLP (MoE models: `model.moe.megatron_mlp_term`),
    `attention_term` one layer's h (h + 2 h g / a) + h s + h^2 (multi-head latent attention:
    `model.mla.MlaShape.megatron_attention_term`)."""
    mlp = h * f * (3 if swiglu else 2)
    attention = h * (h + 2 * h * g / a) + h * s + h * h if attention_term is None \
        else attention_term
    if mlp_term is not None:
        return 6 * B * s * (mlp_term + L * attention + h * V)
    return 6 * B * s * (L * (mlp + attention) + h * V)
