"""The simulated attention backend reaches Megatron-LM as `--attention-backend` (a name of
Megatron-Core's `AttnBackend`, which its parser takes), nothing where it is the default auto;
the Holmes fork, whose parser predates the flag, runs unfused attention through Transformer
Engine's switches in its environment and gets no launch for flash or fused."""

from __future__ import annotations

import json
import shlex

import pytest

from holmes_sim.export.launch import launch_files
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from tests.conftest import small_scenario
from tests.export.test_hosts_mapping import arrays
from tests.export.test_launch_targets import FORK, UPSTREAM, parse


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
    if expected in (None, ["unfused"]):
        assert "--attention-backend" not in files["holmes_args.txt"]  # the fork has no flag
        assert not files["holmes_args.txt"].startswith("# not expressible")
        parse(shlex.split(files["holmes_args.txt"]), FORK)
    else:
        enums = pytest.importorskip("megatron.core.transformer.enums")
        assert enums.AttnBackend[expected[0]].name == expected[0]  # the parser's `type`
        assert files["holmes_args.txt"].startswith("# not expressible")
        assert "the Holmes fork has no --attention-backend" in files["holmes_args.txt"]


def test_explicit_unfused_exports_exactly_as_auto_without_flash(write_scenario):
    """Both spellings simulate TE's unfused attention, so every file of the two exports,
    the fork's launch included, is the same."""
    explicit = _files(write_scenario, "flash_attention: false, attention_backend: unfused")
    assert explicit == _files(write_scenario, "flash_attention: false")
    assert not explicit["holmes_args.txt"].startswith("# not expressible")
    assert "holmes_config.json" in explicit


@pytest.mark.parametrize("fields, unfused", [
    ("flash_attention: false", True),
    ("flash_attention: false, attention_backend: unfused", True),
    ("flash_attention: true", False),
])
def test_the_forks_unfused_attention_is_set_by_transformer_engines_switches(
        write_scenario, fields, unfused):
    """The fork's legacy layers are TE `TransformerLayer`s, which run unfused attention only
    with NVTE_FLASH_ATTN=0 and NVTE_FUSED_ATTN=0; upstream sets them itself from
    `--attention-backend` and asserts they are unset or equal, so its environment has none."""
    files = _files(write_scenario, fields)
    got = arrays(files["launch.sh"])
    assert len(got["ENV_HOLMES"]) == 2
    for env in got["ENV_HOLMES"]:
        words = env.split()
        assert ("NVTE_FLASH_ATTN=0" in words and "NVTE_FUSED_ATTN=0" in words) == unfused
        assert unfused or "NVTE" not in env
    assert not any("NVTE" in env for env in got["ENV_MEGATRON"])
    assert ("NVTE_FLASH_ATTN=0 NVTE_FUSED_ATTN=0" in files["README.md"]) == unfused


@pytest.mark.parametrize("nvls, expected", [(None, None), ("true", None), ("false", "0")])
def test_nvls_off_reaches_every_node_of_both_targets(write_scenario, nvls, expected):
    files = _files(write_scenario, "flash_attention: true" + (
        f", nccl_nvls_enable: {nvls}" if nvls else ""))
    script = files["launch.sh"]
    if expected is None:
        assert "NCCL_NVLS_ENABLE" not in script
    else:
        assert script.count(f"NCCL_NVLS_ENABLE={expected}") >= 2 * 2  # 2 nodes x 2 targets


NETWORK_CHOICE = ("NCCL_NET", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME")
"""The variables that pick a node's network, which differ between the plan (`nccl.json`'s
`nodes`), upstream's one job-wide network and the fork's world group on TCP."""


@pytest.mark.parametrize("nvls", [None, "false"])
def test_nccl_json_holds_every_other_nccl_variable_the_launch_sets(write_scenario, nvls):
    """`nccl.json` lists each node's NCCL settings and the README tells users to edit them
    there: every NCCL variable `launch.sh` sets on a node, beyond its network choice, is in
    that node's entry with the same value, and the README's Networks section names it."""
    files = _files(write_scenario, "flash_attention: true" + (
        f", nccl_nvls_enable: {nvls}" if nvls else ""))
    got, nodes = arrays(files["launch.sh"]), json.loads(files["nccl.json"])["nodes"]
    seen = set()
    for target in ("ENV_MEGATRON", "ENV_HOLMES"):
        for host, env in zip(got["HOSTS"], got[target]):
            for key, value in (w.split("=", 1) for w in env.split()):
                if key.startswith("NCCL_") and key not in NETWORK_CHOICE:
                    assert nodes[host].get(key) == value, (target, host, key)
                    seen.add(f"`{key}={value}`")
    networks = files["README.md"].split("## Networks")[1].split("\n## ")[0]
    assert seen == ({"`NCCL_NVLS_ENABLE=0`"} if nvls else set())
    assert all(word in networks for word in seen)
    assert ("NCCL_NVLS_ENABLE" in networks) == bool(nvls)
