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


def megatron_mla_transformer_flops(B, s, L, h, a, f, V, experts_layer_freq, topk, moe_ffn, shared,
                                   q_lora_rank, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim,
                                   v_head_dim):
    """Megatron-LM's `transformer_flops` for a SwiGLU MoE model with multi-latent attention
    (the `args.multi_latent_attention` branch), without MTP or a latent MoE size, transcribed
    term by term (BSHD: total tokens B s, squared-length sum B s^2)."""
    moe_layer_pattern = list(experts_layer_freq)
    num_moe_layers = sum(moe_layer_pattern)
    num_dense_layers = L - num_moe_layers
    forward_backward_expansion_factor, fma_expansion_factor, ffn_expansion_factor = 3, 2, 3
    if q_lora_rank is None:
        q_term = h * a * (qk_head_dim + qk_pos_emb_head_dim)
    else:
        q_term = q_lora_rank * (h + a * (qk_head_dim + qk_pos_emb_head_dim) + 1)
    standard_self_attn_term = forward_backward_expansion_factor * fma_expansion_factor * (
        q_term
        + kv_lora_rank * (h + a * (qk_head_dim + v_head_dim) + 1)
        + h * qk_pos_emb_head_dim
        + (a * v_head_dim) * h)
    standard_self_attn_core_term = forward_backward_expansion_factor * fma_expansion_factor * (
        a * (qk_head_dim + qk_pos_emb_head_dim) / 2 + a * v_head_dim / 2)
    total_real_tokens_in_batch, seqlen_squared_sum_in_batch = B * s, B * s * s
    return (total_real_tokens_in_batch * (
        forward_backward_expansion_factor * fma_expansion_factor * h * (
            (f * ffn_expansion_factor) * num_dense_layers
            + (moe_ffn * topk * ffn_expansion_factor) * num_moe_layers
            + (shared * ffn_expansion_factor) * num_moe_layers)
        + standard_self_attn_term * L
        + forward_backward_expansion_factor * fma_expansion_factor * h * V)
        + seqlen_squared_sum_in_batch * standard_self_attn_core_term * L)
