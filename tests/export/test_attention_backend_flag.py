"""The simulated attention backend reaches Megatron-LM as `--attention-backend` (a name of
Megatron-Core's `AttnBackend`, which its parser takes), nothing where it is the default auto;
the Holmes fork, whose parser predates the flag, gets no launch for another backend."""

from __future__ import annotations

import shlex

import pytest

from holmes_sim.export.launch import launch_files
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from tests.conftest import small_scenario
from tests.export.test_launch_targets import UPSTREAM, parse


def _files(write_scenario, fields: str) -> dict[str, str]:
    text = small_scenario(nodes_ib=2, tp=8, pp=2).replace(
        "micro_batch_size: 1}", f"micro_batch_size: 1, {fields}}}")
    prepared = prepare(write_scenario(text))
    plan, cluster = plan_policy(prepared, "holmes")
    return launch_files(plan, cluster, prepared.workload, "bf16").files


@pytest.mark.parametrize("fields, expected", [
    ("flash_attention: true", None),
    ("flash_attention: true, attention_backend: auto", None),
    ("flash_attention: true, attention_backend: flash", ["flash"]),
    ("flash_attention: true, attention_backend: fused", ["fused"]),
    ("flash_attention: false, attention_backend: unfused", ["unfused"]),
])
def test_a_backend_other_than_auto_is_exported_as_megatrons_flag(write_scenario, fields,
                                                                 expected):
    files = _files(write_scenario, fields)
    parsed = parse(shlex.split(files["megatron_args.txt"]), UPSTREAM)
    assert parsed.get("--attention-backend") == expected
    if expected is not None:
        enums = pytest.importorskip("megatron.core.transformer.enums")
        assert enums.AttnBackend[expected[0]].name == expected[0]  # the parser's `type`
        assert files["holmes_args.txt"].startswith("# not expressible")
        assert "the Holmes fork has no --attention-backend" in files["holmes_args.txt"]
    else:
        assert not files["holmes_args.txt"].startswith("# not expressible")
