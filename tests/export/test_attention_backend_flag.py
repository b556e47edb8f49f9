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
    ("flash_attention: false", ["unfused"]),  # auto would launch a fused kernel
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
    if "attention_backend" not in fields:
        assert "--attention-backend" not in files["holmes_args.txt"]  # the fork has no flag
        assert not files["holmes_args.txt"].startswith("# not expressible")
    elif expected is not None:
        enums = pytest.importorskip("megatron.core.transformer.enums")
        assert enums.AttnBackend[expected[0]].name == expected[0]  # the parser's `type`
        assert files["holmes_args.txt"].startswith("# not expressible")
        assert "the Holmes fork has no --attention-backend" in files["holmes_args.txt"]
    else:
        assert not files["holmes_args.txt"].startswith("# not expressible")


@pytest.mark.parametrize("nvls, expected", [(None, None), ("true", None), ("false", "0")])
def test_nvls_off_reaches_every_node_of_both_targets(write_scenario, nvls, expected):
    files = _files(write_scenario, "flash_attention: true" + (
        f", nccl_nvls_enable: {nvls}" if nvls else ""))
    script = files["launch.sh"]
    if expected is None:
        assert "NCCL_NVLS_ENABLE" not in script
    else:
        assert script.count(f"NCCL_NVLS_ENABLE={expected}") >= 2 * 2  # 2 nodes x 2 targets
