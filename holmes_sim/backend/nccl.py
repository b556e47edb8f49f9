"""Process groups on real GPU clusters: NCCL, each group on the transport the plan chose.

Holmes (arXiv 2312.03549, section 3.3) chooses a NIC per communication group. Stock NCCL reads
its network settings when a communicator is created, so each group is created eagerly, in plan
order on every rank, right after its settings are put in place:

- RDMA on a fabric: ``NCCL_NET=IB`` and ``NCCL_IB_HCA`` = the HCAs of the members' NICs on it
  (IB and RoCE alike: NCCL's IB transport drives both through verbs); on RoCE also
  ``NCCL_IB_GID_INDEX`` (3: RoCE v2 over IPv4 on a default Linux GID table; site-specific, set by
  the run config); and ``NCCL_SOCKET_IFNAME`` = the node's Ethernet interface, over which NCCL
  bootstraps every communicator (its out-of-band connections are sockets even on RDMA);
- TCP: ``NCCL_NET=Socket`` and ``NCCL_SOCKET_IFNAME`` = the members' Ethernet interfaces;
- LOCAL (one node): nothing; NCCL uses NVLink / PCIe peer-to-peer.

The world communicator is never built from these settings: the worker initialises the NCCL world
without ``device_id`` (so torch creates it lazily and never splits the plan's groups from it,
which would carry the world's settings into them) and runs its barriers on a gloo group. Where
the installed torch exposes NCCL's per-communicator ``netName`` through
``ProcessGroupNCCL.Options().config.net_name``, that is set too, since some NCCL versions cache
environment settings after the first communicator. The plan names NICs node-locally ("ib0",
"eth0"); `nic_devices` maps them to the site's device names ("mlx5_0", "ens1f0").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from datetime import timedelta

from holmes_sim.errors import TestbedError
from holmes_sim.plan import Group, TransportKind

_KEYS = ("NCCL_NET", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_IB_GID_INDEX")
ROCE_GID_INDEX = 3
"""RoCE v2 over IPv4 in a default Linux GID table (`show_gids`); sites differ."""


def nccl_settings(group: Group, nic_devices: Mapping[str, str],
                  fabric_types: Mapping[str, str] | None = None, bootstrap_interface: str = "",
                  roce_gid_index: int = ROCE_GID_INDEX) -> dict[str, str]:
    """NCCL environment for creating `group`'s communicator (see module docstring).

    `fabric_types` maps the plan's fabric names to "ib" or "roce"; `bootstrap_interface` is the
    node's Ethernet interface for an RDMA group's bootstrap ("": NCCL's own choice)."""
    kind = group.transport.kind
    if kind is TransportKind.LOCAL:
        return {}
    devices = sorted({nic_devices.get(n, n) for n in group.nics})
    if kind is TransportKind.RDMA:
        # "=" makes NCCL match HCA names exactly rather than as prefixes.
        settings = {"NCCL_NET": "IB", "NCCL_IB_HCA": "=" + ",".join(devices)}
        if (fabric_types or {}).get(group.transport.fabric) == "roce":
            settings["NCCL_IB_GID_INDEX"] = str(roce_gid_index)
        if bootstrap_interface:
            settings["NCCL_SOCKET_IFNAME"] = "=" + bootstrap_interface
        return settings
    return {"NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "=" + ",".join(devices)}


def check_placement(planned_node: str, planned_gpu: int, node_hostnames: Mapping[str, str],
                    hostname: str, local_rank: int) -> None:
    """Refuse a rank that torchrun started on another node or GPU than its plan says.

    `node_hostnames` maps the plan's node names to short hostnames (empty: the node is not
    checked, only the GPU index)."""
    want = node_hostnames.get(planned_node)
    if want is not None and hostname.split(".")[0] != want.split(".")[0]:
        raise TestbedError(f"this rank's plan puts it on node '{planned_node}' ({want}) but it runs "
                           f"on '{hostname}': start torchrun on each node with the node rank of "
                           "the plan's hostfile order")
    if local_rank != planned_gpu:
        raise TestbedError(f"this rank's plan puts it on GPU {planned_gpu} of '{planned_node}' but "
                           f"LOCAL_RANK is {local_rank}: use --nproc-per-node equal to the node's "
                           "GPUs and the plan's node order")


@contextlib.contextmanager
def _environment(settings: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in _KEYS}
    for k in _KEYS:
        os.environ.pop(k, None)
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def nccl_group(group: Group, member: bool, settings: Mapping[str, str], device, timeout_s: float):
    """Create `group` with NCCL on every rank (torch requires all ranks to call new_group) and,
    on members, force its communicator into existence while its `settings` are in place."""
    import torch
    import torch.distributed as dist

    options = dist.ProcessGroupNCCL.Options()
    if "NCCL_NET" in settings and hasattr(options, "config") and hasattr(options.config, "net_name"):
        options.config.net_name = settings["NCCL_NET"]
    with _environment(settings):
        pg = dist.new_group(list(group.ranks), backend="nccl", pg_options=options,
                            timeout=timedelta(seconds=timeout_s))
        if member:
            probe = torch.zeros(1, device=device)
            dist.all_reduce(probe, group=pg)  # eager: the communicator is built now
            torch.cuda.synchronize(device)
    if member and pg is None:
        raise TestbedError(f"NCCL group {group.ranks} was not created on a member rank")
    return pg, dict(settings)
