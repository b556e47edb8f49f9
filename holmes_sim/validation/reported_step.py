"""Measured step time of a published row reported as a step time or as TFLOP/s per GPU.

NVIDIA's performance summaries publish tokens/s/GPU (`nemo_summary.measured_iteration_s`); papers
and READMEs publish either the step time itself (Nemotron-4 340B technical report, Table 2:
"iteration time") or TFLOP/s per GPU in their framework's own model-FLOP count (Megatron-LM's
README scaling table). A row carries one of:

- `seconds_per_iteration_published`: the step time, seconds;
- `tflops_per_gpu_published` with `flops_formula_published`: the step time is
  t = F(GBS) / (TFLOP/s x 1e12 x GPUs) seconds, F the model FLOP of one global batch in the named
  formula, which is the formula the authors' software logged with (not holmes-sim's own).
"""

from __future__ import annotations

from holmes_sim.spec.presets import PRESETS

MEGATRON_CORE_R080 = "megatron-lm core_r0.8.0"
"""`num_floating_point_operations` of NVIDIA/Megatron-LM megatron/training/training.py at tag
core_r0.8.0: it counts the attention scores of every (query, key) pair, causal or not."""


def megatron_r080_flop(batch: int, seq: int, layers: int, hidden: int, ffn: int, heads: int,
                       groups: int, padded_vocab: int, swiglu: bool) -> float:
    """Model FLOP of `batch` sequences in Megatron-LM core_r0.8.0's `num_floating_point_operations`
    (kv_channels = hidden / heads, one expert): 12 B s L h^2 [(1 + g/a + s/h) + f/h x (3/2 if
    SwiGLU) + V / (2 L h)]."""
    gated = 1.5 if swiglu else 1.0
    return (12.0 * batch * seq * layers * hidden * hidden
            * ((1 + groups / heads + seq / hidden) + ffn / hidden * gated
               + padded_vocab / (2 * layers * hidden)))


def _architecture(row: dict) -> dict:
    """The row's ModelSpec fields (its preset's, then its own `architecture` over them)."""
    fields = dict(PRESETS[row["preset"]].fields) if row.get("preset") else {}
    fields.update(row.get("architecture") or {})
    return fields


def _padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's `_vocab_size_with_padding` (megatron/training/tokenizer/tokenizer.py)."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def published_flop(row: dict) -> float:
    """Model FLOP of one global batch of the row in its `flops_formula_published`."""
    formula = row["flops_formula_published"]
    if formula != MEGATRON_CORE_R080:
        raise ValueError(f"flops_formula_published: unknown formula {formula!r}; "
                         f"known: {MEGATRON_CORE_R080!r}")
    a = _architecture(row)
    heads = a["num_attention_heads"]
    return megatron_r080_flop(row["global_batch"], row["seq_length"], a["num_layers"],
                              a["hidden_size"], a.get("ffn_hidden_size") or 4 * a["hidden_size"],
                              heads, a.get("num_query_groups") or heads,
                              _padded_vocab(a["vocab_size"], a.get("make_vocab_size_divisible_by",
                                                                   128), row["tp"]),
                              bool(a.get("swiglu", False)))


def reported_iteration_s(row: dict) -> float | None:
    """Measured step time in seconds of a row reported as a step time or as TFLOP/s per GPU;
    None for a row reported in tokens/s/GPU."""
    if "seconds_per_iteration_published" in row:
        return float(row["seconds_per_iteration_published"])
    if "tflops_per_gpu_published" in row:
        return published_flop(row) / (row["tflops_per_gpu_published"] * 1e12 * row["gpus"])
    return None


def published_figure(row: dict) -> str:
    """What the row's authors published, for the scenario's header comment."""
    if "seconds_per_iteration_published" in row:
        return f"{row['seconds_per_iteration_published']} s per iteration"
    if "tflops_per_gpu_published" in row:
        return (f"{row['tflops_per_gpu_published']} TFLOP/s per GPU "
                f"({row['flops_formula_published']} formula)")
    return f"{row['tokens_per_s_per_gpu']} tokens/s/GPU"
