"""Rows of NVIDIA's published Megatron-Core MoE training throughput as scenarios.

A dataset with `"format": "megatron-core-moe"` (`validation/published/megatron_moe_h100.json`)
holds MoE runs of Megatron-LM's `pretrain_gpt.py` as their authors launched them: model `preset`,
GPUs, GBS, MBS, sequence, TP, PP, CP, VP, EP and the experts' TP degree (`etp`), dispatcher,
precision and router mode, with the TFLOP/s per GPU Megatron-LM logged (`--log-throughput`:
`num_floating_point_operations` over step time and GPUs). That count changed: until 2025 it
counted the whole s x s attention matrix, later half of it (causal). A row's `flops_formula`
names the version, and the measured step time is that version's FLOPs over the TFLOP/s
(`measured_iteration_s`), so the comparison needs no assumption about the count.

Settings every row shares are `common.launch`; a switch is written into the scenario when
TrainingSpec has a field of that name. A row whose experts' TP degree differs from TP gets it as
`parallel.expert_tensor` (Megatron-Core's `--expert-tensor-parallel-size`); a row whose
mechanism holmes-sim lacks carries its reason in `not_simulated`.
"""

from __future__ import annotations

import dataclasses
import math

from holmes_sim.spec.job import ModelSpec, TrainingSpec
from holmes_sim.spec.presets import PRESETS

FORMAT = "megatron-core-moe"
# Megatron-LM `num_floating_point_operations` (megatron/training/training.py): the attention
# score and value GEMMs per token and layer, in units of h s, by version.
ATTENTION_SCORE_FACTOR = {
    "megatron-2024": 2.0,   # (1 + g/a + s/h) at 0b981f9 and c230e0d (2024)
    "megatron-2025": 1.0,   # (1 + g/a + s/(2h)), "only half of the attention matrix" (ff45bd4)
}


def is_moe_dataset(dataset: dict) -> bool:
    return dataset.get("format") == FORMAT


def row_name(row: dict) -> str:
    """`<preset>-<gpus>gpu-<variant>` (`mixtral-8x22b-128gpu-dropless`)."""
    return f"{row['preset']}-{row['gpus']}gpu-{row['variant']}"


def not_simulated(row: dict) -> str | None:
    """Why the row is recorded but not simulated, or None when it simulates."""
    return row.get("not_simulated")


def logged_flop(row: dict) -> float:
    """FLOPs per step as the row's Megatron-LM version logged them, every layer MoE:
    6 B s [L (e h (f_e k + f_s) + 2 h^2 + 2 h^2 g / a + c h s) + h V], e = 3 (SwiGLU) else 2,
    c = `ATTENTION_SCORE_FACTOR`, V padded to a multiple of 128 x TP (`_vocab_size_with_padding`).
    """
    spec = ModelSpec(**{**PRESETS[row["preset"]].fields, "seq_length": row["seq_length"]})
    if spec.moe_layer_freq != 1:
        raise ValueError(f"{row_name(row)}: logged_flop counts every layer as MoE")
    h, s, layers = spec.hidden_size, row["seq_length"], spec.num_layers
    groups = spec.num_query_groups or spec.num_attention_heads
    expert = (spec.moe_ffn_hidden_size or spec.ffn_hidden_size) * spec.moe_router_topk
    mlp = (3 if spec.swiglu else 2) * h * (expert + (spec.moe_shared_expert_intermediate_size or 0))
    attention = (2 * h * h + 2 * h * h * groups / spec.num_attention_heads
                 + ATTENTION_SCORE_FACTOR[row["flops_formula"]] * h * s)
    multiple = spec.make_vocab_size_divisible_by * row["tp"]
    vocab = math.ceil(spec.vocab_size / multiple) * multiple
    return 6 * row["global_batch"] * s * (layers * (mlp + attention) + h * vocab)


def measured_iteration_s(row: dict) -> float:
    """Step time in seconds: the logged FLOPs over the published TFLOP/s and the GPUs."""
    return logged_flop(row) / (row["measured_tflops_per_gpu"] * 1e12 * row["gpus"])


def _training_lines(dataset: dict, row: dict) -> list[str]:
    """The launch switches: `common.launch` with the row's source's own `launch` over it."""
    launch = {**dataset["common"]["launch"], **dataset["sources"][row["source"]].get("launch", {})}
    fields = {f.name for f in dataclasses.fields(TrainingSpec)}
    if set(launch) - fields:
        raise ValueError(f"{row_name(row)}: launch keys {sorted(set(launch) - fields)} are not "
                         "TrainingSpec fields")
    values = dict(launch)
    values["sequence_parallel"] = bool(launch["sequence_parallel"] and row["tp"] > 1)
    values["tp_comm_overlap"] = bool(row["tp_comm_overlap"] and row["tp"] > 1)
    values["overlap_p2p_comm"] = bool(launch["overlap_p2p_comm"] and row["vp"] > 1)
    lines = [f"  global_batch_size: {row['global_batch']}",
             f"  micro_batch_size: {row['micro_batch']}",
             f"  precision: {row['precision']}",
             f"  recompute: {row['recompute']}"]
    return lines + [f"  {key}: {str(value).lower()}" for key, value in sorted(values.items())]


def _parallel_lines(row: dict) -> list[str]:
    lines = [f"  tensor: {row['tp']}", f"  pipeline: {row['pp']}", f"  expert: {row['ep']}"]
    if row["etp"] != row["tp"]:
        lines.append(f"  expert_tensor: {row['etp']}")
    if row["cp"] > 1:
        lines.append(f"  context: {row['cp']}")
    if row["vp"] > 1:
        return lines + ["  schedule: interleaved", f"  virtual_stages: {row['vp']}"]
    return lines + ["  schedule: 1f1b"]


def render_scenario(dataset: dict, row: dict) -> str:
    """A scenario YAML reproducing one row on the dataset's nodes (catalog entries of `common`)."""
    common = dataset["common"]
    nodes = row["gpus"] // common["gpus_per_node"]
    node = (f"{{count: {nodes}, gpu: {common['gpu']}, gpus_per_node: {common['gpus_per_node']}, "
            f"intra_node: {common['intra_node']}, nics: [{{type: ib, model: {common['nic']}, "
            f"count: {common['nics_per_node']}, fabric: ib}}]}}")
    capacity = row.get("capacity_factor")
    lines = [f"# {row_name(row)}: {dataset['sources'][row['source']]['measurements'].split(':')[0]}",
             f"# Measured {row['measured_tflops_per_gpu']} TFLOP/s per GPU ({row['router']}). "
             "Generated by holmes_sim.validation.published.",
             f"name: {row_name(row)}",
             "description: published measurement, rendered with the catalog defaults",
             "seed: 0",
             "fabrics: [{name: ib, type: ib}]",
             "clusters:",
             f"  - name: {common['cluster_name']}",
             "    nodes:",
             f"      - {node}",
             "model:", f"  preset: {row['preset']}", f"  seq_length: {row['seq_length']}",
             *([f"  moe_expert_capacity_factor: {capacity}"] if capacity is not None else []),
             "training:", *_training_lines(dataset, row),
             "parallel:", *_parallel_lines(row),
             "policies: [megatron]"]
    return "\n".join(lines) + "\n"
