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
- [RND] `--moe-router-force-load-balancing` (`TopKRouter.forward`, router.py; `RandomSTE`,
  moe_utils.py): the router's logits replaced by normal random values per token and rank, so
  each token's top-k is a uniformly random k-subset of the E experts.
- [ORD] The expected maximum of n exchangeable normal variables with a fixed sum: with
  Y = mu + c (Z - mean(Z)), Z independent standard normal, E[max Y] = mu + c e_n, e_n the
  expected maximum of n standard normals (Blom 1958; David and Nagaraja, *Order Statistics*,
  3rd ed., section 4.5), Var Y = c^2 (n - 1)/n.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache


AUX_LOSS_COEFF_START = 0.01
"""The load-balancing loss weight without one given: Megatron-Core's recommended starting value
(`TransformerConfig.moe_aux_loss_coeff`), its Mixtral example's
(examples/mixtral/train_mixtral_8x7b_distributed.sh `--moe-aux-loss-coeff 1e-2`)."""


@dataclass(frozen=True, slots=True)
class MoeRouter:
    """The router's settings that change the model's numbers (Megatron-Core
    `TransformerConfig.moe_router_*`, `moe_aux_loss_coeff`): the export writes them. Of the cost
    only a zero loss weight counts, which skips the loss (`MoeShape.aux_loss`)."""

    aux_loss_coeff: float = 0.0
    pre_softmax: bool = False
    score_function: str = "softmax"
    expert_bias: bool = False
    topk_scaling: float | None = None
    num_groups: int | None = None
    group_topk: int | None = None
    chosen: tuple[str, ...] = ()
    """The fields the scenario left unset that resolved to a value Megatron-Core would not
    take by default (`moe_aux_loss_coeff`, `moe_router_pre_softmax`): the export says so."""


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
    shared_gate: bool = False
    """The shared expert's output is scaled by a sigmoid gate, a 1 x h weight replicated over TP
    (`SharedExpertMLP.gate_weight`, megatron/core/transformer/moe/shared_experts.py;
    `--moe-shared-expert-gate`, Hugging Face Qwen2-MoE's `shared_expert_gate`)."""
    routing: str = "random"
    """`random`: each token's k experts an independent draw, balanced in expectation [RND];
    `even`: every expert exactly its share each micro-batch."""
    router: MoeRouter = MoeRouter()
    """Scoring, balancing loss weight and group limit (`MoeRouter`); no cost reads them."""

    @property
    def layers(self) -> int:
        return len(self.pattern)

    @property
    def moe_layers(self) -> int:
        return sum(self.pattern)

    @property
    def aux_loss(self) -> bool:
        """A load-balancing loss reads the router probabilities again: the aux-loss types at a
        weight above 0 (Megatron-Core `TopKRouter._apply_aux_loss` and its sequence and global
        variants return early at weight 0; sinkhorn asserts weight 0, router.py)."""
        return self.load_balancing.endswith("aux_loss") and self.router.aux_loss_coeff > 0

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
        cap = self.capacity(tokens)
        return min(busiest, cap), min(others, cap)

    def capacity(self, tokens: float) -> float:
        """Most rows an expert keeps of `tokens` tokens routed k times each,
        ceil(M k / E x capacity factor) [CAP]; infinite when dropless."""
        if self.capacity_factor is None:
            return math.inf
        return math.ceil(tokens * self.topk / self.experts * self.capacity_factor)

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
        local = self.experts // ep
        rows = busiest + (local - 1) * others + self.routing_excess(tokens * ep, ep)
        return max(1, round(min(rows, local * self.capacity(tokens * ep))))

    def routing_excess(self, tokens: float, ep: int) -> float:
        """Expected rows by which the busiest of `ep` ranks, each holding E/ep experts, exceeds
        a rank's mean when `tokens` tokens route at random [RND]: a token sends one of its k
        distinct picks to a given rank with hypergeometric variance k p (1 - p) (E - k)/(E - 1),
        p = 1/ep; the ranks' counts sum to `tokens` k, so the excess is
        sqrt(tokens x that x ep/(ep - 1)) e_ep [ORD]. Zero for `even` routing or one rank."""
        if self.routing != "random" or ep < 2 or self.topk >= self.experts:
            return 0.0
        p = 1.0 / ep
        per_token = self.topk * p * (1 - p) * (self.experts - self.topk) / (self.experts - 1)
        return math.sqrt(tokens * per_token * ep / (ep - 1)) * expected_max_normal(ep)


@lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """e_n, the expected maximum of n independent standard normal variables: the integral of
    x n phi(x) Phi(x)^(n - 1) over x, summed on [-12, 12] in steps of 1/400 (the integrand
    vanishes at both ends; e_2 = 1/sqrt(pi), e_8 = 1.4236) [ORD]."""
    if n < 2:
        return 0.0
    step = 1.0 / 400
    total = 0.0
    for i in range(24 * 400 + 1):
        x = -12.0 + i * step
        pdf = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1.0 + math.erf(x / math.sqrt(2)))
        total += x * n * pdf * cdf ** (n - 1)
    return total * step


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
    experts and the shared expert with its gate's h [MC] (Megatron-LM
    megatron/training/theoretical_memory_usage.py `shared_expert_gate_params`)."""
    shared = mlp_params(h, m.shared_ffn, gated, bias) if m.shared_ffn else 0
    return m.experts * h + m.experts * mlp_params(h, m.ffn, gated, bias) + shared + \
        shared_gate_params(m, h)


def shared_gate_params(m: MoeShape, h: int) -> int:
    """The shared expert's gate, h (a 1 x h weight, no bias), where it has one [MC]."""
    return h if m.shared_gate and m.shared_ffn else 0


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
