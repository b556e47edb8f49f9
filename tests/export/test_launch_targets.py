"""Each export launchable by its consumer: upstream Megatron-LM's arguments checked flag by flag
against its argument definitions (tests/export/data/megatron_lm_flags.json, with the switches
that postdate it, `model_args.AFTER_RELEASE`, each with a README note), the Holmes fork's
against the fork's (holmes_fork_flags.json) and its --hetero rules, and `launch.sh` on a named
host running its own torchrun line (dry run)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from holmes_sim.errors import PlanError
from holmes_sim.export.hosts import read_hosts
from holmes_sim.export.launch import LaunchFiles, launch_files, node_order
from holmes_sim.export.model_args import AFTER_RELEASE, architecture_args
from holmes_sim.model.workload import build_workload
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from holmes_sim.spec.job import ModelSpec, TrainingSpec
from holmes_sim.spec.presets import preset_fields
from tests.conftest import SCENARIOS
from tests.export.test_export import hetero_stages

DATA = Path(__file__).parent / "data"
RELEASE = json.loads((DATA / "megatron_lm_flags.json").read_text())["flags"]
UPSTREAM = {**RELEASE, **{flag: "0" for flag in AFTER_RELEASE}}
"""The release's arguments and the newer switches the export writes with a note
(tests/export/test_megatron_main_flags.py checks them against Megatron-LM main)."""
FORK = json.loads((DATA / "holmes_fork_flags.json").read_text())["flags"]
FORK_CHOICES = json.loads((DATA / "holmes_fork_flags.json").read_text())["choices"]
"""The values the fork's parser accepts for each flag defined with `choices=`."""
UPSTREAM_POLICIES = ("megatron", "holmes")
"""Policies whose framework is Megatron-LM itself (megatron-llama and megatron-deepspeed get no
launch files: `export.refusals.framework_refusal`)."""


def parse(args: list[str], flags: dict[str, str]) -> dict[str, list[str]]:
    """argparse's reading of `args` under `flags` (name -> arity), or an assertion error naming
    the first flag the parser would reject."""
    out, i = {}, 0
    while i < len(args):
        flag = args[i]
        assert flag in flags, f"{flag} is not an argument of this parser"
        arity, i = flags[flag], i + 1
        values = []
        while i < len(args) and not args[i].startswith("--") and (
                arity in "+*" or len(values) < int(arity)):
            values.append(args[i])
            i += 1
        assert arity in "+*" or len(values) == int(arity), f"{flag} takes {arity} values: {values}"
        assert arity != "+" or values, f"{flag} needs at least one value"
        out[flag] = values
    return out


def _exports():
    for path in sorted(SCENARIOS.glob("*.yaml")):
        prepared = prepare(path)
        for policy in UPSTREAM_POLICIES:
            if policy in prepared.scenario.policies:
                plan, cluster = plan_policy(prepared, policy)
                yield path.stem, policy, plan, cluster, launch_files(
                    plan, cluster, prepared.workload, prepared.scenario.training.precision).files


EXPORTS = list(_exports())


@pytest.mark.parametrize("export", EXPORTS, ids=[f"{e[0]}-{e[1]}" for e in EXPORTS])
def test_upstream_arguments_parse_with_megatron_lm(export):
    *_, files = export
    parsed = parse(shlex.split(files["megatron_args.txt"]), UPSTREAM)
    assert not any(f.startswith("--hetero") or f == "--use-hetnet" for f in parsed)


@pytest.mark.parametrize("export", EXPORTS, ids=[f"{e[0]}-{e[1]}" for e in EXPORTS])
def test_holmes_arguments_parse_with_the_fork(export):
    _, _, plan, cluster, files = export
    text = files["holmes_args.txt"]
    if text.startswith("# not expressible"):
        assert "holmes_config.json" not in files
        return
    parsed = parse(shlex.split(text), FORK)
    types = parsed["--hetero-device-types"]
    stages = [int(x) for x in parsed["--hetero-pipeline-stages"]]
    assert parsed["--hetero-mode"] == ["pp"] and len(types) == len(set(types))
    assert "--global-batch-size" in parsed
    assert "--overlap-param-gather" not in parsed  # only with MCore models, not the legacy one
    for flag, values in parsed.items():
        assert set(values) <= set(FORK_CHOICES.get(flag, values)), (flag, values)
    counts, layers = hetero_stages(stages)
    assert len(counts) == len(types) and sum(counts) == plan.pp
    assert layers == list(plan.layers_per_stage)
    config = {e["CLUSTER_NAME"] for e in json.loads(files["holmes_config.json"])}
    assert config == {*types, "heter"}


def _fake_hostname(tmp_path: Path, name: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "hostname").write_text(f"#!/bin/sh\necho {name}\n")
    (bin_dir / "hostname").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DRY_RUN": "1"}


def _launch(tmp_path: Path, target: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(tmp_path / "out" / f"launch_{target}.sh"), "--mock-data"],
                          capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture(scope="module")
def holmes_export():
    prepared = prepare(SCENARIOS / "mixed_ib_roce.yaml")
    plan, cluster = plan_policy(prepared, "holmes")
    return prepared, plan, cluster


@pytest.mark.parametrize("target", ["megatron", "holmes"])
def test_launch_on_a_named_host_runs_its_torchrun_line(tmp_path, holmes_export, target):
    prepared, plan, cluster = holmes_export
    nodes = node_order(plan, cluster)
    scenario = [n.name for n in prepared.cluster.nodes]
    real = {name: f"gpu{k:02d}.example" for k, name in enumerate(scenario)}
    (tmp_path / "hosts").write_text("".join(f"{real[n]} slots=8\n" for n in scenario))
    by_node = read_hosts(tmp_path / "hosts", scenario)
    launch_files(plan, cluster, prepared.workload, "fp16", hosts=by_node).write(tmp_path / "out")
    hosts = [real[n.name] for n in nodes]  # in the plan's node order
    for rank in (0, 3):
        proc = _launch(tmp_path, target, _fake_hostname(tmp_path, hosts[rank]))
        assert proc.returncode == 0, proc.stderr
        words = shlex.split(proc.stdout)
        torchrun = words.index("torchrun")
        assert words[words.index("--node-rank") + 1] == str(rank)
        assert words[words.index("--master-addr") + 1] == hosts[0]
        assert words[-1] == "--mock-data" and "pretrain_gpt.py" in words[torchrun:]
        net = [w for w in words[:torchrun] if w.startswith("NCCL_NET=")]
        assert net == ["NCCL_NET=Socket"]  # IB and RoCE nodes share only TCP
        if target == "holmes":
            device = words[words.index("--hetero-current-device-type") + 1]
            assert device == ("ib" if "ib" in nodes[rank].rdma_fabrics else "roce")
    stranger = _launch(tmp_path, target, _fake_hostname(tmp_path, "laptop"))
    assert stranger.returncode == 2 and "NODE_RANK" in stranger.stderr
    by_rank = _launch(tmp_path, target, {**_fake_hostname(tmp_path, "laptop"), "NODE_RANK": "5"})
    assert by_rank.returncode == 0 and "--node-rank 5 " in by_rank.stdout


def test_hosts_file_of_the_wrong_length_is_refused(tmp_path):
    (tmp_path / "hosts").write_text("a\nb\n")
    with pytest.raises(PlanError, match="names 2 hosts, the plan has 8 nodes"):
        read_hosts(tmp_path / "hosts", [f"n{k}" for k in range(8)])


def test_export_readme_lists_what_the_user_must_add(holmes_export):
    prepared, plan, cluster = holmes_export
    readme = launch_files(plan, cluster, prepared.workload, "fp16").files["README.md"]
    for flag in ("--data-path", "--tokenizer-type", "--lr-decay-style", "--train-iters", "--save",
                 "--load"):
        assert flag in readme
    assert "TODO" not in readme
    example = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    parse(shlex.split(example.replace("\\\n", " "))[1:], UPSTREAM)


def test_export_readme_names_exactly_what_upstream_cannot_express(holmes_export):
    prepared, plan, cluster = holmes_export
    readme = launch_files(plan, cluster, prepared.workload, "fp16").files["README.md"]
    rows = {line.split(" | ")[0].strip("| "): line for line in readme.splitlines()
            if line.startswith("| dp ") or line.startswith("| pp ")}
    assert "rdma:ib, rdma:roce" in rows["dp"] and rows["dp"].endswith("not as planned |")
    assert rows["pp"].endswith("| as planned |")  # TCP groups stay TCP under NCCL_NET=Socket
    assert "cannot express: RDMA for the dp groups on rdma:ib, rdma:roce." in readme


def test_export_readme_of_an_all_rdma_plan_loses_nothing():
    prepared = prepare(SCENARIOS / "pure_ib.yaml")
    plan, cluster = plan_policy(prepared, "holmes")
    readme = launch_files(plan, cluster, prepared.workload, "fp16").files["README.md"]
    assert "`NCCL_NET=IB`" in readme and "not as planned" not in readme
    assert "can express every group's transport" in readme


@pytest.mark.parametrize("preset", ["deepseek-v2-lite", "deepseek-v3"])
def test_latent_attention_arguments_parse_with_megatron_lm(preset):
    """The multi-head latent attention and MoE flags of the DeepSeek presets, with the values
    each flag takes (`_add_mla_args`, `_add_moe_args`)."""
    w = build_workload(ModelSpec(**preset_fields(preset)),
                       TrainingSpec(global_batch_size=8, micro_batch_size=1), 8, ep=8)
    parsed = parse(architecture_args(w), UPSTREAM)
    assert parsed["--multi-latent-attention"] == [] and parsed["--kv-lora-rank"] == ["512"]
    assert parsed["--qk-pos-emb-head-dim"] == ["64"] and parsed["--v-head-dim"] == ["128"]
    assert ("--q-lora-rank" in parsed) == (preset == "deepseek-v3")


@pytest.mark.parametrize("bucket_mb", [None, 200])
def test_a_given_bucket_size_is_exported_in_elements(bucket_mb):
    """`bucket_size_mb` counts fp32 megabytes (`model.bucket_layout`): 200 MB is 50,000,000
    elements, `--ddp-bucket-size 50000000`; unset, Megatron-Core's own default applies."""
    from holmes_sim.prepare import prepare_text
    text = (SCENARIOS / "llama3_70b_h100.yaml").read_text()
    if bucket_mb is not None:
        text = text.replace("training:\n", f"training:\n  bucket_size_mb: {bucket_mb}\n", 1)
    prepared = prepare_text(text)
    plan, cluster = plan_policy(prepared, "megatron")
    assert plan.releases_gradients_in_backward
    files = launch_files(plan, cluster, prepared.workload, "bf16").files
    parsed = parse(shlex.split(files["megatron_args.txt"]), UPSTREAM)
    assert parsed.get("--ddp-bucket-size") == (None if bucket_mb is None else ["50000000"])


def _with_training(name: str, lines: str):
    from holmes_sim.prepare import prepare_text
    return prepare_text((SCENARIOS / f"{name}.yaml").read_text().replace(
        "training:\n", f"training:\n{lines}", 1))


@pytest.mark.parametrize("fusion, impl, expected", [
    (False, "te", None), (True, "native", []), (True, "te", ["te"])])
def test_the_fused_cross_entropy_is_exported_as_its_megatron_flags(fusion, impl, expected):
    """`--cross-entropy-loss-fusion` with `--cross-entropy-fusion-impl te` where chosen (native
    is Megatron's default, unfused its default without the switch)."""
    prepared = _with_training("llama3_70b_h100", f"  cross_entropy_loss_fusion: "
                              f"{str(fusion).lower()}\n  cross_entropy_fusion_impl: {impl}\n")
    plan, cluster = plan_policy(prepared, "megatron")
    files = launch_files(plan, cluster, prepared.workload, "bf16").files
    parsed = parse(shlex.split(files["megatron_args.txt"]), UPSTREAM)
    assert ("--cross-entropy-loss-fusion" in parsed) == fusion
    assert parsed.get("--cross-entropy-fusion-impl", [] if fusion else None) == expected
    assert ("refuses it" in files["README.md"]) == (expected == ["te"])


def test_the_holmes_fork_cannot_express_the_fused_cross_entropy():
    """The fork's arguments predate `--cross-entropy-loss-fusion`: its export is left out with
    the reason, where the same plan without the switch exports."""
    fused = _with_training("mixed_ib_roce", "  cross_entropy_loss_fusion: true\n")
    for prepared, expressible in ((prepare(SCENARIOS / "mixed_ib_roce.yaml"), True),
                                  (fused, False)):
        plan, cluster = plan_policy(prepared, "holmes")
        text = launch_files(plan, cluster, prepared.workload, "bf16").files["holmes_args.txt"]
        assert text.startswith("# not expressible") != expressible
    assert "no --cross-entropy-loss-fusion" in text


@pytest.mark.parametrize("check, average", [(True, False), (False, False), (False, True)])
def test_the_gradient_checks_are_exported_where_they_leave_megatron_lms_defaults(check, average):
    """`--no-check-for-nan-in-loss-and-grad` and `--ddp-average-in-collective` only where the
    scenario departs from Megatron-LM's defaults (check, scale before a summing reduction);
    the Holmes fork's parser has the first, not the second, so a plan averaging in the
    collective is left out of its export with the reason."""
    prepared = _with_training("mixed_ib_roce", f"  check_for_nan_in_loss_and_grad: "
                              f"{str(check).lower()}\n  ddp_average_in_collective: "
                              f"{str(average).lower()}\n")
    plan, cluster = plan_policy(prepared, "holmes")
    files = launch_files(plan, cluster, prepared.workload, "bf16").files
    parsed = parse(shlex.split(files["megatron_args.txt"]), UPSTREAM)
    assert ("--no-check-for-nan-in-loss-and-grad" in parsed) == (not check)
    assert ("--ddp-average-in-collective" in parsed) == average
    fork = files["holmes_args.txt"]
    assert fork.startswith("# not expressible") == average
    if average:
        assert "no --ddp-average-in-collective" in fork
    else:
        assert ("--no-check-for-nan-in-loss-and-grad" in parse(shlex.split(fork), FORK)) == \
            (not check)


# The keys of a Transformer Engine userbuffer configuration entry that `initialize_ub`'s
# `get_default_config` defines (transformer_engine/pytorch/module/base.py, which updates each
# default with the user's entry) and the methods it knows.
TE_UB_KEYS = {"method", "is_reduce_scatter", "num_sm", "cga_size", "set_sm_margin", "num_splits",
              "aggregate", "atomic_gemm", "fp8_buf", "use_ce", "pipeline_rs_overlap_first_gemm"}
TE_UB_METHODS = {"ring_exchange", "pipeline", "bulk", "external"}
MBRIDGE_70B = (Path(__file__).parents[2] / "validation" / "published" / "scenarios" /
               "nemo_dgx_h100" / "llama3-70b-64gpu-mbridge-25.11.yaml")


def _export_with_rs_sms(write_scenario, sms: int) -> dict[str, str]:
    text = MBRIDGE_70B.read_text().replace("tp_comm_overlap_rs_sms: 1",
                                           f"tp_comm_overlap_rs_sms: {sms}")
    prepared = prepare(write_scenario(text))
    assert prepared.workload.ub_rs_sms == sms
    plan, cluster = plan_policy(prepared, "megatron")
    return launch_files(plan, cluster, prepared.workload, "fp8").files


def _dry_run_ub_config(files: dict[str, str], tmp_path: Path, target: str) -> Path:
    """Write the export, dry-run node 0's `target` launch from / and return the path its
    command passes as `--tp-comm-overlap-cfg`."""
    LaunchFiles(files).write(tmp_path / "out")
    proc = subprocess.run(["bash", str(tmp_path / "out" / f"launch_{target}.sh")], cwd="/",
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "NODE_RANK": "0", "DRY_RUN": "1"})
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    return Path(words[words.index("--tp-comm-overlap-cfg") + 1])


@pytest.mark.parametrize("sms, method", [(1, "ring_exchange"), (8, "pipeline"), (16, "pipeline"),
                                         (24, "pipeline")])
def test_the_userbuffer_config_holds_the_simulated_reduce_scatter_sms(write_scenario, sms, method,
                                                                       tmp_path):
    files = _export_with_rs_sms(write_scenario, sms)
    config = yaml.safe_load(files["tp_comm_overlap_cfg.yaml"])
    assert set(config) == {"proj_fprop", "fc2_fprop"}
    for entry in config.values():
        assert set(entry) <= TE_UB_KEYS and entry["method"] in TE_UB_METHODS
        assert (entry["method"], entry["num_sm"], entry["set_sm_margin"]) == (method, sms, True)
    parsed = parse(shlex.split(files["megatron_args.txt"]), UPSTREAM)
    assert parsed["--tp-comm-overlap-cfg"] == ["tp_comm_overlap_cfg.yaml"]
    assert "--tp-comm-overlap" in parsed
    path = _dry_run_ub_config(files, tmp_path, "megatron")
    assert path.is_absolute() and yaml.safe_load(path.read_text()) == config
    assert "tp_comm_overlap_cfg.yaml" in files["README.md"]


def test_no_userbuffer_config_where_none_expresses_the_simulation(write_scenario):
    """0 SMs has no TE configuration: no file, and the README says the launch holds TE's 16
    where 0 was simulated."""
    files = _export_with_rs_sms(write_scenario, 0)
    assert "tp_comm_overlap_cfg.yaml" not in files
    assert "--tp-comm-overlap-cfg" not in files["megatron_args.txt"]
    assert "--tp-comm-overlap-cfg" not in files["launch.sh"]
    assert "tp_comm_overlap_rs_sms: 0" in files["README.md"]


def test_the_fork_gets_the_userbuffer_config_too(write_scenario, tmp_path):
    """The Holmes fork's parser has `--tp-comm-overlap-cfg` (holmes_fork_flags.json): a 1F1B
    holmes plan it can run gets the file by its absolute path, as upstream does."""
    text = (SCENARIOS / "llama3_70b_h100.yaml").read_text().replace(
        "  tp_comm_overlap: true\n", "  tp_comm_overlap: true\n  tp_comm_overlap_rs_sms: 1\n").replace(
        "  schedule: interleaved\n  virtual_stages: 5\n", "  schedule: 1f1b\n")
    prepared = prepare(write_scenario(text))
    plan, cluster = plan_policy(prepared, "holmes")
    files = launch_files(plan, cluster, prepared.workload, "bf16").files
    parsed = parse(shlex.split(files["holmes_args.txt"]), FORK)
    assert parsed["--tp-comm-overlap-cfg"] == ["tp_comm_overlap_cfg.yaml"]
    assert _dry_run_ub_config(files, tmp_path, "holmes") == tmp_path / "out" / \
        "tp_comm_overlap_cfg.yaml"
