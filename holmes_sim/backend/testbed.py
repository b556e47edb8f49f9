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
* Each NIC is capped to its line rate in both directions (`shaper_lines`: htb, one leaf per
  peer node, so that the flows of a NIC share it max-min as the simulator assumes): the qdisc on
  the node-side veth limits what the node sends (a leaf per destination), the one on the
  bridge-side veth what it receives (a leaf per source). A NIC is thus full duplex at its rate,
  and a node's NICs are independent of each other.
* A fabric may be cut into two segments (e.g. the Ethernet of two clusters), each its own bridge,
  joined by an uplink: a veth pair between the two bridges, shaped on each end, so all traffic
  between the segments shares the uplink's rate in each direction (`TestbedUplink`). The
  segments stay one subnet. At most one uplink per fabric: two would close a bridge loop.

NIC shapers (`shaper_lines`): rate and ceil at the line rate, ``burst = max(16 KiB, rate *
1 ms)`` (`nic_burst_bytes`: 16 KiB at 100 Mbit/s, 250 KB at 2 Gbit/s; a millisecond of rate
lets the qdisc watchdog fire late on a busy machine without losing tokens), leaves of 50 ms of
rate, pure ACKs first. A link of the simulator has a rate and a latency, no bucket; a full
bucket lets its bytes through at memory speed, so the bucket is kept small next to the
testbed's messages (256 KiB): a 256 KiB message after an idle gap crosses a 100 Mbit/s NIC in
21.2 ms, its rate's time (with the 128 KiB buckets used until 2026-12-02c: 11.9-13.9 ms, which
the simulator over-predicted by 6-15% on the pipeline-bound cases). Small buckets showed two
effects of the transport, both fixed where they arose, not in the buckets: gloo's rendezvous
message queued behind data going the other way on one TCP connection (`groups.py`: one
connection per direction), and TCP's restart from its initial window after an idle period
longer than its retransmission timeout (RFC 5681 section 4.1), which made each iteration's first
gradient bucket take 1.3x its rate's time: node namespaces set
``net.ipv4.tcp_slow_start_after_idle = 0`` (their own, per-namespace setting). A 4 MB transfer
runs at about 0.95 of the rate (the Ethernet/IP/TCP headers count: 1448 of 1514 bytes). With
one tbf FIFO per NIC instead (until 2026-12), a flow that also queued at the uplink starved
behind a segment-local flow of the same NIC (6 of 50 Mbit/s while the other ran at line rate),
and two_clusters' iterations were bimodal (0.56-0.84 s).

An uplink end is shaped like a NIC (`shaper_lines`, one leaf per source node of its segment,
so the clusters' flows share it max-min as the simulator's uplink link does) with a smaller
bucket (`uplink_burst_bytes`: ``max(4 KiB, rate * 0.25 ms)``): every leaf and the root have
one, and after an idle gap their buckets together let two flows cross about 5% faster than
the rate (two 256 KiB messages at once: 39-42 ms with 16 KiB buckets, 43-44 ms with 4 KiB,
against 43.8 ms at the rate; one alone 21.2 ms either way). Until 2026-12-02c the uplink was one
tbf FIFO (16 KiB bucket, 10 ms queue): flows through it were served unfairly, the replicas'
pipelines fell in and out of step, and two_clusters' iterations varied by 2-10% (one run of
three missed by 13.9%); with the fair uplink they vary by 0.5-1.5% and agree with the
prediction within 3%. (An htb uplink tried before that, with the NICs' old 128 KiB buckets and
one gloo connection per pair, ran 15-18% slower than predicted: the transport effects above.)

Safety and ownership
--------------------
Names from the caller are checked against a strict pattern and reach ``ip``/``tc`` only as
elements of an argument list (``subprocess.run([...])``, never a shell). Locks and records live
in ``/run/holmes-sim`` (root only, mode 0700, never followed through a symlink). Each run holds
an ``flock`` on ``<runid>.lock`` while it lives and keeps ``<runid>.json``, the record of what it
created (namespaces, interfaces, processes with their start times, temporary folders), written
before each thing is made. `cleanup_leftovers` undoes exactly what the records of dead runs
(e.g. one killed with SIGKILL) list, verifies each removal, and only reports other objects with
matching names. Processes started here die with their parent (``PR_SET_PDEATHSIG``). SIGTERM and
SIGHUP unwind like SIGINT. Teardown kills the processes started with `Testbed.popen` (whole
process group, SIGTERM then SIGKILL) and any other process still inside the namespaces, then
deletes the namespaces, which deletes the veths and bridges in them. It is idempotent and never
raises on missing resources. `measurement_lock` lets one real measurement run on a host at a time.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
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

NIC_MIN_BURST_BYTES = 16 * 1024
NIC_BURST_S = 1e-3
UPLINK_MIN_BURST_BYTES = 4 * 1024
UPLINK_BURST_S = 0.25e-3
SHAPER_LATENCY_S = 50e-3
"""Queue of each shaper leaf, in seconds of its link's rate: deep enough that two senders
converging on one leaf's share do not overflow it (10 ms dropped packets on the uplink)."""
HTB_QUANTUM_BYTES = 65536
"""DRR quantum of every leaf: one GSO super-packet on veth, so each round serves a peer once."""
_LEAF_BASE = 0x10
"""Minor class id of a shaper's default leaf; the peers' leaves follow."""

MAX_RATE_BIT_PER_S = 1e12
"""Fastest NIC the testbed shapes (its bucket, 1 ms of line rate, must fit in 32 bits)."""
IFNAME_MAX = 15
"""Longest Linux interface name (IFNAMSIZ - 1 bytes)."""
RUN_DIR = Path("/run/holmes-sim")
"""Root-only directory of run locks, run records and the measurement lock."""
TEMP_PREFIXES = ("holmes-probe-", "holmes-run-")
"""Prefixes of the temporary folders runs create (and record)."""

KILL_GRACE_S = 2.0
COMMAND_TIMEOUT_S = 30.0

_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,14}")
_NAME_RULE = "1-15 characters: a letter, then letters, digits, '-' or '_'"
_RUN_ID_RE = re.compile(r"[a-z0-9]{1,8}")
_RUN_ID_RULE = "1-8 characters: lowercase letters or digits"
_OWN_LINK_RE = re.compile(rf"{PREFIX}(\d+f\d+|br\d+(s\d+)?|up\d+[ab]|p[01]|pbr)")
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here, not in a child between fork and exec
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


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


def die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when its parent (thread) dies (Linux PR_SET_PDEATHSIG)."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def process_start(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (/proc/PID/stat field 22), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return int(fh.read().rsplit(")", 1)[-1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


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


# ---------------------------------------------------------------------------------------------
# Commands


def _run(argv: Sequence[str], check: bool = True,
         stdin_text: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run one command (argument list, no shell; `stdin_text` fed to it); raise TestbedError
    on failure if `check`."""
    try:
        proc = subprocess.run(
            list(argv), check=False, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
            input=stdin_text,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        if check:
            raise TestbedError(f"`{' '.join(argv)}` failed: {exc}") from exc
        return subprocess.CompletedProcess(list(argv), 1, "", str(exc))
    if check and proc.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def nic_burst_bytes(rate_bit_per_s: float) -> int:
    """A NIC shaper's bucket in bytes for a line rate in bit/s: max(16 KiB, 1 ms of line rate)
    (module docstring)."""
    return max(NIC_MIN_BURST_BYTES, math.ceil(rate_bit_per_s / 8 * NIC_BURST_S))


def uplink_burst_bytes(rate_bit_per_s: float) -> int:
    """An uplink shaper's bucket in bytes: max(4 KiB, 0.25 ms of its rate) (module docstring)."""
    return max(UPLINK_MIN_BURST_BYTES, math.ceil(rate_bit_per_s / 8 * UPLINK_BURST_S))


def shaper_lines(dev: str, rate_bit_per_s: float, burst: int, match: str,
                 peers: Sequence[str], latency_s: float = SHAPER_LATENCY_S) -> list[str]:
    """`tc -batch` lines that cap egress of `dev` at `rate_bit_per_s` and share it fairly
    between `peers` (IPv4 addresses, matched as ``ip <match>``, "dst" or "src").

    An htb root class at the rate; one leaf per peer (guaranteed rate / leaves, may borrow up
    to the rate, equal DRR quanta) plus a default leaf, each a byte FIFO of
    ``rate * latency + burst``; and a first-served leaf for packets under 128 bytes (TCP's pure
    ACKs), so that the ACKs of a flow do not wait behind data going the other way. Backlogged
    peers thus get equal shares, as flows do on a NIC that arbitrates between connections
    (max-min); one FIFO let TCP's RTT unfairness starve a flow that crosses a second bottleneck
    (measured: 6 of 50 Mbit/s)."""
    if match not in ("dst", "src"):
        raise ValueError(f"match must be 'dst' or 'src', not {match!r}")
    rate = max(1, round(rate_bit_per_s))
    leaves = len(peers) + 2
    share = max(1, rate // leaves)
    limit = math.ceil(rate / 8 * latency_s) + burst
    bucket = f"burst {burst} cburst {burst} quantum {HTB_QUANTUM_BYTES}"
    lines = [f"qdisc add dev {dev} root handle 1: htb default {_LEAF_BASE:x}",
             f"class add dev {dev} parent 1: classid 1:1 htb rate {rate}bit ceil {rate}bit {bucket}",
             f"class add dev {dev} parent 1:1 classid 1:2 htb rate {share}bit ceil {rate}bit "
             f"prio 0 {bucket}",
             f"qdisc add dev {dev} parent 1:2 bfifo limit {limit}",
             # IPv4 total length (bytes 2-3) below 128: an ACK or another small control packet.
             f"filter add dev {dev} parent 1: protocol ip prio 1 u32 match u16 0 0xff80 at 2 "
             "flowid 1:2"]
    for k, peer in enumerate([None, *peers]):
        leaf = f"1:{_LEAF_BASE + k:x}"
        lines += [f"class add dev {dev} parent 1:1 classid {leaf} htb rate {share}bit "
                  f"ceil {rate}bit prio 1 {bucket}",
                  f"qdisc add dev {dev} parent {leaf} bfifo limit {limit}"]
        if peer is not None:
            lines.append(f"filter add dev {dev} parent 1: protocol ip prio 2 u32 "
                         f"match ip {match} {peer}/32 flowid {leaf}")
    return lines


def _apply_tc(ns: str, lines: Sequence[str]) -> None:
    """Run `lines` as one `tc -batch` in namespace `ns`; raise TestbedError naming the line that
    failed."""
    res = _run(["tc", "-n", ns, "-batch", "-"], check=False, stdin_text="\n".join(lines) + "\n")
    if res.returncode != 0:
        failed = re.search(r"Command failed -:(\d+)", res.stderr)
        line = lines[int(failed.group(1)) - 1] if failed and int(failed.group(1)) <= len(lines) \
            else "(unknown line)"
        raise TestbedError(f"`tc -n {ns} {line}` failed: {res.stderr.strip() or res.returncode}")


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
# The run directory, run locks and run records


def run_dir() -> Path:
    """/run/holmes-sim, made root-only (0700); TestbedError unless it is a real directory of root's."""
    if os.geteuid() != 0:
        raise TestbedError(f"testbed needs root (network namespaces, tc and its records in "
                           f"{RUN_DIR}); run it as root")
    try:
        os.mkdir(RUN_DIR, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise TestbedError(f"cannot create {RUN_DIR}: {exc.strerror}") from None
    info = os.lstat(RUN_DIR)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0:
        raise TestbedError(f"{RUN_DIR} is not a directory owned by root (a symlink?); remove it")
    if info.st_mode & 0o077:
        os.chmod(RUN_DIR, 0o700, follow_symlinks=False)  # made 0755 by an older version
    return RUN_DIR


def _open_record_file(name: str, flags: int, mode: int = 0o600) -> int:
    """Open `name` inside the run directory, never through a symlink."""
    return os.open(run_dir() / name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def _acquire_run_lock(run_id: str) -> int:
    """Lock run `run_id` for this process; return the lock's fd. TestbedError if it is taken."""
    fd = _open_record_file(f"{run_id}.lock", os.O_RDWR | os.O_CREAT)
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
    with contextlib.suppress(OSError, TestbedError):
        (run_dir() / f"{run_id}.lock").unlink()
    with contextlib.suppress(OSError):
        os.close(fd)


def _run_is_live(run_id: str) -> bool:
    """Whether a live process holds the lock of run `run_id`."""
    try:
        fd = _open_record_file(f"{run_id}.lock", os.O_RDONLY)
    except (OSError, TestbedError):
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


@dataclass
class RunRecord:
    """What one run created, saved to `<runid>.json` before each thing is made."""

    run_id: str
    namespaces: list[str] = field(default_factory=list)
    interfaces: list[list[str]] = field(default_factory=list)
    """[namespace, interface] pairs."""
    processes: list[dict[str, int]] = field(default_factory=list)
    """{"pid", "start"}: start is the clock-tick start time, so a reused pid is not mistaken."""
    temp_dirs: list[str] = field(default_factory=list)

    def add(self, kind: str, item: Any) -> None:
        """Append `item` to list `kind` and save the record."""
        getattr(self, kind).append(item)
        self.save()

    def save(self) -> None:
        """Write the record atomically (temporary file, then rename)."""
        doc = {"run_id": self.run_id, "pid": os.getpid(), "namespaces": self.namespaces,
               "interfaces": self.interfaces, "processes": self.processes,
               "temp_dirs": self.temp_dirs}
        tmp = f"{self.run_id}.json.tmp"
        fd = _open_record_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh)
        os.replace(run_dir() / tmp, run_dir() / f"{self.run_id}.json")

    def delete(self) -> None:
        """Remove the saved record, and its temporary file when a signal arrived mid-save."""
        for name in (f"{self.run_id}.json", f"{self.run_id}.json.tmp"):
            with contextlib.suppress(OSError, TestbedError):
                (run_dir() / name).unlink()

    @classmethod
    def load(cls, path: Path) -> RunRecord | None:
        """The record at `path`, or None when it is not a well-formed record."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd) as fh:
                doc = json.loads(fh.read(1 << 20))
            record = cls(doc["run_id"], [str(n) for n in doc["namespaces"]],
                         [[str(a), str(b)] for a, b in doc["interfaces"]],
                         [{"pid": int(p["pid"]), "start": int(p["start"])} for p in doc["processes"]],
                         [str(t) for t in doc["temp_dirs"]])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return record if _RUN_ID_RE.fullmatch(str(record.run_id)) else None


def _records() -> list[RunRecord]:
    """Every well-formed run record in the run directory."""
    paths = sorted(run_dir().glob("*.json"))
    return [r for r in map(RunRecord.load, paths) if r is not None]


@contextlib.contextmanager
def measurement_lock(what: str) -> Iterator[None]:
    """Hold the host-wide lock of real measurements (two at once corrupt each other's timings).

    Raises:
        TestbedError: at once, naming the PID and start time of the measurement that holds it.
    """
    fd = _open_record_file("measurement.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "unknown process"
        os.close(fd)
        raise TestbedError(f"another measurement is running on this host ({holder}); two at once "
                           "corrupt each other's timings: wait for it to finish") from None
    try:
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"PID {os.getpid()}, started {started}: {what}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Preflight and leftovers


def _probe_kernel() -> list[str]:
    """Create a probe namespace with a veth pair, a bridge and an htb shaper; list what failed."""
    run_id = secrets.token_hex(4)
    ns = f"{NS_PREFIX}{run_id}-probe"
    record = RunRecord(run_id)
    fd = None
    try:
        with _signals_deferred():
            fd = _acquire_run_lock(run_id)
            record.add("namespaces", ns)
        if _run(["ip", "netns", "add", ns], check=False).returncode != 0:
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
            res = _run(argv, check=False, stdin_text=htb if "-batch" in argv else None)
            if res.returncode != 0:
                missing.append(f"{what} ({res.stderr.strip() or 'failed'})")
        return missing
    finally:
        with _signals_deferred():
            if not _remove_namespace(ns) or ns not in _list_namespaces():
                record.delete()
            if fd is not None:
                _release_run_lock(run_id, fd)


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


@dataclass
class Cleanup:
    """What `cleanup_leftovers` did: removed, left alone (not ours), and could not remove."""

    removed: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def cleanup_leftovers() -> Cleanup:
    """Undo what the records of dead runs list; report, but never touch, anything else.

    Namespaces, interfaces, processes (matched by pid and start time) and temporary folders of
    runs whose process still holds its lock are left alone. Each removal is verified; what could
    not be removed stays in its record and in `failed`.

    Raises:
        TestbedError: not root (the records and namespaces need it).
    """
    if os.geteuid() != 0:
        raise TestbedError("--cleanup needs root (network namespaces and the records in "
                           f"{RUN_DIR}); nothing was removed")
    report = Cleanup()
    known_ns: set[str] = set()
    known_tmp: set[str] = set()
    for record in _records():
        known_ns.update(record.namespaces)
        known_tmp.update(record.temp_dirs)
        if not _run_is_live(record.run_id):
            _undo(record, report)
    _report_foreign(known_ns, known_tmp, report)
    _remove_stale_locks()
    return report


def _undo(record: RunRecord, report: Cleanup) -> None:
    """Remove what `record` lists, verifying each; drop the record when all is gone."""
    failed_before = len(report.failed)
    for proc in record.processes:
        if process_start(proc["pid"]) == proc["start"]:
            _kill_verified(proc["pid"], report)
    present = set(_list_namespaces())
    for ns in reversed(record.namespaces):
        if ns not in present:
            continue
        _remove_namespace(ns)
        if ns in _list_namespaces():
            report.failed.append(f"namespace {ns}")
        else:
            report.removed.append(ns)
    for path in record.temp_dirs:
        _remove_temp_dir(Path(path), report)
    if len(report.failed) == failed_before:
        record.delete()


def _kill_verified(pid: int, report: Cleanup) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + KILL_GRACE_S
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    (report.failed if _pid_alive(pid) else report.removed).append(f"process {pid}")


def _remove_temp_dir(path: Path, report: Cleanup) -> None:
    """Remove a recorded temporary folder: only a real directory named like ours."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode) or not path.name.startswith(TEMP_PREFIXES):
        report.foreign.append(f"{path} (recorded, but not one of our folders)")
        return
    shutil.rmtree(path, ignore_errors=True)
    (report.failed if os.path.lexists(path) else report.removed).append(str(path))


def _report_foreign(known_ns: set[str], known_tmp: set[str], report: Cleanup) -> None:
    """Note objects named like ours that no record lists (left untouched)."""
    for ns in _list_namespaces():
        if ns.startswith(NS_PREFIX) and ns not in known_ns:
            report.foreign.append(f"namespace {ns}")
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    for line in out.splitlines():
        parts = line.split(":", 2)
        name = parts[1].strip().split("@", 1)[0] if len(parts) > 2 else ""
        if name.startswith(PREFIX):
            report.foreign.append(f"interface {name}")
    for prefix in TEMP_PREFIXES:
        for path in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
            if str(path) not in known_tmp:
                report.foreign.append(str(path))


def _remove_stale_locks() -> None:
    """Delete lock files of runs that are no longer live and have no record left."""
    with contextlib.suppress(OSError, TestbedError):
        for path in run_dir().glob("*.lock"):
            stale = _RUN_ID_RE.fullmatch(path.stem) and not _run_is_live(path.stem)
            if stale and not (path.parent / f"{path.stem}.json").exists():
                with contextlib.suppress(OSError):
                    path.unlink()


# ---------------------------------------------------------------------------------------------
# Validation


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


def _validate_segments(nodes: Sequence[TestbedNode], fabrics: list[str],
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
    """SIGTERM/SIGHUP handler: raise SystemExit(128 + signum) so `with` blocks unwind and clean up."""
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _signals_deferred(restore: dict[int, Any] | None = None) -> Iterator[None]:
    """Hold off SIGINT, SIGTERM and SIGHUP (main thread only); re-deliver them afterwards.

    Afterwards each signal gets back its previous handler, or the one given in `restore`.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _f: pending.append(signum)) for s in _SIGNALS}
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

    def __init__(self, nodes: Sequence[TestbedNode], run_id: str | None = None,
                 uplinks: Sequence[TestbedUplink] = ()) -> None:
        nodes = tuple(nodes)
        self._fabrics = _validate(nodes)
        self.uplinks = tuple(uplinks)
        self._segments = _validate_segments(nodes, self._fabrics, self.uplinks)
        if run_id is None:
            run_id = secrets.token_hex(3)
        if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
            raise TestbedError(f"bad run id {run_id!r}: must be {_RUN_ID_RULE}")
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
        with _signals_deferred():
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
        with _signals_deferred():
            path = Path(tempfile.mkdtemp(prefix=prefix))
            self._temp_dirs.append(path)
            self._record.add("temp_dirs", str(path))
        return path

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
        """Make SIGTERM and SIGHUP raise SystemExit while the testbed lives (main thread only)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._prev_handlers[sig] = signal.signal(sig, _raise_on_sigterm)

    # -- building -----------------------------------------------------------------------------

    def _add_namespace(self, ns: str) -> None:
        """Create namespace `ns` (recorded first, so a half-made one is still removed)."""
        self._created.append(ns)
        self._record.add("namespaces", ns)
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _build(self) -> None:
        """Create the fabric namespace with its bridges, then every node with its NICs."""
        fns = self.fabrics_namespace
        self._add_namespace(fns)
        for j in range(len(self._fabrics)):
            for k in range(len(self._segments[j])):
                self._record.add("interfaces", [fns, bridge_name(j, k)])
                _run(["ip", "-n", fns, "link", "add", bridge_name(j, k), "type", "bridge"])
                _run(["ip", "-n", fns, "link", "set", bridge_name(j, k), "up"])
        for up in self.uplinks:
            self._add_uplink(up)
        for i, node in enumerate(self.nodes):
            ns = self.namespace(node.name)
            self._add_namespace(ns)
            # A NIC link has no congestion window: no restart from TCP's initial window after
            # an idle gap (module docstring). Per namespace; the host's setting is untouched.
            _run(["ip", "netns", "exec", ns, "sysctl", "-qw",
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
        _run(["ip", "-n", ns, "link", "add", nic.name, "type", "veth",
              "peer", "name", peer, "netns", fns])  # fmt: skip
        bridge = bridge_name(j, self._segments[j].index(nic.segment))
        _run(["ip", "-n", fns, "link", "set", peer, "master", bridge])
        _run(["ip", "-n", ns, "addr", "add", f"{self.address(node, nic.name)}/24", "dev", nic.name])
        peers = self._fabric_peers(j, exclude=node)
        burst = nic_burst_bytes(nic.rate_bit_per_s)
        _apply_tc(ns, shaper_lines(nic.name, nic.rate_bit_per_s, burst, "dst", peers))
        _apply_tc(fns, shaper_lines(peer, nic.rate_bit_per_s, burst, "src", peers))
        _run(["ip", "-n", fns, "link", "set", peer, "up"])
        _run(["ip", "-n", ns, "link", "set", nic.name, "up"])

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
        _run(["ip", "-n", fns, "link", "add", ends[0], "type", "veth", "peer", "name", ends[1]])
        for end, segment in zip(ends, up.segments, strict=True):
            _run(["ip", "-n", fns, "link", "set", end, "master",
                  bridge_name(j, self._segments[j].index(segment))])
            sources = [a for a, seg in self._fabric_members(j) if seg == segment]
            _apply_tc(fns, shaper_lines(end, up.rate_bit_per_s,
                                        uplink_burst_bytes(up.rate_bit_per_s), "src", sources))
            _run(["ip", "-n", fns, "link", "set", end, "up"])

    # -- teardown -----------------------------------------------------------------------------

    def _teardown(self) -> None:
        """Kill spawned processes, delete namespaces and temp folders, drop the record (when all
        is gone) and the lock, restore SIGTERM and SIGHUP. Idempotent."""
        restore, self._prev_handlers = self._prev_handlers, {}
        with _signals_deferred(restore):
            self._kill_processes()
            for ns in reversed(self._created):
                _remove_namespace(ns)
            for path in self._temp_dirs:
                shutil.rmtree(path, ignore_errors=True)
            left = set(self._created) & set(_list_namespaces())
            left |= {str(p) for p in self._temp_dirs if os.path.lexists(p)}
            self._created.clear()
            self._temp_dirs.clear()
            if self._lock_fd is not None:
                if left:
                    log.warning("could not remove %s; `holmes-sim validate --cleanup` retries",
                                ", ".join(sorted(left)))
                else:
                    self._record.delete()
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
