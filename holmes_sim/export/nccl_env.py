"""The NCCL and CUDA environment of an export's nodes (NCCL environment-variable documentation).

RDMA groups name their HCAs with `NCCL_IB_HCA` (the NICs' `devices` from the scenario, else
placeholders: `node_nccl_env`), a node those of the fabrics its groups use (`planned_fabrics`:
NCCL picks a GPU's HCA by locality, not by its peers' fabric); RoCE's `NCCL_IB_GID_INDEX` is left to NCCL (`roce_gid_note`);
TCP groups use `NCCL_NET=Socket` with `NCCL_SOCKET_IFNAME`; every
process bootstraps over the Ethernet interface (`NCCL_SOCKET_IFNAME`). NCCL picks one network
(`NCCL_NET`: IB or Socket) per communicator when it is created, from the process environment at
that moment. Upstream Megatron-LM creates every group under one environment, so its export sets
one network for the whole job (`upstream_net`).
"""

from __future__ import annotations

from collections.abc import Collection

from holmes_sim.hardware.cluster import ETHERNET, Node
from holmes_sim.model.workload import Workload
from holmes_sim.plan import GroupKind, Plan, TransportKind

SOCKET_EXCLUDE = "^docker,lo,virbr,ib"
"""`NCCL_SOCKET_IFNAME` of a node whose Ethernet NICs name no devices: NCCL's own choice without
its preference for IPoIB (`^`: every interface but those starting with these prefixes)."""


def node_nccl_env(node: Node, fabrics: Collection[str] | None = None) -> dict[str, str]:
    """The NCCL environment of one node: bootstrap on Ethernet, its HCAs for RDMA (with
    `fabrics`, only those on them: the fabrics its groups use, `planned_fabrics`, or a device
    type's, an RDMA fabric or Ethernet, `holmes_config`).

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
            if fabrics is None or n.fabric in fabrics]
    if rdma:
        env["NCCL_NET"] = "IB"
        env["NCCL_IB_HCA"] = (_exact([n.device for _, n in rdma])
                              or ",".join(f"mlx5_{k}" for k, _ in rdma))
    else:
        env["NCCL_NET"] = "Socket"
    return env


def roce_gid_note(plan: Plan, nodes: list[Node]) -> str | None:
    """The README's note on `NCCL_IB_GID_INDEX`, which the export leaves unset, where the plan
    runs groups over a RoCE fabric; None otherwise. Since 2.21.5 (2024-04) NCCL picks a RoCE
    port's GID itself (`NCCL_IB_GID_INDEX` default -1, `ncclIbGetGidIndex`, src/transport/
    net_ib: a configured, not link-local GID of IPv4, `NCCL_IB_ADDR_FAMILY`, and RoCE v2,
    `NCCL_IB_ROCE_VERSION_NUM`); before, its default was index 0, RoCE v1 on a default
    ConnectX set-up."""
    roce = {n.fabric for node in nodes for n in node.nics if n.type == "roce"}
    used = {g.transport.fabric for g in plan.groups if g.transport.kind is TransportKind.RDMA}
    if not roce & used:
        return None
    return ("`NCCL_IB_GID_INDEX` is left unset on RoCE: NCCL 2.21 and later pick the RoCE v2 "
            "IPv4 GID of each port themselves. An older NCCL takes GID index 0 (RoCE v1 on a "
            "default ConnectX set-up): there, add `NCCL_IB_GID_INDEX=<index>` (`show_gids` "
            "lists each port's; 3 is RoCE v2 over IPv4 on a default ConnectX set-up) to the "
            "`ENV_MEGATRON` lines of `launch.sh` and to the RoCE entries of "
            "`holmes_config.json`, which the Holmes fork applies per group.")


def list_names(hcas: str) -> list[str]:
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


def planned_fabrics(plan: Plan) -> dict[str, tuple[str, ...]]:
    """Per node (by name), the RDMA fabrics of the plan's groups that hold one of its ranks, by
    name; a node without such a group is absent."""
    out: dict[str, dict[str, None]] = {}
    for g in plan.groups:
        if g.transport.kind is TransportKind.RDMA:
            for r in g.ranks:
                out.setdefault(plan.rank_to_gpu[r].node, {})[str(g.transport.fabric)] = None
    return {node: tuple(sorted(f)) for node, f in out.items()}


def fabric_splits(plan: Plan, fabrics: dict[str, tuple[str, ...]], net: str) -> dict[str, str]:
    """Per group class, the nodes its RDMA groups hold a rank on that the plan runs on two or
    more RDMA fabrics (`fabrics`, `planned_fabrics`), as README text, where upstream runs
    RDMA (`net` "IB"): one process environment gives NCCL both fabrics' HCAs there."""
    split = {n for n, f in fabrics.items() if len(f) > 1}
    out: dict[str, dict[str, None]] = {}
    for g in plan.groups if net == "IB" and split else ():
        if g.transport.kind is TransportKind.RDMA:
            for node in dict.fromkeys(plan.rank_to_gpu[r].node for r in g.ranks):
                if node in split:
                    out.setdefault(g.kind.value, {})[node] = None
    return {kind: ", ".join(f"{n} ({' and '.join(fabrics[n])})" for n in list(nodes)[:4])
            + (", ..." if len(nodes) > 4 else "") for kind, nodes in out.items()}


def upstream_node_env(node: Node, net: str, fabrics: tuple[str, ...] = ()) -> dict[str, str]:
    """A node's NCCL environment under upstream Megatron-LM's one job-wide network: on RDMA the
    HCAs of `fabrics`, those its groups use (`planned_fabrics`; all its HCAs without any)."""
    env = node_nccl_env(node, fabrics or None)
    if net == "Socket":
        return {k: v for k, v in env.items() if k == "NCCL_SOCKET_IFNAME"} | {"NCCL_NET": "Socket"}
    return env


def issues_collectives_ahead(plan: Plan) -> bool:
    """Whether the plan's TP or CP collectives overlap GEMMs (TP or CP > 1), which is when
    upstream Megatron-LM needs one CUDA connection (`process_env`)."""
    return plan.tp > 1 or plan.cp > 1


def process_env(plan: Plan, node: Node, target: str) -> dict[str, str]:
    """The CUDA and Gloo environment of `node`'s processes under `target` ("megatron" or
    "holmes"): `gloo_env`, and the CUDA connections.

    `CUDA_DEVICE_MAX_CONNECTIONS=1`, so that each TP or CP collective is issued ahead of the GEMM
    that overlaps it: upstream Megatron-LM's `validate_args` asserts it with TP or CP > 1 before
    Blackwell (since 7ef4f90, 2025-03); the Holmes fork's (03d9522) raises without it whenever
    sequence parallelism or the asynchronous TP all-reduce is on, and the latter is its default
    (`--no-async-tensor-model-parallel-allreduce` turns it off) even at TP 1, so the fork gets it
    on every plan. Upstream on a Blackwell node (compute capability 10) sets 32 instead, as
    Megatron-Bridge's performance scripts do on B200 and GB200
    (`scripts/performance/utils/overrides.py`): the requirement is gone there and more hardware
    queues let DP and PP transfers run beside compute."""
    if target == "holmes":
        return gloo_env(node) | {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    if not issues_collectives_ahead(plan):
        return gloo_env(node)
    blackwell = node.gpu.compute_capability is not None and node.gpu.compute_capability >= 10
    return gloo_env(node) | {"CUDA_DEVICE_MAX_CONNECTIONS": "32" if blackwell else "1"}


def gloo_env(node: Node) -> dict[str, str]:
    """`GLOO_SOCKET_IFNAME`, the interfaces of the Gloo groups Megatron-LM and the fork create
    beside the NCCL ones (the distributed optimizer's, the barriers'), where the scenario names
    the node's Ethernet devices: PyTorch takes a comma-separated list of exact interface names
    (`torch.distributed` documentation), no prefixes. Without names, none: Gloo takes the
    interface of the address the host name resolves to."""
    names = [n.device for n in node.nics_on(ETHERNET)]
    return {"GLOO_SOCKET_IFNAME": ",".join(names)} if names and all(names) else {}


def cuda_connections_notes(plan: Plan, fork: bool) -> tuple[str, ...]:
    """The export README's notes on `process_env` under upstream Megatron-LM and, when it runs
    the plan (`fork`), the Holmes fork."""
    notes = []
    if issues_collectives_ahead(plan):
        notes.append("`launch.sh megatron` sets `CUDA_DEVICE_MAX_CONNECTIONS=1` on every node "
                     "before Blackwell: Megatron-LM refuses to start tensor or context "
                     "parallelism without it there. On Blackwell GPUs upstream does not require "
                     "it, and `launch.sh megatron` sets 32, as NVIDIA's Megatron-Bridge "
                     "performance scripts do.")
    if fork:
        notes.append("`launch.sh holmes` sets `CUDA_DEVICE_MAX_CONNECTIONS=1` on every node: the "
                     "Holmes fork's `validate_args` raises without it when sequence parallelism "
                     "or the asynchronous tensor-parallel all-reduce is on, and the latter is its "
                     "default, at TP 1 too.")
    return tuple(notes)


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


def job_env(workload: Workload) -> dict[str, str]:
    """The NCCL settings the workload was simulated with that are not NCCL's defaults:
    `NCCL_NVLS_ENABLE=0` where `training.nccl_nvls_enable` is false (NCCL's default, 2, enables
    NVLink SHARP where the hardware has it; NCCL docs, Environment Variables)."""
    return {} if workload.nvls_enable else {"NCCL_NVLS_ENABLE": "0"}


def job_env_text(env: dict[str, str]) -> str:
    """The export README's sentence on `job_env`, "" when it is empty: both targets set it on
    every node, and `nccl.json` lists it in each node's entry."""
    if not env:
        return ""
    words = " ".join(f"`{k}={v}`" for k, v in sorted(env.items()))
    nvls = (" (`training.nccl_nvls_enable: false`: no collective runs as NVLink SHARP)"
            if "NCCL_NVLS_ENABLE" in env else "")
    return (f"Every node runs with {words} under both targets, as the plan was simulated{nvls}; "
            "each node's entry of `nccl.json` and the `ENV_*` lines of `launch.sh` hold it.")
