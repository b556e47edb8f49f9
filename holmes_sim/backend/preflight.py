"""Checks before a testbed is built: the node list and its names, and the kernel's support.

`validate_nodes` and `validate_segments` refuse a description the testbed cannot build (bad
names, repeated NICs, rates tc cannot shape, segments without an uplink) before anything is
made; `preflight` checks for root, ``ip`` and ``tc``, and probes the kernel by building a
throw-away namespace with a veth pair, a bridge and an htb shaper.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
from collections.abc import Sequence

from holmes_sim.backend.netns import (
    list_namespaces,
    remove_namespace,
    run_command,
    signals_deferred,
)
from holmes_sim.backend.records import RunRecord, acquire_run_lock, release_run_lock, run_dir
from holmes_sim.backend.shaping import shaper_lines
from holmes_sim.backend.topology import (
    MAX_FABRICS,
    MAX_NODES,
    MAX_RATE_BIT_PER_S,
    NS_PREFIX,
    PREFIX,
    TestbedNic,
    TestbedNode,
    TestbedUplink,
    name_problem,
)
from holmes_sim.errors import TestbedError


def _probe_kernel() -> list[str]:
    """Create a probe namespace with a veth pair, a bridge and an htb shaper; list what failed."""
    run_id = secrets.token_hex(4)
    ns = f"{NS_PREFIX}{run_id}-probe"
    record = RunRecord(run_id)
    fd = None
    try:
        with signals_deferred():
            fd = acquire_run_lock(run_id)
            record.add("namespaces", ns)
        if run_command(["ip", "netns", "add", ns], check=False).returncode != 0:
            return ["network namespace support (`ip netns add` failed)"]
        steps = [
            ("veth support", ["ip", "-n", ns, "link", "add", f"{PREFIX}p0", "type", "veth",
                              "peer", "name", f"{PREFIX}p1"]),
            ("bridge support", ["ip", "-n", ns, "link", "add", f"{PREFIX}pbr", "type", "bridge"]),
            ("tc htb qdisc with u32 filters", ["tc", "-n", ns, "-batch", "-"]),
        ]  # fmt: skip
        htb = "\n".join(shaper_lines(f"{PREFIX}p1", 1e6, 16384, "dst", ["10.200.0.1"])) + "\n"
        missing = []
        for what, argv in steps:
            res = run_command(argv, check=False, stdin_text=htb if "-batch" in argv else None)
            if res.returncode != 0:
                missing.append(f"{what} ({res.stderr.strip() or 'failed'})")
        return missing
    finally:
        with signals_deferred():
            if not remove_namespace(ns) or ns not in list_namespaces():
                record.delete()
            if fd is not None:
                release_run_lock(run_id, fd)


def preflight() -> None:
    """Check that a testbed can be built here; raise TestbedError naming everything missing."""
    if os.geteuid() != 0:
        raise TestbedError("testbed needs root (network namespaces and tc); run it as root")
    run_dir()
    missing = [
        f"the `{tool}` command (iproute2)" for tool in ("ip", "tc") if not shutil.which(tool)
    ]
    if not missing:
        missing = _probe_kernel()
    if missing:
        raise TestbedError("testbed preflight failed; missing: " + "; ".join(missing))


def _check_name(kind: str, name: object) -> None:
    """Raise TestbedError unless `name` follows the name rule."""
    problem = name_problem(name)
    if problem is not None:
        raise TestbedError(f"bad {kind} name {name!r}: {problem}")


def _check_nic(node: str, nic: TestbedNic) -> None:
    """Validate one NIC of node `node`."""
    _check_name("NIC", nic.name)
    _check_name("fabric", nic.fabric)
    if nic.name == "lo":
        raise TestbedError(f"node {node!r}: NIC name 'lo' is reserved for loopback")
    rate = nic.rate_bit_per_s
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate):
        raise TestbedError(f"node {node!r} NIC {nic.name!r}: rate must be a finite number (bit/s)")
    if not 0 < rate <= MAX_RATE_BIT_PER_S:
        raise TestbedError(f"node {node!r} NIC {nic.name!r}: rate {rate} bit/s is outside "
                           f"(0, {MAX_RATE_BIT_PER_S:g}]")


def _check_node(node: TestbedNode) -> None:
    """Validate a node: its name, NICs, unique NIC names, at most one NIC per fabric."""
    _check_name("node", node.name)
    if not node.nics:
        raise TestbedError(f"node {node.name!r} has no NICs")
    names: set[str] = set()
    fabrics: set[str] = set()
    for nic in node.nics:
        _check_nic(node.name, nic)
        if nic.name in names:
            raise TestbedError(f"node {node.name!r}: NIC name {nic.name!r} repeats")
        if nic.fabric in fabrics:
            raise TestbedError(
                f"node {node.name!r}: two NICs on fabric {nic.fabric!r} (one subnet per fabric)"
            )
        names.add(nic.name)
        fabrics.add(nic.fabric)


def validate_segments(nodes: Sequence[TestbedNode], fabrics: list[str],
                      uplinks: Sequence[TestbedUplink]) -> list[list[str]]:
    """Per fabric, its segments in order of first appearance; a fabric in two segments needs
    exactly one uplink joining them (more segments or uplinks would need routing or loop)."""
    segments: list[list[str]] = [[] for _ in fabrics]
    for node in nodes:
        for nic in node.nics:
            seg = segments[fabrics.index(nic.fabric)]
            if nic.segment not in seg:
                seg.append(nic.segment)
    joined: set[str] = set()
    for up in uplinks:
        if up.fabric not in fabrics:
            raise TestbedError(f"uplink on fabric {up.fabric!r}, which no NIC uses")
        if up.fabric in joined:
            raise TestbedError(f"fabric {up.fabric!r} has two uplinks; the testbed joins two "
                               "segments with one")
        seg = segments[fabrics.index(up.fabric)]
        if len(set(up.segments)) != 2 or set(up.segments) != set(seg):
            raise TestbedError(f"uplink on fabric {up.fabric!r} joins {list(up.segments)}; its "
                               f"NICs are on segments {seg}")
        if not 0 < up.rate_bit_per_s <= MAX_RATE_BIT_PER_S:
            raise TestbedError(f"uplink rate {up.rate_bit_per_s} bit/s cannot be shaped")
        joined.add(up.fabric)
    for f, seg in zip(fabrics, segments, strict=True):
        if len(seg) > 1 and f not in joined:
            raise TestbedError(f"fabric {f!r} is cut into segments {seg} with no uplink joining "
                               "them")
    return segments


def validate_nodes(nodes: Sequence[TestbedNode]) -> list[str]:
    """Validate the node list; return the fabric names in order of first appearance."""
    if not nodes:
        raise TestbedError("testbed needs at least one node")
    if len(nodes) > MAX_NODES:
        raise TestbedError(f"testbed supports at most {MAX_NODES} nodes, got {len(nodes)}")
    seen: set[str] = set()
    fabrics: list[str] = []
    for node in nodes:
        _check_node(node)
        if node.name in seen:
            raise TestbedError(f"node name {node.name!r} repeats")
        seen.add(node.name)
        fabrics += [nic.fabric for nic in node.nics if nic.fabric not in fabrics]
    if len(fabrics) > MAX_FABRICS:
        raise TestbedError(f"testbed supports at most {MAX_FABRICS} fabrics, got {len(fabrics)}")
    return fabrics

