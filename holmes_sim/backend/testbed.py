"""An emulated multi-node cluster on one Linux machine, built from network namespaces.

Technique
---------
* Every emulated node is a network namespace ``hsim-<runid>-<node>`` with ``lo`` up.
* Every fabric (``"ib"``, ``"roce"``, ``"eth"``, ...) is a Linux bridge. All bridges of a run live
  in one extra namespace of the testbed's own, ``hsim-<runid>--fabrics`` (the double dash cannot
  come from a node name, which starts with a letter), never in the host's namespace.
* Every NIC is a veth pair created directly between the node's namespace (the end is named as the
  caller's NIC, e.g. ``ib0``) and the fabric namespace (an internal name ``hsim<i>f<j>``, enslaved
  to the fabric's bridge). No interface is ever created in, or moved through, the host namespace.
* Each fabric is its own IPv4 subnet ``10.200.<fabric_index>.0/24``; node ``i`` gets host part
  ``i + 1``. A node's NICs are therefore in different subnets, so a process that binds or
  connects to a NIC's address goes out through that NIC (names and addresses: `topology.py`).
* Each NIC is capped to its line rate in both directions by htb shapers (`shaping.py`).
* A fabric may be cut into two segments (e.g. the Ethernet of two clusters), each its own bridge,
  joined by an uplink: a veth pair between the two bridges, shaped on each end, so all traffic
  between the segments shares the uplink's rate in each direction (`TestbedUplink`). The
  segments stay one subnet. At most one uplink per fabric: two would close a bridge loop.

Safety and ownership
--------------------
The description is validated (`preflight.py`) before anything is made; what a run creates is
recorded and locked (`records.py`). Processes started here die with their parent. SIGTERM and
SIGHUP unwind like SIGINT. Teardown kills the processes started with `Testbed.popen` that it
has not reaped yet (whole process group, SIGTERM then SIGKILL; a reaped one's PID may be another
process's) and any other process still inside the namespaces, then
deletes the namespaces, which deletes the veths and bridges in them. It is idempotent and never
raises on missing resources.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from holmes_sim.backend.netns import (
    KILL_GRACE_S,
    die_with_parent,
    killpg,
    list_namespaces,
    process_start,
    remove_namespace,
    run_command,
    signals_deferred,
)
from holmes_sim.backend.preflight import preflight, validate_nodes, validate_segments
from holmes_sim.backend.records import (
    TEMP_PREFIXES,
    RunRecord,
    acquire_run_lock,
    release_run_lock,
)
from holmes_sim.backend.shaping import apply_tc, nic_burst_bytes, shaper_lines, uplink_burst_bytes
from holmes_sim.backend.topology import (
    ADDRESS_BASE,
    FABRICS_NS_SUFFIX,
    NS_PREFIX,
    RUN_ID_RE,
    RUN_ID_RULE,
    TestbedNic,
    TestbedNode,
    TestbedUplink,
    bridge_name,
    peer_name,
    uplink_names,
)
from holmes_sim.errors import TestbedError

log = logging.getLogger(__name__)


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM/SIGHUP handler: raise SystemExit(128 + signum) so `with` blocks unwind and clean up."""
    raise SystemExit(128 + signum)


class Testbed:
    """An emulated cluster; use as a context manager. Rates are in bit/s."""

    __test__ = False  # not a pytest test class

    def __init__(self, nodes: Sequence[TestbedNode], run_id: str | None = None,
                 uplinks: Sequence[TestbedUplink] = ()) -> None:
        nodes = tuple(nodes)
        self._fabrics = validate_nodes(nodes)
        self.uplinks = tuple(uplinks)
        self._segments = validate_segments(nodes, self._fabrics, self.uplinks)
        if run_id is None:
            run_id = secrets.token_hex(3)
        if not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id):
            raise TestbedError(f"bad run id {run_id!r}: must be {RUN_ID_RULE}")
        self.run_id = run_id
        self.nodes = nodes
        self._index = {node.name: i for i, node in enumerate(nodes)}
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._temp_dirs: list[Path] = []
        self._lock_fd: int | None = None
        self._record = RunRecord(run_id)
        self._prev_handlers: dict[int, Any] = {}

    # -- names and addresses ------------------------------------------------------------------

    @property
    def prefix(self) -> str:
        """Prefix of every namespace of this run: `hsim-<runid>-`."""
        return f"{NS_PREFIX}{self.run_id}-"

    @property
    def fabrics_namespace(self) -> str:
        """The namespace that holds this run's bridges."""
        return f"{self.prefix}{FABRICS_NS_SUFFIX}"

    def _node(self, node: str) -> TestbedNode:
        """The node called `node`; TestbedError if there is none."""
        if node not in self._index:
            raise TestbedError(f"testbed has no node {node!r}")
        return self.nodes[self._index[node]]

    def namespace(self, node: str) -> str:
        """Network namespace name of `node`."""
        self._node(node)
        return f"{self.prefix}{node}"

    def address(self, node: str, nic: str) -> str:
        """IPv4 address (no prefix length) of NIC `nic` of `node`."""
        for item in self._node(node).nics:
            if item.name == nic:
                return f"{ADDRESS_BASE}.{self._fabrics.index(item.fabric)}.{self._index[node] + 1}"
        raise TestbedError(f"node {node!r} has no NIC {nic!r}")

    def exec_prefix(self, node: str) -> list[str]:
        """Argument prefix that runs a command inside `node`'s namespace."""
        return ["ip", "netns", "exec", self.namespace(node)]

    def popen(self, node: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside `node` in its own process group; it is killed on exit."""
        if kwargs.pop("start_new_session", True) is not True or "process_group" in kwargs:
            raise TestbedError("popen always starts a new session; do not override it")
        return self.start_process(self.exec_prefix(node) + list(argv), **kwargs)

    def start_process(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start a recorded helper process (own session, dies with us); it is killed on exit."""
        if self._lock_fd is None:
            raise TestbedError("testbed is not built; use it inside a `with` block")
        with signals_deferred():
            proc = subprocess.Popen(list(argv), start_new_session=True,
                                    preexec_fn=die_with_parent, **kwargs)
            self._procs.append(proc)
            start = process_start(proc.pid)
            if start is not None:
                self._record.add("processes", {"pid": proc.pid, "start": start})
        return proc

    def mkdtemp(self, prefix: str) -> Path:
        """A recorded temporary folder (0700), removed on exit and by `--cleanup`."""
        if not prefix.startswith(TEMP_PREFIXES):
            raise TestbedError(f"temporary folder prefix must start with one of {TEMP_PREFIXES}")
        if self._lock_fd is None:
            raise TestbedError("testbed is not built; use it inside a `with` block")
        with signals_deferred():
            path = Path(tempfile.mkdtemp(prefix=prefix))
            self._temp_dirs.append(path)
            self._record.add("temp_dirs", str(path))
        return path

    # -- context manager ----------------------------------------------------------------------

    def __enter__(self) -> Testbed:
        self._install_sigterm()
        try:
            preflight()
            if any(ns.startswith(self.prefix) for ns in list_namespaces()):
                raise TestbedError(
                    f"namespaces {self.prefix}* already exist; run `holmes-sim validate --cleanup`"
                )
            with signals_deferred():
                self._lock_fd = acquire_run_lock(self.run_id)
            self._build()
        except BaseException as exc:
            self._teardown()
            if isinstance(exc, Exception) and not isinstance(exc, TestbedError):
                raise TestbedError(f"building the testbed failed: {exc}") from exc
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._teardown()

    def _install_sigterm(self) -> None:
        """Make SIGTERM and SIGHUP raise SystemExit while the testbed lives (main thread only)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._prev_handlers[sig] = signal.signal(sig, _raise_on_sigterm)

    # -- building -----------------------------------------------------------------------------

    def _add_namespace(self, ns: str) -> None:
        """Create namespace `ns` (recorded first, so a half-made one is still removed)."""
        self._created.append(ns)
        self._record.add("namespaces", ns)
        run_command(["ip", "netns", "add", ns])
        run_command(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _build(self) -> None:
        """Create the fabric namespace with its bridges, then every node with its NICs."""
        fns = self.fabrics_namespace
        self._add_namespace(fns)
        for j in range(len(self._fabrics)):
            for k in range(len(self._segments[j])):
                self._record.add("interfaces", [fns, bridge_name(j, k)])
                run_command(["ip", "-n", fns, "link", "add", bridge_name(j, k), "type", "bridge"])
                run_command(["ip", "-n", fns, "link", "set", bridge_name(j, k), "up"])
        for up in self.uplinks:
            self._add_uplink(up)
        for i, node in enumerate(self.nodes):
            ns = self.namespace(node.name)
            self._add_namespace(ns)
            # A NIC link has no congestion window: no restart from TCP's initial window after
            # an idle gap (`shaping.py` docstring). Per namespace; the host's setting is
            # untouched.
            run_command(["ip", "netns", "exec", ns, "sysctl", "-qw",
                         "net.ipv4.tcp_slow_start_after_idle=0"])
            for nic in node.nics:
                self._add_nic(i, node.name, nic)

    def _add_nic(self, i: int, node: str, nic: TestbedNic) -> None:
        """Create NIC `nic` of node number `i`: veth pair, bridge port, address, shaped both
        ways."""
        ns, fns = self.namespace(node), self.fabrics_namespace
        j = self._fabrics.index(nic.fabric)
        peer = peer_name(i, j)
        self._record.interfaces += [[ns, nic.name], [fns, peer]]
        self._record.save()
        run_command(["ip", "-n", ns, "link", "add", nic.name, "type", "veth",
                     "peer", "name", peer, "netns", fns])  # fmt: skip
        bridge = bridge_name(j, self._segments[j].index(nic.segment))
        run_command(["ip", "-n", fns, "link", "set", peer, "master", bridge])
        run_command(["ip", "-n", ns, "addr", "add", f"{self.address(node, nic.name)}/24", "dev", nic.name])
        peers = self._fabric_peers(j, exclude=node)
        burst = nic_burst_bytes(nic.rate_bit_per_s)
        apply_tc(ns, shaper_lines(nic.name, nic.rate_bit_per_s, burst, "dst", peers))
        apply_tc(fns, shaper_lines(peer, nic.rate_bit_per_s, burst, "src", peers))
        run_command(["ip", "-n", fns, "link", "set", peer, "up"])
        run_command(["ip", "-n", ns, "link", "set", nic.name, "up"])

    def _fabric_members(self, j: int) -> list[tuple[str, str]]:
        """(address, segment) of every NIC on fabric number `j`, in node order."""
        return [(self.address(node.name, nic.name), nic.segment) for node in self.nodes
                for nic in node.nics if nic.fabric == self._fabrics[j]]

    def _fabric_peers(self, j: int, exclude: str) -> list[str]:
        """Addresses on fabric number `j` of every node but `exclude`."""
        own = {self.address(exclude, nic.name) for nic in self._node(exclude).nics}
        return [a for a, _ in self._fabric_members(j) if a not in own]

    def _add_uplink(self, up: TestbedUplink) -> None:
        """A veth pair between the two segments' bridges, shaped on each end: each direction is
        capped at the uplink's rate, shared max-min by the source nodes of its segment."""
        fns, j = self.fabrics_namespace, self._fabrics.index(up.fabric)
        ends = uplink_names(j)
        self._record.interfaces += [[fns, ends[0]], [fns, ends[1]]]
        self._record.save()
        run_command(["ip", "-n", fns, "link", "add", ends[0], "type", "veth", "peer", "name", ends[1]])
        for end, segment in zip(ends, up.segments, strict=True):
            run_command(["ip", "-n", fns, "link", "set", end, "master",
                         bridge_name(j, self._segments[j].index(segment))])
            sources = [a for a, seg in self._fabric_members(j) if seg == segment]
            apply_tc(fns, shaper_lines(end, up.rate_bit_per_s,
                                        uplink_burst_bytes(up.rate_bit_per_s), "src", sources))
            run_command(["ip", "-n", fns, "link", "set", end, "up"])

    # -- teardown -----------------------------------------------------------------------------

    def _teardown(self) -> None:
        """Kill spawned processes, delete namespaces and temp folders, drop the record (when all
        is gone) and the lock, restore SIGTERM and SIGHUP. Idempotent."""
        restore, self._prev_handlers = self._prev_handlers, {}
        with signals_deferred(restore):
            self._kill_processes()
            for ns in reversed(self._created):
                remove_namespace(ns)
            for path in self._temp_dirs:
                shutil.rmtree(path, ignore_errors=True)
            left = set(self._created) & set(list_namespaces())
            left |= {str(p) for p in self._temp_dirs if os.path.lexists(p)}
            self._created.clear()
            self._temp_dirs.clear()
            if self._lock_fd is not None:
                if left:
                    log.warning("could not remove %s; `holmes-sim validate --cleanup` retries",
                                ", ".join(sorted(left)))
                else:
                    self._record.delete()
                release_run_lock(self.run_id, self._lock_fd)
                self._lock_fd = None

    def _kill_processes(self) -> None:
        """SIGTERM each spawned process group whose leader is not reaped yet, SIGKILL it after a
        grace period, reap. A leader already reaped (`returncode` set) is skipped: its PID may
        belong to another process by now. An unreaped one, running or a zombie, still holds its
        PID, so the group is ours, members that outlived the leader included; leaders are only
        reaped after the SIGKILL for that reason."""
        procs, self._procs = [p for p in self._procs if p.returncode is None], []
        for proc in procs:
            killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + KILL_GRACE_S
        while not all(_exited(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.02)
        for proc in procs:
            killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=KILL_GRACE_S)


def _exited(proc: subprocess.Popen[Any]) -> bool:
    """Whether `proc` has ended, without reaping it (a zombie keeps its PID until `wait`)."""
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True
