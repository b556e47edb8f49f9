"""Process groups on real GPU clusters: NCCL, each group on the transport the plan chose.

Holmes (arXiv 2312.03549, section 3.3) chooses a NIC per communication group. Stock NCCL reads
its network settings when a communicator is created, so each group is created eagerly, in plan
order on every rank, right after its settings are put in place:

- RDMA on a fabric: ``NCCL_NET=IB`` and ``NCCL_IB_HCA`` = the HCAs of the members' NICs on it
  (IB and RoCE alike: NCCL's IB transport drives both through verbs); on RoCE fabrics also
  ``NCCL_IB_GID_INDEX`` (default 3: RoCE v2 over IPv4 on most Mellanox setups); and, when a
  bootstrap interface is given, ``NCCL_SOCKET_IFNAME`` = it, for NCCL's out-of-band bootstrap;
- TCP: ``NCCL_NET=Socket`` and ``NCCL_SOCKET_IFNAME`` = the members' Ethernet interfaces;
- LOCAL (one node): nothing; NCCL uses NVLink / PCIe peer-to-peer.

The world group is created without ``device_id`` (so torch builds no world NCCL communicator
eagerly and never splits a plan group from one carrying other settings: each plan group gets a
communicator of its own, built inside `_environment`), and barriers run on a separate gloo
group, so no NCCL traffic ever crosses the world group.

Where the installed torch exposes NCCL's per-communicator ``netName`` through
``ProcessGroupNCCL.Options().config.net_name``, that is set too, since some NCCL versions cache
environment settings after the first communicator. The plan names NICs node-locally ("ib0",
"eth0"); `nic_devices` maps them to the site's device names ("mlx5_0", "ens1f0").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from datetime import timedelta

from holmes_sim.errors import TestbedError
from holmes_sim.plan import Group, TransportKind

_KEYS = ("NCCL_NET", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_IB_GID_INDEX")
DEFAULT_ROCE_GID_INDEX = 3


def is_roce(fabric: str | None, roce_fabrics: Iterable[str] = ()) -> bool:
    """A fabric is RoCE when listed in `roce_fabrics`, or (none listed) when named like one."""
    listed = set(roce_fabrics)
    return fabric in listed if listed else "roce" in (fabric or "").lower()


def nccl_settings(group: Group, nic_devices: Mapping[str, str], *,
                  roce_fabrics: Iterable[str] = (), gid_index: int = DEFAULT_ROCE_GID_INDEX,
                  bootstrap_ifname: str = "") -> dict[str, str]:
    """NCCL environment for creating `group`'s communicator (see module docstring)."""
    kind = group.transport.kind
    if kind is TransportKind.LOCAL:
        return {}
    devices = sorted({nic_devices.get(n, n) for n in group.nics})
    if any(not d for d in devices):
        raise TestbedError(f"group {group.ranks} ({group.transport}) has a member without a NIC")
    if kind is TransportKind.RDMA:
        # "=" makes NCCL match HCA names exactly rather than as prefixes.
        settings = {"NCCL_NET": "IB", "NCCL_IB_HCA": "=" + ",".join(devices)}
        if is_roce(group.transport.fabric, roce_fabrics):
            if gid_index < 0:
                raise TestbedError(f"RoCE GID index must be >= 0, got {gid_index}")
            settings["NCCL_IB_GID_INDEX"] = str(gid_index)
        if bootstrap_ifname:
            settings["NCCL_SOCKET_IFNAME"] = "=" + bootstrap_ifname
        return settings
    return {"NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "=" + ",".join(devices)}


def check_placement(plan, rank: int, hostname: str, local_rank: int,
                    node_hosts: Mapping[str, str]) -> None:
    """Refuse to run when torchrun put `rank` somewhere other than the plan's node and GPU.

    `node_hosts` maps plan node names to host names; unmapped nodes must equal the host name
    (compared up to the first dot)."""
    gpu = plan.rank_to_gpu[rank]
    want = node_hosts.get(gpu.node, gpu.node)
    if want.split(".")[0] != hostname.split(".")[0]:
        raise TestbedError(f"rank {rank} runs on host {hostname!r} but the plan puts it on node "
                           f"{gpu.node!r} (host {want!r}); launch torchrun with the plan's node "
                           f"order or map nodes to hosts with node_hosts")
    if local_rank != gpu.local_index:
        raise TestbedError(f"rank {rank} has LOCAL_RANK {local_rank} but the plan puts it on "
                           f"{gpu}; run torchrun with --nproc-per-node = GPUs per node")


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


def nccl_group(group: Group, member: bool, nic_devices: Mapping[str, str], device,
               timeout_s: float, **setting_options):
    """Create `group` with NCCL on every rank (torch requires all ranks to call new_group) and,
    on members, force its communicator into existence while its settings are in place."""
    import torch
    import torch.distributed as dist

    settings = nccl_settings(group, nic_devices, **setting_options)
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
    return pg, settings
