"""A plan as something a launcher reads: node order, one `torchrun` line per node, the framework's
arguments, the Holmes repository's arguments and the NCCL environment of every node.

Megatron-LM places global rank r = node_rank x G + local_rank (torchrun) and builds its groups in
the "tp-cp-ep-dp-pp" order that `Plan` uses (`--context-parallel-size`, `--cp-comm-type`), so a
plan is launchable when its ranks fill nodes in order (every policy here does: they only reorder
nodes). Argument names follow Megatron-LM's
`arguments.py` (`--pipeline-model-parallel-layout` is parsed by Megatron-Core's
`PipelineParallelLayerLayout`: stages separated by `|`, `E` embedding, `t` a decoder layer, `L` the
loss) and the Holmes repository's scripts (`--hetero-mode pp
--hetero-device-types A B --hetero-current-device-type A --hetero-pipeline-stages n_A l.. n_B l..
--use-hetnet`: per device type, its number of pipeline stages and their layer counts). Plans of
Megatron-LLaMA and Megatron-DeepSpeed, and GPipe plans, get none (`plan_launch_refusal`).

NCCL settings (NCCL environment-variable documentation): RDMA groups name their HCAs with
`NCCL_IB_HCA` (the NICs' `devices` from the scenario, else placeholders: `node_nccl_env`);
RoCE also needs `NCCL_IB_GID_INDEX` (3: RoCE v2 over IPv4 on a
default ConnectX set-up); TCP groups use `NCCL_NET=Socket` with `NCCL_SOCKET_IFNAME`; every
process bootstraps over the Ethernet interface (`NCCL_SOCKET_IFNAME`). NCCL picks one network
(`NCCL_NET`: IB or Socket) per communicator when it is created, from the process environment at
that moment. Upstream Megatron-LM creates every group under one environment, so its export sets
one network for the whole job (`upstream_net`); the Holmes fork sets the environment of each group
from its `config.json` (one entry per device type, `heter` for groups that mix them) before
creating it (`megatron/core/hetnet.py`), which `holmes_config` writes.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from holmes_sim.export.device_types import device_types
from holmes_sim.export.script import NodeLaunch, launch_readme, launch_script
from holmes_sim.report.staged import write_together
from holmes_sim.hardware.cluster import ETHERNET, Cluster, Node
from holmes_sim.errors import FieldError, PlanError
from holmes_sim.export.refusals import plan_launch_refusal
from holmes_sim.export.model_args import (FORK_LACKS, TE_CROSS_ENTROPY_REFUSED,
                                          USERBUFFER_CONFIG, USERBUFFER_ZERO_SMS,
                                          architecture_args, attention_args, expert_tensor_args,
                                          fork_lacks_note, loss_args, overlap_args,
                                          pipeline_split_note,
                                          rope_factor_note, router_note, shared_gate_note,
                                          split_args, tokenizer_args, userbuffer_config,
                                          vocab_args, vocabulary_section, without_flags)
from holmes_sim.plan import GroupKind, Plan, TransportKind
from holmes_sim.model.pipeline_split import megatron_layers_per_stage
from holmes_sim.model.workload import Workload

REFERENCE_POLICIES = ("all-ib", "all-ethernet")
LAUNCH_FILE_NAMES = ("hostfile", "megatron_args.txt", "plan.json", "nccl.json", "holmes_args.txt",
                     "holmes_config.json", USERBUFFER_CONFIG, "launch.sh", "launch_megatron.sh",
                     "launch_holmes.sh", "README.md")
"""Every file a launch folder may hold (`launch_files` writes a subset)."""
ROCE_GID_INDEX = 3
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


def holmes_args(plan: Plan, cluster: Cluster, nodes: list[Node]) -> tuple[list[str], str | None]:
    """The Holmes repository's heterogeneous-pipeline arguments (without the per-node
    `--hetero-current-device-type`), or ([], why not) when the plan cannot be expressed: Holmes
    takes one device type per stage (`device_types`), one contiguous run of pipeline stages per
    device type and no virtual stages."""
    if plan.num_chunks > 1:
        return [], "Holmes' --hetero-pipeline-stages has no virtual (interleaved) stages"
    _, classes = device_types(plan, cluster)
    if isinstance(classes, str):
        return [], classes
    runs: list[tuple[str, list[int]]] = []
    for s, c in enumerate(classes):
        if runs and runs[-1][0] == c:
            runs[-1][1].append(plan.layers_per_stage[s])
        elif any(r[0] == c for r in runs):
            return [], f"device type {c} holds pipeline stages that are not contiguous"
        else:
            runs.append((c, [plan.layers_per_stage[s]]))
    stages = [str(x) for c, layers in runs for x in (len(layers), *layers)]
    return (["--hetero-mode", "pp", "--hetero-device-types", *[c for c, _ in runs],
             "--hetero-pipeline-stages", *stages, "--use-hetnet"], None)


SOCKET_EXCLUDE = "^docker,lo,virbr,ib"
"""`NCCL_SOCKET_IFNAME` of a node whose Ethernet NICs name no devices: NCCL's own choice without
its preference for IPoIB (`^`: every interface but those starting with these prefixes)."""


def node_nccl_env(node: Node, fabric: str | None = None) -> dict[str, str]:
    """The NCCL environment of one node: bootstrap on Ethernet, its HCAs for RDMA (with
    `fabric`, an RDMA fabric or Ethernet, only those on it: a device type's, `holmes_config`).

    NCCL's environment-variable documentation: `NCCL_SOCKET_IFNAME` and `NCCL_IB_HCA` are lists
    of prefixes, `^` first excludes them, `=` first makes them exact names, `name:port` is an
    HCA's port. The NICs' `device` names (a node group names all of a kind or none) are listed
    exactly (`=ens1f0`, `=mlx5_0:1`). Without names, NCCL_SOCKET_IFNAME is no guess: unset,
    NCCL takes `ib*` (IPoIB) interfaces first, then any but `docker`, `lo` and `virbr`
    (`ncclFindInterfaces`, src/misc/socket.cc), and IPoIB does not reach the nodes without
    InfiniBand that a mixed plan holds, so it is that second choice, `SOCKET_EXCLUDE`;
    NCCL_IB_HCA is `mlx5_<k>` in the node's NIC order, the ConnectX default, as prefixes."""
    env = {}
    eth = node.nics_on(ETHERNET)
    if eth:
        env["NCCL_SOCKET_IFNAME"] = _exact([n.device for n in eth]) or SOCKET_EXCLUDE
    # (k, NIC): its HCA's place among the node's RDMA NICs, which names it without devices
    rdma = [(k, n) for k, n in enumerate(x for x in node.nics if x.type != ETHERNET)
            if fabric is None or n.fabric == fabric]
    if rdma:
        env["NCCL_NET"] = "IB"
        env["NCCL_IB_HCA"] = (_exact([n.device for _, n in rdma])
                              or ",".join(f"mlx5_{k}" for k, _ in rdma))
        if any(n.type == "roce" for _, n in rdma):
            env["NCCL_IB_GID_INDEX"] = str(ROCE_GID_INDEX)
    else:
        env["NCCL_NET"] = "Socket"
    return env


def shared_hca_notes(nodes: list[Node], types: dict[str, str],
                     config: list[dict[str, str]]) -> tuple[str, ...]:
    """The export README's note on a node whose device type's `holmes_config` entry (the HCAs
    of all that type's nodes) names HCAs that are, on this node, on another fabric."""
    listed = {e["CLUSTER_NAME"]: _names(e.get("NCCL_IB_HCA", "")) for e in config}
    notes: dict[str, None] = {}
    for node in nodes:
        kind = types[node.name]
        own = _names(node_nccl_env(node, kind).get("NCCL_IB_HCA", ""))
        other = [h for h in _names(node_nccl_env(node).get("NCCL_IB_HCA", ""))
                 if h not in own and h in listed.get(kind, ())]
        if other:
            notes[f"Node group {node.group_path or node.name} runs as device type {kind} "
                  f"(its HCAs there: {', '.join(own)}); the fork gives every {kind} node "
                  f"the one `NCCL_IB_HCA` of that `holmes_config.json` entry, which also "
                  f"names {', '.join(other)}, on this group another fabric's HCAs that NCCL "
                  f"would take too. Rename them on its hosts (`rdma dev set <hca> name "
                  f"<new>`), give the names in the scenario's `devices` and export "
                  f"again."] = None
    return tuple(notes)


def _names(hcas: str) -> list[str]:
    """The names of an NCCL interface list."""
    return [h for h in hcas.lstrip("=^").split(",") if h]


def _exact(devices: list[str | None]) -> str:
    """NCCL's exact list (`=a,b`) of the named `devices`, or "" when none is named."""
    named = [d for d in devices if d]
    return "=" + ",".join(named) if named else ""


def group_nccl_settings(plan: Plan) -> dict[str, dict[str, str]]:
    """Per group class (tp, dp, pp, embedding): the transports its groups use and the NCCL
    setting each needs; a group class on TCP must run with NCCL_NET=Socket for its communicator."""
    out: dict[str, dict[str, str]] = {}
    for kind in GroupKind:
        transports = sorted({str(g.transport) for g in plan.groups_of(kind)})
        if not transports:
            continue
        kinds = {g.transport.kind for g in plan.groups_of(kind)}
        setting = "NCCL_NET=Socket" if kinds == {TransportKind.TCP} else \
            "intra-node (NVLink/P2P)" if kinds == {TransportKind.LOCAL} else \
            "NCCL_NET=IB on the fabric's HCAs" if TransportKind.TCP not in kinds else \
            "per group: RDMA groups NCCL_NET=IB, TCP groups NCCL_NET=Socket"
        out[kind.value] = {"transports": ", ".join(transports), "nccl": setting}
    return out


def upstream_net(plan: Plan) -> str:
    """The one network upstream Megatron-LM can use for the whole job: "IB" when every group
    that leaves a node runs over RDMA, else "Socket" (a TCP group and RDMA groups cannot have
    different NCCL_NET in one process)."""
    kinds = {g.transport.kind for kind in GroupKind for g in plan.groups_of(kind)}
    return "Socket" if TransportKind.TCP in kinds else "IB"


def upstream_node_env(node: Node, net: str) -> dict[str, str]:
    """A node's NCCL environment under upstream Megatron-LM's one job-wide network."""
    env = node_nccl_env(node)
    if net == "Socket":
        return {k: v for k, v in env.items() if k == "NCCL_SOCKET_IFNAME"} | {"NCCL_NET": "Socket"}
    return env


def _issues_collectives_ahead(plan: Plan) -> bool:
    """Whether the plan's TP or CP collectives overlap GEMMs (TP or CP > 1), which is when
    `process_env` sets the CUDA connections and the README explains them."""
    return plan.tp > 1 or plan.cp > 1


def process_env(plan: Plan, node: Node, target: str) -> dict[str, str]:
    """The CUDA environment of `node`'s processes under `target` ("megatron" or "holmes").

    With TP or CP > 1, `CUDA_DEVICE_MAX_CONNECTIONS=1`, which Megatron-LM's `validate_args`
    asserts before Blackwell (since 7ef4f90, 2025-03) and the Holmes fork asserts on every GPU
    with sequence parallelism (bdd9731, 2022-10), so that each TP or CP collective is issued
    ahead of the GEMM that overlaps it. Upstream on a Blackwell node (compute capability 10) sets
    32 instead, as Megatron-Bridge's performance scripts do on B200 and GB200
    (`scripts/performance/utils/overrides.py`): the requirement is gone there and more hardware
    queues let DP and PP transfers run beside compute."""
    if not _issues_collectives_ahead(plan):
        return {}
    blackwell = node.gpu.compute_capability is not None and node.gpu.compute_capability >= 10
    connections = "32" if target == "megatron" and blackwell else "1"
    return {"CUDA_DEVICE_MAX_CONNECTIONS": connections}


CUDA_CONNECTIONS_NOTE = (
    "`launch.sh` sets `CUDA_DEVICE_MAX_CONNECTIONS=1` on every node before Blackwell, and for "
    "the Holmes fork on every node: Megatron-LM refuses to start tensor or context parallelism "
    "without it there. On Blackwell GPUs upstream does not require it, and `launch.sh megatron` "
    "sets 32, as NVIDIA's Megatron-Bridge performance scripts do.")
"""The export README's note on `process_env`."""


def holmes_config(nodes: list[Node], types: dict[str, str]) -> list[dict[str, str]]:
    """The Holmes fork's config.json: per device type (`types`, `device_types`) the NCCL
    environment of its groups, its nodes' NICs on that fabric, and `heter` (TCP) for groups
    that mix device types. One entry serves many nodes: where their interface lists differ (node
    groups that name other devices), it holds them all (`_merged`)."""
    envs: dict[str, list[dict[str, str]]] = {}
    for node in nodes:
        kind = types[node.name]
        envs.setdefault(kind, []).append(node_nccl_env(node, kind))
    entries = [{"CLUSTER_NAME": c, **e[0], **{k: _merged([x[k] for x in e if k in x])
                                              for k in _LISTS if k in e[0]}}
               for c, e in envs.items()]
    heter = {"CLUSTER_NAME": "heter", "NCCL_NET": "Socket", "NCCL_IB_DISABLE": "1"}
    eth = [x["NCCL_SOCKET_IFNAME"] for e in envs.values() for x in e if "NCCL_SOCKET_IFNAME" in x]
    if eth:
        heter["NCCL_SOCKET_IFNAME"] = _merged(eth)
    return [*entries, heter]


_LISTS = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA")


def _merged(values: list[str]) -> str:
    """One NCCL interface list for nodes whose own lists are `values`: all their names (NCCL on
    a node matches those it has), exact if every list is; `SOCKET_EXCLUDE` if one excludes."""
    distinct = list(dict.fromkeys(values))
    if len(distinct) == 1:
        return distinct[0]
    if any(v.startswith("^") for v in distinct):
        return SOCKET_EXCLUDE
    names = dict.fromkeys(n for v in distinct for n in v.lstrip("=").split(","))
    return ("=" if all(v.startswith("=") for v in distinct) else "") + ",".join(names)


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
    fork, why_not = _fork_args(plan, cluster, nodes, workload, margs)
    net = upstream_net(plan)
    groups = group_nccl_settings(plan)
    ub = userbuffer_config(workload)
    ub_args = ["--tp-comm-overlap-cfg", USERBUFFER_CONFIG] if ub else []
    files = {"hostfile": "".join(f"{h} slots={n.num_gpus}\n" for h, n in zip(names, nodes)),
             "megatron_args.txt": shlex.join(margs + ub_args) + "\n",
             "plan.json": plan.to_json() + "\n",
             "nccl.json": json.dumps({"nodes": {n.name: node_nccl_env(n) for n in nodes},
                                      "groups": groups,
                                      "upstream_job_wide": {"NCCL_NET": net}},
                                     indent=2, sort_keys=True) + "\n"}
    files["holmes_args.txt"] = shlex.join(fork + ub_args) + "\n" if fork else \
        f"# not expressible: {why_not}\n"
    types = device_types(plan, cluster)[0]
    config = holmes_config(nodes, types)
    if fork:
        files["holmes_config.json"] = json.dumps(config, indent=2) + "\n"
    launches = [NodeLaunch(h, n.num_gpus, types[n.name],
                           upstream_node_env(n, net) | process_env(plan, n, "megatron"),
                           upstream_node_env(n, "Socket") | process_env(plan, n, "holmes"))
                for h, n in zip(names, nodes)]
    if ub:
        files[USERBUFFER_CONFIG] = ub
    files["launch.sh"] = launch_script(launches, margs, fork, script, net, MASTER_PORT,
                                       USERBUFFER_CONFIG if ub else None)
    files["launch_megatron.sh"] = _wrapper("megatron")
    files["launch_holmes.sh"] = _wrapper("holmes")
    lacked = fork_lacks_note(margs) if fork else None
    cuda = (CUDA_CONNECTIONS_NOTE,) if _issues_collectives_ahead(plan) else ()
    split = pipeline_split_note(workload, plan.tp, plan.pp)
    notes = (_notes(workload, ub) + ((split,) if split else ()) + cuda + device_notes(nodes)
             + (shared_hca_notes(nodes, types, config) if fork else ())
             + ((lacked,) if lacked else ()))
    files["README.md"] = launch_readme(plan, names, net, why_not if not fork else None, groups,
                                       notes, tokenizer=tokenizer_args(workload)[0],
                                       vocabulary=vocabulary_section(workload, plan.tp))
    return LaunchFiles(files)


def _hosts_of(nodes: list[Node], hosts: dict[str, str]) -> list[str]:
    """The host of each of `nodes` (in the plan's order) from `hosts`, by scenario node name."""
    missing = [n.name for n in nodes if n.name not in hosts]
    if missing:
        raise PlanError(f"no host given for node {', '.join(missing[:8])}; give --hosts a host "
                        "for every node of the scenario")
    return [hosts[n.name] for n in nodes]


def _fork_args(plan: Plan, cluster: Cluster, nodes: list[Node], workload: Workload,
               margs: list[str]) -> tuple[list[str], str | None]:
    """The Holmes fork's arguments (upstream's without the flags its parser predates, and its
    --hetero flags), or [] and why the fork cannot run the plan."""
    hargs, why_not = holmes_args(plan, cluster, nodes)
    if hargs and workload.defer_embedding_wgrad:
        hargs, why_not = [], "the Holmes fork has no --defer-embedding-wgrad-compute"
    if hargs and workload.fp8_current_scaling:
        hargs, why_not = [], "the Holmes fork has no --fp8-recipe (FP8 current scaling)"
    if hargs and workload.average_in_collective:
        hargs, why_not = [], "the Holmes fork has no --ddp-average-in-collective"
    if hargs and "--grad-reduce-in-bf16" in margs:
        hargs, why_not = [], "the Holmes fork has no --grad-reduce-in-bf16 (it reduces bf16 " \
            "gradients in fp32)"
    if hargs and workload.cross_entropy != "unfused":
        hargs, why_not = [], "the Holmes fork has no --cross-entropy-loss-fusion"
    if hargs and workload.attention_backend != "auto":
        hargs, why_not = [], "the Holmes fork has no --attention-backend"
    if hargs and workload.moe is not None:  # its arguments.py predates Megatron-Core's MoE flags
        hargs, why_not = [], "the Holmes fork has no --moe-ffn-hidden-size (Megatron-Core's MoE)"
    if hargs and plan.cp > 1 and workload.cp_comm_type != "p2p":
        # The fork takes --context-parallel-size but not --cp-comm-type: its ring (p2p) only.
        hargs, why_not = [], f"the Holmes fork runs context parallelism as p2p only, not " \
            f"{workload.cp_comm_type}"
    if not hargs:
        return [], why_not
    upstream_only = _layout_args(plan, workload) + _cp_comm_args(workload, plan)
    flags = [a for a in upstream_only if a.startswith("--")] + list(FORK_LACKS)
    return without_flags(margs, flags) + hargs, why_not


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


def device_notes(nodes: list[Node]) -> tuple[str, ...]:
    """The export README's note on the NCCL device names of `node_nccl_env`: the scenario's
    `devices`, or which of them are placeholders, on which node groups, and how to set them."""
    blanks: dict[str, dict[str, None]] = {}  # placeholder -> node groups it stands in on
    for node in nodes:
        for rdma, what in ((False, f"`NCCL_SOCKET_IFNAME={SOCKET_EXCLUDE}` (any interface but "
                                   "docker, loopback, libvirt and IPoIB ones)"),
                           (True, "`NCCL_IB_HCA=mlx5_0,...` (ConnectX's default HCA names, in "
                                  "NIC order, as prefixes)")):
            nics = [n for n in node.nics if (n.type != ETHERNET) == rdma]
            if nics and not any(n.device for n in nics):
                blanks.setdefault(what, {})[node.group_path or node.name] = None
    if not blanks:
        return (DEVICES_NAMED_NOTE,)
    where = "; ".join(f"{what} on {', '.join(groups)}" for what, groups in blanks.items())
    return (f"Placeholders, not your device names: {where}, whose NICs name no `devices` in the "
            "scenario. NCCL stops at initialisation when a list matches none of a node's "
            "devices. Give each NIC entry the names `ip link` (interfaces) and `ibv_devices` "
            "(HCAs, optionally `:port`) show, one per NIC of its `count`, e.g. `devices: "
            "[ens1f0]`, `devices: [mlx5_0, mlx5_1]`, and export again; or edit the `ENV_*` "
            "lines of `launch.sh`, `nccl.json` and `holmes_config.json`.",)


DEVICES_NAMED_NOTE = ("`NCCL_SOCKET_IFNAME` and `NCCL_IB_HCA` list the devices the scenario's "
                      "NICs name (`devices`), as exact names (NCCL's `=` form).")


def _wrapper(target: str) -> str:
    return ("#!/usr/bin/env bash\n"
            f'exec "$(dirname "$0")/launch.sh" {target} "$@"\n')
