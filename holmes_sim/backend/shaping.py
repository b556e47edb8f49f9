"""The testbed's traffic shapers: ``tc`` htb trees that cap each NIC and uplink at its rate.

Each NIC is capped to its line rate in both directions (`shaper_lines`: htb, one leaf per
peer node, so that the flows of a NIC share it max-min as the simulator assumes): the qdisc on
the node-side veth limits what the node sends (a leaf per destination), the one on the
bridge-side veth what it receives (a leaf per source). A NIC is thus full duplex at its rate,
and a node's NICs are independent of each other.

NIC shapers: rate and ceil at the line rate, ``burst = max(16 KiB, rate * 1 ms)``
(`nic_burst_bytes`: 16 KiB at 100 Mbit/s, 250 KB at 2 Gbit/s; a millisecond of rate lets the
qdisc watchdog fire late on a busy machine without losing tokens), leaves of 50 ms of rate,
pure ACKs first. A link of the simulator has a rate and a latency, no bucket; a full bucket
lets its bytes through at memory speed, so the bucket is kept small next to the testbed's
messages (256 KiB): a 256 KiB message after an idle gap crosses a 100 Mbit/s NIC in 21.2 ms,
its rate's time (with 128 KiB buckets: 11.9-13.9 ms, which the simulator over-predicts by
6-15% on the pipeline-bound cases). Small buckets show two effects of the transport, both
handled where they arise, not in the buckets: gloo's rendezvous message queues behind data
going the other way on one TCP connection (`groups.py`: one connection per direction), and
TCP restarts from its initial window after an idle period longer than its retransmission
timeout (RFC 5681 section 4.1), which makes each iteration's first gradient bucket take 1.3x
its rate's time: node namespaces set ``net.ipv4.tcp_slow_start_after_idle = 0`` (their own,
per-namespace setting; `testbed.Testbed`). A 4 MB transfer runs at about 0.95 of the rate
(the Ethernet/IP/TCP headers count: 1448 of 1514 bytes). With one tbf FIFO per NIC instead, a
flow that also queued at the uplink starved behind a segment-local flow of the same NIC (6 of
50 Mbit/s while the other ran at line rate), and two_clusters' iterations were bimodal
(0.56-0.84 s).

An uplink end is shaped like a NIC (`shaper_lines`, one leaf per source node of its segment,
so the clusters' flows share it max-min as the simulator's uplink link does) with a smaller
bucket (`uplink_burst_bytes`: ``max(4 KiB, rate * 0.25 ms)``): every leaf and the root have
one, and after an idle gap their buckets together let two flows cross about 5% faster than
the rate (two 256 KiB messages at once: 39-42 ms with 16 KiB buckets, 43-44 ms with 4 KiB,
against 43.8 ms at the rate; one alone 21.2 ms either way). With one tbf FIFO as the uplink
(16 KiB bucket, 10 ms queue), flows through it were served unfairly, the replicas' pipelines
fell in and out of step, and two_clusters' iterations varied by 2-10% (one run of three missed
by 13.9%); with the fair uplink they vary by 0.5-1.5% and agree with the prediction within
3%. (An htb uplink with 128 KiB NIC buckets and one gloo connection per pair ran 15-18% slower
than predicted: the transport effects above.)
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from holmes_sim.backend.netns import run_command
from holmes_sim.errors import TestbedError

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


def apply_tc(ns: str, lines: Sequence[str]) -> None:
    """Run `lines` as one `tc -batch` in namespace `ns`; raise TestbedError naming the line that
    failed."""
    res = run_command(["tc", "-n", ns, "-batch", "-"], check=False,
                      stdin_text="\n".join(lines) + "\n")
    if res.returncode != 0:
        failed = re.search(r"Command failed -:(\d+)", res.stderr)
        line = lines[int(failed.group(1)) - 1] if failed and int(failed.group(1)) <= len(lines) \
            else "(unknown line)"
        raise TestbedError(f"`tc -n {ns} {line}` failed: {res.stderr.strip() or res.returncode}")
