"""What an emulated testbed is made of, and the names and addresses its parts get.

* Every emulated node is a network namespace ``hsim-<runid>-<node>``.
* Every fabric (``"ib"``, ``"roce"``, ``"eth"``, ...) is a Linux bridge in the run's fabric
  namespace ``hsim-<runid>--fabrics`` (the double dash cannot come from a node name, which
  starts with a letter).
* Every NIC is a veth pair: the node-side end is named as the caller's NIC (e.g. ``ib0``), the
  fabric-side end ``hsim<i>f<j>`` (`peer_name`).
* Each fabric is its own IPv4 subnet ``10.200.<fabric_index>.0/24``; node ``i`` gets host part
  ``i + 1``.

Names from the caller must match a strict pattern (`name_problem`), so that they reach ``ip``
and ``tc`` only as harmless elements of an argument list.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "hsim"
"""Common prefix of every namespace and interface the testbed creates."""
NS_PREFIX = f"{PREFIX}-"
FABRICS_NS_SUFFIX = "-fabrics"
ADDRESS_BASE = "10.200"
"""First two octets of the private range the testbed owns; fabric j is 10.200.j.0/24."""
MAX_NODES = 254
MAX_FABRICS = 256
MAX_RATE_BIT_PER_S = 1e12
"""Fastest NIC the testbed shapes (its bucket, 1 ms of line rate, must fit in 32 bits)."""
IFNAME_MAX = 15
"""Longest Linux interface name (IFNAMSIZ - 1 bytes)."""

_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,14}")
_NAME_RULE = "1-15 characters: a letter, then letters, digits, '-' or '_'"
RUN_ID_RE = re.compile(r"[a-z0-9]{1,8}")
"""A run id: the `<runid>` of every name of one run."""
RUN_ID_RULE = "1-8 characters: lowercase letters or digits"
_OWN_LINK_RE = re.compile(rf"{PREFIX}(\d+f\d+|br\d+(s\d+)?|up\d+[ab]|p[01]|pbr)")


def peer_name(node_index: int, fabric_index: int) -> str:
    """Fabric-side interface name of node `node_index`'s NIC on fabric `fabric_index`."""
    return f"{PREFIX}{node_index}f{fabric_index}"


def bridge_name(fabric_index: int, segment_index: int = 0) -> str:
    """Name of fabric `fabric_index`'s bridge (of its segment `segment_index`, see
    TestbedUplink)."""
    return f"{PREFIX}br{fabric_index}" + (f"s{segment_index}" if segment_index else "")


def uplink_names(fabric_index: int) -> tuple[str, str]:
    """The two ends of fabric `fabric_index`'s uplink veth pair (segment 0's end first)."""
    return f"{PREFIX}up{fabric_index}a", f"{PREFIX}up{fabric_index}b"


def name_problem(name: object) -> str | None:
    """Why `name` cannot name a node, NIC or fabric of a testbed, or None when it can."""
    if isinstance(name, str) and _NAME_RE.fullmatch(name):
        return None
    return f"must be {_NAME_RULE}"


def run_id_of(ns: str) -> str:
    """The run id in namespace name `hsim-<runid>-...`."""
    return ns[len(NS_PREFIX) :].split("-", 1)[0]


@dataclass(frozen=True)
class TestbedNic:
    """One NIC of an emulated node.

    name: interface name inside the node namespace (e.g. "ib0"); fabric: the bridge it plugs into
    (e.g. "ib"); rate_bit_per_s: line rate in bit/s, applied in each direction.
    """

    __test__ = False  # not a pytest test class

    name: str
    fabric: str
    rate_bit_per_s: float
    segment: str = ""
    """The fabric segment (bridge) it plugs into; "" for an undivided fabric."""


@dataclass(frozen=True)
class TestbedUplink:
    """The link joining the two segments of one fabric, shaped to `rate_bit_per_s` each way
    (e.g. the Ethernet uplink between two clusters)."""

    __test__ = False  # not a pytest test class

    fabric: str
    segments: tuple[str, str]
    rate_bit_per_s: float


@dataclass(frozen=True)
class TestbedNode:
    """One emulated node (a network namespace) and its NICs."""

    __test__ = False  # not a pytest test class

    name: str
    nics: tuple[TestbedNic, ...]
