"""Tests of the namespace/veth/bridge/htb testbed.

Tests marked `root` build real namespaces and are skipped unless run as root with `ip` and `tc`.
Rates are kept small (tens to hundreds of Mbit/s) so the transfers take well under a second.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from holmes_sim.backend import preflight as preflight_mod
from holmes_sim.backend import records, shaping
from holmes_sim.backend import testbed as tbmod
from holmes_sim.backend.preflight import preflight
from holmes_sim.backend.records import cleanup_leftovers
from holmes_sim.backend.testbed import Testbed
from holmes_sim.backend.topology import TestbedNic, TestbedNode, TestbedUplink, run_id_of
from holmes_sim.errors import TestbedError

REPO = Path(__file__).resolve().parents[2]
FAST = 200e6  # bit/s
SLOW = 50e6  # bit/s
CAN_BUILD = os.geteuid() == 0 and bool(shutil.which("ip")) and bool(shutil.which("tc"))

RECEIVER = r"""
import socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2])))
srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept()
want, got = int(sys.argv[3]), 0
while got < want:
    chunk = conn.recv(1 << 20)
    if not chunk:
        break
    got += len(chunk)
conn.sendall(b"k" if got == want else b"x")
conn.close()
"""

SENDER = r"""
import socket, sys, time
src, dst, port, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
conn = socket.create_connection((dst, port), source_address=(src, 0))
time.sleep(max(0.0, float(sys.argv[5]) - time.time()))  # common start time of all senders
block = b"x" * (1 << 20)
start = time.perf_counter()
left = size
while left > 0:
    conn.sendall(block[: min(left, len(block))])
    left -= min(left, len(block))
assert conn.recv(1) == b"k", "receiver did not get every byte"
print(size * 8 / (time.perf_counter() - start))
"""

# A child that builds a testbed, starts a long sleep in n0, reports and waits to be signalled.
CHILD = r"""
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from holmes_sim.backend.testbed import Testbed
from holmes_sim.backend.topology import TestbedNic, TestbedNode
nodes = [TestbedNode(n, (TestbedNic("eth0", "eth", 1e8),)) for n in ("n0", "n1")]
with Testbed(nodes) as tb:
    sleeper = tb.popen("n0", ["sleep", "300"])
    print(tb.run_id, sleeper.pid, flush=True)
    time.sleep(60)
"""


DECOY_NS = "hsim-decoy9-n0"
DECOY_LINK = "hsim99f99"
"""Objects named like the testbed's that no run created: --cleanup must leave them alone."""


@contextlib.contextmanager
def decoys():
    """A namespace and a host veth pair named like ours, removed afterwards."""
    subprocess.run(["ip", "netns", "add", DECOY_NS], check=True)
    try:
        subprocess.run(["ip", "link", "add", DECOY_LINK, "type", "veth", "peer", "name",
                        "hsim99f98"], check=True)
        yield
    finally:
        subprocess.run(["ip", "link", "delete", DECOY_LINK], capture_output=True)
        subprocess.run(["ip", "netns", "delete", DECOY_NS], capture_output=True)


def exists(kind: str, name: str) -> bool:
    """Whether namespace or host link `name` exists."""
    argv = ["ip", "netns", "list"] if kind == "ns" else ["ip", "-o", "link", "show"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return any(name in line.split() or f"{name}@" in line for line in out.splitlines())


def two_nodes() -> list[TestbedNode]:
    """Two nodes, each with a fast and a slow NIC on fabrics "fast" and "slow"."""
    nics = (TestbedNic("fast0", "fast", FAST), TestbedNic("slow0", "slow", SLOW))
    return [TestbedNode("n0", nics), TestbedNode("n1", nics)]


def leftovers(run_id: str) -> list[str]:
    """Namespaces of run `run_id` (the testbed makes no host interface: its veths are created
    inside its namespaces, so they go with them)."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    names = [line.split()[0] for line in netns.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"hsim-{run_id}-")]


def all_hsim_namespaces() -> set[str]:
    """Every namespace whose name has the module's prefix."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.startswith("hsim-")}


def stray_namespaces(before: set[str]) -> set[str]:
    """hsim namespaces made since `before` whose run is over (a live run elsewhere is fine)."""
    new = all_hsim_namespaces() - before
    return {ns for ns in new if not records.run_is_live(run_id_of(ns))}


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def wait_dead(pid: int, timeout_s: float = 5.0) -> bool:
    """Wait until `pid` is gone; True if it went."""
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def transfer_rate(
    tb: Testbed, src: str, dst: str, nic: str, size: int, port: int = 5001, at: float = 0.0
) -> subprocess.Popen:
    """Start a TCP transfer of `size` bytes from `src` to `dst` over `nic`; return the sender.

    The sender connects, then waits until time.time() reaches `at` before sending.
    """
    rx = tb.popen(
        dst,
        [sys.executable, "-c", RECEIVER, tb.address(dst, nic), str(port), str(size)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
    argv = [sys.executable, "-c", SENDER, tb.address(src, nic), tb.address(dst, nic)]
    argv += [str(port), str(size), str(at)]
    return tb.popen(src, argv, stdout=subprocess.PIPE, text=True)


def measured(sender: subprocess.Popen) -> float:
    """The rate in bit/s a sender started by `transfer_rate` reports."""
    out, _ = sender.communicate(timeout=30)
    assert sender.returncode == 0
    return float(out)


def start_child() -> tuple[subprocess.Popen, str, int]:
    """Start CHILD; return it, its run id and the pid of the sleep it started in n0."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    assert child.stdout is not None and child.stderr is not None
    line = child.stdout.readline().split()
    if len(line) != 2:
        child.kill()
        pytest.fail(f"child did not start its testbed: {child.stderr.read()}")
    return child, line[0], int(line[1])


# ---------------------------------------------------------------------------------------------
# Validation and naming (no root needed)


@pytest.mark.parametrize(
    ("nodes", "needle"),
    [
        ([TestbedNode("n0;rm -rf", (TestbedNic("e0", "eth", 1e9),))], "'n0;rm -rf'"),
        ([TestbedNode("n" * 40, (TestbedNic("e0", "eth", 1e9),))], "n" * 40),
        ([TestbedNode("n0", (TestbedNic("e0\n", "eth", 1e9),))], "'e0\\n'"),
        ([TestbedNode("n0", (TestbedNic("e0", "../x", 1e9),))], "'../x'"),
        ([TestbedNode("-n0", (TestbedNic("e0", "eth", 1e9),))], "'-n0'"),
    ],
)
def test_bad_names_are_refused_with_the_rule(nodes: list[TestbedNode], needle: str) -> None:
    with pytest.raises(TestbedError) as err:
        Testbed(nodes)
    assert needle in str(err.value)
    assert "letter" in str(err.value)  # the rule is stated


@pytest.mark.parametrize(
    ("nodes", "needle"),
    [
        ([], "at least one node"),
        ([TestbedNode("n0", (TestbedNic("e0", "eth", 1e9),))] * 2, "repeats"),
        ([TestbedNode("n0", (TestbedNic("e0", "eth", 0.0),))], "outside"),
        ([TestbedNode("n0", (TestbedNic("e0", "eth", -5.0),))], "outside"),
        ([TestbedNode("n0", (TestbedNic("e0", "eth", float("nan")),))], "finite"),
        ([TestbedNode("n0", (TestbedNic("e0", "a", 1e9), TestbedNic("e0", "b", 1e9)))], "repeats"),
        ([TestbedNode("n0", (TestbedNic("e0", "a", 1e9), TestbedNic("e1", "a", 1e9)))], "fabric"),
        ([TestbedNode("n0", (TestbedNic("lo", "a", 1e9),))], "loopback"),
        ([TestbedNode("n0", ())], "no NICs"),
    ],
)
def test_bad_node_lists_are_refused(nodes: list[TestbedNode], needle: str) -> None:
    with pytest.raises(TestbedError, match=needle):
        Testbed(nodes)


def test_bad_run_id_is_refused() -> None:
    with pytest.raises(TestbedError, match="run id"):
        Testbed(two_nodes(), run_id="Bad-Id")


def test_names_and_addresses() -> None:
    tb = Testbed(two_nodes(), run_id="abc123")
    assert tb.namespace("n1") == "hsim-abc123-n1"
    assert tb.exec_prefix("n0") == ["ip", "netns", "exec", "hsim-abc123-n0"]
    assert tb.address("n0", "fast0") == "10.200.0.1"
    assert tb.address("n1", "slow0") == "10.200.1.2"
    with pytest.raises(TestbedError, match="no NIC"):
        tb.address("n0", "ib0")
    with pytest.raises(TestbedError, match="no node"):
        tb.namespace("n9")
    with pytest.raises(TestbedError, match="not built"):
        tb.popen("n0", ["true"])


def test_nic_burst_is_small_and_scales_with_rate() -> None:
    assert shaping.nic_burst_bytes(100e6) == 16 * 1024  # 1 ms would be 12.5 KB
    assert shaping.nic_burst_bytes(2e9) == 250_000  # 1 ms at 2 Gbit/s
    # An uplink's is smaller: two flows sharing it get its rate, not a burst.
    assert shaping.uplink_burst_bytes(1e8) == 4 * 1024
    assert shaping.uplink_burst_bytes(1e9) == 31_250  # 0.25 ms at 1 Gbit/s


def test_preflight_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight_mod.os, "geteuid", lambda: 1000)
    with pytest.raises(TestbedError, match="root"):
        preflight()
    monkeypatch.setattr(preflight_mod.os, "geteuid", lambda: 0)
    monkeypatch.setattr(preflight_mod.shutil, "which", lambda tool: None)
    with pytest.raises(TestbedError, match=r"`ip`.*`tc`"):
        preflight()


# ---------------------------------------------------------------------------------------------
# Real testbeds (root)


@pytest.mark.root
@pytest.mark.skipif(not CAN_BUILD, reason="needs root with `ip` and `tc`")
def test_preflight_passes_and_leaves_no_probe() -> None:
    before = all_hsim_namespaces()
    preflight()
    assert stray_namespaces(before) == set()


@pytest.mark.root
@pytest.mark.skipif(not CAN_BUILD, reason="needs root with `ip` and `tc`")
def test_each_fabric_runs_at_its_rate_and_nothing_is_left() -> None:
    with Testbed(two_nodes()) as tb:
        run_id = tb.run_id
        assert len(leftovers(run_id)) == 3  # two nodes and the fabric namespace
        fast = measured(transfer_rate(tb, "n0", "n1", "fast0", 10_000_000))
        slow = measured(transfer_rate(tb, "n0", "n1", "slow0", 4_000_000))
        sleeper = tb.popen("n1", ["sleep", "300"])
    print(f"fast {fast / 1e6:.1f} of {FAST / 1e6:.0f} Mbit/s; slow {slow / 1e6:.1f} of 50")
    # Goodput sits ~4 % under the cap (the shaper counts Ethernet/IP/TCP headers); the full
    # buckets at the start add at most a few ms of rate, 1-3 % on these sizes.
    assert 0.85 * FAST <= fast <= 1.03 * FAST
    assert 0.85 * SLOW <= slow <= 1.03 * SLOW
    assert 3.4 <= fast / slow <= 4.6
    assert leftovers(run_id) == []
    assert wait_dead(sleeper.pid), "process started with popen survived the testbed"
    assert not (records.run_dir() / f"{run_id}.lock").exists()


def two_segments() -> tuple[list[TestbedNode], list[TestbedUplink]]:
    """n0, n1 on segment "a" and n2 on "b" of fabric "eth" (NICs at FAST), uplink at SLOW."""
    nodes = [TestbedNode(f"n{i}", (TestbedNic("eth0", "eth", FAST, seg),))
             for i, seg in enumerate("aab")]
    return nodes, [TestbedUplink("eth", ("a", "b"), SLOW)]


@pytest.mark.parametrize(("uplinks", "needle"), [
    ([], "no uplink"),
    ([TestbedUplink("eth", ("a", "a"), SLOW)], "joins"),
    ([TestbedUplink("ib", ("a", "b"), SLOW)], "no NIC uses"),
    ([TestbedUplink("eth", ("a", "b"), SLOW)] * 2, "two uplinks"),
])
def test_bad_uplinks_are_refused(uplinks: list[TestbedUplink], needle: str) -> None:
    nodes, _ = two_segments()
    with pytest.raises(TestbedError, match=needle):
        Testbed(nodes, uplinks=uplinks)


@pytest.mark.root
@pytest.mark.skipif(not CAN_BUILD, reason="needs root with `ip` and `tc`")
def test_uplink_joins_two_segments_at_its_rate_and_nothing_is_left() -> None:
    nodes, uplinks = two_segments()
    with Testbed(nodes, uplinks=uplinks) as tb:
        run_id = tb.run_id
        across = measured(transfer_rate(tb, "n0", "n2", "eth0", 4_000_000))
        inside = measured(transfer_rate(tb, "n0", "n1", "eth0", 8_000_000, port=5002))
    print(f"across the uplink {across / 1e6:.1f} Mbit/s, inside a segment {inside / 1e6:.1f}")
    assert across <= 1.05 * SLOW  # the uplink caps it, whatever the NICs could do
    assert inside >= 2 * across  # a segment's own traffic does not cross it
    assert leftovers(run_id) == []


@pytest.mark.root
@pytest.mark.skipif(not CAN_BUILD, reason="needs root with `ip` and `tc`")
def test_flows_share_a_nic_fairly() -> None:
    # n0 sends inside its segment (to n1) and across the uplink (to n2), NICs and uplink at
    # SLOW: n0's NIC is the bottleneck of both, so max-min sharing gives each half of SLOW.
    # With one FIFO per NIC the flow that also queues at the uplink lost (measured: 6 of 50).
    nodes = [TestbedNode(f"n{i}", (TestbedNic("eth0", "eth", SLOW, seg),))
             for i, seg in enumerate("aab")]
    with Testbed(nodes, uplinks=[TestbedUplink("eth", ("a", "b"), SLOW)]) as tb:
        at = time.time() + 0.5
        flows = [("n0", "n1"), ("n0", "n2")]
        senders = [transfer_rate(tb, src, dst, "eth0", 2_500_000, port=5001 + k, at=at)
                   for k, (src, dst) in enumerate(flows)]
        rates = [measured(s) for s in senders]
    print(f"two flows sharing a NIC: {[round(r / 1e6, 1) for r in rates]} Mbit/s")
    assert all(0.35 * SLOW <= r <= 0.65 * SLOW for r in rates)


@pytest.mark.root
@pytest.mark.skipif(not CAN_BUILD, reason="needs root with `ip` and `tc`")
def test_nic_is_full_duplex() -> None:
    with Testbed(two_nodes()) as tb:
        at = time.time() + 0.5
        ahead = transfer_rate(tb, "n0", "n1", "slow0", 3_000_000, port=5001, at=at)
        back = transfer_rate(tb, "n1", "n0", "slow0", 3_000_000, port=5002, at=at)
        rates = [measured(ahead), measured(back)]
    print(f"slow NIC both ways at once: {[round(r / 1e6, 1) for r in rates]} Mbit/s")
    # Each direction gets close to the line rate (the ACKs of one share the queue with the
    # data of the other); a half-duplex link would give about half of it each.
    assert all(0.7 * SLOW <= r <= 1.05 * SLOW for r in rates)
    assert sum(rates) >= 1.5 * SLOW


@pytest.mark.root
@pytest.mark.skipif(not CAN_BUILD, reason="needs root with `ip` and `tc`")
def test_exception_inside_with_cleans_up() -> None:
    with pytest.raises(RuntimeError, match="boom"), Testbed(two_nodes()) as tb:
        run_id = tb.run_id
        sleeper = tb.popen("n0", ["sleep", "300"])
        assert leftovers(run_id)
        raise RuntimeError("boom")
    assert leftovers(run_id) == []
    assert wait_dead(sleeper.pid)


@pytest.mark.root
@pytest.mark.skipif(not CAN_BUILD, reason="needs root with `ip` and `tc`")
def test_failure_while_building_removes_what_was_built(monkeypatch: pytest.MonkeyPatch) -> None:
    real = shaping.shaper_lines

    def broken(dev: str, *args: Any, **kwargs: Any) -> list[str]:
        lines = real(dev, *args, **kwargs)
        return lines if dev != "slow0" else [*lines, f"qdisc add dev {dev} nonsense"]

    monkeypatch.setattr(tbmod, "shaper_lines", broken)
    tb = Testbed(two_nodes())
    with pytest.raises(TestbedError, match="nonsense"), tb:
        pass
    assert leftovers(tb.run_id) == []
    assert signal.getsignal(signal.SIGTERM) is not tbmod._raise_on_sigterm


@pytest.mark.root
@pytest.mark.skipif(not CAN_BUILD, reason="needs root with `ip` and `tc`")
def test_bad_names_create_nothing() -> None:
    before = all_hsim_namespaces()
    for name in ("n0;rm -rf", "x" * 40):
        with pytest.raises(TestbedError):  # raised by the constructor, before __enter__
            Testbed([TestbedNode(name, (TestbedNic("e0", "eth", 1e8),))]).__enter__()
    assert stray_namespaces(before) == set()


@pytest.mark.root
@pytest.mark.skipif(not CAN_BUILD, reason="needs root with `ip` and `tc`")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_inside_testbed_cleans_up(sig: signal.Signals) -> None:
    child, run_id, sleeper = start_child()
    try:
        assert len(leftovers(run_id)) == 3
        child.send_signal(sig)
        rc = child.wait(timeout=20)
    finally:
        child.kill()
    assert rc == (143 if sig == signal.SIGTERM else -signal.SIGINT), rc
    assert leftovers(run_id) == []
    assert wait_dead(sleeper)


@pytest.mark.root
@pytest.mark.skipif(not CAN_BUILD, reason="needs root with `ip` and `tc`")
def test_cleanup_after_sigkill_removes_what_was_recorded_and_nothing_else() -> None:
    child, run_id, sleeper = start_child()
    child.kill()
    child.wait(timeout=10)
    left = leftovers(run_id)
    assert len(left) == 3  # SIGKILL leaves the namespaces behind
    assert wait_dead(sleeper), "a process started by the testbed outlived its killed parent"
    with decoys(), Testbed(two_nodes()) as live:
        report = cleanup_leftovers()
        assert set(left) <= set(report.removed)
        assert report.failed == []
        assert f"namespace {DECOY_NS}" in report.foreign
        assert f"interface {DECOY_LINK}" in report.foreign
        assert exists("ns", DECOY_NS) and exists("link", DECOY_LINK)
        assert len(leftovers(live.run_id)) == 3  # a live run is not touched
    assert leftovers(run_id) == []
    assert not (records.run_dir() / f"{run_id}.lock").exists()
    assert not (records.run_dir() / f"{run_id}.json").exists()


@pytest.mark.root
@pytest.mark.skipif(not CAN_BUILD, reason="needs root with `ip` and `tc`")
def test_records_live_in_a_root_only_directory() -> None:
    with Testbed(two_nodes()) as tb:
        info = os.lstat(records.run_dir())
        assert info.st_uid == 0 and info.st_mode & 0o777 == 0o700
        record = records.RunRecord.load(records.run_dir() / f"{tb.run_id}.json")
        assert record is not None and set(record.namespaces) == set(leftovers(tb.run_id))
        assert [tb.fabrics_namespace, "hsim0f0"] in record.interfaces
        tmp = tb.mkdtemp("holmes-probe-")
        assert oct(os.stat(tmp).st_mode & 0o777) == oct(0o700)
    assert not tmp.exists()
    assert not (records.run_dir() / f"{tb.run_id}.json").exists()


def test_cleanup_as_non_root_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records.os, "geteuid", lambda: 1000)
    with pytest.raises(TestbedError, match="needs root"):
        cleanup_leftovers()


@pytest.mark.root
@pytest.mark.skipif(not CAN_BUILD, reason="needs root with `ip` and `tc`")
def test_second_measurement_is_refused_at_once_naming_the_first() -> None:
    with records.measurement_lock("first"):
        start = time.monotonic()
        with pytest.raises(TestbedError, match=rf"PID {os.getpid()}, started .*: first"), \
                records.measurement_lock("second"):
            pass
        assert time.monotonic() - start < 1.0
    with records.measurement_lock("third"):  # free again
        pass


@pytest.mark.root
@pytest.mark.skipif(not CAN_BUILD, reason="needs root with `ip` and `tc`")
def test_deleting_a_record_also_removes_a_temporary_file_a_signal_left() -> None:
    """A signal between writing `<id>.json.tmp` and renaming it left the temporary file behind."""
    record = records.RunRecord("t0d3l3")
    record.save()
    (records.run_dir() / "t0d3l3.json.tmp").write_text("{}")
    record.delete()
    assert not (records.run_dir() / "t0d3l3.json").exists()
    assert not (records.run_dir() / "t0d3l3.json.tmp").exists()


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (no such process, or a zombie no one reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2:][:1] in ("Z", "X")


def test_teardown_signals_only_groups_whose_leader_it_has_not_reaped(monkeypatch) -> None:
    # A reaped leader's PID may be another process's by now: teardown must not signal it. An
    # unreaped one (running, or a zombie) holds its PID, and its group's members are killed,
    # also when they outlived the leader.
    reaped = subprocess.Popen(["true"], start_new_session=True)
    reaped.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               start_new_session=True)
    zombie = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!"], start_new_session=True,
                              stdout=subprocess.PIPE, text=True)
    member = int(zombie.stdout.readline())
    zombie.stdout.close()
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # the leader exits, unreaped
    signalled: list[tuple[int, int]] = []
    real = tbmod.killpg
    monkeypatch.setattr(tbmod, "killpg", lambda pgid, sig: (signalled.append((pgid, sig)),
                                                            real(pgid, sig)))
    tb = Testbed([TestbedNode("n0", (TestbedNic("eth0", "eth", 1e8),))])
    tb._procs = [reaped, running, zombie]
    tb._kill_processes()
    assert {pgid for pgid, _ in signalled} == {running.pid, zombie.pid}
    assert running.returncode is not None and zombie.returncode == 0
    deadline = time.monotonic() + 5
    while not _gone(member) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(member)
