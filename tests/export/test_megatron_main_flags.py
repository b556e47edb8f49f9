"""Exports against the current Megatron-LM as well as the release table the other tests use: every
upstream flag a bundled scenario's export or a preset's architecture writes is an argument of
Megatron-LM at d98e8a6 (2026-08-22) with its number of values (tests/export/data/
megatron_lm_flags_d98e8a6.json), so a launch file parses under both."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from holmes_sim.export.model_args import architecture_args
from holmes_sim.model.workload import build_workload
from holmes_sim.spec.job import ModelSpec, TrainingSpec
from holmes_sim.spec.presets import PRESETS, preset_fields
from holmes_sim.export.model_args import AFTER_RELEASE
from tests.export.test_launch_targets import EXPORTS, RELEASE, UPSTREAM, parse

MAIN = json.loads((Path(__file__).parent / "data/megatron_lm_flags_d98e8a6.json").read_text())["flags"]


@pytest.mark.parametrize("export", EXPORTS, ids=[f"{e[0]}-{e[1]}" for e in EXPORTS])
def test_upstream_arguments_parse_with_megatron_lm_main(export):
    *_, files = export
    args = shlex.split(files["megatron_args.txt"])
    assert parse(args, MAIN) == parse(args, UPSTREAM)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_presets_architecture_parses_with_megatron_lm_main(preset):
    """Each preset's model flags (GQA, SwiGLU, RMSNorm, RoPE base and scaling, norm epsilon,
    MoE and latent attention) at TP 8."""
    workload = build_workload(ModelSpec(**preset_fields(preset)),
                              TrainingSpec(global_batch_size=64, micro_batch_size=1), 8)
    args = architecture_args(workload)
    assert set(parse(args, MAIN)) == {a for a in args if a.startswith("--")}
    assert parse(args, MAIN) == parse(args, UPSTREAM)


_GELU_MOE = dict(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=1024,
                 num_experts=8)


@pytest.mark.parametrize("fields, flags", [
    ({"moe_router_topk": 1}, {"--no-bias-gelu-fusion", "--moe-router-pre-softmax",
                              "--moe-aux-loss-coeff"}),
    ({"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
      "moe_router_topk_scaling_factor": 2.5, "moe_router_num_groups": 4,
      "moe_router_group_topk": 2, "moe_router_load_balancing_type": "seq_aux_loss",
      "moe_aux_loss_coeff": 1e-4},
     {"--moe-router-score-function", "--moe-router-enable-expert-bias",
      "--moe-router-topk-scaling-factor", "--moe-router-num-groups",
      "--moe-router-group-topk", "--moe-router-load-balancing-type", "--moe-aux-loss-coeff"})])
def test_router_and_expert_flags_parse_with_megatron_lm_main(fields, flags):
    """The MoE router's flags and the GeLU experts' `--no-bias-gelu-fusion`, each with its
    number of values at d98e8a6 as in the release table."""
    workload = build_workload(ModelSpec(**_GELU_MOE, **fields),
                              TrainingSpec(global_batch_size=64, micro_batch_size=1), 1)
    args = architecture_args(workload)
    assert flags <= set(parse(args, MAIN))
    assert parse(args, MAIN) == parse(args, UPSTREAM)


@pytest.mark.parametrize("flag", AFTER_RELEASE)
def test_flags_written_after_the_release_are_switches_of_megatron_lm_main(flag):
    """The release table is extended only by switches 93da800 (2025-12) lacks and main has
    (`--moe-shared-expert-gate`: TransformerConfig.moe_shared_expert_gate, arguments generated
    from it since bddd0a8, 2026-01)."""
    assert flag not in RELEASE and MAIN[flag] == "0"
