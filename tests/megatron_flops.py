"""Megatron-LM's model FLOPs per iteration, the oracle the workload's FLOP count is tested against."""

from __future__ import annotations


def megatron_transformer_flops(B, s, L, h, a, g, f, V, swiglu, experts_layer_freq=None, topk=0,
                               moe_ffn=0, shared=0):
    """Megatron-LM's `transformer_flops` (megatron/training/training.py), transcribed term by
    term for a model without MLA, MTP or a latent size (kv_channels = h / a); without
    `experts_layer_freq` every layer is dense."""
    if experts_layer_freq is None:
        moe_layer_pattern = [0] * L
    elif isinstance(experts_layer_freq, int):
        moe_layer_pattern = [1 if (i % experts_layer_freq == 0) else 0 for i in range(L)]
    else:
        moe_layer_pattern = list(experts_layer_freq)
    num_moe_layers = sum(moe_layer_pattern)
    num_dense_layers = L - num_moe_layers
    kv_channels = h // a
    query_projection_size = kv_channels * a
    key_projection_size = value_projection_size = kv_channels * g
    standard_self_attn_term = 3 * 2 * (
        h * (query_projection_size + key_projection_size + value_projection_size)
        + query_projection_size * s / 2 * 2
        + query_projection_size * h)
    ffn_expansion_factor = 3 if swiglu else 2
    return B * s * (3 * 2 * h * ((f * ffn_expansion_factor) * num_dense_layers
                                 + (moe_ffn * topk * ffn_expansion_factor) * num_moe_layers
                                 + (shared * ffn_expansion_factor) * num_moe_layers)
                    + standard_self_attn_term * L
                    + 3 * 2 * h * V)
