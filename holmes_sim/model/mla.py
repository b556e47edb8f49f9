"""Multi-head latent attention (MLA, DeepSeek-V2/V3) as Megatron-Core builds it: parameters,
forward FLOP, GEMM shapes per GPU of a TP group, memory-bound bytes, stored activations and the
attention term of Megatron-LM's model FLOPs.

Symbols: h hidden size, a attention heads, r_q the query latent (`q_lora_rank`; 0: no query
compression), r_kv the key/value latent (`kv_lora_rank`), d_n `qk_head_dim` (the part of a
query/key head without rotary embedding), d_r `qk_pos_emb_head_dim` (its rotary part), d_v
`v_head_dim`, q = a (d_n + d_r) the query width, M token rows of a micro-batch on one GPU, t the
TP degree.

Sources:
- [MLA] Megatron-Core `MLASelfAttention` (megatron/core/transformer/multi_latent_attention.py)
  with the layer spec of megatron/core/models/gpt/gpt_layer_specs.py: `linear_q_proj` h -> q
  (column-parallel) without query compression, else `linear_q_down_proj` h -> r_q (`TELinear`,
  `parallel_mode="duplicated"`: not split, every TP rank computes it on its tokens, s/t of them
  with sequence parallelism) and `linear_q_up_proj` r_q -> q (column-parallel);
  `linear_kv_down_proj` h -> r_kv + d_r (duplicated); `linear_kv_up_proj` r_kv -> a (d_n + d_v)
  (column-parallel); `linear_proj` a d_v -> h (row-parallel). No linear has a bias but
  `linear_proj` (`add_bias_linear`). The latents are normalised (`q_layernorm` on r_q,
  `kv_layernorm` on r_kv, `--qk-layernorm`); the key's rotary part (d_r wide) is shared by
  every head. The core attention runs with key head dim d_n + d_r and value head dim d_v.
- [MLM] Megatron-LM `num_floating_point_operations` (megatron/training/training.py,
  `transformer_flops`, the `multi_latent_attention` branch), per token and per factor 6 (3
  GEMMs x 2 FLOP): q_r_q (h + q + 1) (or h q without compression) + r_kv (h + a (d_n + d_v) + 1)
  + h d_r + a d_v h, plus s (q + a d_v) / 2 for the causal core attention.
- [ARG] Megatron-LM megatron/training/arguments.py `_add_mla_args`: defaults `--q-lora-rank`
  None, `--kv-lora-rank` 32, `--qk-head-dim` 128, `--qk-pos-emb-head-dim` 64, `--v-head-dim`
  128; training.py asserts MLA without `--group-query-attention`.
- [DSV2] DeepSeek-AI, "DeepSeek-V2", arXiv 2405.04434, section 2.1 (MLA's equations 9-19).
"""

from __future__ import annotations

from dataclasses import dataclass

from holmes_sim.errors import FieldError
from holmes_sim.spec.job import ModelSpec
from holmes_sim.spec.presets import overridden, preset_source

Shape = tuple[int, int, int]
"""One GEMM (m, n, k): m x n outputs with inner dimension k (`cost.gemm.Gemm`)."""


@dataclass(frozen=True, slots=True)
class MlaShape:
    """The latent attention of every layer: heads, latent ranks and head dimensions."""

    heads: int
    q_rank: int
    """r_q: the query latent; 0 without query compression (`q_lora_rank` None)."""
    kv_rank: int
    """r_kv: the key/value latent (`kv_lora_rank`)."""
    qk_dim: int
    """d_n: per head, the query/key part without rotary embedding (`qk_head_dim`)."""
    rope_dim: int
    """d_r: per head, the rotary part of query and key (`qk_pos_emb_head_dim`)."""
    v_dim: int
    """d_v: per head, the value dimension (`v_head_dim`)."""

    @property
    def q_width(self) -> int:
        """a (d_n + d_r): the queries of all heads (and the keys after the rotary part joins)."""
        return self.heads * (self.qk_dim + self.rope_dim)

    @property
    def kv_up_width(self) -> int:
        """a (d_n + d_v): `linear_kv_up_proj`'s output, the keys' non-rotary part and the values."""
        return self.heads * (self.qk_dim + self.v_dim)

    @property
    def v_width(self) -> int:
        """a d_v: the values of all heads, the core attention's output and `linear_proj`'s input."""
        return self.heads * self.v_dim

    @property
    def latent_width(self) -> int:
        """r_q + r_kv: the two normalised latents of a token."""
        return self.q_rank + self.kv_rank

    def params(self, h: int, norm_params_per_width: int, bias: bool) -> int:
        """Parameters of one layer's attention beyond its input norm [MLA]: the query
        projections (h q, or h r_q + r_q q), the key/value down (h (r_kv + d_r)) and up
        (r_kv a (d_n + d_v)) projections, the output projection a d_v h (+ h bias), and the
        latent norms (`norm_params_per_width` 1 for RMSNorm, 2 for LayerNorm, per latent width)."""
        q = h * self.q_width if not self.q_rank else h * self.q_rank + self.q_rank * self.q_width
        kv = h * (self.kv_rank + self.rope_dim) + self.kv_rank * self.kv_up_width
        proj = self.v_width * h + (h if bias else 0)
        return q + kv + proj + norm_params_per_width * self.latent_width

    def replicated_params(self, h: int, norm_params_per_width: int) -> int:
        """Of `params`, those every TP rank holds whole: the duplicated down projections
        (h r_q with a query latent, h (r_kv + d_r)) and the latent norms [MLA]."""
        q = h * self.q_rank if self.q_rank else 0
        return q + h * (self.kv_rank + self.rope_dim) + norm_params_per_width * self.latent_width

    def gemm_shapes(self, rows: int, h: int, tp: int,
                    sequence_parallel: bool) -> tuple[Shape, ...]:
        """The projections' GEMMs of one micro-batch of `rows` tokens on one GPU, in order:
        the query GEMMs (one direct, or down and up), key/value down, key/value up, output
        projection [MLA]. The duplicated down projections split nothing over TP: each rank
        runs them on all `rows` tokens, or on rows/t under sequence parallelism."""
        local = rows // tp if sequence_parallel and tp > 1 else rows
        if self.q_rank:
            q: tuple[Shape, ...] = ((local, self.q_rank, h),
                                    (rows, self.q_width // tp, self.q_rank))
        else:
            q = ((rows, self.q_width // tp, h),)
        return q + ((local, self.kv_rank + self.rope_dim, h),
                    (rows, self.kv_up_width // tp, self.kv_rank),
                    (rows, h, self.v_width // tp))

    def core_shapes(self, queries: int, keys: int) -> tuple[Shape, Shape]:
        """Per head: scores (queries x keys, inner d_n + d_r) and context (queries x d_v, inner
        keys)."""
        return (queries, keys, self.qk_dim + self.rope_dim), (queries, self.v_dim, keys)

    def projection_forward_flop(self, tokens: float, h: int) -> float:
        """Forward FLOP of the projections over `tokens` tokens on one GPU without TP: 2 M per
        multiply-add of every [MLA] linear."""
        return sum(2.0 * m * n * k for m, n, k in self.gemm_shapes(1, h, 1, False)) * tokens

    def core_forward_flop(self, tokens: float, keys: int) -> float:
        """Forward FLOP of the core attention, every score computed: 2 M keys a (d_n + d_r)
        for the scores, 2 M keys a d_v for the weighted sum."""
        return 2.0 * tokens * keys * (self.q_width + self.v_width)

    def norm_rope_bytes(self, rows: int, tp: int, sequence_parallel: bool, d: int,
                        backward: bool) -> float:
        """HBM bytes of the latent norms and the rotary embedding of one micro-batch on one GPU:
        the norms read and write the r_q + r_kv latents (2 bytes moves forward, 3 backward, like
        a layer norm), on rows/t tokens with sequence parallelism; the rotary embedding reads
        and writes the queries' rotary parts (a d_r / t) and the shared key part (d_r), and the
        concatenation of each head's query and key from its two parts copies 2 q / t."""
        local = rows / tp if sequence_parallel and tp > 1 else rows
        norms = (3 if backward else 2) * local * self.latent_width * d
        rope = 2 * rows * (self.heads * self.rope_dim / tp + self.rope_dim) * d
        concat = 2 * 2 * rows * self.q_width / tp * d
        return norms + rope + concat

    def activation_terms(self, h: int) -> tuple[float, float]:
        """What one layer's attention stores for its backward per s b h element (2-byte values)
        beyond the norm and the down projections' input, (replicated over TP without sequence
        parallelism, split over TP) [MLA]: replicated the two latents before and after their
        norms (4 (r_q + r_kv) / h) and the key's rotary part (2 d_r / h); split the queries and
        keys (2 x 2q / h), the values (2 a d_v / h) and the output projection's input
        (2 a d_v / h)."""
        replicated = (4 * self.latent_width + 2 * self.rope_dim) / h
        split = (4 * self.q_width + 4 * self.v_width) / h
        return replicated, split

    def megatron_attention_term(self, h: int, seq: int) -> float:
        """[MLM]'s attention FLOP of one layer per token and per factor 6 (3 GEMMs x 2 FLOP),
        with its token-linear and its causal s^2 parts."""
        if self.q_rank:
            q = self.q_rank * (h + self.q_width + 1)
        else:
            q = h * self.q_width
        kv = self.kv_rank * (h + self.kv_up_width + 1) + h * self.rope_dim
        return q + kv + self.v_width * h + seq * (self.q_width + self.v_width) / 2


_DEFAULTS = {"kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128}
"""Megatron-LM's defaults of the MLA arguments [ARG]."""
_FIELDS = ("q_lora_rank", *_DEFAULTS)


def mla_shape(model: ModelSpec) -> MlaShape | None:
    """The latent attention of `model` with Megatron-LM's defaults [ARG]; None without MLA."""
    if not model.multi_latent_attention:
        return None
    given = {name: getattr(model, name) for name in _DEFAULTS}
    kv, qk, rope, v = (given[name] or default for name, default in _DEFAULTS.items())
    return MlaShape(heads=model.num_attention_heads, q_rank=model.q_lora_rank or 0,
                    kv_rank=kv, qk_dim=qk, rope_dim=rope, v_dim=v)


def check_mla(model: ModelSpec, cp: int, precision: str) -> None:
    """Raise FieldError for MLA settings Megatron-LM refuses or holmes-sim does not model:
    MLA fields without MLA, MLA with grouped-query attention [ARG] or without rotary
    embeddings, and MLA under context parallelism or FP8 (their K/V exchange and FP8 casts are
    priced for standard attention only)."""
    if not model.multi_latent_attention:
        _check_no_mla_fields(model)
        return
    if model.num_query_groups is not None:
        preset = preset_source(model, "num_query_groups")
        fix = overridden(preset, "num_query_groups", "null") if preset else \
            "remove num_query_groups"
        raise FieldError("model.num_query_groups", "multi-head latent attention has no "
                         "key/value groups (Megatron refuses --group-query-attention with "
                         f"--multi-latent-attention); {fix}")
    if model.position_embedding != "rope":
        preset = preset_source(model, "position_embedding")
        raise FieldError("model.position_embedding", "multi-head latent attention applies "
                         "rotary embeddings to its qk_pos_emb_head_dim part; "
                         + (overridden(preset, "position_embedding", "rope") if preset else
                            "set position_embedding: rope"))
    check_mla_context(model, cp)
    if precision == "fp8":
        raise FieldError("training.precision", "FP8 with multi-head latent attention is not "
                         "modelled; use bf16")


def _check_no_mla_fields(model: ModelSpec) -> None:
    """Raise FieldError for an MLA shape field of a model without MLA; when a preset set them,
    name every one it set."""
    given = [name for name in _FIELDS if getattr(model, name) is not None]
    if not given:
        return
    preset = preset_source(model, given[0])
    if preset is None:
        raise FieldError(f"model.{given[0]}", f"{given[0]} shapes multi-head latent attention; "
                         "add multi_latent_attention: true or remove it")
    mine = [name for name in given if preset_source(model, name) == preset]
    raise FieldError(f"model.{given[0]}", f"preset {preset} sets {', '.join(mine)} for "
                     "multi-head latent attention; keep multi_latent_attention: true, or "
                     "override each beside the preset with null")


def check_mla_context(model: ModelSpec, cp: int) -> None:
    """Raise FieldError for MLA under context parallelism (its K/V exchange is priced for
    standard attention's K and V only)."""
    if model.multi_latent_attention and cp > 1:
        raise FieldError("parallel.context", "context parallelism with multi-head latent "
                         "attention is not modelled; use context: 1")
