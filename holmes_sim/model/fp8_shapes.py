"""The FP8 GEMM operands Transformer Engine refuses, found before anything is priced.

Under `precision: fp8` the linear layers of every transformer layer run in Transformer Engine
(TE), whose forward checks its input and weight before casting them to FP8:
`assert_dim_for_fp8_exec` (transformer_engine/pytorch/utils.py, NVIDIA/TransformerEngine at
d0067d0da6cb01811b8072a7d304f0e00344ce2b, 2026-08-22; the same rule, on 2-D views, since
8c3110d18, 2023-07) raises ValueError unless, of each tensor, the product of all dimensions but
the last (its rows) is a multiple of 8 and the last dimension (its columns) a multiple of 16.
TE's `Linear` (module/linear.py, `_linear_forward_impl`: `assert_dim_for_fp8_exec(inputmat,
weight)`) and `LayerNormLinear` (module/layernorm_linear.py, `_LayerNormLinear.forward`, the same
call) make it on the GPU's own input,
before any sequence-parallel all-gather, and on the GPU's own weight shard: [out / t, in] for a
column-parallel layer, [out, in / t] for a row-parallel one. Only the forward checks; the
backward GEMMs reuse these tensors.

Megatron-Core's TE layer spec (megatron/core/models/gpt/gpt_layer_specs.py, NVIDIA/Megatron-LM
at d98e8a64ddf34856e74b24714e3bedb2f5a39553) builds, per layer: `linear_qkv`
(`TELayerNormColumnParallelLinear`), `linear_proj` (`TERowParallelLinear`), `linear_fc1`
(column-parallel) and `linear_fc2` (row-parallel) where the layer has a dense MLP, and, in an
MoE layer with a shared expert, its `linear_fc1`/`linear_fc2` (`TEColumnParallelLinear` /
`TERowParallelLinear`, megatron/core/models/gpt/moe_module_specs.py). With micro-batch b,
sequence s, CP degree c, TP degree t, hidden size h, heads a, query groups g, MLP width f (f1 =
2f with SwiGLU, else f), the token rows a GPU holds are M = b s / c (megatron/core/utils.py
`get_batch_on_this_cp_rank`),
and M / t for a column-parallel layer's input under sequence parallelism (M_sp). Per GPU, rows x
columns, in elements:

    linear_qkv   input M_sp x h    weight (a + 2g)(h / a) / t x h
    linear_proj  input M x h / t   weight h x h / t
    linear_fc1   input M_sp x h    weight f1 / t x h
    linear_fc2   input M x f / t   weight h x f / t

Not checked by TE, so not here: the routed experts (Megatron-Core's `TEGroupedMLP` pads each
expert's tokens to the FP8 alignment, `Fp8Padding`, megatron/core/transformer/moe/experts.py),
the output layer (Megatron-Core's own `ColumnParallelLinear`, outside the FP8 region, unless
MXFP8, megatron/core/models/gpt/gpt_model.py), and the attention core. Multi-head latent
attention under FP8 is refused apart (`model.mla.check_mla`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from holmes_sim.errors import FieldError
from holmes_sim.spec.job import ModelSpec, TrainingSpec
from holmes_sim.spec.presets import overridden, preset_source

ROWS, COLS = 8, 16
"""TE's FP8 rule: rows (the product of all dimensions but the last) a multiple of 8, the last
dimension a multiple of 16 (`assert_dim_for_fp8_exec`)."""
_SEARCH = 4096
"""Steps searched each way for the nearest valid value of a field."""


@dataclass(frozen=True, slots=True)
class Dim:
    """One dimension TE checks: its size in elements, the scenario field that sets it and how."""

    size: int
    field: str
    why: str


@dataclass(frozen=True, slots=True)
class Operand:
    """One tensor a linear layer hands `assert_dim_for_fp8_exec`, as one GPU holds it."""

    layer: str
    tensor: str
    """input | weight"""
    rows: Dim
    cols: Dim

    def failing(self) -> tuple[Dim, int] | None:
        """The dimension TE refuses and the multiple it needs; None where it passes."""
        if self.rows.size % ROWS:
            return self.rows, ROWS
        if self.cols.size % COLS:
            return self.cols, COLS
        return None


def fp8_operands(model: ModelSpec, training: TrainingSpec, tp: int, cp: int) -> list[Operand]:
    """Every operand TE checks in one transformer layer of `model` at TP `tp` and CP `cp`, with
    the micro-batch and sequence parallelism of `training` (the table of the module docstring).
    Assumes the splits the degree checks require (heads, widths and tokens divide evenly)."""
    b, s, h, a = training.micro_batch_size, model.seq_length, model.hidden_size, \
        model.num_attention_heads
    g = model.num_query_groups or a
    per_cp, per_tp = f" / context={cp}" if cp > 1 else "", f" / tensor={tp}" if tp > 1 else ""
    tokens = Dim(b * s // cp, "model.seq_length", f"micro_batch_size={b} x seq_length={s}{per_cp}")
    gathered = tokens if not (training.sequence_parallel and tp > 1) else \
        Dim(tokens.size // tp, tokens.field, f"{tokens.why} / tensor={tp} (sequence parallelism)")
    hidden = Dim(h, "model.hidden_size", f"hidden_size={h}")
    split = Dim(h // tp, hidden.field, f"hidden_size={h}{per_tp}")
    qkv = Dim((a + 2 * g) * (h // a) // tp, hidden.field, f"(num_attention_heads={a} + 2 x "
              f"{g} query groups) x head width {h // a}{per_tp}")
    operands = [Operand("linear_qkv", "input", gathered, hidden),
                Operand("linear_qkv", "weight", qkv, hidden),
                Operand("linear_proj", "input", tokens, split),
                Operand("linear_proj", "weight", hidden, split)]
    for layer, width, field in _mlps(model):
        wide = 2 * width if model.swiglu else width
        gate = " (gate and up, SwiGLU)" if model.swiglu else ""
        out = Dim(wide // tp, field, f"{_name(field)}={width}{gate}{per_tp}")
        inner = Dim(width // tp, field, f"{_name(field)}={width}{per_tp}")
        operands += [Operand(f"{layer}linear_fc1", "input", gathered, hidden),
                     Operand(f"{layer}linear_fc1", "weight", out, hidden),
                     Operand(f"{layer}linear_fc2", "input", tokens, inner),
                     Operand(f"{layer}linear_fc2", "weight", hidden, inner)]
    return operands


def _mlps(model: ModelSpec) -> list[tuple[str, int, str]]:
    """(layer name prefix, width f, field setting it) of each TE MLP: the dense MLP where a layer
    has one (ffn_hidden_size, default 4 x hidden_size), and an MoE layer's shared expert."""
    freq = model.moe_layer_freq
    dense = model.num_experts is None or (0 in freq if isinstance(freq, tuple) else freq != 1)
    mlps = []
    if dense:
        field = "model.ffn_hidden_size" if model.ffn_hidden_size else "model.hidden_size"
        mlps.append(("", model.ffn_hidden_size or 4 * model.hidden_size, field))
    if model.num_experts is not None and model.moe_shared_expert_intermediate_size:
        mlps.append(("shared expert ", model.moe_shared_expert_intermediate_size,
                     "model.moe_shared_expert_intermediate_size"))
    return mlps


def _name(field: str) -> str:
    return field.removeprefix("model.")


def check_fp8_shapes(model: ModelSpec, training: TrainingSpec, tp: int, cp: int) -> None:
    """Under precision fp8, raise FieldError for the first operand TE's FP8 GEMMs refuse at this
    layout (`fp8_operands`), on the field that sets the failing dimension, with the nearest
    values of it that every such operand takes and the other ways out."""
    if training.precision != "fp8":
        return
    for operand in fp8_operands(model, training, tp, cp):
        if (bad := operand.failing()) is None:
            continue
        dim, multiple = bad
        kind = "rows" if multiple == ROWS else "last dimension"
        problem = (f"under precision fp8 Transformer Engine refuses {operand.layer}'s "
                   f"{operand.tensor}: its {kind} {_sized(dim)} is not a multiple of "
                   f"{multiple} (`assert_dim_for_fp8_exec` asks of each FP8 GEMM operand rows "
                   f"a multiple of {ROWS} and a last dimension a multiple of {COLS})")
        fixes = _tokens_fixes(model, training, tp, cp) if dim.field == "model.seq_length" \
            else _width_fixes(model, training, tp, cp, dim.field)
        raise FieldError(dim.field, f"{problem}; {', '.join(fixes)}, or precision: bf16")


def _sized(dim: Dim) -> str:
    """'<why> = <size>', or <why> alone where it is the field's value itself."""
    return dim.why if dim.why == f"{_name(dim.field)}={dim.size}" else f"{dim.why} = {dim.size}"


def _passes(model: ModelSpec, training: TrainingSpec, tp: int, cp: int, field: str) -> bool:
    """Whether every dimension that `field` sets passes TE's rule (rows a multiple of ROWS, a
    last dimension of COLS), whatever the dimensions other fields set."""
    return all(o.rows.size % ROWS == 0 for o in fp8_operands(model, training, tp, cp)
               if o.rows.field == field) and \
        all(o.cols.size % COLS == 0 for o in fp8_operands(model, training, tp, cp)
            if o.cols.field == field)


def _nearest(model: ModelSpec, training: TrainingSpec, tp: int, cp: int, field: str,
             step: int) -> list[int]:
    """The nearest multiples of `step` below and above the model's `field` (either may be
    missing) at which every operand it sets passes."""
    name = _name(field)
    value = getattr(model, name)
    found = []
    for sign in (-1, 1):
        start = (value // step + (sign > 0)) * step if value % step else value + sign * step
        for k in range(_SEARCH):
            candidate = start + sign * k * step
            if candidate <= 0:
                break
            if _passes(dataclasses.replace(model, **{name: candidate}), training, tp, cp, field):
                found.append(candidate)
                break
    return found


def _use(model: ModelSpec, field: str, values: list[int]) -> str:
    """'use <field> A or B (...)', or the preset override where a preset set the field."""
    name, listed = _name(field), " or ".join(map(str, values))
    what = "the nearest whose FP8 operands TE takes"
    preset = preset_source(model, name)
    if preset is not None:
        return f"{overridden(preset, name, listed)} ({what})"
    return f"use {name} {listed} ({what})"


def _tokens_fixes(model: ModelSpec, training: TrainingSpec, tp: int, cp: int) -> list[str]:
    """The ways to token rows TE takes: the nearest seq_length that still splits evenly over CP
    (2 x context) and, under sequence parallelism, over TP; a micro-batch that makes every
    GPU's rows a multiple of 8; sequence parallelism off where that is enough (not for an MoE
    model at TP > 1, which Megatron-Core's MoELayer runs only with it)."""
    sp = training.sequence_parallel and tp > 1
    step = math.lcm(2 * cp if cp > 1 else 1, cp * (tp if sp else 1))
    fixes = []
    values = _nearest(model, training, tp, cp, "model.seq_length", step)
    if values:
        fixes.append(_use(model, "model.seq_length", values))
    per_sequence = model.seq_length // (cp * (tp if sp else 1))
    batch = ROWS // math.gcd(per_sequence, ROWS)
    fixes.append(f"training.micro_batch_size a multiple of {batch}")
    off = dataclasses.replace(training, sequence_parallel=False)
    if sp and model.num_experts is None and _passes(model, off, tp, cp, "model.seq_length"):
        fixes.append("training.sequence_parallel: false")
    return fixes


def _width_fixes(model: ModelSpec, training: TrainingSpec, tp: int, cp: int,
                 field: str) -> list[str]:
    """The ways to widths TE takes: the nearest values of `field` that every operand it sets
    takes (hidden_size among the multiples of the heads, an MLP width among those of the TP
    degree), and a lower TP degree that is enough."""
    step = model.num_attention_heads if field == "model.hidden_size" else tp
    values = _nearest(model, training, tp, cp, field, step)
    fixes = [_use(model, field, values)] if values else []
    lower = [d for d in range(tp - 1, 0, -1) if tp % d == 0 and _passes(model, training, d, cp,
                                                                         field)]
    if lower:
        fixes.append(f"parallel.tensor: {lower[0]}")
    return fixes
