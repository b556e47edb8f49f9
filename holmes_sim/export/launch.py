"""A plan as something a launcher reads: node order, one `torchrun` line per node, the framework's
arguments, the Holmes repository's arguments (`export.fork`) and the NCCL environment of every
node (`export.nccl_env`).

Megatron-LM places global rank r = node_rank x G + local_rank (torchrun) and builds its groups in
the "tp-cp-ep-dp-pp" order that `Plan` uses (`--context-parallel-size`, `--cp-comm-type`), so a
plan is launchable when its ranks fill nodes in order (every policy here does: they only reorder
nodes). Argument names follow Megatron-LM's
`arguments.py` (`--pipeline-model-parallel-layout` is parsed by Megatron-Core's
`PipelineParallelLayerLayout`: stages separated by `|`, `E` embedding, `t` a decoder layer, `L` the
loss). Plans of Megatron-LLaMA and Megatron-DeepSpeed, and GPipe plans, get none
(`plan_launch_refusal`).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from holmes_sim.export.device_types import device_types
from holmes_sim.export.fork import (attention_env_note, fork_args, fork_attention_env,
                                    fork_node_env, fork_notes, holmes_config)
from holmes_sim.export.nccl_env import (cuda_connections_notes, device_notes, fabric_splits,
                                        group_nccl_settings, job_env, job_env_text,
                                        node_nccl_env, planned_fabrics, process_env,
                                        roce_gid_note, upstream_net, upstream_node_env)
from holmes_sim.export.script import NodeLaunch, launch_readme, launch_script
from holmes_sim.report.staged import write_together
from holmes_sim.hardware.cluster import Cluster, Node
from holmes_sim.errors import FieldError, PlanError
from holmes_sim.export.refusals import plan_launch_refusal
from holmes_sim.export.model_args import (TE_CROSS_ENTROPY_REFUSED,
                                          USERBUFFER_CONFIG, USERBUFFER_ZERO_SMS,
                                          architecture_args, attention_args, expert_tensor_args,
                                          loss_args, overlap_args,
                                          pipeline_split_note,
                                          rope_factor_note, router_note, shared_gate_note,
                                          split_args, tokenizer_args, userbuffer_config,
                                          vocab_args, vocabulary_section)
from holmes_sim.plan import Plan
from holmes_sim.model.pipeline_split import megatron_layers_per_stage
from holmes_sim.model.workload import Workload

REFERENCE_POLICIES = ("all-ib", "all-ethernet")
LAUNCH_FILE_NAMES = ("hostfile", "megatron_args.txt", "plan.json", "nccl.json", "holmes_args.txt",
                     "holmes_config.json", USERBUFFER_CONFIG, "launch.sh", "launch_megatron.sh",
                     "launch_holmes.sh", "README.md")
"""Every file a launch folder may hold (`launch_files` writes a subset)."""
MASTER_PORT = 29500


@dataclass(frozen=True, slots=True)
class LaunchFiles:
    """Everything needed to start one plan: file name -> text."""

    files: dict[str, str]

    def write(self, directory: Path) -> list[Path]:
        """Write every file into `directory` (created if new) as one change
        (`staged.write_together`); the CLI writes its folders with `export.folders`, which
        records them in their output folder."""
        write_together(directory.parent,
                       {f"{directory.name}/{name}": text for name, text in self.files.items()})
        return [directory / name for name in sorted(self.files)]


def node_order(plan: Plan, cluster: Cluster) -> list[Node]:
    """Nodes in the order their ranks come, checking torchrun's rank layout.

    Raises:
        PlanError: when a node's ranks are not one contiguous block in local-GPU order.
    """
    nodes: list[Node] = []
    rank = 0
    while rank < len(plan.rank_to_gpu):
        node = cluster.node(plan.rank_to_gpu[rank].node)
        block = plan.rank_to_gpu[rank:rank + node.num_gpus]
        if [(g.node, g.local_index) for g in block] != [(node.name, i) for i in range(node.num_gpus)]:
            raise PlanError(f"ranks {rank}..{rank + node.num_gpus - 1} do not fill node {node.name} "
                            "in GPU order, which torchrun requires; this plan cannot be launched as is")
        nodes.append(node)
        rank += node.num_gpus
    return nodes


def pipeline_layout(plan: Plan) -> str:
    """Megatron-Core's layout string: virtual stages in model order, embedding first, loss last."""
    stages = ["t" * n for n in plan.layers_per_stage]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "L"
    return "|".join(stages)


def _precision_args(precision: str) -> list[str]:
    """`--bf16`/`--fp16`; fp8: bf16 training with Transformer Engine FP8 GEMMs in the hybrid
    format (E4M3 forward, E5M2 gradients; Megatron-LM `--fp8-format`); fp32: none, Megatron-LM's
    default (it has no `--fp32`)."""
    if precision == "fp8":
        return ["--bf16", "--fp8-format", "hybrid"]
    return [] if precision == "fp32" else [f"--{precision}"]


def megatron_args(plan: Plan, workload: Workload, precision: str) -> list[str]:
    """Arguments of `pretrain_gpt.py` for the plan's layout, batch, numerics and optimizer."""
    w = workload
    args = ["--tensor-model-parallel-size", str(plan.tp), "--pipeline-model-parallel-size", str(plan.pp),
            "--num-layers", str(w.num_layers), "--hidden-size", str(w.hidden),
            "--ffn-hidden-size", str(w.ffn), "--num-attention-heads", str(w.heads),
            "--seq-length", str(w.seq), "--max-position-embeddings", str(w.seq),
            "--micro-batch-size", str(w.micro_batch), "--global-batch-size", str(w.global_batch),
            *_precision_args(precision)]
    if w.fp8_current_scaling:
        args += ["--fp8-recipe", "tensorwise"]
    args += _layout_args(plan, w)
    args += overlap_args(w, plan.num_chunks > 1) + loss_args(w)
    if plan.cp > 1:
        args += ["--context-parallel-size", str(plan.cp), *_cp_comm_args(w, plan)]
    if not w.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    args += architecture_args(w) + vocab_args(w, plan.tp) + expert_tensor_args(w, plan.tp)
    if w.sequence_parallel and plan.tp > 1:
        args.append("--sequence-parallel")
    if w.flash_attention:
        args.append("--use-flash-attn")
    args += attention_args(w)
    args += _recompute_args(w.recompute)
    return (args + _optimizer_args(plan) + _bucket_args(plan, w) + _gradient_check_args(w)
            + _grad_dtype_args(w, precision))


def _grad_dtype_args(w: Workload, precision: str) -> list[str]:
    """The gradients' reduction dtype where the simulated one (`training.grad_reduce_in_fp32`)
    is not Megatron-LM's default for the precision (`validate_args`): bf16 (and fp8, bf16
    underneath) reduces in fp32 unless `--grad-reduce-in-bf16` (d165a85, 2025-02), fp16 in fp16
    unless `--accumulate-allreduce-grads-in-fp32`; fp32 in fp32."""
    fp32 = w.grad_bytes == 4
    if precision in ("bf16", "fp8") and not fp32:
        return ["--grad-reduce-in-bf16"]
    return ["--accumulate-allreduce-grads-in-fp32"] if precision == "fp16" and fp32 else []


def _bucket_args(plan: Plan, w: Workload) -> list[str]:
    """`--ddp-bucket-size` (elements) where the scenario sets `bucket_size_mb` and the plan's
    gradients are reduced in buckets during the backward; Megatron-Core's default otherwise."""
    if w.given_bucket_numel is None or not plan.releases_gradients_in_backward:
        return []
    return ["--ddp-bucket-size", str(w.given_bucket_numel)]


def _gradient_check_args(w: Workload) -> list[str]:
    """`--ddp-average-in-collective` and `--no-check-for-nan-in-loss-and-grad` where the workload
    departs from Megatron-LM's defaults (scale before the reduction; check for NaN)."""
    args = ["--ddp-average-in-collective"] if w.average_in_collective else []
    return args + ([] if w.check_for_nan_in_grad else ["--no-check-for-nan-in-loss-and-grad"])


def _layout_args(plan: Plan, w: Workload) -> list[str]:
    """The layers per virtual stage: none (even), per virtual stage, Megatron-Core's split
    flags when they give the plan's split (`model.pipeline_split`), else the explicit layout."""
    layers = plan.layers_per_stage
    even = len(set(layers)) == 1
    if plan.pp == 1 or (even and plan.num_chunks == 1 and not w.pipeline_split.is_set):
        return []
    split = w.pipeline_split
    if split.is_set and layers == _split_layers(w, plan):
        # Megatron-LM asks for the virtual degree, not layers per chunk, with an uneven split.
        per_chunk = ["--num-virtual-stages-per-pipeline-rank", str(plan.num_chunks)] \
            if plan.num_chunks > 1 else []
        return per_chunk + split_args(split)
    if even:
        return ["--num-layers-per-virtual-pipeline-stage", str(layers[0])]
    return ["--pipeline-model-parallel-layout", pipeline_layout(plan)]


def _split_layers(w: Workload, plan: Plan) -> tuple[int, ...] | None:
    """The split Megatron-Core builds from the workload's split flags, None if it cannot."""
    try:
        return megatron_layers_per_stage(w.num_layers, plan.pp, plan.num_chunks, w.pipeline_split)
    except FieldError:
        return None


TE_CP_COMM_TYPES = {"p2p": "p2p", "a2a": "a2a", "allgather": "all_gather"}
"""`parallel.cp_comm_type` -> the `--cp-comm-type` value Transformer Engine runs: Megatron-Core
hands the string to TE as is (`TEDotProductAttention`, megatron/core/extensions/
transformer_engine.py), whose `attn_forward_func_with_cp` takes p2p, a2a+p2p, all_gather and a2a
and raises ValueError on anything else ("allgather" included, though Megatron-LM's help text
spells it so)."""


def _cp_comm_args(w: Workload, plan: Plan) -> list[str]:
    return ["--cp-comm-type", TE_CP_COMM_TYPES[w.cp_comm_type]] if plan.cp > 1 else []


def _recompute_args(mode: str) -> list[str]:
    if mode == "full":
        return ["--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1"]
    if mode == "selective":
        return ["--recompute-granularity", "selective"]
    return []


def _optimizer_args(plan: Plan) -> list[str]:
    """Megatron-LM's optimizer flags (`framework_refusal` keeps other frameworks' plans out)."""
    mode = plan.optimizer
    args = ["--use-distributed-optimizer"] if mode.sharded else []
    if plan.releases_gradients_in_backward:
        args.append("--overlap-grad-reduce")
    if mode.overlapped:
        args.append("--overlap-param-gather")
    return args


def launch_files(plan: Plan, cluster: Cluster, workload: Workload, precision: str,
                 script: str = "pretrain_gpt.py", hosts: dict[str, str] | None = None
                 ) -> LaunchFiles:
    """Hostfile, arguments and NCCL settings for upstream Megatron-LM and for the Holmes fork,
    `launch.sh` (with `launch_megatron.sh` and `launch_holmes.sh`), a README, the plan. `hosts`
    maps each scenario node's name to its real host (`hosts.read_hosts`), listed in the plan's node
    order (default: the scenario's node names).

    Raises:
        PlanError: for a reference policy (a hypothetical network), an unlaunchable rank order,
            or `hosts` without a host for one of the plan's nodes.
    """

    if plan.policy in REFERENCE_POLICIES:
        raise PlanError(f"{plan.policy} is a reference on a hypothetical network (it changes the "
                        "NICs), not a placement for this cluster; export a real policy such as holmes")
    if (why := plan_launch_refusal(plan, workload)) is not None:
        raise PlanError(f"no launch files: {why}")
    nodes = node_order(plan, cluster)
    names = [n.name for n in nodes] if hosts is None else _hosts_of(nodes, hosts)
    margs = megatron_args(plan, workload, precision)
    fork, why_not = fork_args(plan, cluster, nodes, workload, margs,
                             _layout_args(plan, workload) + _cp_comm_args(workload, plan))
    net, fabrics = upstream_net(plan), planned_fabrics(plan)
    groups, env = group_nccl_settings(plan), job_env(workload)
    ub = userbuffer_config(workload)
    ub_args = ["--tp-comm-overlap-cfg", USERBUFFER_CONFIG] if ub else []
    files = {"hostfile": "".join(f"{h} slots={n.num_gpus}\n" for h, n in zip(names, nodes)),
             "megatron_args.txt": shlex.join(margs + ub_args) + "\n",
             "plan.json": plan.to_json() + "\n",
             "nccl.json": _nccl_json(nodes, fabrics, groups, net, env)}
    files["holmes_args.txt"] = shlex.join(fork + ub_args) + "\n" if fork else \
        f"# not expressible: {why_not}\n"
    types = device_types(plan, cluster)[0]
    config = holmes_config(nodes, types)
    if fork:
        files["holmes_config.json"] = json.dumps(config, indent=2) + "\n"
    fork_env = fork_attention_env(workload) if fork else {}
    launches = _launches(plan, names, nodes, types, net, fabrics, env, fork_env)
    if ub:
        files[USERBUFFER_CONFIG] = ub
    files["launch.sh"] = launch_script(launches, margs, fork, script, net, MASTER_PORT,
                                       USERBUFFER_CONFIG if ub else None)
    files["launch_megatron.sh"] = _wrapper("megatron")
    files["launch_holmes.sh"] = _wrapper("holmes")
    split = pipeline_split_note(workload, plan.tp, plan.pp)
    notes = (_notes(workload, ub) + ((split,) if split else ())
             + cuda_connections_notes(plan, bool(fork)) + device_notes(nodes)
             + tuple(filter(None, [roce_gid_note(plan, nodes)]))
             + (fork_notes(plan, nodes, types, config, margs) if fork else ())
             + tuple(filter(None, [attention_env_note(fork_env)])))
    files["README.md"] = launch_readme(plan, names, net, why_not if not fork else None, groups,
                                       notes, tokenizer=tokenizer_args(workload)[0],
                                       vocabulary=vocabulary_section(workload, plan.tp),
                                       splits=fabric_splits(plan, fabrics, net),
                                       job_nccl=job_env_text(env))
    return LaunchFiles(files)


def _nccl_json(nodes: list[Node], fabrics: dict[str, tuple[str, ...]],
               groups: dict[str, dict[str, str]], net: str, env: dict[str, str]) -> str:
    """`nccl.json`: per node its NCCL settings, those of its planned `fabrics`
    (`node_nccl_env`) and the job's own `env` (`job_env`), which both targets set on every
    node; per group class its transports (`groups`); upstream's job-wide `net`."""
    return json.dumps({"nodes": {n.name: node_nccl_env(n, fabrics.get(n.name)) | env
                                 for n in nodes},
                       "groups": groups, "upstream_job_wide": {"NCCL_NET": net}},
                      indent=2, sort_keys=True) + "\n"


def _launches(plan: Plan, hosts: list[str], nodes: list[Node], types: dict[str, str], net: str,
              fabrics: dict[str, tuple[str, ...]], env: dict[str, str],
              fork_env: dict[str, str]) -> list[NodeLaunch]:
    """What `launch.sh` needs of each node (`hosts`, `nodes` in rank order) under both targets:
    upstream's job-wide `net` on the HCAs of the node's planned `fabrics`, the fork's world
    group on TCP with `fork_env` (`fork_attention_env`), and the job's own `env` on every
    node."""
    return [NodeLaunch(h, n.num_gpus, types[n.name],
                       upstream_node_env(n, net, fabrics.get(n.name, ()))
                       | process_env(plan, n, "megatron") | env,
                       fork_node_env(n) | process_env(plan, n, "holmes") | fork_env | env)
            for h, n in zip(hosts, nodes)]


def _hosts_of(nodes: list[Node], hosts: dict[str, str]) -> list[str]:
    """The host of each of `nodes` (in the plan's order) from `hosts`, by scenario node name."""
    missing = [n.name for n in nodes if n.name not in hosts]
    if missing:
        raise PlanError(f"no host given for node {', '.join(missing[:8])}; give --hosts a host "
                        "for every node of the scenario")
    return [hosts[n.name] for n in nodes]


def _notes(workload: Workload, ub: str | None) -> tuple[str, ...]:
    """The export README's notes on exported arguments and files."""
    notes: list[str] = []
    if workload.cross_entropy == "te":
        notes.append(TE_CROSS_ENTROPY_REFUSED)
    if ub:
        notes.append(f"`{USERBUFFER_CONFIG}` sets the userbuffer overlap of the forward's "
                     "reduce-scatters as simulated; `launch.sh` passes it as "
                     "`--tp-comm-overlap-cfg` with its path in this folder (`megatron_args.txt` "
                     "and `holmes_args.txt` name it relative to the folder).")
    elif workload.tp_comm_overlap and workload.ub_rs_sms == 0:
        notes.append(USERBUFFER_ZERO_SMS)
    return tuple(notes) + tuple(filter(None, [router_note(workload), shared_gate_note(workload),
                                              rope_factor_note(workload)]))


def _wrapper(target: str) -> str:
    return ("#!/usr/bin/env bash\n"
            f'exec "$(dirname "$0")/launch.sh" {target} "$@"\n')
