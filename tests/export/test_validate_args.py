"""Launch files Megatron-LM starts: the exported arguments and environment hold to what
`validate_args` (megatron/training/arguments.py) and Megatron-Core's `TransformerConfig` check at
startup, beyond the argument table that tests/export/test_launch_targets.py parses against."""

from __future__ import annotations

import shlex

import pytest

from holmes_sim.export.launch import launch_files
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from tests.conftest import small_scenario
from tests.export.test_launch_targets import FORK, UPSTREAM, parse


def _training(text: str, fields: str) -> str:
    return text.replace("micro_batch_size: 1}", f"micro_batch_size: 1, {fields}}}")


def _export(write_scenario, text: str, policy: str = "megatron") -> dict[str, str]:
    prepared = prepare(write_scenario(text))
    plan, cluster = plan_policy(prepared, policy)
    return launch_files(plan, cluster, prepared.workload,
                        prepared.scenario.training.precision).files


@pytest.mark.parametrize("precision, flags", [("fp32", []), ("fp16", ["--fp16"]),
                                              ("bf16", ["--bf16"])])
def test_fp32_training_is_megatron_lms_default_and_takes_no_flag(write_scenario, precision,
                                                                   flags):
    """Megatron-LM has `--fp16` and `--bf16` and trains in fp32 without either; `--fp32` is no
    argument of it (nor of the Holmes fork), so the launch stopped at the parser."""
    files = _export(write_scenario, _training(small_scenario(), f"precision: {precision}"),
                    "holmes")
    for text, table in ((files["megatron_args.txt"], UPSTREAM), (files["holmes_args.txt"], FORK)):
        parsed = parse(shlex.split(text), table)
        assert [f for f in ("--fp16", "--bf16", "--fp32") if f in parsed] == flags
