"""The Holmes fork's launch (CodexDive/Holmes 03d9522): its `--hetero` arguments, the upstream
arguments its parser and `validate_args` take, its `config.json`, and the groups it runs on
other transports than the plan.

Its `--hetero` arguments follow the Holmes repository's scripts (`--hetero-mode pp
--hetero-device-types A B --hetero-current-device-type A --hetero-pipeline-stages n_A l.. n_B
l.. --use-hetnet`: per device type, its number of pipeline stages and their layer counts). The
fork sets the NCCL environment of each group from its `config.json` (one entry per device type,
`heter` for groups that mix them) before creating it (`megatron/core/hetnet.py`), which
`holmes_config` writes.
"""

from __future__ import annotations

from holmes_sim.export.device_types import device_types
from holmes_sim.export.model_args import (FORK_LACKS, fork_lacks_note, launched_attention_backend,
                                         without_flags)
from holmes_sim.export.nccl_env import SOCKET_EXCLUDE, list_names, node_nccl_env, upstream_node_env
from holmes_sim.hardware.cluster import ETHERNET, Cluster, Node
from holmes_sim.model.workload import Workload
from holmes_sim.plan import Plan, TransportKind
from holmes_sim.policies import POLICIES
from holmes_sim.policies.holmes import HolmesPolicy


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


def shared_hca_notes(nodes: list[Node], types: dict[str, str],
                     config: list[dict[str, str]]) -> tuple[str, ...]:
    """The export README's note on a node whose device type's `holmes_config` entry (the HCAs
    of all that type's nodes) names HCAs that are, on this node, on another fabric."""
    listed = {e["CLUSTER_NAME"]: list_names(e.get("NCCL_IB_HCA", "")) for e in config}
    notes: dict[str, None] = {}
    for node in nodes:
        kind = types[node.name]
        own = list_names(node_nccl_env(node, (kind,)).get("NCCL_IB_HCA", ""))
        other = [h for h in list_names(node_nccl_env(node).get("NCCL_IB_HCA", ""))
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


def holmes_config(nodes: list[Node], types: dict[str, str]) -> list[dict[str, str]]:
    """The Holmes fork's config.json: per device type (`types`, `device_types`) the NCCL
    environment of its groups, its nodes' NICs on that fabric, and `heter` (TCP) for groups
    that mix device types. One entry serves many nodes: where their interface lists differ (node
    groups that name other devices), it holds them all (`_merged`)."""
    envs: dict[str, list[dict[str, str]]] = {}
    for node in nodes:
        kind = types[node.name]
        envs.setdefault(kind, []).append(node_nccl_env(node, (kind,)))
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


def fork_args(plan: Plan, cluster: Cluster, nodes: list[Node], workload: Workload,
              margs: list[str], upstream_only: list[str]) -> tuple[list[str], str | None]:
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
    if hargs and workload.attention_backend not in FORK_ATTENTION_BACKENDS:
        hargs, why_not = [], "the Holmes fork has no --attention-backend"
    if hargs and workload.moe is not None:  # its arguments.py predates Megatron-Core's MoE flags
        hargs, why_not = [], "the Holmes fork has no --moe-ffn-hidden-size (Megatron-Core's MoE)"
    if hargs and workload.mla is not None:
        hargs, why_not = [], "the Holmes fork has no --multi-latent-attention (its parser " \
            "predates Megatron-Core's multi-head latent attention)"
    if hargs and workload.position_embedding == "none":
        hargs, why_not = [], "the Holmes fork's --position-embedding-type takes " \
            "learned_absolute or rope, not none"
    if hargs and plan.cp > 1:  # megatron/training/hetero_context.py
        hargs, why_not = [], "the Holmes fork has no context parallelism with its heterogeneous " \
            "pipeline (its HeteroContext asserts \"Context parallel size must be 1 in hetero " \
            "mode pp\")"
    if hargs and (why := ablation_refusal(plan, device_types(plan, cluster)[0])):
        hargs, why_not = [], why
    if not hargs:
        return [], why_not
    flags = [a for a in upstream_only if a.startswith("--")] + list(FORK_LACKS) + [LEGACY_REFUSES]
    # The fork's parser predates `--attention-backend`; `fork_attention_env` sets the kernel.
    return without_flags(margs, [*flags, "--attention-backend"]) + hargs, why_not


FORK_ATTENTION_BACKENDS = ("auto", "unfused")
"""The attention backends (`TrainingSpec.attention_backend`) the fork's launch runs as
simulated, through `fork_attention_env`."""


def fork_attention_env(workload: Workload) -> dict[str, str]:
    """Transformer Engine's attention switches for the fork's processes: NVTE_FLASH_ATTN=0 and
    NVTE_FUSED_ATTN=0 where the plan was simulated with TE's unfused attention (what upstream
    gets as `--attention-backend unfused`: `model_args.launched_attention_backend`); none
    otherwise.

    The fork's legacy GPT model, the one that reads `--hetero-pipeline-stages`, builds each
    layer as `transformer_engine.pytorch.TransformerLayer` under its default `--transformer-impl
    transformer_engine` (megatron/legacy/model/transformer.py; `--use-flash-attn` reaches only
    its `local` layers), and TE picks that layer's attention kernel from these variables, each
    1 (allowed) by default: both 0 leave its unfused attention (TE 1.8 to 2.x,
    `DotProductAttention`; the fork's own T5 test script exports both for it). Upstream
    Megatron-Core sets the same two for `--attention-backend unfused` (`_set_attention_backend`,
    megatron/core/models/common/language_module/language_module.py)."""
    if launched_attention_backend(workload) == "unfused":
        return {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0"}
    return {}


LEGACY_REFUSES = "--overlap-param-gather"
"""An upstream flag the fork parses but refuses with its legacy model, the one that reads
`--hetero-pipeline-stages` (megatron/legacy/model/transformer.py): its `validate_args` asserts
"--overlap-param-gather only supported with MCore models" (`use_mcore_models`)."""


def fork_notes(plan: Plan, nodes: list[Node], types: dict[str, str],
               config: list[dict[str, str]], margs: list[str]) -> tuple[str, ...]:
    """The export README's notes on a launch of the fork (`holmes_config` of `nodes` of device
    types `types`, upstream's arguments `margs`): groups it runs on other transports than the
    plan, shared HCA names, nodes without Ethernet, the parameter gather it does not overlap,
    upstream flags its parser lacks."""
    return shared_hca_notes(nodes, types, config) + tuple(filter(None, [
        transport_note(plan, types), no_ethernet_note(nodes), param_gather_note(margs),
        fork_lacks_note(margs)]))


def fork_transports(plan: Plan, types: dict[str, str]) -> dict[tuple[str, str, str], int]:
    """The plan's groups that leave a node and that the fork runs on another transport than
    planned, counted per (group class, the plan's transport, the fork's).

    The fork creates each group under the `config.json` entry of its nodes' device type
    (`hetnet.new_process_group`): RDMA on that fabric, TCP for the `ethernet` type and for
    `heter`, a group of nodes of several types. A node has one type (`device_types`), so a group
    planned on another fabric of the node, or on TCP between nodes of one RDMA type, changes."""
    changed: dict[tuple[str, str, str], int] = {}
    for g in plan.groups:
        if g.transport.kind is TransportKind.LOCAL:
            continue
        held = {types[plan.rank_to_gpu[r].node] for r in g.ranks}
        kind = held.pop() if len(held) == 1 else ETHERNET
        fork = f"{TransportKind.TCP.value}:{ETHERNET}" if kind == ETHERNET else \
            f"{TransportKind.RDMA.value}:{kind}"
        planned = f"{TransportKind.TCP.value}:{ETHERNET}" \
            if g.transport.kind is TransportKind.TCP else str(g.transport)
        if fork != planned:
            key = (g.kind.value, planned, fork)
            changed[key] = changed.get(key, 0) + 1
    return changed


def _changes(changed: dict[tuple[str, str, str], int]) -> str:
    return "; ".join(f"{n} {kind} group{'s run' if n > 1 else ' runs'} on {fork}, planned on "
                     f"{planned}" for (kind, planned, fork), n in changed.items())


def ablation_refusal(plan: Plan, types: dict[str, str]) -> str | None:
    """Why the fork cannot run a plan of a Holmes ablation (a Holmes policy other than holmes)
    whose groups it would run on other transports (`fork_transports`), None otherwise: its run
    would not reproduce the ablation."""
    policy = POLICIES.get(plan.policy)
    if not isinstance(policy, HolmesPolicy) or policy.name == HolmesPolicy().name:
        return None
    changed = fork_transports(plan, types)
    if not changed:
        return None
    return (f"the Holmes fork does not reproduce the {policy.name} ablation: it sets a group's "
            f"network from its nodes' device type, so {_changes(changed)}")


def transport_note(plan: Plan, types: dict[str, str]) -> str | None:
    """The README's note on the groups the fork runs on other transports than the plan
    (`fork_transports`), None if none."""
    changed = fork_transports(plan, types)
    if not changed:
        return None
    return (f"Under the Holmes fork, {_changes(changed)}: the fork gives each node one device "
            "type (`TYPES` in `launch.sh`) and creates each group under the "
            "`holmes_config.json` entry of its nodes' type (`heter`, TCP, where they differ), "
            "so it cannot run one node's groups on two fabrics, nor on TCP between nodes of one "
            "RDMA type. The fork's iteration time is not the simulated one.")


SOCKET_ANY = "^docker,lo,virbr"
"""`NCCL_SOCKET_IFNAME` of the fork on a node that declares no Ethernet NIC: any interface but
docker, loopback and libvirt ones, NCCL's own fallback (`ncclFindInterfaces`), IPoIB included."""


def fork_node_env(node: Node) -> dict[str, str]:
    """A node's NCCL environment when the fork starts: the world group on TCP (`NCCL_NET=Socket`)
    with `NCCL_SOCKET_IFNAME` always set, since `hetnet.set_nccl_envs` raises "NCCL_SOCKET_IFNAME
    was not set" before it creates each group (`SOCKET_ANY` on a node without Ethernet)."""
    return {"NCCL_SOCKET_IFNAME": SOCKET_ANY} | upstream_node_env(node, "Socket")


def no_ethernet_note(nodes: list[Node]) -> str | None:
    """The README's note on the nodes that get `SOCKET_ANY` under the fork, None if none."""
    groups = list(dict.fromkeys(n.group_path or n.name for n in nodes if not n.nics_on(ETHERNET)))
    if not groups:
        return None
    return (f"Node group {', '.join(groups)} declares no Ethernet NIC: `launch.sh holmes` sets "
            f"`NCCL_SOCKET_IFNAME={SOCKET_ANY}` there (any interface but docker, loopback and "
            "libvirt ones, IPoIB included), since the Holmes fork's `hetnet.set_nccl_envs` "
            "raises \"NCCL_SOCKET_IFNAME was not set\" without it. Add the node's Ethernet NIC "
            "with its `devices` to the scenario, or edit `ENV_HOLMES` in `launch.sh`, to name "
            "the interface.")


def param_gather_note(margs: list[str]) -> str | None:
    """The README's note on the parameter gather the fork's launch does not overlap, None when
    the plan does not overlap it."""
    if LEGACY_REFUSES not in margs:
        return None
    return (f"`holmes_args.txt` leaves out `{LEGACY_REFUSES}`, which `megatron_args.txt` sets: "
            "the Holmes fork builds its heterogeneous pipeline (`--hetero-pipeline-stages`) only "
            "in its legacy GPT model, and its `validate_args` stops the legacy model with "
            "\"--overlap-param-gather only supported with MCore models\". So under the fork the "
            "distributed optimizer gathers the updated parameters after the step instead of "
            "during the next forward, and the fork runs slower than the plan simulated.")


def attention_env_note(env: dict[str, str]) -> str | None:
    """The README's note on the `fork_attention_env` that `launch.sh holmes` sets, None if
    none."""
    if not env:
        return None
    return (f"`launch.sh holmes` sets `{' '.join(f'{k}={v}' for k, v in sorted(env.items()))}` "
            "on every node, where `megatron_args.txt` has `--attention-backend unfused`: the "
            "Holmes fork's parser has no `--attention-backend`, and its legacy GPT model (the one "
            "`--hetero-pipeline-stages` builds) runs Transformer Engine's `TransformerLayer`, "
            "whose attention kernel TE picks from these variables. With both 0 it runs TE's "
            "unfused attention, as simulated and as upstream Megatron-Core sets them for "
            "`--attention-backend unfused`.")
