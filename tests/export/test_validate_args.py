"""Launch files Megatron-LM starts: the exported arguments and environment hold to what
`validate_args` (megatron/training/arguments.py) and Megatron-Core's `TransformerConfig` check at
startup, beyond the argument table that tests/export/test_launch_targets.py parses against."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from holmes_sim.export.launch import LaunchFiles, launch_files
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


def _dry_run_env(files: dict[str, str], tmp_path, target: str) -> list[str]:
    """The environment words of node 0's `target` command (`launch.sh` dry run)."""
    LaunchFiles(files).write(tmp_path / target)
    proc = subprocess.run(["bash", str(tmp_path / target / "launch.sh"), target], cwd="/",
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "NODE_RANK": "0", "DRY_RUN": "1"})
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    return words[:words.index("torchrun")]


@pytest.mark.parametrize("tp, cp, needed", [(8, 1, True), (1, 2, True), (1, 1, False)])
def test_tensor_and_context_parallel_launches_set_one_cuda_connection(write_scenario, tmp_path,
                                                                      tp, cp, needed):
    """Megatron-LM's `validate_args` asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with TP or CP > 1
    (before Blackwell): upstream's command sets it there, and only there. The Holmes fork's
    raises without it whenever the asynchronous TP all-reduce is on, its default at TP 1 too:
    the fork's command sets it on every plan it runs (not CP > 1)."""
    text = small_scenario(tp=tp, pp=2, seq=2048)
    if cp > 1:
        text = _training(text, "flash_attention: true").replace(
            "virtual_stages: 1}", f"virtual_stages: 1, context: {cp}}}")
    files = _export(write_scenario, text, "holmes")
    fork = cp == 1
    for target, set_here in (("megatron", needed), ("holmes", True))[:1 + fork]:
        env = _dry_run_env(files, tmp_path, target)
        assert ("CUDA_DEVICE_MAX_CONNECTIONS=1" in env) == set_here, (target, env)
        assert any(w.startswith("NCCL_NET=") for w in env)
    readme = files["README.md"]
    assert ("`launch.sh megatron` sets `CUDA_DEVICE_MAX_CONNECTIONS=1`" in readme) == needed
    assert ("`launch.sh holmes` sets `CUDA_DEVICE_MAX_CONNECTIONS=1`" in readme) == fork


@pytest.mark.parametrize("gpu, upstream", [("b200", "32"), ("gb200", "32"), ("h100-sxm", "1")])
def test_blackwell_nodes_run_upstream_with_many_cuda_connections(write_scenario, tmp_path, gpu,
                                                                 upstream):
    """On compute capability 10 upstream Megatron-LM no longer asserts one connection, and
    NVIDIA's Megatron-Bridge scripts set 32 there; the Holmes fork still asserts 1 with
    sequence parallelism on every GPU."""
    text = small_scenario(tp=8, pp=2, seq=2048).replace("gpu: a100-80gb", f"gpu: {gpu}")
    files = _export(write_scenario, text, "holmes")
    for target, value in (("megatron", upstream), ("holmes", "1")):
        env = _dry_run_env(files, tmp_path, target)
        assert [w for w in env if w.startswith("CUDA_DEVICE_MAX_CONNECTIONS=")] == \
            [f"CUDA_DEVICE_MAX_CONNECTIONS={value}"], (target, env)


def core_config(args: list[str]):
    """Megatron-Core's `TransformerConfig` of the exported arguments, as Megatron-LM's
    `core_transformer_config_from_args` (megatron/training/argument_utils.py) builds it, for
    the architecture and parallel fields its `__post_init__` checks together: its error, if
    any, is Megatron-LM's at startup."""
    import torch.nn.functional as F
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import TransformerConfig

    parsed = parse(args, UPSTREAM)

    def value(flag: str, default=None):
        return int(parsed[flag][0]) if flag in parsed else default

    bias = "--disable-bias-linear" not in parsed
    tp = value("--tensor-model-parallel-size", 1)
    fields = dict(num_layers=value("--num-layers"), hidden_size=value("--hidden-size"),
                  num_attention_heads=value("--num-attention-heads"),
                  ffn_hidden_size=value("--ffn-hidden-size"),
                  num_query_groups=value("--num-query-groups"), add_bias_linear=bias,
                  tensor_model_parallel_size=tp,
                  sequence_parallel="--sequence-parallel" in parsed,
                  num_moe_experts=value("--num-experts"),
                  moe_ffn_hidden_size=value("--moe-ffn-hidden-size"),
                  expert_tensor_parallel_size=value("--expert-tensor-parallel-size", tp),
                  expert_model_parallel_size=value("--expert-model-parallel-size", 1))
    if "--num-experts" in parsed:
        fields.update(router_fields(parsed),
                      moe_shared_expert_intermediate_size=value(
                          "--moe-shared-expert-intermediate-size"),
                      moe_shared_expert_gate="--moe-shared-expert-gate" in parsed)
    if "--swiglu" in parsed:
        fields.update(gated_linear_unit=True, activation_func=F.silu,
                      bias_activation_fusion=bias and
                      "--no-bias-swiglu-fusion" not in parsed)
    else:  # validate_args turns the GeLU fusion off without biases
        fields["bias_activation_fusion"] = bias and "--no-bias-gelu-fusion" not in parsed
    if "--squared-relu" in parsed:
        fields["activation_func"] = squared_relu
    return TransformerConfig(**fields)


def router_fields(parsed: dict[str, list[str]]) -> dict:
    """`TransformerConfig`'s router fields of parsed MoE arguments, Megatron-Core's defaults
    where a flag is absent."""
    def one(flag: str, kind, default=None):
        return kind(parsed[flag][0]) if flag in parsed else default

    return dict(moe_router_topk=one("--moe-router-topk", int, 2),
                moe_router_load_balancing_type=one("--moe-router-load-balancing-type", str,
                                                   "aux_loss"),
                moe_aux_loss_coeff=one("--moe-aux-loss-coeff", float, 0.0),
                moe_router_pre_softmax="--moe-router-pre-softmax" in parsed,
                moe_router_score_function=one("--moe-router-score-function", str, "softmax"),
                moe_router_enable_expert_bias="--moe-router-enable-expert-bias" in parsed,
                moe_router_topk_scaling_factor=one("--moe-router-topk-scaling-factor", float),
                moe_router_num_groups=one("--moe-router-num-groups", int),
                moe_router_group_topk=one("--moe-router-group-topk", int))


@pytest.mark.parametrize("bias", [True, False])
def test_squared_relu_with_biases_turns_off_the_bias_gelu_fusion(write_scenario, bias):
    """Megatron-LM fuses each MLP bias into its activation by default (`--no-bias-gelu-fusion`
    turns it off) and Megatron-Core refuses that fusion for squared ReLU, so a squared-ReLU
    model with biases did not start; without biases Megatron-LM turns the fusion off itself."""
    text = small_scenario().replace("tie_embeddings: true}", "tie_embeddings: true, "
                                    f"squared_relu: true, bias: {str(bias).lower()}}}")
    files = _export(write_scenario, text, "holmes")
    args = shlex.split(files["megatron_args.txt"])
    config = core_config(args)  # raises Megatron-Core's ValueError where it refuses
    assert config.add_bias_linear == bias and not config.bias_activation_fusion
    assert ("--no-bias-gelu-fusion" in args) == bias
    assert "--no-bias-gelu-fusion" in parse(shlex.split(files["holmes_args.txt"]), FORK) or not bias


@pytest.mark.parametrize("precision, fp32, flag", [
    ("bf16", True, None), ("bf16", False, "--grad-reduce-in-bf16"),
    ("fp16", True, "--accumulate-allreduce-grads-in-fp32"), ("fp16", False, None),
    ("fp32", True, None)])
def test_gradients_are_reduced_in_the_simulated_dtype(write_scenario, precision, fp32, flag):
    """`grad_reduce_in_fp32` sets the simulated gradient bytes; Megatron-LM reduces bf16
    gradients in fp32 and fp16 ones in fp16 by default (`validate_args`), so the export states
    the other choice. The Holmes fork's parser predates `--grad-reduce-in-bf16` (its bf16
    always reduces in fp32): that plan is left out of its export with the reason."""
    text = _training(small_scenario(), f"precision: {precision}, "
                                       f"grad_reduce_in_fp32: {str(fp32).lower()}")
    files = _export(write_scenario, text, "holmes")
    parsed = parse(shlex.split(files["megatron_args.txt"]), UPSTREAM)
    flags = {"--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"}
    assert flags & set(parsed) == ({flag} if flag else set())
    fork = files["holmes_args.txt"]
    if flag == "--grad-reduce-in-bf16":
        assert fork.startswith("# not expressible") and "no --grad-reduce-in-bf16" in fork
    else:
        assert flags & set(parse(shlex.split(fork), FORK)) == ({flag} if flag else set())


def _moe(bias: bool, parallel: str = "expert: 4", extra: str = "") -> str:
    text = small_scenario(nodes_ib=2, tp=2, pp=2, extra=extra).replace(
        "tie_embeddings: true}", f"tie_embeddings: true, bias: {str(bias).lower()}, "
        "num_experts: 8, moe_router_topk: 2}")
    return _training(text, "sequence_parallel: true").replace(
        "virtual_stages: 1}", f"virtual_stages: 1, {parallel}}}")


@pytest.mark.parametrize("parallel, field", [("expert: 4", "parallel.tensor"),
                                             ("expert: 4, expert_tensor: 2",
                                              "parallel.expert_tensor")])
def test_moe_with_biases_split_over_tensor_ranks_is_refused_at_load(write_scenario, tmp_path,
                                                                    parallel, field):
    """Megatron-Core builds experts with biases only at expert TP 1 (`TransformerConfig`:
    "Bias in Moe is only supported when ETP==1"), and the experts take the TP degree unless
    `expert_tensor` says otherwise: refused when the file loads, at the line of the degree."""
    from typer.testing import CliRunner

    from holmes_sim.cli import app

    path = write_scenario(_moe(True, parallel))
    out = tmp_path / "plans"
    result = CliRunner().invoke(app, ["run", str(path), "-q", "--plans", str(out)])
    message = " ".join(result.output.split())
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1)
                if text.startswith("parallel:"))
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert f"{path}:{line}: {field}: expert_tensor=2: Megatron-Core splits no expert with " \
           "biases over tensor ranks" in message
    assert "set model.bias: false, or parallel.expert_tensor: 1" in message
    assert not out.exists()


@pytest.mark.parametrize("bias, parallel", [(False, "expert: 4"),
                                            (True, "expert: 4, expert_tensor: 1")])
def test_moe_exports_megatron_core_builds(write_scenario, bias, parallel):
    """Without biases the experts split over the TP ranks; with them, expert TP 1."""
    args = shlex.split(_export(write_scenario, _moe(bias, parallel))["megatron_args.txt"])
    config = core_config(args)
    assert config.add_bias_linear == bias
    assert config.expert_tensor_parallel_size == (1 if bias else 2)


def test_the_planner_keeps_biased_experts_unsplit(write_scenario):
    """`plan` proposes the expert TP degrees Megatron-Core builds: 1 for biased experts."""
    from holmes_sim.search.planner import layouts

    search = ("search: {tensor: [2], pipeline: [2], expert: [1, 2, 4], micro_batch_size: [1], "
              "recompute: [none], schedule: [1f1b]}\n")
    for bias, etps in ((True, {1}), (False, {1, 2})):
        prepared = prepare(write_scenario(_moe(bias, "expert: 2, expert_tensor: 1", search)))
        found = {lay.etp for lay in layouts(prepared, prepared.scenario.search)}
        assert found == etps


@pytest.mark.parametrize("fields, name, width", [
    ("ffn_hidden_size: 4100", "model.ffn_hidden_size", 4100),
    ("bias: false, num_experts: 8, moe_shared_expert_intermediate_size: 1030",
     "model.moe_shared_expert_intermediate_size", 1030)])
def test_mlp_widths_that_tensor_ranks_cannot_share_are_refused(write_scenario, fields, name,
                                                               width):
    """Megatron-Core's tensor-parallel linear layers divide the FFN width (and the shared
    expert's) by the TP degree when the model is built; a width tensor=8 does not divide
    loaded and exported a launch that stopped there."""
    from holmes_sim.errors import ScenarioError

    text = _training(small_scenario().replace("tie_embeddings: true}",
                                              f"tie_embeddings: true, {fields}}}"),
                     "sequence_parallel: true")
    with pytest.raises(ScenarioError, match=f"parallel.tensor: tensor=8 must divide {name}="
                                            f"{width}: each TP rank holds width / tensor"):
        prepare(write_scenario(text))
    assert prepare(write_scenario(text.replace("tensor: 8", "tensor: 2"))).tp == 2


def test_an_all_moe_model_splits_no_dense_ffn(write_scenario):
    """With every layer an MoE layer no dense MLP is built: its width is not checked."""
    text = _training(small_scenario().replace(
        "tie_embeddings: true}", "tie_embeddings: true, ffn_hidden_size: 4100, bias: false, "
        "num_experts: 8, moe_ffn_hidden_size: 1024}"), "sequence_parallel: true")
    assert prepare(write_scenario(text)).tp == 8


def test_biases_without_the_qkv_bias_get_no_launch_files(write_scenario, tmp_path):
    """Megatron-LM's `validate_args` sets `add_qkv_bias` whenever `add_bias_linear` is on, so a
    model with biases but no QKV bias has no launch: `run --plans` writes the plans without
    launch folders and says why, `plan --export` is refused before its search, and the model
    still simulates."""
    from typer.testing import CliRunner

    from holmes_sim.cli import app
    from holmes_sim.errors import PlanError

    text = small_scenario().replace("tie_embeddings: true}",
                                    "tie_embeddings: true, bias: true, qkv_bias: false}")
    path = write_scenario(text)
    out = tmp_path / "plans"
    result = CliRunner().invoke(app, ["run", str(path), "-q", "--plans", str(out)])
    message = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert any(f"note: no launch files for {pair}: Megatron-LM cannot drop the QKV bias alone"
               in message for pair in ("megatron, holmes", "holmes, megatron"))  # fastest first
    assert "set model.qkv_bias: true, or model.bias: false with qkv_bias: false" in message
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "plan_holmes.json", "plan_megatron.json"]
    export = tmp_path / "export"
    result = CliRunner().invoke(app, ["plan", str(path), "--export", str(export)])
    message = " ".join(result.output.split())
    assert result.exit_code == 2 and "--export: no launch files: Megatron-LM cannot" in message
    assert not export.exists()
    prepared = prepare(path)
    plan, cluster = plan_policy(prepared, "holmes")
    with pytest.raises(PlanError, match="cannot drop the QKV bias alone"):
        launch_files(plan, cluster, prepared.workload, "bf16")
    for fields in ("bias: false, qkv_bias: true", "bias: false, qkv_bias: false"):
        files = _export(write_scenario, text.replace("bias: true, qkv_bias: false", fields))
        assert ("--add-qkv-bias" in files["megatron_args.txt"]) == ("qkv_bias: true" in fields)


def _te_cp_comm_types() -> set[str]:
    """The `cp_comm_type` values Transformer Engine's `attn_forward_func_with_cp` runs, read from
    its dispatch (tests/export/data/te_cp_comm_dispatch.json, TE d0067d0): the values of each
    `if`/`elif` on `cp_comm_type`, whose final `else` raises ValueError."""
    text = json.loads((Path(__file__).parent / "data/te_cp_comm_dispatch.json").read_text())
    excerpt = text["excerpt"]
    assert 'raise ValueError(f"Unsupported communication type: {cp_comm_type}!")' in excerpt
    accepted: set[str] = set()
    for listed, single in re.findall(r'if cp_comm_type (?:in \[([^\]]*)\]|== "([^"]*)")', excerpt):
        accepted |= set(re.findall(r'"([^"]*)"', listed)) | ({single} if single else set())
    return accepted


@pytest.mark.parametrize("comm, exported", [("p2p", "p2p"), ("a2a", "a2a"),
                                             ("allgather", "all_gather")])
def test_cp_comm_type_exports_a_value_transformer_engine_runs(write_scenario, comm, exported):
    """Megatron-Core passes `--cp-comm-type` to Transformer Engine unchanged
    (`TEDotProductAttention`), and TE raises "Unsupported communication type: allgather!": the
    export writes TE's own spelling."""
    assert _te_cp_comm_types() == {"p2p", "a2a+p2p", "all_gather", "a2a"}
    text = _training(small_scenario(tp=4, pp=2, seq=2048), "flash_attention: true").replace(
        "virtual_stages: 1}", f"virtual_stages: 1, context: 2, cp_comm_type: {comm}}}")
    args = shlex.split(_export(write_scenario, text)["megatron_args.txt"])
    value = args[args.index("--cp-comm-type") + 1]
    assert value == exported and value in _te_cp_comm_types()
    assert parse(args, UPSTREAM)["--cp-comm-type"] == [exported]
