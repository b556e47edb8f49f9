"""Process groups on real GPU clusters: NCCL, each group on the transport the plan chose.

Holmes (arXiv 2312.03549, section 3.3) chooses a NIC per communication group. Stock NCCL reads
its network settings when a communicator is created, so each group is created eagerly, in plan
order on every rank, right after its settings are put in place:

- RDMA on a fabric: ``NCCL_NET=IB`` and ``NCCL_IB_HCA`` = the HCAs of the members' NICs on it
  (IB and RoCE alike: NCCL's IB transport drives both through verbs);
- TCP: ``NCCL_NET=Socket`` and ``NCCL_SOCKET_IFNAME`` = the members' Ethernet interfaces;
- LOCAL (one node): nothing; NCCL uses NVLink / PCIe peer-to-peer.

Where the installed torch exposes NCCL's per-communicator ``netName`` through
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

_KEYS = ("NCCL_NET", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME")


def nccl_settings(group: Group, nic_devices: Mapping[str, str]) -> dict[str, str]:
    """NCCL environment for creating `group`'s communicator (see module docstring)."""
    kind = group.transport.kind
    if kind is TransportKind.LOCAL:
        return {}
    devices = sorted({nic_devices.get(n, n) for n in group.nics})
    if kind is TransportKind.RDMA:
        # "=" makes NCCL match HCA names exactly rather than as prefixes.
        return {"NCCL_NET": "IB", "NCCL_IB_HCA": "=" + ",".join(devices)}
    return {"NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "=" + ",".join(devices)}


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


def nccl_group(group: Group, member: bool, nic_devices: Mapping[str, str], device, timeout_s: float):
    """Create `group` with NCCL on every rank (torch requires all ranks to call new_group) and,
    on members, force its communicator into existence while its settings are in place."""
    import torch
    import torch.distributed as dist

    settings = nccl_settings(group, nic_devices)
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
