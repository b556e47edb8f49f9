"""Mixture-of-experts layers as Megatron-Core builds them: which layers are MoE, the experts'
parameters, the tokens each expert receives, and the MoE terms of Megatron-LM's FLOPs.

Symbols: h hidden size, E routed experts, k experts per token (top-k), f_e one expert's FFN
width, f_s the shared experts' FFN width (0: none), e = 3 gated (SwiGLU) else 2 GEMM widths of
f per MLP, M tokens of a micro-batch on one GPU.

Sources:
- [MC] Megatron-Core `MoELayer`, `TopKRouter`, `GroupedMLP`/`TEGroupedMLP`, `SharedExpertMLP`
  (megatron/core/transformer/moe/); `TransformerConfig.moe_layer_freq` (int N: layer i is MoE
  when i % N == 0; or a 0/1 list), `moe_expert_capacity_factor` (None: dropless).
- [CAP] `get_capacity`, megatron/core/transformer/moe/moe_utils.py: an expert keeps at most
  ceil(M k / E x capacity_factor) tokens.
- [MLM] Megatron-LM `num_floating_point_operations` (megatron/training/training.py,
  `transformer_flops`): the MLP term 6 B s h e (f L_dense + (f_e k + f_s) L_moe); the router
  GEMM is not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MoeShape:
    """The MoE part of a model: experts, routing and which layers carry them."""

    experts: int
    topk: int
    ffn: int
    """f_e: one routed expert's FFN width."""
    shared_ffn: int
    """f_s: the shared experts' FFN width; 0 without shared experts."""
    pattern: tuple[int, ...]
    """1 for an MoE layer, 0 for a dense one, per layer (`moe_layer_pattern`)."""
    capacity_factor: float | None
    imbalance: float
    """Tokens of the busiest expert over the mean, >= 1."""
    load_balancing: str
    """Megatron's `moe_router_load_balancing_type`."""

    @property
    def layers(self) -> int:
        return len(self.pattern)

    @property
    def moe_layers(self) -> int:
        return sum(self.pattern)

    @property
    def aux_loss(self) -> bool:
        """A load-balancing loss reads the router probabilities again (every type but none)."""
        return self.load_balancing != "none"

    @property
    def moe_fraction(self) -> float:
        """Share of the layers whose MLP is an MoE layer."""
        return self.moe_layers / self.layers

    def expert_rows(self, tokens: int) -> tuple[float, float]:
        """Rows (tokens) of the busiest expert and of each other expert for `tokens` tokens
        routed k times each: the busiest gets imbalance x M k / E, the other E - 1 share the
        rest evenly; each capped at the capacity [CAP]."""
        mean = tokens * self.topk / self.experts
        busiest = mean * self.imbalance
        others = mean * (self.experts - self.imbalance) / (self.experts - 1) \
            if self.experts > 1 else 0.0
        if self.capacity_factor is not None:
            cap = math.ceil(mean * self.capacity_factor)
            busiest, others = min(busiest, cap), min(others, cap)
        return busiest, others

    def routed_rows(self, tokens: int) -> int:
        """Rows the routed experts of one GPU process together (all E experts, EP = 1), at
        least 1."""
        busiest, others = self.expert_rows(tokens)
        return max(1, round(busiest + (self.experts - 1) * others))

    def rank_rows(self, tokens: int, ep: int) -> int:
        """Rows the E/ep routed experts of the busiest rank of an expert-parallel group of `ep`
        ranks process when each rank routes `tokens` tokens: the busiest expert's rows plus
        E/ep - 1 others' over the group's ep x tokens, at least 1 (`routed_rows` when ep = 1)."""
        busiest, others = self.expert_rows(tokens * ep)
        return max(1, round(busiest + (self.experts // ep - 1) * others))


def moe_layer_pattern(freq: int | tuple[int, ...], layers: int) -> tuple[int, ...]:
    """1 for an MoE layer, 0 for a dense one, per layer [MC]."""
    if isinstance(freq, tuple):
        return freq
    return tuple(1 if i % freq == 0 else 0 for i in range(layers))


def mlp_params(h: int, f: int, gated: bool, bias: bool) -> int:
    """One MLP: fc1 h x f1 (f1 = 2f gated) and fc2 f x h, with biases f1 + h."""
    f1 = 2 * f if gated else f
    return h * f1 + f * h + ((f1 + h) if bias else 0)


def moe_mlp_params(m: MoeShape, h: int, gated: bool, bias: bool) -> int:
    """An MoE layer's MLP part: the router (E x h, no bias; `TopKRouter.weight`), E routed
    experts and the shared expert [MC]."""
    shared = mlp_params(h, m.shared_ffn, gated, bias) if m.shared_ffn else 0
    return m.experts * h + m.experts * mlp_params(h, m.ffn, gated, bias) + shared


def expert_params(m: MoeShape, h: int, gated: bool, bias: bool) -> int:
    """The E routed experts' parameters of one MoE layer (split over expert parallelism)."""
    return m.experts * mlp_params(h, m.ffn, gated, bias)


def moe_mlp_forward_flop(m: MoeShape, tokens: float, h: int, gated: bool) -> float:
    """Forward FLOP of an MoE MLP over `tokens` tokens: router 2 M h E, routed experts
    2 M k h (f1_e + f_e), shared expert 2 M h (f1_s + f_s)."""
    e = 3 if gated else 2
    return 2 * tokens * h * (m.experts + e * (m.topk * m.ffn + m.shared_ffn))


def megatron_mlp_term(m: MoeShape, h: int, f: int, gated: bool) -> float:
    """[MLM]'s MLP term per token and per FLOP factor 6: h e (f L_dense + (f_e k + f_s) L_moe)."""
    e = 3 if gated else 2
    dense = m.layers - m.moe_layers
    return h * e * (f * dense + (m.ffn * m.topk + m.shared_ffn) * m.moe_layers)
