"""Process groups of a Plan, each bound to the NIC (network interface) the plan chose.

Every group of the plan is a separate gloo process group whose gloo device is created on the
member's interface, so its traffic leaves through that (rate-limited) interface. The world group
(barriers, timing) is the default torch.distributed group.

Group conventions (the policies produce the same structure):
- DATA: one group per (pp_rank, tp_rank), members in dp_rank order.
- PIPELINE: one 2-rank group per (sender, receiver) pair, ranks = (src, dst) in the forward
  direction (virtual stage j -> j + 1, same dp_rank, same tp_rank). The same group carries
  the gradient back (on its other connection under gloo, below).
- TENSOR: one group per (pp_rank, dp_rank), members in tp_rank order (a LOCAL group inside a
  node: loopback on the testbed, NVLink / PCIe under NCCL).
  For the interleaved schedule the wrap-around (stage p-1 chunk c -> stage 0 chunk c+1) is the
  group (rank of stage p-1, rank of stage 0); for p == 2 that is a second group (1 -> 0) next
  to (0 -> 1). Pairs repeated across chunks appear once.
- EXPERT: one group per (pp_rank, tp_rank, run of ep consecutive dp_ranks), members in dp_rank
  order (Megatron-Core's expert rank order, `policies/groups.py`); its all-to-alls are
  pairwise sends and receives (`collectives.pairwise_all_to_all`).
- EXPERT_DATA: one group per (pp_rank, tp_rank, EP rank e) when dp > ep, members the dp_ranks
  e, e + ep, e + 2 ep, ... in order (Megatron-Core's expert-data-parallel group); the routed
  experts' gradients are reduced over it (`data_parallel.py`), the dense ones over DATA.
- Group rank = index of the global rank in `group.ranks`.

Point-to-point traffic (pipeline sends, the worker's ring collectives) goes through
`BuiltGroup.send` / `recv`, which under gloo use two connections per group on the same NIC:
data from a lower to a higher group rank on one, from higher to lower on the other, as NCCL
keeps a send and a receive connection per peer. gloo's send is a rendezvous: it waits for a
"ready" message from the receive, sent back over the pair's TCP stream. On one connection that
message queues behind whatever data the receiver is still sending the other way (TCP is one byte
stream; a gloo send completes once its bytes are in the kernel, not delivered), so a transfer
waited for a whole transfer in the opposite direction: measured on the testbed at 100 Mbit/s
with rate-sized shaper buckets, 256 KiB activations took 43 ms instead of 21 ms next to
gradients going back, and a p = 2 ring exchange of 256 KiB each way took 42 ms instead of 21 ms
in a quarter of the steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from holmes_sim.errors import TestbedError
from holmes_sim.plan import Group, GroupKind, Plan

InterfaceOf = Callable[[str], str]


@dataclass(frozen=True, slots=True)
class GroupOptions:
    """What a group's gloo backend was built with.

    gloo's Device object does not expose its interface, so the chosen NIC and interface are kept
    next to the native (private) options object.

    Attributes:
        nic: the member's NIC name from the plan ("" for LOCAL).
        interface: the interface the gloo device was created on (interface_of(nic)).
        timeout_s: gloo operation timeout, seconds.
        native: the `ProcessGroupGloo._Options` passed to the backend.
    """

    nic: str
    interface: str
    timeout_s: float
    native: object


@dataclass(slots=True)
class BuiltGroup:
    """A constructed group as seen by one member.

    Attributes:
        index: position of the group in `plan.groups`.
        group: the plan's group.
        group_rank: this member's index in `group.ranks`.
        options: the options the gloo backend was built with (nic, interface, native object).
        pg: the process group backend (group-local ranks); under gloo it carries the
            point-to-point data from lower to higher group ranks.
        pg_rev: gloo only: the connection for data from higher to lower group ranks (None:
            `pg` carries both, as NCCL's communicator does with its own per-peer connections).
    """

    index: int
    group: Group
    group_rank: int
    options: GroupOptions
    pg: dist.ProcessGroupGloo
    pg_rev: dist.ProcessGroupGloo | None = None

    @property
    def size(self) -> int:
        return len(self.group.ranks)

    def send(self, tensor: torch.Tensor, dst: int, tag: int):
        """Start sending `tensor` to group rank `dst`; returns the work to wait on."""
        return _direction(self, self.group_rank, dst).send([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int):
        """Start receiving into `tensor` from group rank `src`; returns the work to wait on."""
        return _direction(self, src, self.group_rank).recv([tensor], src, tag)

    def peer(self, global_rank: int) -> int:
        """Group rank of `global_rank`."""
        return self.group.ranks.index(global_rank)


def _direction(links, src: int, dst: int):
    """The process group that carries data from group rank `src` to `dst` (module docstring)."""
    return links.pg if links.pg_rev is None or src < dst else links.pg_rev


@dataclass(slots=True)
class PointToPoint:
    """The point-to-point side of a group without a plan (link probes): the same two
    connections and `send`/`recv` as `BuiltGroup`."""

    pg: dist.ProcessGroupGloo
    pg_rev: dist.ProcessGroupGloo | None
    group_rank: int
    size: int

    send = BuiltGroup.send
    recv = BuiltGroup.recv


def gloo_connections(store: dist.Store, name: str, group_rank: int, group_size: int,
                     interface: str, timeout_s: float):
    """(pg, pg_rev, native options): a group's two gloo connections on `interface` (module
    docstring); blocks until every member has called it."""
    pg, native = gloo_group(store, name, group_rank, group_size, interface, timeout_s)
    pg_rev, _ = gloo_group(store, f"{name}-rev", group_rank, group_size, interface, timeout_s)
    return pg, pg_rev, native


def group_name(index: int, group: Group) -> str:
    """Store prefix of a group: unique per plan position, readable in logs."""
    return f"g{index}-{group.kind.value}-" + "-".join(map(str, group.ranks))


def gloo_group(store: dist.Store, name: str, group_rank: int, group_size: int, interface: str,
               timeout_s: float) -> tuple[dist.ProcessGroupGloo, object]:
    """A gloo process group whose device is bound to `interface`; returns (pg, native options).

    The only torch-private spelling of the backend lives here: in torch 2.13,
    `dist.new_group(backend="gloo", pg_options=...)` ignores gloo options, so the group's backend
    is constructed directly. Blocks until every member has called it (store rendezvous).
    """
    try:
        opts = dist.ProcessGroupGloo._Options()
        device = dist.ProcessGroupGloo.create_device(interface=interface)
        opts._devices = [device]
        opts._timeout = timedelta(seconds=timeout_s)
    except (AttributeError, TypeError) as e:  # a torch upgrade renamed the private API
        raise TestbedError(f"torch {torch.__version__}: gloo private API changed ({e}); "
                           "update holmes_sim/backend/groups.py:gloo_group") from e
    except RuntimeError as e:  # gloo's enforce: no such interface or it has no address
        raise TestbedError(f"group {name}: cannot bind gloo to interface {interface!r}: {e}") from e
    pg = dist.ProcessGroupGloo(dist.PrefixStore(name, store), group_rank, group_size, opts)
    return pg, opts


def default_interface_of(nic: str) -> str:
    """Testbed mapping: a node's namespace names its interfaces like the NICs; LOCAL ("") -> lo."""
    return nic or "lo"


def build_groups(plan: Plan, rank: int, store: dist.Store, interface_of: InterfaceOf,
                 timeout_s: float) -> list[BuiltGroup]:
    """Construct every plan group that holds `rank`, in plan order.

    All ranks walk the groups in the same (plan) order, so a rendezvous only waits on members
    that will reach it: no deadlock.
    """
    built = []
    for index, group in enumerate(plan.groups):
        if rank not in group.ranks:
            continue
        group_rank = group.ranks.index(rank)
        nic = group.nics[group_rank]
        interface = interface_of(nic)
        pg, pg_rev, native = gloo_connections(store, group_name(index, group), group_rank,
                                              len(group.ranks), interface, timeout_s)
        options = GroupOptions(nic, interface, timeout_s, native)
        built.append(BuiltGroup(index, group, group_rank, options, pg, pg_rev))
    return built


def build_nccl_groups(plan: Plan, rank: int, nic_devices: dict, device,
                      timeout_s: float, **setting_options) -> list[BuiltGroup]:
    """NCCL counterpart of `build_groups` for GPU clusters under torchrun (`nccl.py`)."""
    from holmes_sim.backend.nccl import nccl_group

    built = []
    for index, group in enumerate(plan.groups):
        member = rank in group.ranks
        pg, settings = nccl_group(group, member, nic_devices, device, timeout_s,
                                  **setting_options)
        if member:
            group_rank = group.ranks.index(rank)
            options = GroupOptions(group.nics[group_rank], settings.get("NCCL_IB_HCA") or
                                   settings.get("NCCL_SOCKET_IFNAME") or "local", timeout_s, settings)
            built.append(BuiltGroup(index, group, group_rank, options, pg))
    return built


def init_world(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """The default (world) gloo group, used for barriers and nothing on the measured path.

    Its interface follows GLOO_SOCKET_IFNAME (the worker sets it from the run config).
    """
    dist.init_process_group("gloo", store=dist.PrefixStore("world", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


def pipeline_group(groups: list[BuiltGroup], src: int, dst: int) -> BuiltGroup:
    """The PIPELINE group carrying activations src -> dst (and gradients dst -> src)."""
    for g in groups:
        if g.group.kind is GroupKind.PIPELINE and g.group.ranks == (src, dst):
            return g
    raise TestbedError(f"plan has no PIPELINE group with ranks ({src}, {dst})")


def _only_group(groups: list[BuiltGroup], kind: GroupKind) -> BuiltGroup | None:
    """This rank's one group of `kind`, or None when the plan has none."""
    found = [g for g in groups if g.group.kind is kind]
    if len(found) > 1:
        raise TestbedError(f"rank is in {len(found)} {kind.name} groups; expected one")
    return found[0] if found else None


def tensor_group(groups: list[BuiltGroup]) -> BuiltGroup | None:
    """This rank's TENSOR group, or None when the plan has none (tp == 1)."""
    return _only_group(groups, GroupKind.TENSOR)


def data_group(groups: list[BuiltGroup]) -> BuiltGroup | None:
    """This rank's DATA group, or None when the plan has none (dp == 1)."""
    return _only_group(groups, GroupKind.DATA)


def expert_group(groups: list[BuiltGroup]) -> BuiltGroup | None:
    """This rank's EXPERT group, or None when the plan has none (EP 1)."""
    return _only_group(groups, GroupKind.EXPERT)


def expert_data_group(groups: list[BuiltGroup]) -> BuiltGroup | None:
    """This rank's EXPERT_DATA group, or None when the plan has none (EP 1, or dp = ep)."""
    return _only_group(groups, GroupKind.EXPERT_DATA)
