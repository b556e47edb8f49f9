"""The Holmes fork's launch starts: what its `validate_args` (megatron/training/arguments.py at
03d9522), its `HeteroContext` and `hetnet.set_nccl_envs` check at startup, beyond the argument
table tests/export/test_launch_targets.py parses against (the rules of holmes_fork_flags.json)."""

from __future__ import annotations

import shlex

import pytest

from holmes_sim.export.launch import launch_files
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from tests.conftest import SCENARIOS, small_scenario
from tests.export.test_launch_targets import FORK, FORK_CHOICES, UPSTREAM, parse
from tests.export.test_nic_devices import dual_fabric
from tests.export.test_validate_args import _dry_run_env


def _files(prepared, policy: str = "holmes") -> dict[str, str]:
    plan, cluster = plan_policy(prepared, policy)
    return launch_files(plan, cluster, prepared.workload,
                        prepared.scenario.training.precision).files


def test_the_fork_gets_no_overlapped_parameter_gather():
    """The fork asserts `--overlap-param-gather` only with MCore models, and its heterogeneous
    pipeline is built by its legacy model: the flag is left out of its arguments, kept in
    upstream's, and the README says the fork runs slower than simulated."""
    files = _files(prepare(SCENARIOS / "mixed_ib_roce.yaml"))
    assert "--overlap-param-gather" in parse(shlex.split(files["megatron_args.txt"]), UPSTREAM)
    fork = parse(shlex.split(files["holmes_args.txt"]), FORK)
    assert "--overlap-param-gather" not in fork and "--use-distributed-optimizer" in fork
    assert "--overlap-grad-reduce" in fork
    assert "only supported with MCore models" in files["README.md"]
    assert "runs slower than the plan simulated" in files["README.md"]


def _scenario(write_scenario, text: str):
    return prepare(write_scenario(text))


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_context_parallel_plans_get_no_fork_files(write_scenario, comm):
    """The fork's `HeteroContext` asserts "Context parallel size must be 1 in hetero mode pp"
    (megatron/training/hetero_context.py), whatever the communication type."""
    text = small_scenario(tp=4, pp=2, seq=2048).replace(
        "micro_batch_size: 1}", "micro_batch_size: 1, flash_attention: true}").replace(
        "virtual_stages: 1}", f"virtual_stages: 1, context: 2, cp_comm_type: {comm}}}")
    files = _files(_scenario(write_scenario, text))
    assert "--context-parallel-size" in files["megatron_args.txt"]
    assert files["holmes_args.txt"].startswith("# not expressible")
    assert "Context parallel size must be 1 in hetero mode pp" in files["holmes_args.txt"]
    assert "holmes_config.json" not in files


@pytest.mark.parametrize("model, why", [
    ("bias: false, multi_latent_attention: true, q_lora_rank: 256, kv_lora_rank: 128, "
     "qk_head_dim: 64, qk_pos_emb_head_dim: 32, v_head_dim: 64, position_embedding: rope, "
     "swiglu: true, normalization: rmsnorm", "no --multi-latent-attention"),
    ("position_embedding: none", "learned_absolute or rope, not none")],
    ids=["mla", "no-position-embedding"])
def test_models_the_forks_parser_rejects_get_no_fork_files(write_scenario, model, why):
    """The fork's parser has no `--multi-latent-attention` ("unrecognized arguments") and its
    `--position-embedding-type` takes learned_absolute or rope ("invalid choice": the
    `choices` of holmes_fork_flags.json): upstream gets the flags, the fork the reason."""
    text = small_scenario(tp=2, pp=2).replace("tie_embeddings: true}",
                                              f"tie_embeddings: true, {model}}}")
    files = _files(_scenario(write_scenario, text))
    upstream = parse(shlex.split(files["megatron_args.txt"]), UPSTREAM)
    assert "--multi-latent-attention" in upstream or \
        upstream["--position-embedding-type"] == ["none"]
    assert "none" not in FORK_CHOICES["--position-embedding-type"]
    assert "--multi-latent-attention" not in FORK
    assert files["holmes_args.txt"].startswith("# not expressible") and why in \
        files["holmes_args.txt"]
    assert "holmes_config.json" not in files


NO_ETHERNET = """name: noeth
seed: 0
fabrics:
  - {name: ib, type: ib}
clusters:
  - name: c
    nodes:
      - {name: ib, count: 2, gpu: a100-80gb,
         nics: [{type: ib, bandwidth_gbit_per_s: 200, count: 2, fabric: ib}]}
model: {num_layers: 8, hidden_size: 1024, num_attention_heads: 16, seq_length: 1024,
        vocab_size: 51200}
training: {global_batch_size: 16, micro_batch_size: 1}
parallel: {tensor: 8, pipeline: 2}
policies: [holmes]
"""


def _node_env(files: dict[str, str], tmp_path, target: str) -> dict[str, str]:
    """Node 0's environment under `target` (`launch.sh` dry run)."""
    return dict(w.split("=", 1) for w in _dry_run_env(files, tmp_path, target)[1:])


def test_the_fork_always_gets_a_socket_interface(write_scenario, tmp_path):
    """`hetnet.set_nccl_envs` raises "NCCL_SOCKET_IFNAME was not set" before each group: on
    nodes that declare no Ethernet NIC the fork still gets one (any but docker, lo, virbr),
    and the README says so; upstream keeps NCCL's own choice there."""
    files = _files(_scenario(write_scenario, NO_ETHERNET))
    assert _node_env(files, tmp_path, "holmes")["NCCL_SOCKET_IFNAME"] == "^docker,lo,virbr"
    assert "NCCL_SOCKET_IFNAME" not in _node_env(files, tmp_path, "megatron")
    assert "declares no Ethernet NIC" in files["README.md"]


def test_groups_the_fork_runs_on_another_fabric_are_named(write_scenario):
    """The dual nodes (one IB, two RoCE HCAs) are of device type ib for the fork, whose groups
    take the network of their nodes' type: the DP groups the plan runs on RoCE run on IB
    there, and the README says so; a plan whose types match its transports gets no note."""
    files = _files(_scenario(write_scenario, dual_fabric(1, 100, 200)))
    assert "dp groups run on rdma:ib, planned on rdma:roce" in files["README.md"]
    assert "Under the Holmes fork" not in _files(prepare(SCENARIOS / "mixed_ib_roce.yaml"))[
        "README.md"]


def test_an_ablation_the_fork_cannot_reproduce_gets_no_fork_files():
    """holmes-no-nic-selection runs DP over TCP between nodes of one fabric; the fork would run
    them over RDMA (one device type per node), so its files would not run the ablation."""
    files = _files(prepare(SCENARIOS / "mixed_ib_roce.yaml"), "holmes-no-nic-selection")
    text = files["holmes_args.txt"]
    assert text.startswith("# not expressible") and "holmes_config.json" not in files
    assert "does not reproduce the holmes-no-nic-selection ablation" in text
    assert "dp group runs on rdma:ib, planned on tcp:ethernet" in text
