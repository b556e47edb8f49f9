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
  connects to a NIC's address goes out through that NIC.
* Each NIC is capped to its line rate in both directions with ``tc ... tbf``: the qdisc on the
  node-side veth limits what the node sends, the one on the bridge-side veth limits what it
  receives. A NIC is thus full duplex at its rate, and a node's NICs are independent of each
  other.

tbf parameters (see `tbf_burst_bytes`): ``burst = max(128 KiB, rate * 4 ms)`` and
``latency = 10 ms``. The burst must hold a whole GSO/TSO super-packet (up to 64 KiB on veth),
else tbf splits every super-packet into MTU-sized segments, which costs CPU at Gbit/s rates.
Sizing it to a few milliseconds of line rate lets the qdisc watchdog fire late (scheduler jitter
on a busy machine, HZ=250 here) without the bucket overflowing and wasting tokens. A larger
burst only lets the first bytes of a transfer through above the line rate (128 KiB is 1.3 % of
a 10 MB transfer), so it is kept small. ``latency`` bounds the queue
(``limit = rate * latency + burst``). Measured on the 2-core build machine with one TCP flow:
goodput is 0.95-0.97 of the rate at 50 Mbit/s, 200 Mbit/s and 2 Gbit/s for any latency of
5-20 ms (the missing ~4 % are the Ethernet/IP/TCP headers tbf counts: 1448 of 1514 bytes).
With traffic both ways on a NIC, as in a ring all-reduce, the ACKs of one direction queue
behind the data of the other; 10 ms gave 0.87-0.99 per direction, better than 20 ms (deeper
queue, later ACKs) and 2-5 ms (drops at 2 Gbit/s).

Safety
------
Names from the caller are checked against a strict pattern and reach ``ip``/``tc`` only as
elements of an argument list (``subprocess.run([...])``, never a shell). Each run holds an
``flock`` on ``/run/holmes-sim/<runid>.lock`` while it lives, so `cleanup_leftovers` removes
only what dead runs (e.g. one killed with SIGKILL) left behind and never a live run's testbed.
Teardown kills the processes started with `Testbed.popen` (whole process group, SIGTERM then
SIGKILL) and any other process still inside the namespaces, then deletes the namespaces, which
deletes the veths and bridges in them. It is idempotent and never raises on missing resources.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from holmes_sim.errors import TestbedError

log = logging.getLogger(__name__)

PREFIX = "hsim"
"""Common prefix of every namespace and interface this module creates."""
NS_PREFIX = f"{PREFIX}-"
FABRICS_NS_SUFFIX = "-fabrics"
ADDRESS_BASE = "10.200"
"""First two octets of the private range the testbed owns; fabric j is 10.200.j.0/24."""
MAX_NODES = 254
MAX_FABRICS = 256

TBF_MIN_BURST_BYTES = 128 * 1024
TBF_BURST_S = 4e-3
TBF_LATENCY_S = 10e-3

KILL_GRACE_S = 2.0
COMMAND_TIMEOUT_S = 30.0

_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,14}")
_NAME_RULE = "1-15 characters: a letter, then letters, digits, '-' or '_'"
_RUN_ID_RE = re.compile(r"[a-z0-9]{1,8}")
_RUN_ID_RULE = "1-8 characters: lowercase letters or digits"
_OWN_LINK_RE = re.compile(rf"{PREFIX}(\d+f\d+|br\d+|p[01]|pbr)")


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


@dataclass(frozen=True)
class TestbedNode:
    """One emulated node (a network namespace) and its NICs."""

    __test__ = False  # not a pytest test class

    name: str
    nics: tuple[TestbedNic, ...]


# ---------------------------------------------------------------------------------------------
# Commands


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one command (argument list, no shell); raise TestbedError on failure if `check`."""
    try:
        proc = subprocess.run(
            list(argv), check=False, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        if check:
            raise TestbedError(f"`{' '.join(argv)}` failed: {exc}") from exc
        return subprocess.CompletedProcess(list(argv), 1, "", str(exc))
    if check and proc.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def tbf_burst_bytes(rate_bit_per_s: float) -> int:
    """tbf bucket size in bytes for a line rate in bit/s: max(128 KiB, 4 ms of line rate)."""
    return max(TBF_MIN_BURST_BYTES, math.ceil(rate_bit_per_s / 8 * TBF_BURST_S))


def _tbf_argv(ns: str, dev: str, rate_bit_per_s: float) -> list[str]:
    """The `tc` command that caps egress of `dev` in namespace `ns` at `rate_bit_per_s`."""
    rate = max(1, round(rate_bit_per_s))
    latency_us = round(TBF_LATENCY_S * 1e6)
    burst = tbf_burst_bytes(rate_bit_per_s)
    return ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
            "rate", f"{rate}bit", "burst", str(burst), "latency", f"{latency_us}us"]  # fmt: skip


def _list_namespaces() -> list[str]:
    """Names of all named network namespaces (`ip netns list`)."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL every process inside namespace `ns` and wait up to 2 s for them to go."""
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    pids = [int(tok) for tok in out.split() if tok.isdigit() and int(tok) != os.getpid()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + KILL_GRACE_S
    while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def _remove_namespace(ns: str) -> bool:
    """Kill what runs in `ns` and delete it; True if it existed. Never raises."""
    if ns not in _list_namespaces():
        return False
    _kill_namespace_processes(ns)
    res = _run(["ip", "netns", "delete", ns], check=False)
    if res.returncode != 0 and ns in _list_namespaces():
        log.warning("could not delete network namespace %s: %s", ns, res.stderr.strip())
    return True


# ---------------------------------------------------------------------------------------------
# Run ids and their locks


def _lock_dir() -> Path:
    """Directory of the per-run lock files (/run/holmes-sim, else the temp dir)."""
    for base in (Path("/run"), Path(tempfile.gettempdir())):
        path = base / "holmes-sim"
        with contextlib.suppress(OSError):
            path.mkdir(mode=0o755, exist_ok=True)
            return path
    raise TestbedError("cannot create a lock directory under /run or the temp dir")


def _acquire_run_lock(run_id: str) -> int:
    """Lock run `run_id` for this process; return the lock's fd. TestbedError if it is taken."""
    path = _lock_dir() / f"{run_id}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise TestbedError(f"testbed run id {run_id!r} is in use by a live process") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode("ascii"))
    return fd


def _release_run_lock(run_id: str, fd: int) -> None:
    """Remove the lock file of `run_id` and drop the lock."""
    with contextlib.suppress(OSError):
        (_lock_dir() / f"{run_id}.lock").unlink()
    with contextlib.suppress(OSError):
        os.close(fd)


def _run_is_live(run_id: str) -> bool:
    """Whether a live process holds the lock of run `run_id`."""
    path = _lock_dir() / f"{run_id}.lock"
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _run_id_of(ns: str) -> str:
    """The run id in namespace name `hsim-<runid>-...`."""
    return ns[len(NS_PREFIX) :].split("-", 1)[0]


# ---------------------------------------------------------------------------------------------
# Preflight and leftovers


def _probe_kernel() -> list[str]:
    """Create a probe namespace with a veth pair, a bridge and a tbf qdisc; list what failed."""
    run_id = secrets.token_hex(4)
    ns = f"{NS_PREFIX}{run_id}-probe"
    fd = None
    try:
        with _signals_deferred():
            fd = _acquire_run_lock(run_id)
        if _run(["ip", "netns", "add", ns], check=False).returncode != 0:
            return ["network namespace support (`ip netns add` failed)"]
        steps = [
            ("veth support", ["ip", "-n", ns, "link", "add", f"{PREFIX}p0", "type", "veth",
                              "peer", "name", f"{PREFIX}p1"]),
            ("bridge support", ["ip", "-n", ns, "link", "add", f"{PREFIX}pbr", "type", "bridge"]),
            ("tc tbf qdisc", _tbf_argv(ns, f"{PREFIX}p0", 1e6)),
        ]  # fmt: skip
        missing = []
        for what, argv in steps:
            res = _run(argv, check=False)
            if res.returncode != 0:
                missing.append(f"{what} ({res.stderr.strip() or 'failed'})")
        return missing
    finally:
        with _signals_deferred():
            _remove_namespace(ns)
            if fd is not None:
                _release_run_lock(run_id, fd)


def preflight() -> None:
    """Check that a testbed can be built here; raise TestbedError naming everything missing."""
    if os.geteuid() != 0:
        raise TestbedError("testbed needs root (network namespaces and tc); run it as root")
    missing = [
        f"the `{tool}` command (iproute2)" for tool in ("ip", "tc") if not shutil.which(tool)
    ]
    if not missing:
        missing = _probe_kernel()
    if missing:
        raise TestbedError("testbed preflight failed; missing: " + "; ".join(missing))


def cleanup_leftovers() -> list[str]:
    """Remove every namespace (and stray interface) this module created whose run is dead.

    Recognised by the `hsim` name prefix; namespaces of runs whose process still holds its lock
    are left alone. Returns the names removed.
    """
    removed = []
    for ns in _list_namespaces():
        ours = ns.startswith(NS_PREFIX) and not _run_is_live(_run_id_of(ns))
        if ours and _remove_namespace(ns):
            removed.append(ns)
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    for line in out.splitlines():
        parts = line.split(":", 2)
        name = parts[1].strip().split("@", 1)[0] if len(parts) > 2 else ""
        ours = _OWN_LINK_RE.fullmatch(name) is not None
        if ours and _run(["ip", "link", "delete", name], check=False).returncode == 0:
            removed.append(name)
    _remove_stale_locks()
    return removed


def _remove_stale_locks() -> None:
    """Delete lock files of runs that are no longer live."""
    with contextlib.suppress(OSError, TestbedError):
        for path in _lock_dir().glob("*.lock"):
            if _RUN_ID_RE.fullmatch(path.stem) and not _run_is_live(path.stem):
                with contextlib.suppress(OSError):
                    path.unlink()


# ---------------------------------------------------------------------------------------------
# Validation


def _check_name(kind: str, name: object) -> None:
    """Raise TestbedError unless `name` follows the name rule."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise TestbedError(f"bad {kind} name {name!r}: must be {_NAME_RULE}")


def _check_nic(node: str, nic: TestbedNic) -> None:
    """Validate one NIC of node `node`."""
    _check_name("NIC", nic.name)
    _check_name("fabric", nic.fabric)
    if nic.name == "lo":
        raise TestbedError(f"node {node!r}: NIC name 'lo' is reserved for loopback")
    rate = nic.rate_bit_per_s
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate):
        raise TestbedError(f"node {node!r} NIC {nic.name!r}: rate must be a finite number (bit/s)")
    if rate <= 0:
        raise TestbedError(f"node {node!r} NIC {nic.name!r}: rate {rate} bit/s is not positive")


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


def _validate(nodes: Sequence[TestbedNode]) -> list[str]:
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


# ---------------------------------------------------------------------------------------------
# Signals


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM handler: raise SystemExit(143) so `with` blocks unwind and clean up."""
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _signals_deferred(restore: dict[int, Any] | None = None) -> Iterator[None]:
    """Hold off SIGINT and SIGTERM (main thread only); re-deliver them afterwards.

    Afterwards each signal gets back its previous handler, or the one given in `restore`.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    sigs = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, _f: pending.append(signum)) for s in sigs}
    previous.update(restore or {})
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for sig in dict.fromkeys(pending):
            signal.raise_signal(sig)


# ---------------------------------------------------------------------------------------------
# The testbed


class Testbed:
    """An emulated cluster; use as a context manager. Rates are in bit/s."""

    __test__ = False  # not a pytest test class

    def __init__(self, nodes: Sequence[TestbedNode], run_id: str | None = None) -> None:
        nodes = tuple(nodes)
        self._fabrics = _validate(nodes)
        if run_id is None:
            run_id = secrets.token_hex(3)
        if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
            raise TestbedError(f"bad run id {run_id!r}: must be {_RUN_ID_RULE}")
        self.run_id = run_id
        self.nodes = nodes
        self._index = {node.name: i for i, node in enumerate(nodes)}
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._lock_fd: int | None = None
        self._prev_sigterm: Any = None
        self._sigterm_installed = False

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
        if self._lock_fd is None:
            raise TestbedError("testbed is not built; use it inside a `with` block")
        if kwargs.pop("start_new_session", True) is not True or "process_group" in kwargs:
            raise TestbedError("popen always starts a new session; do not override it")
        proc = subprocess.Popen(
            self.exec_prefix(node) + list(argv), start_new_session=True, **kwargs
        )
        self._procs.append(proc)
        return proc

    # -- context manager ----------------------------------------------------------------------

    def __enter__(self) -> Testbed:
        self._install_sigterm()
        try:
            preflight()
            if any(ns.startswith(self.prefix) for ns in _list_namespaces()):
                raise TestbedError(
                    f"namespaces {self.prefix}* already exist; run `holmes-sim validate --cleanup`"
                )
            with _signals_deferred():
                self._lock_fd = _acquire_run_lock(self.run_id)
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
        """Make SIGTERM raise SystemExit while the testbed lives (main thread only)."""
        if threading.current_thread() is threading.main_thread():
            self._prev_sigterm = signal.signal(signal.SIGTERM, _raise_on_sigterm)
            self._sigterm_installed = True

    # -- building -----------------------------------------------------------------------------

    def _add_namespace(self, ns: str) -> None:
        """Create namespace `ns` (recorded first, so a half-made one is still removed)."""
        self._created.append(ns)
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _build(self) -> None:
        """Create the fabric namespace with its bridges, then every node with its NICs."""
        fns = self.fabrics_namespace
        self._add_namespace(fns)
        for j in range(len(self._fabrics)):
            _run(["ip", "-n", fns, "link", "add", f"{PREFIX}br{j}", "type", "bridge"])
            _run(["ip", "-n", fns, "link", "set", f"{PREFIX}br{j}", "up"])
        for i, node in enumerate(self.nodes):
            self._add_namespace(self.namespace(node.name))
            for nic in node.nics:
                self._add_nic(i, node.name, nic)

    def _add_nic(self, i: int, node: str, nic: TestbedNic) -> None:
        """Create NIC `nic` of node number `i`: veth pair, bridge port, address, tbf both ways."""
        ns, fns = self.namespace(node), self.fabrics_namespace
        j = self._fabrics.index(nic.fabric)
        peer = f"{PREFIX}{i}f{j}"
        _run(["ip", "-n", ns, "link", "add", nic.name, "type", "veth",
              "peer", "name", peer, "netns", fns])  # fmt: skip
        _run(["ip", "-n", fns, "link", "set", peer, "master", f"{PREFIX}br{j}"])
        _run(["ip", "-n", ns, "addr", "add", f"{self.address(node, nic.name)}/24", "dev", nic.name])
        _run(_tbf_argv(ns, nic.name, nic.rate_bit_per_s))
        _run(_tbf_argv(fns, peer, nic.rate_bit_per_s))
        _run(["ip", "-n", fns, "link", "set", peer, "up"])
        _run(["ip", "-n", ns, "link", "set", nic.name, "up"])

    # -- teardown -----------------------------------------------------------------------------

    def _teardown(self) -> None:
        """Kill spawned processes, delete namespaces, drop the lock, restore SIGTERM. Idempotent."""
        restore = {signal.SIGTERM: self._prev_sigterm} if self._sigterm_installed else {}
        self._sigterm_installed = False
        with _signals_deferred(restore):
            self._kill_processes()
            for ns in reversed(self._created):
                _remove_namespace(ns)
            self._created.clear()
            if self._lock_fd is not None:
                _release_run_lock(self.run_id, self._lock_fd)
                self._lock_fd = None

    def _kill_processes(self) -> None:
        """SIGTERM each spawned process group, SIGKILL it after a grace period, reap."""
        procs, self._procs = self._procs, []
        for proc in procs:
            _killpg(proc.pid, signal.SIGTERM)  # also when the leader is gone but its group lives
        deadline = time.monotonic() + KILL_GRACE_S
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for proc in procs:
            _killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=KILL_GRACE_S)


def _killpg(pgid: int, sig: int) -> None:
    """Send `sig` to process group `pgid`, ignoring a group that is already gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
