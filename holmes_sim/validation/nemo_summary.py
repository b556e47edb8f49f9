"""Rows of NVIDIA's NeMo / Megatron-Bridge performance summaries as scenarios.

A dataset with `"format": "nemo-performance-summary"` (`validation/published/nemo_dgx_h100.json`)
holds rows as NVIDIA publishes them: model, GPUs, GBS, MBS, sequence length, TP, PP, CP, VP,
tokens/s/GPU and model TFLOP/s/GPU, with the row's `source` (release) and holmes-sim's model
`preset` (or, for a model without one, its `architecture` as ModelSpec fields). The measured
step time needs no FLOPs formula:
t = GBS x sequence / (tokens/s/GPU x GPUs) seconds. A row published as a step time or as TFLOP/s
in its software's own FLOP count (the H100 BF16 sets) gets it from `reported_step`.

Settings the table leaves out are the performance recipe's (`common.recipe`: sequence parallelism
when TP > 1, distributed optimizer, fused attention and its backend, the overlaps); a recipe
switch is written into the scenario when holmes-sim's TrainingSpec has a field of that name,
context parallelism (`CONTEXT_FIELD`) when ParallelSpec has it, and a row's `pipeline_split`
switches (Megatron-Core's uneven split) when either spec has them. Until then a row with CP > 1
is recorded, rendered and reported as "needs context parallelism", one whose layers do not
divide into PP x VP chunks as "needs an uneven pipeline split", never simulated
(`not_simulated`).
"""

from __future__ import annotations

import dataclasses

from holmes_sim.spec.job import ParallelSpec, TrainingSpec
from holmes_sim.spec.presets import PRESETS
from holmes_sim.validation import reported_step

FORMAT = "nemo-performance-summary"
CONTEXT_FIELD = "context"
"""ParallelSpec's context-parallel degree (Megatron `--context-parallel-size`)."""
NEEDS_CONTEXT_PARALLELISM = "needs context parallelism"
NO_ARCHITECTURE = "architecture not among holmes_sim's model presets"
NEEDS_UNEVEN_SPLIT = "needs an uneven pipeline split"

# The TrainingSpec fields a row's recipe may set (written sorted, besides sequence_parallel).
_TRAINING_KEYS = ("distributed_optimizer", "flash_attention", "attention_backend",
                  "tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather",
                  "overlap_p2p_comm",
                  "grad_reduce_in_fp32", "cross_entropy_loss_fusion", "cross_entropy_fusion_impl",
                  "tp_comm_overlap_rs_sms", "ddp_average_in_collective",
                  "check_for_nan_in_loss_and_grad", "fp8_recipe", "nccl_nvls_enable")


def is_nemo_dataset(dataset: dict) -> bool:
    return dataset.get("format") == FORMAT


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def context_parallel_available() -> bool:
    """True once ParallelSpec has the context-parallel degree: then CP rows simulate."""
    return CONTEXT_FIELD in _field_names(ParallelSpec)


def _split_fields(row: dict) -> dict[str, dict]:
    """The row's `pipeline_split` switches (Megatron-Core's uneven split, e.g.
    `account_for_embedding_in_pipeline_split`) by the spec section that has a field of that name."""
    out: dict[str, dict] = {}
    for key, value in row.get("pipeline_split", {}).items():
        for section, cls in (("parallel", ParallelSpec), ("training", TrainingSpec)):
            if key in _field_names(cls):
                out.setdefault(section, {})[key] = value
    return out


def _uneven(row: dict) -> bool:
    """Layers do not divide into PP x VP chunks (Megatron-Core then splits them unevenly)."""
    layers = (PRESETS[row["preset"]].fields["num_layers"] if row.get("preset")
              else row["architecture"]["num_layers"])
    return layers % (row["pp"] * row["vp"]) != 0


def row_name(row: dict) -> str:
    """`<model>-<gpus>gpu-<source>`, lower case, Megatron-Bridge as `mbridge` so that the case
    fits an 80-column table whole (`llama3-70b-64gpu-nemo-24.07`)."""
    model = row["model"].lower().replace("_", "-")
    return f"{model}-{row['gpus']}gpu-{row['source'].replace('megatron-bridge', 'mbridge')}"


def not_simulated(row: dict) -> str | None:
    """Why a row is recorded but not simulated, or None when it simulates."""
    if row.get("not_simulated"):
        return row["not_simulated"]
    if not renders(row):
        return NO_ARCHITECTURE
    if row["cp"] > 1 and not context_parallel_available():
        return NEEDS_CONTEXT_PARALLELISM
    if _uneven(row) and not _split_fields(row):
        return NEEDS_UNEVEN_SPLIT
    return None


def renders(row: dict) -> bool:
    """A row renders a scenario when holmes-sim has its architecture: a preset, or the row's own
    `architecture` (ModelSpec fields, with `architecture_source`)."""
    return row.get("preset") is not None or bool(row.get("architecture"))


def _model_lines(row: dict) -> list[str]:
    if row.get("preset") is not None:
        fields = {"preset": row["preset"]}
    else:
        fields = {"name": row["model"].lower(), **row["architecture"]}
    fields["seq_length"] = row["seq_length"]
    return [f"  {key}: {str(value).lower() if isinstance(value, bool) else value}"
            for key, value in fields.items()]


def measured_iteration_s(row: dict) -> float:
    """Step time in seconds from the published tokens/s/GPU: GBS x seq / (tokens/s/GPU x GPUs);
    a row published as a step time or as TFLOP/s per GPU: `reported_step.reported_iteration_s`."""
    reported = reported_step.reported_iteration_s(row)
    if reported is not None:
        return reported
    return row["global_batch"] * row["seq_length"] / (row["tokens_per_s_per_gpu"] * row["gpus"])


def _training_lines(dataset: dict, row: dict) -> list[str]:
    """The recipe's training switches: `common.recipe`, the row's source's own `recipe` over it
    (e.g. a Megatron-Bridge model provider's fused cross entropy), and the row's `recipe` over
    both (its model's launch configuration)."""
    common = dataset["common"]
    recipe = {**common["recipe"], **dataset["sources"][row["source"]].get("recipe", {}),
              **row.get("recipe", {})}
    unknown = sorted(set(recipe) - {*_TRAINING_KEYS, "sequence_parallel"})
    if unknown:
        raise ValueError(f"{row_name(row)}: recipe keys {unknown} are not TrainingSpec switches "
                         "this renderer writes")
    fields = _field_names(TrainingSpec)
    values = {key: recipe[key] for key in _TRAINING_KEYS if key in recipe and key in fields}
    values.update(_split_fields(row).get("training", {}))
    values["sequence_parallel"] = row["tp"] > 1 and recipe["sequence_parallel"] == "tp > 1"
    # NeMo's MegatronCommOverlapCallback (nemo/lightning/pytorch/callbacks/megatron_comm_overlap.py)
    # turns the TP overlap off below TP 2 or without sequence parallelism, and the p2p overlap
    # off without virtual stages: the recipe's switch applies where the callback keeps it.
    if "tp_comm_overlap" in values:
        values["tp_comm_overlap"] = bool(values["tp_comm_overlap"] and values["sequence_parallel"])
    if "overlap_p2p_comm" in values:
        values["overlap_p2p_comm"] = bool(values["overlap_p2p_comm"] and row["vp"] > 1
                                          and row["pp"] > 1)
    lines = [f"  global_batch_size: {row['global_batch']}",
             f"  micro_batch_size: {row['micro_batch']}",
             f"  precision: {common['precision']}",
             f"  recompute: {row.get('recompute', common['recompute'])}"]
    lines += [f"  {key}: {str(value).lower()}" for key, value in sorted(values.items())]
    return lines


def _parallel_lines(row: dict) -> list[str]:
    lines = [f"  tensor: {row['tp']}", f"  pipeline: {row['pp']}"]
    if row["cp"] > 1:
        lines.append(f"  {CONTEXT_FIELD}: {row['cp']}")
    if row["vp"] > 1:
        lines += ["  schedule: interleaved", f"  virtual_stages: {row['vp']}"]
    else:
        lines.append("  schedule: 1f1b")
    lines += [f"  {key}: {str(value).lower()}"
              for key, value in sorted(_split_fields(row).get("parallel", {}).items())]
    return lines


def render_scenario(dataset: dict, row: dict) -> str:
    """A scenario YAML reproducing one row on DGX H100 nodes (catalog entries of `common`)."""
    common = dataset["common"]
    source = dataset["sources"][row["source"]]["measurements"].split(":")[0]
    nodes = row["gpus"] // common["gpus_per_node"]
    node = (f"{{count: {nodes}, gpu: {common['gpu']}, gpus_per_node: {common['gpus_per_node']}, "
            f"intra_node: {common['intra_node']}, nics: [{{type: ib, model: {common['nic']}, "
            f"count: {common['nics_per_node']}, fabric: ib}}]}}")
    lines = [f"# {row_name(row)}: {source}",
             f"# Published {reported_step.published_figure(row)} "
             f"({row['precision_published']}). Generated by holmes_sim.validation.published.",
             f"name: {row_name(row)}",
             "description: published measurement, rendered with the catalog defaults",
             "seed: 0",
             "fabrics: [{name: ib, type: ib}]",
             "clusters:",
             "  - name: dgx-h100",
             "    nodes:",
             f"      - {node}",
             "model:", *_model_lines(row),
             "training:", *_training_lines(dataset, row),
             "parallel:", *_parallel_lines(row),
             "policies: [megatron]"]
    return "\n".join(lines) + "\n"
